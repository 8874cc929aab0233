"""``build_cpu_metadata`` (numpy, straight from the request->slot table) gives the metadata
``build_metadata`` (torch ops on gathered table rows) gives the native attention kernel: the
same key slots, masks, padding indices and row maps, for decode batches, verification trees
of mixed widths and prefill chunks."""
from __future__ import annotations

import pytest
import torch

from specserve.kernels import attention as attention_kernel
from specserve.models.attention import build_metadata
from specserve.models.cpu_metadata import build_cpu_metadata

pytestmark = pytest.mark.skipif(not attention_kernel.is_available(),
                                reason="the native attention kernel (the only user of build_cpu_metadata) "
                                       "is not built here")

PAD_SLOT = 4095
GROUPS = 3


def _table(num_rows: int, width: int, seed: int) -> torch.Tensor:
    """A request->slot table of distinct, shuffled slots (as a paged pool hands them out)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(PAD_SLOT, generator=generator)[:num_rows * width].view(num_rows, width).to(torch.int64)


def _tree_mask(n: int, seed: int) -> torch.Tensor:
    """[n, n] ancestor mask of a random tree whose node 0 is the root."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        parent = int(torch.randint(0, i, (1,), generator=generator))
        mask[i] |= mask[parent]
    return mask


def _both(prefix_lens, extend_lens, rows, tree_masks, pad_slot):
    table = _table(8, 300, seed=sum(prefix_lens))
    out_loc = torch.arange(sum(extend_lens), dtype=torch.int64)
    reference = build_metadata(prefix_lens, extend_lens, table.index_select(0, torch.tensor(rows)), out_loc,
                               tree_masks, GROUPS, pad_slot=pad_slot)
    ours = build_cpu_metadata(prefix_lens, extend_lens, table.numpy(), rows, out_loc, tree_masks, GROUPS, pad_slot)
    return reference, ours


def _assert_same(reference, ours) -> None:
    assert ours.row_invariant == reference.row_invariant
    assert (ours.batch_size, ours.max_query_len) == (reference.batch_size, reference.max_query_len)
    assert torch.equal(ours.out_cache_loc, reference.out_cache_loc)
    assert torch.equal(ours.kv_indices, reference.kv_indices)
    assert torch.equal(ours.query_mask, reference.query_mask)
    assert torch.equal(ours.grouped_mask(), reference.mask)
    for name in ("query_index", "output_index"):
        expected, got = getattr(reference, name), getattr(ours, name)
        assert (expected is None) == (got is None), name
        if expected is not None:
            assert torch.equal(got.to(expected.dtype), expected), name
    assert torch.equal(ours.row_batch, reference.row_batch)
    assert torch.equal(ours.row_query, reference.row_query)


@pytest.mark.parametrize("prefix_lens", [[37], [5, 130, 64], [63, 64, 65, 1]])
def test_decode_batches_get_the_same_metadata(prefix_lens):
    rows = list(range(len(prefix_lens)))[::-1]
    _assert_same(*_both(prefix_lens, [1] * len(prefix_lens), rows, [None] * len(prefix_lens), PAD_SLOT))


def test_trees_of_mixed_widths_get_the_same_metadata():
    prefix_lens, extend_lens = [40, 7, 100], [4, 1, 6]
    masks = [_tree_mask(4, 0), None, _tree_mask(6, 1)]
    _assert_same(*_both(prefix_lens, extend_lens, [2, 5, 0], masks, PAD_SLOT))


def test_prefill_chunks_get_the_same_metadata():
    _assert_same(*_both([0, 17], [90, 33], [1, 3], [None, None], None))


@pytest.mark.parametrize("prefix_len, num_new", [(0, 2), (37, 2), (62, 3), (120, 64), (295, 10)])
def test_one_request_causal_forwards_get_the_same_metadata(prefix_len, num_new):
    """A chain's verification or an EAGLE head's catch-up (one request, no tree mask): its own
    path, the same values (the last case runs past the table's width of 300)."""
    _assert_same(*_both([prefix_len], [num_new], [6], [None], PAD_SLOT))
