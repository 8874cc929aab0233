"""A GGUF's decoder-layer linears load on the integer path without dense copies
(``StrictLoader``'s ``codes_only``): a part whose blocks rebuild its values is never copied, a
whole weight whose blocks the kernel takes becomes a meta tensor carrying them, and anything
else keeps the checkpoint's dense values. The model built so gives the output of one built
with every dense copy, and the memory planner leaves those copies out of its count."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from specserve.kernels import int_codes
from specserve.kernels.coded import q8_0_codes
from specserve.models.weights import StrictLoader, WeightLoadError

ROWS_A, ROWS_B, WIDTH = 8, 4, 64


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Module()
        self.inner.fused = nn.Linear(WIDTH, ROWS_A + ROWS_B, bias=False)


def _part(rows: int, seed: int, with_codes: bool = True) -> torch.Tensor:
    """A checkpoint tensor whose values are Q8_0 blocks' (carrying them, as read_gguf's do)."""
    codes = q8_0_codes(torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(seed)))
    tensor = codes.expand()
    if with_codes:
        tensor.block_codes = codes
    return tensor


def _load(parts: dict[str, torch.Tensor], suffice: bool = True) -> tuple[_Outer, list[nn.Module]]:
    module, handed = _Outer(), []
    loader = StrictLoader(module, ["inner.fused.weight"], lambda codes: suffice, handed.append)
    loader.add_fused("a", "fused", 0, ROWS_A)
    loader.add_fused("b", "fused", ROWS_A, ROWS_B)
    loader.load(parts.items())
    return module, handed


def test_a_weight_whose_blocks_suffice_is_never_written():
    a, b = _part(ROWS_A, 0), _part(ROWS_B, 1)
    module, handed = _load({"inner.a.weight": a, "inner.b.weight": b})
    weight = module.inner.fused.weight
    assert weight.is_meta and tuple(weight.shape) == (ROWS_A + ROWS_B, WIDTH)
    assert torch.equal(weight.block_codes.expand(), torch.cat([a, b]))
    assert handed == [module.inner.fused]


@pytest.mark.parametrize("case", ["part without blocks", "blocks that do not rebuild it", "blocks not taken"])
def test_otherwise_the_weight_holds_the_checkpoint_values(case):
    a, b = _part(ROWS_A, 0), _part(ROWS_B, 1, with_codes=case != "part without blocks")
    if case == "blocks that do not rebuild it":
        codes = a.block_codes
        a = a + 1e-3
        a.block_codes = codes
    module, handed = _load({"inner.a.weight": a, "inner.b.weight": b}, suffice=case != "blocks not taken")
    weight = module.inner.fused.weight
    assert not weight.is_meta and not handed
    assert torch.equal(weight.detach(), torch.cat([a, b]))


def test_the_check_goes_by_chunks_of_rows_to_the_last_one():
    tensor = _part(ROWS_A + ROWS_B, 2)
    codes = tensor.block_codes
    assert codes.rebuilds(tensor, chunk_values=5 * WIDTH)    # chunks of 5, 5 and 2 rows
    changed = tensor.clone()
    changed[-1, -1] += 1e-3
    assert not codes.rebuilds(changed, chunk_values=5 * WIDTH)
    assert not codes.rebuilds(tensor[:-1], chunk_values=5 * WIDTH)


def test_rows_loaded_twice_are_refused():
    a, b = _part(ROWS_A, 0), _part(ROWS_B, 1)
    with pytest.raises(WeightLoadError, match="already loaded"):
        _load({"inner.a.weight": a, "inner.b.weight": b, "inner.fused.weight": torch.cat([a, b])})


# ---- a tiny llama GGUF with Q8_0 layer matrices ----------------------------------------------------------

HIDDEN, FFN = 32, 64


def _write_gguf(path: Path, seed: int, float_v: bool = False) -> Path:
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, 2), (writer.add_context_length, 128),
                       (writer.add_embedding_length, HIDDEN), (writer.add_feed_forward_length, FFN),
                       (writer.add_head_count, 2), (writer.add_head_count_kv, 1), (writer.add_layer_norm_rms_eps, 1e-6),
                       (writer.add_rope_freq_base, 10000.0), (writer.add_tokenizer_model, "gpt2"),
                       (writer.add_tokenizer_pre, "qwen2"), (writer.add_eos_token_id, 4)):
        add(value)
    writer.add_token_list(["a", "b", "ab", "<|im_end|>", "<|endoftext|>"])
    writer.add_token_types([1, 1, 1, 3, 3])
    writer.add_token_merges(["a b"])
    rand = lambda *shape: (rng.standard_normal(shape) * 0.3).astype(np.float32)   # noqa: E731
    Q8 = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("token_embd.weight", rand(5, HIDDEN))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    writer.add_tensor("output.weight", rand(5, HIDDEN))
    for layer in range(2):
        for name, shape in (("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (16, HIDDEN)), ("attn_v", (16, HIDDEN)),
                            ("attn_output", (HIDDEN, HIDDEN)), ("ffn_gate", (FFN, HIDDEN)), ("ffn_up", (FFN, HIDDEN)),
                            ("ffn_down", (HIDDEN, FFN))):
            values = rand(*shape)
            if float_v and name == "attn_v":
                writer.add_tensor(f"blk.{layer}.{name}.weight", values)
            else:
                writer.add_tensor(f"blk.{layer}.{name}.weight", quantize(values, Q8), raw_shape=quantize(values, Q8).shape,
                                  raw_dtype=Q8)
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{name}.weight", np.ones(HIDDEN, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_matrices_can_come_as_their_blocks_with_the_same_values(tmp_path):
    """``dense_from_blocks``: each block-coded matrix a meta tensor carrying blocks whose values are
    the dequantized matrix's (q and k unpermuted alike); other tensors as before."""
    from specserve.loading.gguf import read_gguf

    path = _write_gguf(tmp_path / "q8.gguf", 4, float_v=True)
    dense = dict(read_gguf(path)[1])
    lazy = dict(read_gguf(path, dense_from_blocks=True)[1])
    assert dense.keys() == lazy.keys()
    blocked = [name for name, t in lazy.items() if t.is_meta]
    assert len(blocked) == 2 * 6 and not any("v_proj" in name or "norm" in name for name in blocked)
    for name, tensor in lazy.items():
        values = tensor.block_codes.expand() if tensor.is_meta else tensor
        assert torch.equal(values, dense[name]), name


def test_the_sample_check_catches_blocks_that_are_not_the_file_s(tmp_path):
    import gguf

    from specserve.loading.gguf import _sample_rows_rebuilt, block_codes, open_gguf

    tensor = next(t for t in open_gguf(_write_gguf(tmp_path / "q8.gguf", 5)).tensors if t.name == "blk.1.ffn_up.weight")
    assert tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0
    codes = block_codes(tensor)
    assert _sample_rows_rebuilt(tensor, codes)
    codes.scales[-1, 0] *= 2                     # the last row: one of the sampled
    assert not _sample_rows_rebuilt(tensor, codes)


def test_the_planner_counts_blocks_only_where_a_linear_keeps_them(tmp_path):
    from specserve.loading.gguf import layer_block_weights

    qkv, o, gate_up, down = (HIDDEN + 32) * HIDDEN, HIDDEN * HIDDEN, 2 * FFN * HIDDEN, HIDDEN * FFN
    assert layer_block_weights(_write_gguf(tmp_path / "q8.gguf", 0)) == 2 * (qkv + o + gate_up + down)
    # a float v: the fused qkv keeps its dense copy, the rest does not
    assert layer_block_weights(_write_gguf(tmp_path / "mixed.gguf", 0, float_v=True)) == 2 * (o + gate_up + down)


@pytest.mark.skipif(not int_codes.is_available(), reason="CPU kernels not built here")
@pytest.mark.parametrize("float_v", [False, True])
def test_a_gguf_model_loads_without_layer_copies_and_decodes_the_same(tmp_path, monkeypatch, float_v):
    from specserve.engine import Engine
    from specserve.runner import model_runner

    path = str(_write_gguf(tmp_path / "tiny.gguf", 3, float_v))
    kw = {"model_path": path, "quantization": "gguf", "dtype": "float32", "max_total_tokens": 256,
          "context_length": 64}
    params = {"temperature": 0, "max_new_tokens": 12}
    prompts = [[0, 1, 2], [2, 2, 1, 0, 1], [1]]
    lean = Engine(**kw)
    net = lean.engine.runner.model
    for layer in net.model.layers:
        for name, linear in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                             ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj)):
            integer = not (float_v and name == "qkv")     # a float part: the fused linear stays dense
            assert (linear.int_panels is not None) == integer and linear.weight.is_meta == integer
    assert not net.lm_head.weight.is_meta and not net.model.embed_tokens.weight.is_meta
    monkeypatch.setattr(model_runner, "codes_only_weights", lambda *args: [])
    monkeypatch.setattr(model_runner, "drop_dense_weights", lambda modules: 0)
    keeping = Engine(**kw)
    assert not any(m.weight.is_meta for m in keeping.engine.runner.model.modules() if hasattr(m, "int_panels"))
    outputs = [[o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=[params] * 3)]
               for engine in (lean, keeping)]
    assert outputs[0] == outputs[1]
