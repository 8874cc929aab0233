"""Greedy speculative decoding == plain greedy decoding in bfloat16 as well.

bfloat16 logits tie and round coarsely, so a last-bit difference between a token computed
by a decode step and the same token computed as a row of a verification forward flips
greedy choices. Attention and linears are row-invariant for that reason (the native
kernels in ``specserve/kernels``; without them ``models/row_invariant_attention.py`` and
oneDNN per row). These cases hold the whole engine to it, with draft trees, chains and
concurrent requests.
"""
from __future__ import annotations

import pytest
import torch

from specserve.engine import Engine
from specserve.kernels import skinny
from specserve.models.packed_linear import has_packed_kernels
from tests.model.test_spec_lossless import _always, _assert_no_kv_leak, _dev_prompts

pytestmark = pytest.mark.skipif(
    not skinny.is_available() and not has_packed_kernels(torch.bfloat16),
    reason="bfloat16 row invariance needs the native kernels (a C compiler and AVX2) or oneDNN's "
           "bfloat16 kernels (AVX-512); without either, bfloat16 runs through float32 oneDNN kernels "
           "whose rounding depends on the row count")

# Batched bfloat16 needs the native kernels: without them (SPECSERVE_KERNELS=0, or no C compiler)
# prompts prefilled and decoded together gave other greedy tokens than each alone on an AVX-512
# Xeon (oneDNN bfloat16 kernels, torch attention); one request at a time still holds there.
needs_kernels_for_batches = pytest.mark.skipif(
    not skinny.is_available(), reason="batched bfloat16 equals one-at-a-time only with the native kernels "
                                      "(without them it differed on an AVX-512 Xeon)")
ENGINE_KW = {"dtype": "bfloat16", "max_total_tokens": 8192, "context_length": 2048}
SPECS = {
    "NGRAM": {"speculative_algorithm": "NGRAM"},
    "EAGLE tree": {"speculative_algorithm": "EAGLE", "speculative_num_steps": 5, "speculative_eagle_topk": 4,
                   "speculative_num_draft_tokens": 8},
    "EAGLE3 chain": {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
                     "speculative_num_draft_tokens": 4},
}
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def engines(default_gguf_path) -> dict[str, Engine]:
    from specserve.drafts import shipped_draft

    built = {"plain": Engine(model_path=default_gguf_path, **ENGINE_KW)}
    for name, kw in SPECS.items():
        if name != "NGRAM" and shipped_draft(kw["speculative_algorithm"]) is None:
            continue
        built[name] = _always(lambda kw=kw: Engine(model_path=default_gguf_path, **ENGINE_KW, **kw))
    return built


@pytest.fixture(scope="module")
def prompt_ids(engines) -> list[list[int]]:
    tok = engines["plain"].tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in _dev_prompts()]


@pytest.fixture(scope="module")
def plain_outputs(engines, prompt_ids) -> list[list[int]]:
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS}
    return [engines["plain"].generate(input_ids=ids, sampling_params=params)["output_ids"] for ids in prompt_ids]


def _engine(engines, name):
    if name not in engines:
        pytest.skip(f"no {name} engine: its shipped draft is not in specserve/drafts")
    return engines[name]


@pytest.mark.parametrize("name", list(SPECS))
def test_bf16_greedy_lossless_one_at_a_time(engines, prompt_ids, plain_outputs, name):
    engine = _engine(engines, name)
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS}
    outs = [engine.generate(input_ids=ids, sampling_params=params) for ids in prompt_ids]
    assert [o["output_ids"] for o in outs] == plain_outputs
    assert sum(o["meta_info"]["spec_verify_ct"] for o in outs) < len(prompt_ids) * NEW_TOKENS
    _assert_no_kv_leak(engine)


@needs_kernels_for_batches
@pytest.mark.parametrize("name", list(SPECS))
def test_bf16_greedy_lossless_eight_concurrent(engines, prompt_ids, plain_outputs, name):
    engine = _engine(engines, name)
    params = [{"temperature": 0, "max_new_tokens": NEW_TOKENS} for _ in prompt_ids]
    outs = engine.generate(input_ids=prompt_ids, sampling_params=params)
    assert [o["output_ids"] for o in outs] == plain_outputs
    _assert_no_kv_leak(engine)


@needs_kernels_for_batches
def test_bf16_plain_batched_equals_one_at_a_time(engines, prompt_ids, plain_outputs):
    """Eight prompts of different lengths prefilled and decoded together give the texts each
    gives alone: prefill attention and decode rows do not depend on the batch."""
    engine = engines["plain"]
    outs = engine.generate(input_ids=prompt_ids, sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS})
    assert len({len(ids) for ids in prompt_ids}) > 1
    assert [o["output_ids"] for o in outs] == plain_outputs
    _assert_no_kv_leak(engine)
