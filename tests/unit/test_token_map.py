"""FR-Spec for draft models (speculative/token_map.py): the restricted LM head and reading a map.

The restricted head must give, on the hot ids, the full head's logits. Where the skinny kernel
runs (float32, up to 32 rows: every draft step here), the bits are the same: each output is
one FMA chain over the hidden size whatever the number of weight rows (N) or input rows
(kernels/skinny_linear.c), and the hot rows are copied exactly. Past 32 rows (oneDNN) and in
bfloat16 (oneDNN on AVX-512) the library may block N differently, so there the check is a tight
tolerance.
"""
from __future__ import annotations

import pytest
import torch

from specserve.config import ConfigError
from specserve.kernels import skinny
from specserve.models.packed_linear import FLOAT32_SKINNY_MAX_ROWS, Linear, pack_linears_for_cpu
from specserve.speculative.token_map import read_token_map, restricted_lm_head

VOCAB, HIDDEN = 4099, 192          # odd vocab: the kernel's last block of weight rows is partial


def _head(dtype: torch.dtype, bias: bool = False) -> Linear:
    generator = torch.Generator().manual_seed(0)
    head = Linear(HIDDEN, VOCAB, bias=bias).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=generator) * 0.05)
        if bias:
            head.bias.copy_(torch.randn(VOCAB, generator=generator))
    head.requires_grad_(False)
    pack_linears_for_cpu(head)
    return head


def _hot_ids(n: int = 1031) -> torch.Tensor:
    return torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:n]      # [V_hot], unsorted


@pytest.mark.skipif(not skinny.is_available(), reason="the skinny kernel is not built here")
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 7, 16, FLOAT32_SKINNY_MAX_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_restricted_head_same_bits_as_full_head_on_skinny_path(num_rows, bias):
    full, hot = _head(torch.float32, bias), _hot_ids()
    head = restricted_lm_head(full, hot)
    assert head.skinny_max_rows == full.skinny_max_rows == FLOAT32_SKINNY_MAX_ROWS
    x = torch.randn(num_rows, HIDDEN, generator=torch.Generator().manual_seed(num_rows))
    with torch.inference_mode():
        assert torch.equal(head(x), full(x)[:, hot])                                  # [rows, V_hot]


@pytest.mark.parametrize("dtype,num_rows", [(torch.float32, 40), (torch.float32, 200), (torch.bfloat16, 1),
                                            (torch.bfloat16, 8)])
def test_restricted_head_matches_full_head_elsewhere(dtype, num_rows):
    full, hot = _head(dtype), _hot_ids()
    head = restricted_lm_head(full, hot)
    x = torch.randn(num_rows, HIDDEN, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.inference_mode():
        restricted, reference = head(x), full(x)[:, hot]
    assert restricted.dtype == dtype and restricted.shape == (num_rows, hot.numel())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(restricted.float(), reference.float(), rtol=tol, atol=tol)


def test_restricted_head_keeps_the_full_head_untouched():
    full = _head(torch.float32)
    before = full.weight.clone()
    head = restricted_lm_head(full, torch.tensor([7, 3]))
    assert torch.equal(full.weight, before) and head.weight.data_ptr() != full.weight.data_ptr()
    assert not head.weight.requires_grad and head.weight.is_contiguous()
    assert torch.equal(head.weight, before[[7, 3]])


def _saved(tmp_path, value) -> str:
    path = tmp_path / "map.pt"
    torch.save(value, path)
    return str(path)


def test_read_token_map(tmp_path):
    ids = read_token_map(_saved(tmp_path, [9, 0, 4]), vocab_size=10, topk=2)
    assert ids.dtype == torch.int64 and ids.tolist() == [9, 0, 4]


@pytest.mark.parametrize("value,words", [([0, 10], "token id 10 is outside the vocabulary [0, 10)"),
                                         ([-1, 2], "token id -1 is outside"),
                                         ([1, 2, 1], "more than once"),
                                         ([3], "fewer than --speculative-eagle-topk 2"),
                                         ({"not": "a list"}, "not a token map")])
def test_bad_token_map_is_one_line_config_error(tmp_path, value, words):
    path = _saved(tmp_path, value)
    with pytest.raises(ConfigError) as info:
        read_token_map(path, vocab_size=10, topk=2)
    message = str(info.value)
    assert message.startswith(f"--speculative-token-map {path}: ") and "\n" not in message
    assert words in message


def test_unreadable_token_map_is_one_line_config_error(tmp_path):
    path = tmp_path / "map.pt"
    path.write_bytes(b"not a pickle\nat all")
    with pytest.raises(ConfigError, match="^--speculative-token-map .*: not a token map") as info:
        read_token_map(str(path), vocab_size=10)
    assert "\n" not in str(info.value)


def test_the_shipped_eagle_draft_takes_the_shipped_token_map():
    """The default model's EAGLE head, picked by the engine, proposes from the shipped FR-Spec
    map; a map given, a draft chosen by the user, another algorithm or model get none added."""
    from specserve.config import ServerArgs
    from specserve.drafts import FRSPEC_TOKEN_MAP, shipped_draft
    from specserve.engine_setup import _with_shipped_draft

    if shipped_draft("EAGLE") is None or not FRSPEC_TOKEN_MAP.is_file():
        pytest.skip("no shipped EAGLE draft or FR-Spec map in specserve/drafts")

    def token_map(model_path=None, **kwargs):
        return _with_shipped_draft(ServerArgs(**kwargs), model_path, "cpu", torch.float32).speculative_token_map

    assert token_map(speculative_algorithm="EAGLE") == str(FRSPEC_TOKEN_MAP)
    assert token_map(speculative_algorithm="eagle") == str(FRSPEC_TOKEN_MAP)
    assert token_map(speculative_algorithm="EAGLE", speculative_token_map="mine.pt") == "mine.pt"
    assert token_map(speculative_algorithm="EAGLE", speculative_draft_model_path=str(shipped_draft("EAGLE"))) is None
    assert token_map(speculative_algorithm="EAGLE3") is None
    assert token_map(speculative_algorithm="STANDALONE") is None
    assert token_map("/elsewhere/model.gguf", speculative_algorithm="EAGLE") is None
