"""The native RMSNorm (``kernels/layer.rms_norm``, what models on the integer path use for the
norms outside their native layers): HF's RMSNorm to float32 rounding, the same bits for a row
whatever the other rows, and written into a column block of a wider tensor as into its own."""
from __future__ import annotations

import pytest
import torch

from specserve.kernels import layer as native_layer
from specserve.models.layers import RMSNorm, use_native_norms

pytestmark = pytest.mark.skipif(not native_layer.is_available(),
                                reason="native kernels not built here (no AVX2 or no C compiler)")


def _norm(width: int) -> RMSNorm:
    norm = RMSNorm(width, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=torch.Generator().manual_seed(3)))
    return norm.eval()


def _rows(num_rows: int, width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(num_rows, width, generator=torch.Generator().manual_seed(num_rows)) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_norm_matches_hf_rmsnorm(dtype):
    norm, x = _norm(576).to(dtype), _rows(5, 576, dtype)
    with torch.inference_mode():
        expected = norm(x)
        use_native_norms(norm)
        got = norm(x)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)


def test_a_row_gets_the_same_bits_alone_and_among_others():
    norm = _norm(64)
    rows = _rows(7, 64)
    with torch.inference_mode():
        together = native_layer.rms_norm(rows, norm.weight, norm.eps)
        for i in range(rows.shape[0]):
            assert torch.equal(native_layer.rms_norm(rows[i:i + 1], norm.weight, norm.eps)[0], together[i])


def test_norm_into_a_column_block_of_a_wider_tensor():
    norm, x = _norm(64), _rows(3, 64)
    with torch.inference_mode():
        alone = native_layer.rms_norm(x, norm.weight, norm.eps)
        wide = torch.full((3, 192), 7.0)
        native_layer.rms_norm(x, norm.weight, norm.eps, out=wide[:, 64:128])
    assert torch.equal(wide[:, 64:128], alone)
    assert bool((wide[:, :64] == 7.0).all()) and bool((wide[:, 128:] == 7.0).all())


def test_norm_refuses_what_it_cannot_run():
    x, weight = _rows(2, 64), _norm(64).weight
    assert not native_layer.can_run_norm(x, weight)                                    # autograd on
    with torch.inference_mode():
        assert native_layer.can_run_norm(x, weight)
        assert not native_layer.can_run_norm(_rows(2, 60), _norm(60).weight)          # width not a multiple of 8
        assert not native_layer.can_run_norm(_rows(64, 2).t(), weight)                 # rows not contiguous
        assert not native_layer.can_run_norm(x.to(torch.float64), weight)              # dtype
