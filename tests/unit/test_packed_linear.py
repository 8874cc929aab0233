"""The prepacked CPU linear computes what F.linear computes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.models.packed_linear import Linear, can_pack, pack_linears_for_cpu

pytestmark = pytest.mark.skipif(not can_pack(), reason="torch built without oneDNN")


@pytest.fixture
def without_skinny(monkeypatch):
    """The oneDNN packing path alone (the skinny kernel has its own tests)."""
    import specserve.models.packed_linear as packed_linear

    monkeypatch.setattr(packed_linear, "_use_skinny", lambda module: False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 33, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matches_f_linear(dtype, rows, bias, without_skinny):
    torch.manual_seed(rows)
    layer = Linear(64, 96, bias=bias).to(dtype)
    x = torch.randn(rows, 64).to(dtype)
    expected = F.linear(x, layer.weight, layer.bias)
    assert pack_linears_for_cpu(layer) == 1
    assert layer.packed_weight is not None
    got = layer(x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and got.shape == expected.shape
    assert torch.allclose(got.float(), expected.float(), atol=tol, rtol=tol)


def test_float16_and_plain_modules_are_left_alone():
    layer = Linear(8, 8).to(torch.float16)
    plain = torch.nn.Linear(8, 8)
    assert pack_linears_for_cpu(torch.nn.Sequential(layer, plain)) == 0
    assert layer.packed_weight is None


@pytest.mark.parametrize("in_features", [576, 1536])
def test_bfloat16_rows_do_not_depend_on_the_other_rows(in_features):
    """A row alone and inside a call of many rows get the same bits (the down projection's
    1536 inputs are where oneDNN's one-row kernel rounded differently on AMD EPYC), on the
    path this CPU takes (the skinny kernel where it builds)."""
    torch.manual_seed(in_features)
    layer = Linear(in_features, 576, bias=False).to(torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=0.05)
    pack_linears_for_cpu(layer)
    x = torch.randn(40, in_features).to(torch.bfloat16)
    with torch.inference_mode():
        together = layer(x)
        for num_rows in (2, 5, 17):
            assert torch.equal(layer(x[:num_rows]), together[:num_rows])
        assert all(torch.equal(layer(x[i:i + 1]), together[i:i + 1]) for i in range(40))


def test_one_flagged_layer_flags_its_shape(monkeypatch, without_skinny):
    """The probe is statistical; the rounding difference is the kernel's, so it goes per shape."""
    import specserve.models.packed_linear as packed_linear

    first, second = (Linear(32, 16, bias=False).to(torch.bfloat16) for _ in range(2))
    other = Linear(16, 32, bias=False).to(torch.bfloat16)
    monkeypatch.setattr(packed_linear, "_is_one_row_invariant", lambda module: module is not first)
    pack_linears_for_cpu(torch.nn.Sequential(first, second, other))
    assert first.pads_single_row and second.pads_single_row and not other.pads_single_row
