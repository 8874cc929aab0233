"""Row invariance of decode-shaped attention: one query row gives the same bits alone
(plain decoding: one query over its contiguous keys) and inside a wider forward
(verification: beside other rows, other requests padded to a longer key length, and
draft-tree siblings masked out between its ancestors)."""
from __future__ import annotations

import pytest
import torch

from specserve.kernels import attention as attention_kernel
from specserve.models.attention import KVCache, TorchSDPABackend, build_metadata

NUM_KV, GROUP, HEAD_DIM, PAD_SLOT = 3, 3, 64, 4095


@pytest.fixture(params=["native kernel", "torch"], autouse=True)
def attention_path(request, monkeypatch):
    """Every test runs on both row-invariant paths: the native kernel (where it builds) and
    torch's float64 reductions."""
    if request.param == "torch":
        monkeypatch.setattr(attention_kernel, "is_available", lambda: False)
    elif not attention_kernel.is_available():
        pytest.skip("native attention kernel not built here (no AVX2 or no C compiler)")
    return request.param


def _cache(dtype, head_dim=HEAD_DIM):
    torch.manual_seed(0)
    cache = KVCache(1, PAD_SLOT + 1, NUM_KV, head_dim, dtype, "cpu")
    cache.k[0, :PAD_SLOT] = torch.randn(PAD_SLOT, NUM_KV, head_dim).to(dtype)
    cache.v[0, :PAD_SLOT] = torch.randn(PAD_SLOT, NUM_KV, head_dim).to(dtype)
    return cache


def _attend(cache, q, k, v, prefix_lens, extend_lens, slot_rows, new_slots, tree_masks=None, group=GROUP):
    """One decode-shaped forward; q [T, heads, hd] and k/v [T, kv heads, hd] of the new tokens
    (``group`` query heads a KV head)."""
    width = max(p + e for p, e in zip(prefix_lens, extend_lens))
    kv_indices = torch.full((len(slot_rows), width + 700), PAD_SLOT, dtype=torch.int64)
    for b, slots in enumerate(slot_rows):
        kv_indices[b, :len(slots)] = torch.tensor(slots)
        kv_indices[b, len(slots):len(slots) + 5] = 7         # stale slots past the length: must be ignored
    meta = build_metadata(prefix_lens, extend_lens, kv_indices, torch.tensor(new_slots), tree_masks,
                          num_kv_groups=group, pad_slot=PAD_SLOT)
    return TorchSDPABackend().forward(q, k, v, 0, cache, meta)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix", [5, 63, 300, 700])
def test_tree_rows_equal_plain_decode_rows(dtype, prefix):
    cache = _cache(dtype)
    # tree over 6 nodes: root 0; children 1, 2 of 0; 3 of 1; 4 of 2; 5 of 3
    parents = [-1, 0, 0, 1, 2, 3]
    n = len(parents)
    tree = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        tree[i, i] = True
        while p >= 0:
            tree[i, p], p = True, parents[p]
    q = torch.randn(n, NUM_KV * GROUP, HEAD_DIM).to(dtype)
    k = torch.randn(n, NUM_KV, HEAD_DIM).to(dtype)
    v = torch.randn(n, NUM_KV, HEAD_DIM).to(dtype)
    prefix_slots = list(range(1000, 1000 + prefix))
    tree_slots = list(range(3000, 3000 + n))
    other_len = prefix + 40                                 # a longer request in the same batch
    other_slots = list(range(2000 - other_len, 2000))
    verify = _attend(cache, torch.cat([q, q[:2]]), torch.cat([k, k[:2]]), torch.cat([v, v[:2]]),
                     [prefix, other_len - 2], [n, 2], [prefix_slots + tree_slots, other_slots],
                     tree_slots + [other_slots[-2], other_slots[-1]], [tree, None])
    for node in range(n):
        path, p = [], node
        while p >= 0:
            path.insert(0, p)
            p = parents[p]
        slots = prefix_slots + [tree_slots[i] for i in path]
        alone = _attend(cache, q[node:node + 1], k[node:node + 1], v[node:node + 1],
                        [len(slots) - 1], [1], [slots], [tree_slots[node]])
        assert torch.equal(alone, verify[node:node + 1]), f"tree node {node} differs from its plain decode"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix", [90, 700])          # 700: the kernel's keys in three splits, merged
def test_row_invariant_attention_matches_sdpa_closely(dtype, prefix):
    cache = _cache(dtype)
    n = 4
    q = torch.randn(n, NUM_KV * GROUP, HEAD_DIM).to(dtype)
    k, v = torch.randn(n, NUM_KV, HEAD_DIM).to(dtype), torch.randn(n, NUM_KV, HEAD_DIM).to(dtype)
    slots = list(range(100, 100 + prefix + n))
    ours = _attend(cache, q, k, v, [prefix], [n], [slots], slots[prefix:])
    meta = build_metadata([prefix], [n], torch.tensor([slots]), torch.tensor(slots[prefix:]),
                          num_kv_groups=GROUP)                       # no pad slot: plain SDPA
    reference = TorchSDPABackend().forward(q, k, v, 0, cache, meta)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), reference.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_beside_a_tree_attend_unpadded_and_unchanged(dtype, attention_path):
    """A batch of decode rows and one verify tree: the decode rows attend in their own group
    (torch path: not padded to the tree's width) and every row equals its computation alone."""
    cache = _cache(dtype)
    n, prefix = 5, 77
    q = torch.randn(2 + n, NUM_KV * GROUP, HEAD_DIM).to(dtype)
    k, v = torch.randn(2 + n, NUM_KV, HEAD_DIM).to(dtype), torch.randn(2 + n, NUM_KV, HEAD_DIM).to(dtype)
    decode_slots = [list(range(1000, 1040)), list(range(1100, 1200))]
    tree_slots = list(range(2000, 2000 + prefix + n))
    prefix_lens, extend_lens = [39, 99, prefix], [1, 1, n]
    rows = [decode_slots[0], decode_slots[1], tree_slots]
    new_slots = [decode_slots[0][-1], decode_slots[1][-1]] + tree_slots[prefix:]
    kv_indices = torch.full((3, 200), PAD_SLOT, dtype=torch.int64)
    for b, slots in enumerate(rows):
        kv_indices[b, :len(slots)] = torch.tensor(slots)
    meta = build_metadata(prefix_lens, extend_lens, kv_indices, torch.tensor(new_slots),
                          num_kv_groups=GROUP, pad_slot=PAD_SLOT)
    if attention_path == "torch":
        assert [part.batch_size for _, part in meta.parts] == [2, 1]
        assert meta.parts[0][1].max_query_len == 1
    else:
        assert meta.parts is None and meta.row_batch.tolist() == [0, 1, 2, 2, 2, 2, 2]
    together = TorchSDPABackend().forward(q, k, v, 0, cache, meta)
    for b in range(2):
        alone = _attend(cache, q[b:b + 1], k[b:b + 1], v[b:b + 1], [prefix_lens[b]], [1], [rows[b]], [new_slots[b]])
        assert torch.equal(alone, together[b:b + 1])
    tree = _attend(cache, q[2:], k[2:], v[2:], [prefix], [n], [tree_slots], tree_slots[prefix:])
    assert torch.equal(tree, together[2:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix", [40, 700])
def test_thread_count_does_not_change_bits(prefix, dtype):
    """The kernel shares few rows out by KV head and key split, more rows by segment: whichever
    the thread count picks, every row gets the same bits."""
    cache = _cache(dtype)
    n = 3
    q = torch.randn(n, NUM_KV * GROUP, HEAD_DIM)
    k, v = torch.randn(n, NUM_KV, HEAD_DIM), torch.randn(n, NUM_KV, HEAD_DIM)
    slots = list(range(100, 100 + prefix + n))
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(_attend(cache, q, k, v, [prefix], [n], [slots], slots[prefix:]))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix, n", [(2100, 2), (2100, 8), (200, 4), (200, 8)])
def test_a_verify_on_two_threads_equals_its_rows_decoded_alone(dtype, prefix, n):
    """Chained rows of one request on 2 threads. Over 2,100 keys the kernel shares a verify out by
    KV head and key split (2 rows as one segment of tasks); over 200 keys, 4 or 8 rows as (KV head,
    row) pairs, each thread whole heads and half of one. Each row must still get the bits of its
    plain decode step, and the verify those it gets on one thread."""
    cache = _cache(dtype)
    q = torch.randn(n, NUM_KV * GROUP, HEAD_DIM)
    k, v = torch.randn(n, NUM_KV, HEAD_DIM), torch.randn(n, NUM_KV, HEAD_DIM)
    slots = list(range(100, 100 + prefix + n))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        verify = _attend(cache, q, k, v, [prefix], [n], [slots], slots[prefix:])
        for i in range(n):
            alone = _attend(cache, q[i:i + 1], k[i:i + 1], v[i:i + 1], [prefix + i], [1],
                            [slots[:prefix + i + 1]], [slots[prefix + i]])
            assert torch.equal(alone, verify[i:i + 1]), f"row {i} differs from its decode alone"
        torch.set_num_threads(1)
        assert torch.equal(_attend(cache, q, k, v, [prefix], [n], [slots], slots[prefix:]), verify)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("head_dim, group, n", [(64, 2, 5), (128, 3, 8), (128, 2, 7)])
def test_a_verify_scored_with_keys_in_lanes_equals_its_rows_decoded_alone(head_dim, group, n):
    """A verify on a bfloat16 cache whose shared keys 8 or more (row, query head) pairs score (on
    CPUs with AVX-512 BF16: scored with the keys in lanes, the pairs 4 at a time and a remainder
    one at a time), heads of 64 and 128: each row gets the bits of its decode step alone."""
    cache = _cache(torch.bfloat16, head_dim)
    prefix = 300
    q = torch.randn(n, NUM_KV * group, head_dim)
    k, v = torch.randn(n, NUM_KV, head_dim), torch.randn(n, NUM_KV, head_dim)
    slots = list(range(100, 100 + prefix + n))
    verify = _attend(cache, q, k, v, [prefix], [n], [slots], slots[prefix:], group=group)
    for i in range(n):
        alone = _attend(cache, q[i:i + 1], k[i:i + 1], v[i:i + 1], [prefix + i], [1], [slots[:prefix + i + 1]],
                        [slots[prefix + i]], group=group)
        assert torch.equal(alone, verify[i:i + 1]), f"row {i} differs from its decode alone"


def runnable_variants() -> list[str]:
    """The native kernel's ISA variants this CPU builds and runs, best first."""
    from specserve.kernels import build

    return [v.name for v in build.VARIANTS if build.load_variant(v.name) is not None]


def attention_of_every_variant(q: torch.Tensor, cache: KVCache, meta, variants: list[str]) -> torch.Tensor:
    """The native kernel's attention over layer 0 of ``cache`` by each variant: asserts they all
    give the same bits, and returns that result."""
    from specserve.kernels import build

    results = [attention_kernel.paged_attention(q, cache.k[0], cache.v[0], meta.kv_indices, meta.query_mask,
                                                meta.row_batch, meta.row_query, library=build.load_variant(name))
               for name in variants]
    for other in results[1:]:
        assert torch.equal(other, results[0])
    return results[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_runnable_kernel_variant_gives_the_same_bits(dtype, attention_path):
    """The AVX2 variant (8 keys a tile; bfloat16 rows of 64 widened in registers) and the
    AVX-512 one (16 keys a tile) compute the same sums: one result, whatever the CPU, for decode
    rows, a tree-masked verify beside them and contexts across key splits. Variants this CPU
    cannot run are skipped."""
    if attention_path != "native kernel":
        pytest.skip("compares the native kernel's variants")
    variants = runnable_variants()
    if len(variants) < 2:
        pytest.skip(f"only {variants} runs on this CPU")
    torch.manual_seed(3)
    cache = _cache(dtype)
    prefix_lens, extend_lens = [700, 40, 300], [1, 1, 6]
    rows = [list(range(100 + 1000 * b, 100 + 1000 * b + p + e)) for b, (p, e) in enumerate(zip(prefix_lens, extend_lens))]
    tree = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
                         [1, 1, 0, 1, 0, 0], [1, 0, 1, 0, 1, 0], [1, 1, 0, 1, 0, 1]], dtype=torch.bool)
    width = max(p + e for p, e in zip(prefix_lens, extend_lens))
    kv_indices = torch.full((3, -(-width // 64) * 64), PAD_SLOT, dtype=torch.int64)
    for b, slots in enumerate(rows):
        kv_indices[b, :len(slots)] = torch.tensor(slots)
    meta = build_metadata(prefix_lens, extend_lens, kv_indices, torch.tensor([s[-1] for s in rows[:2]] + rows[2][-6:]),
                          [None, None, tree], num_kv_groups=GROUP, pad_slot=PAD_SLOT)
    attention_of_every_variant(torch.randn(sum(extend_lens), NUM_KV * GROUP, HEAD_DIM), cache, meta, variants)
