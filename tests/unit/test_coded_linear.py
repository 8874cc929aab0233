"""Code blocks (GGUF Q4_0 / Q4_1 / Q8_0 weights kept packed): the exact dequantized values, and
the skinny kernel over them gives the dense weights' bits."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from specserve.kernels import skinny
from specserve.kernels.coded import BlockCodes
from specserve.loading.gguf import block_codes
from specserve.models.packed_linear import Linear, has_packed_kernels, pack_linears_for_cpu

needs_kernel = pytest.mark.skipif(not skinny.is_available(), reason="skinny kernel not built here (no AVX2 or no C compiler)")
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def _gguf_tensor(kind, rows: int, cols: int, seed: int):
    """A fake GGUF tensor record (what GGUFReader yields) of a random [rows, cols] matrix."""
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    return SimpleNamespace(tensor_type=kind, shape=np.array([cols, rows]), data=quantize(values, kind))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_VIEW[t.dtype])


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_block_codes_expand_to_ggufs_dequantized_values(kind):
    tensor = _gguf_tensor(kind, 24, 96, seed=int(kind))
    codes = block_codes(tensor)
    assert codes.shape == (24, 96) and codes.bits == (8 if kind == Q.Q8_0 else 4)
    expected = torch.from_numpy(dequantize(tensor.data, kind).reshape(24, 96).copy())
    # bit for bit but the sign of zeros (Q4_0's d * (8 - 8) is -0.0 where d < 0), which no
    # product sum starting from +0 can tell apart
    assert torch.equal(codes.expand(), expected)
    assert torch.equal(_bits(codes.expand())[expected != 0], _bits(expected)[expected != 0])


def test_other_tensor_types_have_no_codes():
    values = np.ones((4, 64), dtype=np.float32)
    assert block_codes(SimpleNamespace(tensor_type=Q.F32, shape=np.array([64, 4]), data=values)) is None


def test_rows_map_and_concatenate():
    codes = block_codes(_gguf_tensor(Q.Q4_1, 8, 64, seed=1))
    flipped = codes.map_rows(lambda t: t.flip(0))
    assert torch.equal(flipped.expand(), codes.expand().flip(0))
    stacked = BlockCodes.cat([codes, flipped])
    assert torch.equal(stacked.expand(), torch.cat([codes.expand(), codes.expand().flip(0)]))
    assert BlockCodes.cat([codes, block_codes(_gguf_tensor(Q.Q8_0, 8, 64, seed=2))]) is None


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", [Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("cols", [96, 1536])
def test_kernel_over_codes_gives_the_dense_bits(dtype, kind, cols):
    """Every path (1-4 rows fused, 5-8 rows fused while their inputs fit L1, else expanded
    to scratch: 1536 inputs at 7-8 rows, and 9 or more rows), with a bias and a partial last
    weight block (13 outputs)."""
    codes = block_codes(_gguf_tensor(kind, 13, cols, seed=3))
    weight = codes.expand().to(dtype).contiguous()
    records = codes.records(dtype)
    coded = skinny.linear_weights(weight, records, codes.kernel_format(dtype), coded_max_rows=100)
    generator = torch.Generator().manual_seed(7)
    bias = torch.randn(13, generator=generator)
    for rows in (*range(1, 10), 40):
        x = torch.randn(rows, cols, generator=generator).to(dtype)
        got = skinny.linear_forward(x, coded, weight.shape, bias)
        assert torch.equal(_bits(got), _bits(skinny.skinny_linear(x, weight, bias)))
        expected = F.linear(x.double(), weight.double(), bias.double())
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5        # bfloat16: rounding of the output
        assert torch.allclose(got.double(), expected, atol=tol, rtol=tol)


def _linear_with_codes(dtype: torch.dtype, codes: BlockCodes) -> Linear:
    layer = Linear(codes.shape[1], codes.shape[0], bias=False)
    with torch.no_grad():
        layer.weight.copy_(codes.expand())
    layer = layer.to(dtype)
    layer.weight.block_codes = codes
    return layer


def _runs_onednn(dtype: torch.dtype) -> bool:
    """bfloat16 linears run oneDNN where the CPU has its bfloat16 kernels (AVX-512 BW and up), so
    there no codes are kept for them; on AVX2-only CPUs the skinny kernel runs them over codes."""
    return dtype == torch.bfloat16 and has_packed_kernels(dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packing_keeps_codes_that_rebuild_the_weight(dtype):
    codes = block_codes(_gguf_tensor(Q.Q4_1, 16, 64, seed=4))
    layer = _linear_with_codes(dtype, codes)
    pack_linears_for_cpu(layer)
    if _runs_onednn(dtype):
        assert layer.coded_records is None and layer.skinny_max_rows == 0 and layer.packed_weight is not None
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
        with torch.inference_mode():
            torch.testing.assert_close(layer(x).float(), x.float() @ layer.weight.float().T, atol=2e-2, rtol=2e-2)
        return
    assert layer.coded_records is not None and not hasattr(layer.weight, "block_codes")
    pack_linears_for_cpu(layer)                       # packing again keeps the records
    assert layer.coded_records is not None
    assert layer.native_weights.coded_max_rows == min(layer.skinny_max_rows, 2**31 - 1)
    x = torch.randn(1, 64).to(dtype)
    with torch.inference_mode():
        assert torch.equal(_bits(layer(x)), _bits(skinny.skinny_linear(x, layer.weight.detach())))


@needs_kernel
def test_packing_refuses_codes_that_do_not_match_the_weight():
    codes = block_codes(_gguf_tensor(Q.Q4_1, 16, 64, seed=5))
    layer = _linear_with_codes(torch.float32, codes)
    with torch.no_grad():
        layer.weight[3, 7] += 1e-3
    pack_linears_for_cpu(layer)
    assert layer.coded_records is None and layer.native_weights.coded_max_rows == 0


@needs_kernel
def test_a_replaced_weight_drops_its_codes():
    layer = _linear_with_codes(torch.float32, block_codes(_gguf_tensor(Q.Q4_1, 16, 64, seed=6)))
    pack_linears_for_cpu(layer)
    generator = torch.Generator().manual_seed(8)
    layer.weight = torch.nn.Parameter(torch.randn(16, 64, generator=generator))
    x = torch.randn(2, 64, generator=generator)
    with torch.inference_mode():
        assert torch.allclose(layer(x), F.linear(x, layer.weight), atol=1e-5, rtol=1e-5)
    assert layer.coded_records is None
