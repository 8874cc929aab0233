"""The skinny linear kernel computes F.linear, and each row's bits do not depend on the others."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.kernels import skinny
from specserve.models.packed_linear import Linear, has_packed_kernels, pack_linears_for_cpu

pytestmark = pytest.mark.skipif(not skinny.is_available(), reason="skinny kernel not built here (no AVX2 or no C compiler)")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _reference(x, weight, bias):
    """float64 F.linear, rounded to x's dtype (what an exact kernel would return)."""
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 40])
@pytest.mark.parametrize("out_features", [4, 13, 96])
def test_matches_f_linear(dtype, rows, out_features):
    generator = torch.Generator().manual_seed(rows * 100 + out_features)
    x = torch.randn(rows, 64, generator=generator).to(dtype)
    weight = (torch.randn(out_features, 64, generator=generator) * 0.1).to(dtype)
    bias = torch.randn(out_features, generator=generator)
    for b in (None, bias):
        got = skinny.skinny_linear(x, weight, b)
        expected = _reference(x, weight, b)
        assert got.dtype == dtype and got.shape == (rows, out_features)
        tol = TOLERANCE[dtype]
        assert torch.allclose(got.float(), expected.float(), atol=tol, rtol=tol)


def test_leading_dimensions_and_non_contiguous_input():
    x = torch.randn(3, 2, 128)[:, :, :64]
    weight = torch.randn(16, 64)
    assert torch.allclose(skinny.skinny_linear(x, weight), F.linear(x, weight), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_alone_and_among_others(dtype):
    torch.manual_seed(0)
    x = torch.randn(33, 1536).to(dtype)
    weight = (torch.randn(200, 1536) * 0.05).to(dtype)
    together = skinny.skinny_linear(x, weight)
    for start, stop in ((0, 1), (5, 6), (3, 5), (10, 17), (0, 33)):
        assert torch.equal(skinny.skinny_linear(x[start:stop], weight), together[start:stop])


def test_thread_count_does_not_change_bits():
    torch.manual_seed(1)
    x, weight = torch.randn(5, 576), torch.randn(1000, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = skinny.skinny_linear(x, weight)
        torch.set_num_threads(2)
        two = skinny.skinny_linear(x, weight)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_shapes_it_cannot_take_are_refused():
    assert not skinny.can_run(torch.randn(2, 60), torch.randn(8, 60))        # K % 8 != 0
    assert not skinny.can_run(torch.randn(2, 64).half(), torch.randn(8, 64).half())
    assert not skinny.can_run(torch.randn(2, 64), torch.randn(8, 64).bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_layers_route_few_rows_to_the_kernel(dtype):
    layer = Linear(64, 32, bias=True).to(dtype)
    pack_linears_for_cpu(layer)
    expected_rows = 32 if dtype == torch.float32 else (0 if has_packed_kernels(dtype) else 2**62)
    assert layer.skinny_max_rows == expected_rows
    x = torch.randn(5, 64).to(dtype)
    with torch.inference_mode():
        got = layer(x)
    assert torch.allclose(got.float(), _reference(x, layer.weight, layer.bias).float(),
                          atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    layer.unpack()
    assert layer.skinny_max_rows == 0 and layer.skinny_bias is None


def test_training_mode_keeps_autograd():
    layer = Linear(64, 8)
    pack_linears_for_cpu(layer)
    x = torch.randn(2, 64, requires_grad=True)
    layer(x).sum().backward()                      # grad mode on: F.linear, differentiable
    assert x.grad is not None and layer.weight.grad is not None
