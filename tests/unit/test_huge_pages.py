"""Weights gathered into huge-page memory: the same values, aligned, and a model packed that way
computes the same bits as one whose panels stay where they were."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from specserve.kernels import huge_pages, int_codes
from specserve.models import packed_linear
from specserve.models.packed_linear import Linear, pack_linears_for_cpu, quantize_linears_q8_0


def test_gather_copies_values_into_one_aligned_block():
    tensors = [torch.randn(700, 513), torch.randint(0, 255, (3001,), dtype=torch.uint8),
               torch.randn(1024, 600).to(torch.bfloat16)]
    copies = huge_pages.gather(tensors)
    if copies is None:
        pytest.skip("madvise(MADV_HUGEPAGE) refused here (not Linux, or no transparent huge pages)")
    storage = {c.untyped_storage().data_ptr() for c in copies}
    assert len(storage) == 1 and all(c.data_ptr() % huge_pages.ALIGN == 0 for c in copies)
    assert copies[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    for original, copy in zip(tensors, copies):
        copy.copy_(original)
        assert copy.dtype == original.dtype and copy.shape == original.shape and torch.equal(copy, original)
    tensors[0].zero_()
    assert copies[0].abs().sum() > 0                       # a copy, not a view of the original


def test_an_arena_gives_each_tensor_its_room_as_it_comes_block_after_block():
    arena = huge_pages.Arena(block_bytes=huge_pages.HUGE_PAGE)
    tensors = [torch.randn(300, 513), torch.randint(0, 255, (3001,), dtype=torch.uint8),
               torch.randn(1024, 600),        # larger than a block: a block of its size (two huge pages)
               torch.randn(500, 1000),        # not in the rest of that one: the next block
               torch.randn(50, 8).to(torch.bfloat16)]
    copies = [arena.allocate(t.shape, t.dtype) for t in tensors]
    if copies[0] is None:
        pytest.skip("madvise(MADV_HUGEPAGE) refused here (not Linux, or no transparent huge pages)")
    for original, copy in zip(tensors, copies):
        copy.copy_(original)
        assert copy.dtype == original.dtype and copy.shape == original.shape and torch.equal(copy, original)
        assert copy.data_ptr() % huge_pages.ALIGN == 0
    blocks = [c.untyped_storage().data_ptr() for c in copies]
    assert blocks[0] == blocks[1] and blocks[3] == blocks[4] and len(set(blocks)) == 3
    assert all(copies[i].data_ptr() % huge_pages.HUGE_PAGE == 0 for i in (0, 2, 3))
    tensors[0].zero_()
    assert copies[0].abs().sum() > 0


def test_gather_leaves_less_than_a_huge_page_alone():
    assert huge_pages.gather([torch.zeros(1000)]) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_gives_a_writable_tensor_on_a_huge_page_boundary(dtype):
    """The KV cache's storage: the asked shape and dtype, starting on a 2 MiB boundary where
    the kernel takes the advice, an ordinary tensor under one huge page."""
    shape = (3, 5000, 3, 64)
    big = huge_pages.empty(shape, dtype)
    assert big.shape == shape and big.dtype == dtype and big.is_contiguous()
    big[:, -1].zero_()
    big[1, 7] = 2.0
    assert big[1, 7].eq(2.0).all() and big[2, -1].eq(0.0).all()
    advised = big.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert advised or huge_pages.gather([torch.zeros(huge_pages.HUGE_PAGE)]) is None   # aligned where THP is on
    small = huge_pages.empty((10, 64), dtype)
    assert small.shape == (10, 64) and small.dtype == dtype


def _q8_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(*[Linear(1024, 1024, bias=False) for _ in range(4)])
    quantize_linears_q8_0(model)
    return model


@pytest.mark.skipif(not int_codes.is_available(), reason="CPU kernels not built here (no AVX2 or no C compiler)")
def test_gathered_panels_compute_the_same_bits(monkeypatch):
    gathered, in_place = _q8_model(0), _q8_model(0)
    with torch.no_grad():
        pack_linears_for_cpu(gathered, "gguf")
        monkeypatch.setattr(packed_linear.huge_pages, "gather", lambda tensors: None)
        pack_linears_for_cpu(in_place, "gguf")
        moved = [m for m in gathered if m.int_panels_in_huge_pages]
        if not moved:
            pytest.skip("madvise(MADV_HUGEPAGE) refused here")
        assert len(moved) == 4 and len({m.int_panels.untyped_storage().data_ptr() for m in moved}) == 1
        assert not any(m.int_panels_in_huge_pages for m in in_place)
        x = torch.randn(5, 1024)
        assert torch.equal(gathered(x), in_place(x))
