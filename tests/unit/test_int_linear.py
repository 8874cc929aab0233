"""The integer kernel over GGUF blocks (``int_linear.c``, the ``gguf`` quantization path):
the same bits as a numpy model of its arithmetic (int8 input blocks, exact integer dot products,
a fixed float epilogue), row invariance over the row count, and every ISA variant this CPU runs
(``SPECSERVE_ISA`` forces the dispatch down) giving the same bits as the others."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from specserve.kernels import build, int_codes
from specserve.kernels.int_codes import INT_F8, INT_K4, INT_Q4_0, INT_Q4_1, INT_Q5_0, INT_Q5_1, INT_Q6, INT_Q8_0
from specserve.loading.gguf import block_codes

needs_kernel = pytest.mark.skipif(not int_codes.is_available(), reason="CPU kernels not built here (no AVX2 or no C compiler)")
KINDS = {Q.Q4_0: INT_Q4_0, Q.Q4_1: INT_Q4_1, Q.Q8_0: INT_Q8_0, Q.Q5_0: INT_Q5_0, Q.Q5_1: INT_Q5_1,
         Q.Q4_K: INT_K4, Q.Q5_K: INT_F8, Q.Q6_K: INT_Q6}
WITH_MIN = int_codes.WITH_MINS
SCALE_BYTES = {Q.Q4_0: [0], Q.Q5_0: [0], Q.Q8_0: [0], Q.Q4_1: [0, 2], Q.Q5_1: [0, 2], Q.Q4_K: [0, 2],
               Q.Q5_K: [0, 2], Q.Q6_K: [208]}    # where each block's float16 scales lie


def _width(kind, cols: int) -> int:
    """cols rounded up to whole blocks of ``kind`` (256 weights for the K-quants)."""
    block = GGML_QUANT_SIZES[kind][0]
    return -(-cols // block) * block


def raw_blocks(kind, rows: int, cols: int, seed: int) -> np.ndarray:
    """GGUF data of a [rows, cols] matrix of ``kind``: quantized normal values where gguf-py
    quantizes that type, random codes and scales (any bytes are valid blocks) where it does not."""
    rng = np.random.default_rng(seed)
    try:
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, kind)
    except NotImplementedError:
        pass
    block, block_bytes = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows * cols // block, block_bytes), dtype=np.uint8)
    for start in SCALE_BYTES[kind]:
        raw[:, start:start + 2] = rng.uniform(1e-3, 2e-2, len(raw)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def _codes(kind, rows: int, cols: int, seed: int):
    tensor = SimpleNamespace(tensor_type=kind, shape=np.array([cols, rows]), data=raw_blocks(kind, rows, cols, seed))
    return block_codes(tensor)


def _inputs(rows: int, cols: int, seed: int) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 2
    x[0, :32] = 0.0                          # an all-zero block: scale 0
    x[-1, 32:64] = 1.5                       # ties of rint at the block maximum's scale
    return x


# ---- the reference: the kernel's arithmetic in numpy ------------------------------------------

def _quantize_ref(x: np.ndarray):
    """q int8 [M, K], d float32 [M, K / 32]: d = max|x| / 127, q = clamp(rint(x / d))."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = np.abs(blocks).max(-1) / np.float32(127)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = np.clip(np.rint(blocks * inv[..., None]), -127, 127)
    return q.astype(np.int64), d.astype(np.float32)


def _fma(a, b, c):
    """float32 fused multiply-add (the product of two float32 is exact in float64)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def _int_linear_ref(x: torch.Tensor, codes, fmt: int, bias: torch.Tensor | None = None) -> np.ndarray:
    q, d = _quantize_ref(x.float().numpy())                              # [M, B, 32], [M, B]
    c = codes.codes.numpy().astype(np.int64).reshape(codes.shape[0], -1, 32)
    if fmt == INT_Q4_0:
        c = c - 8
    scales, mins = codes.scales.numpy(), codes.mins.numpy()              # [N, B] (F8H: [N, 2B])
    acc = np.zeros((x.shape[0], codes.shape[0]), np.float32)            # [M, N]
    scaled = lambda s: (s[None, :] * d[:, b, None]).astype(np.float32)  # noqa: E731
    for b in range(q.shape[1]):
        if fmt in int_codes.HALF_SCALED:                                # halves summed and scaled apart
            for h in range(2):
                half = slice(16 * h, 16 * h + 16)
                p = (q[:, b, half] @ c[:, b, half].T).astype(np.float32)
                acc = _fma(scaled(scales[:, 2 * b + h]), p, acc)
            continue
        p = (q[:, b] @ c[:, b].T).astype(np.float32)                    # exact integer sums
        acc = _fma(scaled(scales[:, b]), p, acc)
        if fmt in WITH_MIN:
            ds = (d[:, b] * q[:, b].sum(-1).astype(np.float32)).astype(np.float32)
            acc = _fma(mins[None, :, b], ds[:, None], acc)
    return acc if bias is None else (acc + bias.numpy()[None]).astype(np.float32)


def _panels(codes, kind):
    fmt = int_codes.int_format(codes)
    assert fmt == KINDS[kind]
    return int_codes.panels(codes, fmt), fmt


# ---- tests ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(KINDS))
def test_format_read_off_the_blocks(kind):
    assert int_codes.int_format(_codes(kind, 16, _width(kind, 64), seed=3)) == KINDS[kind]


def test_panel_layout():
    """Panel 0, block 0: float16 scales of rows 0-15, then chunk j byte 4i + t = row i's
    weight 4j + t (Q8_0); 4-bit: chunk j in low nibbles, chunk j + 4 in high ones."""
    codes = _codes(Q.Q8_0, 20, 64, seed=4)
    panels = int_codes.panels(codes, INT_Q8_0).numpy()
    assert panels.shape == (2, 2 * int_codes.record_bytes(INT_Q8_0))
    record = panels[0, :int_codes.record_bytes(INT_Q8_0)]
    np.testing.assert_array_equal(record[:32].view(np.float16), codes.scales[:16, 0].numpy())
    chunks = record[32:].view(np.int8).reshape(8, 16, 4)
    np.testing.assert_array_equal(chunks[2, 5], codes.codes[5, 8:12].numpy())
    assert not panels[1].reshape(2, -1)[:, :32].view(np.float16)[:, 4:].any()   # rows past N: zero
    codes4 = _codes(Q.Q4_1, 16, 32, seed=5)
    packed = int_codes.panels(codes4, INT_Q4_1).numpy()[0, 64:].reshape(4, 16, 4)
    np.testing.assert_array_equal(packed[1, 3] & 15, codes4.codes[3, 4:8].numpy())
    np.testing.assert_array_equal(packed[1, 3] >> 4, codes4.codes[3, 20:24].numpy())


@needs_kernel
@pytest.mark.parametrize("kind", list(KINDS))
def test_kernels_pack_the_panels_numpy_packs(kind):
    """int_pack_codes (C, what loading uses) writes numpy's panels, byte for byte, rows past N
    included."""
    codes = _codes(kind, 37, _width(kind, 320), seed=7)
    fmt = KINDS[kind]
    assert torch.equal(int_codes.panels(codes, fmt), int_codes.panels(codes, fmt, in_numpy=True))
    if kind == Q.Q6_K:                                  # F8H: 8-bit codes, a scale per 16 weights
        from specserve.kernels.coded import BlockCodes
        from specserve.kernels.int_codes import INT_F8H

        wide = BlockCodes(codes.codes * 2, codes.scales, codes.mins, 8)
        assert torch.equal(int_codes.panels(wide, INT_F8H), int_codes.panels(wide, INT_F8H, in_numpy=True))


@needs_kernel
def test_activation_quantization_matches_reference():
    x = _inputs(5, 128, seed=6)
    q, d, ds, _ = int_codes.quantize_rows(x, INT_Q4_1)
    q_ref, d_ref = _quantize_ref(x.numpy())
    np.testing.assert_array_equal(q.numpy().reshape(5, 4, 32), q_ref)
    np.testing.assert_array_equal(d.numpy(), d_ref)
    np.testing.assert_array_equal(ds.numpy(), (d_ref * q_ref.sum(-1).astype(np.float32)).astype(np.float32))


@needs_kernel
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("num_out,num_in", [(40, 96), (576, 576)])
def test_kernel_matches_reference_bits(kind, num_out, num_in):
    num_in = _width(kind, num_in)
    codes = _codes(kind, num_out, num_in, seed=int(kind) + num_in)
    panels, fmt = _panels(codes, kind)
    x = _inputs(11, num_in, seed=7)
    bias = torch.randn(num_out, generator=torch.Generator().manual_seed(8))
    for b in (None, bias):
        got = int_codes.int_linear(x, panels, fmt, codes.shape, b).numpy()
        np.testing.assert_array_equal(got, _int_linear_ref(x, codes, fmt, b))


@needs_kernel
@pytest.mark.parametrize("num_out", [40, 80, 112])
def test_threads_sharing_the_panels_unevenly_give_one_threads_bits(num_out):
    """3, 5 or 7 panels of 16 weight rows shared by 2 or 3 threads (shares one panel apart), for a
    decode's row, a verify's 8 and a prefill's 70 rows: each output row is what one thread
    computes, every panel's output written once."""
    codes = _codes(Q.Q4_1, num_out, 96, seed=num_out)
    panels, fmt = _panels(codes, Q.Q4_1)
    x = _inputs(70, 96, seed=13)
    threads = torch.get_num_threads()
    try:
        for rows in (1, 8, 70):
            torch.set_num_threads(1)
            alone = int_codes.int_linear(x[:rows], panels, fmt, codes.shape)
            for n in (2, 3):
                torch.set_num_threads(n)
                assert torch.equal(int_codes.int_linear(x[:rows], panels, fmt, codes.shape), alone), (rows, n)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.parametrize("kind", list(KINDS))
def test_close_to_float_product(kind):
    """Quantizing the inputs to 8 bits costs ~1% of a row's norm, no more."""
    codes = _codes(kind, 64, 256, seed=9)        # every kind's block divides 256
    panels, fmt = _panels(codes, kind)
    x = _inputs(3, 256, seed=10)
    got = int_codes.int_linear(x, panels, fmt, codes.shape)
    exact = x @ codes.expand().T
    assert ((got - exact).norm(dim=-1) / exact.norm(dim=-1)).max() < 0.02


@needs_kernel
@pytest.mark.parametrize("kind", list(KINDS))
def test_row_invariance_over_row_counts(kind):
    """Each row's bits are the same alone, inside 1..16 rows, and inside a prefill-sized call
    (several 64-row chunks), bfloat16 too."""
    cols = _width(kind, 192)
    codes = _codes(kind, 48, cols, seed=11)
    panels, fmt = _panels(codes, kind)
    x = _inputs(150, cols, seed=12)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        alone = torch.cat([int_codes.int_linear(xd[i:i + 1], panels, fmt, codes.shape) for i in range(16)])
        for rows in range(1, 17):
            assert torch.equal(int_codes.int_linear(xd[:rows], panels, fmt, codes.shape), alone[:rows])
        many = int_codes.int_linear(xd, panels, fmt, codes.shape)
        assert torch.equal(many[:16], alone)
        assert torch.equal(many[140:], int_codes.int_linear(xd[140:], panels, fmt, codes.shape))


@needs_kernel
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_runnable_variant_gives_the_same_bits(kind):
    """The AVX2 variant (vpmaddubsw) and the AVX-512 VNNI one (vpdpbusd) compute the same
    lanes: one result, whatever the CPU. Variants this CPU cannot run are skipped."""
    variants = [v.name for v in build.VARIANTS if build.load_variant(v.name) is not None]
    if len(variants) < 2:
        pytest.skip(f"only {variants} runs on this CPU")
    cols = _width(kind, 320)
    codes = _codes(kind, 80, cols, seed=13)
    panels, fmt = _panels(codes, kind)
    x = _inputs(13, cols, seed=14)
    results = [int_codes.int_linear(x, panels, fmt, codes.shape, library=build.load_variant(v)) for v in variants]
    for other in results[1:]:
        assert torch.equal(other, results[0])


def test_forcing_the_variant_down(monkeypatch):
    monkeypatch.setenv("SPECSERVE_ISA", "avx2")
    assert [v.name for v in build.candidate_variants()] == (["avx2"] if build.cpu_runs(build.VARIANTS[-1]) else [])
    monkeypatch.setenv("SPECSERVE_ISA", "no-such-isa")           # ignored, with a warning
    monkeypatch.setenv(build.AMX_SWITCH, "1")
    assert build.candidate_variants() == [v for v in build.VARIANTS if build.cpu_runs(v)]


# ---- routing: --quantization gguf through packed_linear ---------------------------------------

def _coded_linear(kind, rows: int, cols: int, dtype=torch.float32):
    from specserve.models.packed_linear import Linear

    codes = _codes(kind, rows, cols, seed=15)
    layer = Linear(cols, rows, bias=True)
    with torch.no_grad():
        layer.weight.copy_(codes.expand())
        layer.bias.normal_()
    layer = layer.to(dtype)
    layer.weight.block_codes = codes
    return layer, codes


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_quantization_routes_every_row_count_to_the_integer_kernel(dtype):
    from specserve.models.packed_linear import pack_linears_for_cpu

    layer, codes = _coded_linear(Q.Q4_1, 40, 96, dtype)
    assert pack_linears_for_cpu(layer, "gguf") == 1
    assert layer.int_format == INT_Q4_1 and layer.packed_weight is None
    x = _inputs(200, 96, seed=16)
    with torch.inference_mode():
        for rows in (1, 7, 200):                     # decode, verify and prefill shapes alike
            got = layer(x[:rows].to(dtype))
            expected = torch.from_numpy(_int_linear_ref(x[:rows].to(dtype), codes, INT_Q4_1, layer.bias.float()))
            assert torch.equal(got, expected.to(dtype))


@needs_kernel
def test_packing_again_keeps_the_integer_path_and_unquant_keeps_the_exact_one():
    from specserve.models.packed_linear import pack_linears_for_cpu

    layer, _ = _coded_linear(Q.Q8_0, 32, 64)
    pack_linears_for_cpu(layer, "gguf")
    pack_linears_for_cpu(layer)                      # e.g. a draft head packing shared modules
    assert layer.int_panels is not None and layer.native_weights.int_format == INT_Q8_0
    exact, _ = _coded_linear(Q.Q8_0, 32, 64)
    pack_linears_for_cpu(exact, "unquant")
    assert exact.int_panels is None and exact.coded_records is not None


def test_without_kernels_gguf_keeps_the_float_path(monkeypatch):
    from specserve.models.packed_linear import pack_linears_for_cpu

    monkeypatch.setattr(int_codes, "is_available", lambda: False)
    layer, _ = _coded_linear(Q.Q4_0, 32, 64)
    pack_linears_for_cpu(layer, "gguf")
    assert layer.int_panels is None
    x = torch.randn(3, 64)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


# ---- w8a8_int8: float weights rounded to Q8_0 blocks at load -----------------------------------

def test_q8_0_codes_are_llama_cpps_blocks():
    from specserve.kernels.coded import q8_0_codes

    values = np.random.default_rng(7).standard_normal((24, 96)).astype(np.float32) * 0.05
    values[3, 32:64] = 0.0                           # a block of zeros
    values[5, :32] = np.linspace(-1, 1, 32)          # codes that land on .5 before rounding
    reference = block_codes(SimpleNamespace(tensor_type=Q.Q8_0, shape=np.array([96, 24]),
                                            data=quantize(values, Q.Q8_0)))
    ours = q8_0_codes(torch.from_numpy(values))
    assert torch.equal(ours.codes, reference.codes) and torch.equal(ours.scales, reference.scales)
    assert not ours.mins.any() and int_codes.int_format(ours) == INT_Q8_0


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_int8_puts_float_linears_on_the_integer_kernel(dtype):
    from specserve.models.packed_linear import Linear, integer_quantization, pack_linears_for_cpu

    torch.manual_seed(3)
    model = torch.nn.Sequential(Linear(64, 48, bias=False), Linear(48, 40, bias=False)).to(dtype)
    odd = Linear(40, 8, bias=False).to(dtype)        # input width not a multiple of 32: left in float
    model.append(odd)
    original = model[0].weight.detach().float().clone()
    pack_linears_for_cpu(model, integer_quantization(model, "w8a8_int8"))
    assert [m.int_format for m in model] == [INT_Q8_0, 0, 0] and odd.int_panels is None
    rebuilt = model[0].weight.float()
    assert (rebuilt - original).abs().max() <= original.abs().max() / 127       # within Q8_0's rounding
    x = _inputs(5, 64, seed=4)
    with torch.inference_mode():
        from specserve.kernels.coded import q8_0_codes

        expected = _int_linear_ref(x.to(dtype), q8_0_codes(original), INT_Q8_0)
        assert torch.equal(model[0](x.to(dtype)), torch.from_numpy(expected).to(dtype))


@needs_kernel
def test_wider_codes_with_a_scale_per_16_weights_take_f8h():
    """8-bit codes past Q6_K's 6 bits, a scale per 16 weights (F8H): the reference's bits on
    every variant this CPU runs."""
    from specserve.kernels.coded import BlockCodes
    from specserve.kernels.int_codes import INT_F8H

    q6 = _codes(Q.Q6_K, 40, 256, seed=21)
    codes = BlockCodes(q6.codes * 2, q6.scales, q6.mins, 8)             # -64..62
    fmt = int_codes.int_format(codes)
    assert fmt == INT_F8H
    panels, x = int_codes.panels(codes, fmt), _inputs(9, 256, seed=22)
    expected = torch.from_numpy(_int_linear_ref(x, codes, fmt))
    for variant in [v.name for v in build.VARIANTS if build.load_variant(v.name) is not None]:
        assert torch.equal(int_codes.int_linear(x, panels, fmt, codes.shape, library=build.load_variant(variant)),
                           expected), variant


@needs_kernel
def test_q4_k_stored_as_its_6_bit_scales_gives_the_float32_scales_bits():
    """K4 (Q4_K's 6-bit scales times a float16 per 256 weights, rebuilt in the kernel) and F4
    (the same scales as float32) give the same bits; 4-bit blocks whose scales do not factor so
    take F4, with the reference's bits, on every variant this CPU runs."""
    from specserve.kernels.coded import BlockCodes
    from specserve.kernels.int_codes import INT_F4

    codes, x = _codes(Q.Q4_K, 40, 512, seed=23), _inputs(9, 512, seed=24)
    assert int_codes.int_format(codes) == INT_K4
    k4 = int_codes.int_linear(x, int_codes.panels(codes, INT_K4), INT_K4, codes.shape)
    assert torch.equal(k4, int_codes.int_linear(x, int_codes.panels(codes, INT_F4), INT_F4, codes.shape))
    odd = BlockCodes(codes.codes, codes.scales * 1.1, codes.mins, 4)          # no float16 x 6-bit factoring
    assert int_codes.int_format(odd) == INT_F4
    expected = torch.from_numpy(_int_linear_ref(x, odd, INT_F4))
    panels = int_codes.panels(odd, INT_F4)
    for variant in [v.name for v in build.VARIANTS if build.load_variant(v.name) is not None]:
        assert torch.equal(int_codes.int_linear(x, panels, INT_F4, odd.shape, library=build.load_variant(variant)),
                           expected), variant
