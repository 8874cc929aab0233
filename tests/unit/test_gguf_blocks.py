"""GGUF quantized blocks read as ``BlockCodes`` (``loading/gguf_blocks.py``): every type's codes,
scales and mins rebuild exactly the values gguf-py's dequantization gives, and linears carrying
them take the right kernel path (the integer kernel under ``gguf``, the exact float one otherwise)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from specserve.kernels import block_unpack, int_codes
from specserve.loading import gguf_blocks
from specserve.loading.gguf import block_codes
from tests.unit.test_int_linear import KINDS, _inputs, _int_linear_ref, _width, needs_kernel, raw_blocks


def _tensor(kind, rows: int, cols: int, seed: int):
    return SimpleNamespace(tensor_type=kind, shape=np.array([cols, rows]), data=raw_blocks(kind, rows, cols, seed))


@pytest.mark.parametrize("kind", list(gguf_blocks.READERS))
def test_codes_rebuild_ggufs_dequantization_bit_for_bit(kind):
    rows, cols = 12, _width(kind, 512)
    tensor = _tensor(kind, rows, cols, seed=int(kind))
    codes = block_codes(tensor)
    expected = np.asarray(dequantize(tensor.data, kind), dtype=np.float32).reshape(rows, cols)
    assert codes.bits == gguf_blocks.BITS[kind]
    assert torch.equal(codes.expand(), torch.from_numpy(expected))


@needs_kernel
@pytest.mark.parametrize("kind", list(block_unpack.FAST_TYPES))
def test_the_kernels_unpack_what_the_numpy_readers_read(kind):
    """block_unpack.c (what block_codes takes for these types) gives the readers' codes (and their
    dtype), scales and mins, bit for bit: rebuilding gguf-py's values is tested above through it."""
    raw = raw_blocks(kind, 9, 256, seed=41).reshape(-1, GGML_QUANT_SIZES[kind][1])
    raw[0, :2] = np.array([1.0e-7], np.float16).view(np.uint8)          # a subnormal float16 scale
    fast, (codes, scales, mins, _) = block_unpack.unpack(raw, kind), gguf_blocks.READERS[kind](raw)
    assert fast[0].dtype == codes.dtype and np.array_equal(fast[0], codes)
    assert np.array_equal(fast[1].view(np.uint32), scales.view(np.uint32))
    assert np.array_equal(fast[2].view(np.uint32), mins.view(np.uint32))


def test_every_reader_has_a_kernel_format():
    assert set(gguf_blocks.READERS) == set(KINDS)


def test_unsupported_types_and_vectors_carry_no_codes():
    assert block_codes(SimpleNamespace(tensor_type=Q.F16, shape=np.array([32, 4]), data=None)) is None
    vector = _tensor(Q.Q8_0, 1, 64, seed=1)
    vector.shape = np.array([64])
    assert block_codes(vector) is None


def _layer(kind, rows: int, cols: int):
    from specserve.models.packed_linear import Linear

    codes = block_codes(_tensor(kind, rows, cols, seed=5))
    layer = Linear(cols, rows, bias=False)
    with torch.no_grad():
        layer.weight.copy_(codes.expand())
    layer.weight.block_codes = codes
    return layer, codes


@needs_kernel
@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q5_0])
def test_k_quant_linears_run_the_integer_kernel_under_gguf(kind):
    from specserve.models.packed_linear import pack_linears_for_cpu

    layer, codes = _layer(kind, 40, 512)
    pack_linears_for_cpu(layer, "gguf")
    assert layer.int_format == KINDS[kind]
    x = _inputs(9, 512, seed=6)
    with torch.inference_mode():
        assert torch.equal(layer(x), torch.from_numpy(_int_linear_ref(x, codes, KINDS[kind])))


@needs_kernel
@pytest.mark.parametrize("kind,coded", [(Q.Q4_K, True), (Q.Q5_1, True), (Q.Q6_K, False)])
def test_unquant_keeps_the_exact_weights(kind, coded):
    """The exact path streams the code blocks where coded_linear.c takes them (a scale per 32
    weights) and the dense weight otherwise (Q6_K's scale per 16): the same values either way."""
    from specserve.models.packed_linear import pack_linears_for_cpu

    layer, _ = _layer(kind, 24, 256)
    pack_linears_for_cpu(layer, "unquant")
    assert layer.int_panels is None and (layer.coded_records is not None) == coded
    x = torch.randn(2, 256)
    with torch.inference_mode():
        expected = x @ layer.weight.T                # float32 sums: orders differ in the last bits
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))


def test_types_without_kernels_are_named_once_at_load(caplog):
    from specserve.loading.gguf import _log_types_without_kernels

    matrix = lambda kind: SimpleNamespace(tensor_type=kind, shape=np.array([256, 4]))  # noqa: E731
    reader = SimpleNamespace(tensors=[matrix(Q.Q3_K), matrix(Q.Q3_K), matrix(Q.Q4_K), matrix(Q.F16),
                                      SimpleNamespace(tensor_type=Q.Q2_K, shape=np.array([256]))])
    with caplog.at_level("WARNING"):
        _log_types_without_kernels(reader)
    assert len(caplog.records) == 1 and "Q3_K have no integer kernel" in caplog.text
    caplog.clear()
    _log_types_without_kernels(SimpleNamespace(tensors=[matrix(Q.Q4_K), matrix(Q.Q6_K)]))
    assert not caplog.records
