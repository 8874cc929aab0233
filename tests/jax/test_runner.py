"""JaxModelRunner against the torch ModelRunner on a tiny random Llama: logits of prefill,
decode and tree verification; row invariance (a verified row's bits equal decoding's);
strict weight loading; buckets."""
from __future__ import annotations

import pytest
import torch

from specserve.backends.jax import is_available, missing_reason

if not is_available():     # not importorskip("jax"): that finds tests/jax as a namespace package
    pytest.skip(missing_reason(), allow_module_level=True)

from specserve.backends.jax.buckets import Buckets, parse_paddings  # noqa: E402
from specserve.backends.jax.runner import JaxModelRunner  # noqa: E402
from specserve.runner.model_runner import ExtendSpec, ModelRunner  # noqa: E402
from tests.model.tiny_llama import random_weights, tiny_config  # noqa: E402

RUNNER_KW = dict(dtype=torch.float32, max_position=512, num_kv_slots=512, page_size=1, max_rows=8,
                 max_row_len=300)
TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)


@pytest.fixture(scope="module")
def runners():
    cfg = tiny_config()
    weights = random_weights(cfg, seed=0)
    return (ModelRunner(cfg, list(weights.items()), device="cpu", **RUNNER_KW),
            JaxModelRunner(cfg, list(weights.items()), **RUNNER_KW))


def _prefill(runner, row: int, prompt: list[int], slots: list[int]):
    return runner.forward([ExtendSpec(row=row, prefix_len=0, token_ids=prompt, new_slots=slots,
                                      num_logits=len(prompt))], is_prefill=True)


def test_logits_match_the_torch_runner(runners):
    torch_runner, jax_runner = runners
    prompts = ([3, 5, 7, 9, 11, 2, 4], [8, 6, 1])
    for runner in runners:
        _prefill(runner, 0, list(prompts[0]), list(range(10, 17)))
        _prefill(runner, 1, list(prompts[1]), list(range(20, 23)))
    specs = [ExtendSpec(row=0, prefix_len=7, token_ids=[1, 2, 3, 4], new_slots=[17, 18, 19, 30],
                        tree_mask=TREE, num_logits=4),
             ExtendSpec(row=1, prefix_len=3, token_ids=[5], new_slots=[23])]
    expected, got = torch_runner.forward(specs), jax_runner.forward(specs)
    assert got.shape == expected.shape == (5, 32)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_prefill_logits_and_features_match(runners):
    torch_runner, jax_runner = runners
    prompt = [4, 9, 2, 7, 7, 1, 30, 12, 5]
    expected = _prefill(torch_runner, 2, prompt, list(range(40, 49)))
    spec = ExtendSpec(row=2, prefix_len=0, token_ids=prompt, new_slots=list(range(40, 49)), num_logits=9)
    got, features = jax_runner.forward([spec], "final", is_prefill=True)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert features.shape == (9, 64) and features.dtype == torch.float32


def test_verified_rows_have_the_bits_of_decoding(runners):
    """A tree's root row and its causal chain give exactly the logits that decoding gives,
    whatever else shares the forward (greedy speculation == plain decoding rests on it)."""
    _, runner = runners
    prompt = [2, 4, 6, 8, 10, 12]
    _prefill(runner, 3, prompt, list(range(60, 66)))
    runner.set_row_slots(4, 0, list(range(60, 66)))         # row 4 shares row 3's prefix
    decode = runner.forward([ExtendSpec(row=3, prefix_len=6, token_ids=[1], new_slots=[66])])
    others = [ExtendSpec(row=5, prefix_len=0, token_ids=[9, 9, 9], new_slots=[80, 81, 82], num_logits=3)]
    verify = runner.forward([ExtendSpec(row=4, prefix_len=6, token_ids=[1, 3, 5, 7], new_slots=[70, 71, 72, 73],
                                        tree_mask=TREE, num_logits=4)] + others)
    assert torch.equal(verify[0], decode[0])
    chain_next = runner.forward([ExtendSpec(row=3, prefix_len=7, token_ids=[3], new_slots=[67])])
    assert torch.equal(verify[1], chain_next[0])             # node 1's parent is the root


def test_strict_loading_names_the_key():
    cfg = tiny_config()
    weights = random_weights(cfg, seed=0)
    missing = {k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(KeyError, match="model.layers.1.up|wu"):
        JaxModelRunner(cfg, list(missing.items()), **RUNNER_KW)
    extra = dict(weights, **{"model.layers.0.self_attn.rogue.weight": torch.zeros(2)})
    with pytest.raises(KeyError, match="rogue"):
        JaxModelRunner(cfg, list(extra.items()), **RUNNER_KW)


def test_buckets():
    assert parse_paddings("8, 1 4", (1,), "--x") == (1, 4, 8)
    assert parse_paddings(None, (1, 2), "--x") == (1, 2)
    with pytest.raises(ValueError, match="--x"):
        parse_paddings("a,b", (1,), "--x")
    buckets = Buckets((1, 2, 4), (16, 64))
    assert buckets.shape(1, 1) == (2, 1)           # never one row
    assert buckets.shape(3, 5) == (4, 8)
    assert buckets.shape(1, 40) == (1, 64)
    assert buckets.shape(5, 1) == (8, 1)           # past the largest: the next power of two
    assert buckets.shape(1, 5, is_prefill=True) == (1, 16)   # prefill: the token paddings only


def test_page_size_above_one_is_refused():
    from specserve.config import ConfigError

    cfg = tiny_config()
    with pytest.raises(ConfigError, match="--page-size"):
        JaxModelRunner(cfg, list(random_weights(cfg, seed=0).items()), **dict(RUNNER_KW, page_size=4))


def test_bfloat16_logits_and_features():
    cfg = tiny_config()
    weights = list(random_weights(cfg, seed=0).items())
    kw = dict(RUNNER_KW, dtype=torch.bfloat16)
    spec = ExtendSpec(row=0, prefix_len=0, token_ids=[1, 2, 3, 4, 5], new_slots=[10, 11, 12, 13, 14], num_logits=5)
    expected = ModelRunner(cfg, weights, device="cpu", **kw).forward([spec], is_prefill=True)
    got, features = JaxModelRunner(cfg, weights, **kw).forward([spec], "final", is_prefill=True)
    torch.testing.assert_close(got, expected.float(), atol=0.1, rtol=0.05)
    assert features.dtype == torch.bfloat16 and features.shape == (5, 64)
