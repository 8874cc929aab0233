"""The native n-gram cache gives the Python reference's results: the same trees (BFS and PROB,
every window and breadth rule), counts and node numbers, through feeds in pieces, LRU evictions
of inner nodes and leaves, and matches that refresh what they use."""
from __future__ import annotations

import random

import pytest

from specserve.speculative.ngram_cache import NgramCache
from specserve.speculative.ngram_native import NativeNgramCache, native_available

pytestmark = pytest.mark.skipif(not native_available(), reason="CPU kernels not built here (no compiler or CPU "
                                                               "without AVX2, or SPECSERVE_KERNELS=0)")


def _pair(**params):
    return NgramCache(**params), NativeNgramCache(**params)


def _same_tree(a, b) -> bool:
    return a.draft_tokens.tolist() == b.draft_tokens.tolist() and a.parents.tolist() == b.parents.tolist()


@pytest.mark.parametrize("seed", range(6))
def test_native_cache_matches_the_python_reference(seed):
    rng = random.Random(seed)
    params = dict(capacity=rng.choice([40, 300, 10_000]), min_match_window_size=rng.choice([1, 2]),
                  max_match_window_size=rng.choice([3, 6]), branch_length=rng.choice([2, 5]),
                  min_bfs_breadth=1, max_bfs_breadth=rng.choice([1, 3, 6]), num_draft_tokens=rng.choice([4, 8]))
    ref, native = _pair(**params)
    vocab = rng.choice([4, 12])
    sequences = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 20))] for _ in range(4)]
    fed = [0] * len(sequences)
    for step in range(150):
        i = rng.randrange(len(sequences))
        seq = sequences[i]
        if rng.random() < 0.6:                                   # the request gains tokens; feed them
            seq.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 4)))
            num_new = len(seq) - fed[i]
            tail = seq[max(len(seq) - num_new - ref.max_depth, 0):]
            ref.insert_incremental(tail, num_new)
            native.insert_incremental(tail, num_new)
            fed[i] = len(seq)
        else:
            kind = rng.choice(["BFS", "PROB"])
            cap = rng.choice([1, 3, 8, 16])
            a = ref.match(seq[-ref.max_match_window_size:], num_draft_tokens=cap, match_type=kind)
            b = native.match(seq, num_draft_tokens=cap, match_type=kind)
            assert _same_tree(a, b), (step, kind, a.draft_tokens.tolist(), b.draft_tokens.tolist())
        assert native.num_nodes == ref.num_nodes <= params["capacity"]
        probe = seq[-rng.randrange(1, 5):]
        assert native.ngram_count(probe) == ref.ngram_count(probe)


def test_native_cache_counts_and_evicts_like_the_reference():
    ref, native = _pair(capacity=5, max_match_window_size=2, branch_length=1)
    for cache in (ref, native):
        cache.insert([1, 2, 3])              # 1, 2, 3, 12, 23, 123: 6 n-grams, the oldest evicted
        cache.insert([1, 2])                 # refreshes 1, 2, 12
    for ngram in ([1], [2], [3], [1, 2], [2, 3], [1, 2, 3]):
        assert native.ngram_count(ngram) == ref.ngram_count(ngram), ngram
    assert native.num_nodes == ref.num_nodes == 5
    native.clear()
    assert native.num_nodes == 0 and native.match([1, 2]).num_nodes == 1


def test_native_cache_rejects_what_the_reference_rejects():
    native = NativeNgramCache()
    with pytest.raises(ValueError):
        native.match([])
    with pytest.raises(ValueError):
        native.match([1], match_type="DFS")
    with pytest.raises(ValueError):
        native.insert_incremental([1, 2], 3)
    with pytest.raises(ValueError):
        NativeNgramCache(min_match_window_size=3, max_match_window_size=2)


@pytest.mark.parametrize("seed", range(4))
def test_feed_and_match_is_a_feed_then_a_match_in_either_cache(seed):
    """A proposer's step in one call (the native one a single ctypes call) gives what feeding
    and matching apart give, in the Python reference and the native cache alike."""
    rng = random.Random(seed)
    params = dict(min_match_window_size=rng.choice([1, 2]), max_match_window_size=rng.choice([3, 6]),
                  branch_length=rng.choice([2, 5]), max_bfs_breadth=rng.choice([1, 3]), num_draft_tokens=8,
                  match_type=rng.choice(["BFS", "PROB"]))
    apart, native, ref = NgramCache(**params), NativeNgramCache(**params), NgramCache(**params)
    seq, fed, keys = [rng.randrange(6) for _ in range(5)], 0, None
    for _ in range(120):
        seq.extend(rng.randrange(6) for _ in range(rng.choice([0, 0, 1, 3])))
        num_new, cap = len(seq) - fed, rng.choice([1, 4, 8])
        context = seq[max(len(seq) - num_new - apart.max_depth, 0):]
        if num_new:
            apart.insert_incremental(context, num_new)
        expected = apart.match(seq[-apart.max_match_window_size:], num_draft_tokens=cap)
        got_native, _ = native.feed_and_match(context, num_new, cap)
        got_ref, keys = ref.feed_and_match(context, num_new, cap, keys)
        fed = len(seq)
        assert _same_tree(expected, got_native) and _same_tree(expected, got_ref)
    assert native.num_nodes == ref.num_nodes == apart.num_nodes


@pytest.mark.parametrize("kind", ["BFS", "PROB"])
def test_a_smaller_cap_gives_a_prefix_of_the_same_tree(kind):
    """The worker matches at the full cap, then cuts each tree to the size the policy prefers
    (``truncate_tree``): that must be the tree a match at the smaller cap gives."""
    from specserve.speculative.tree import truncate_tree
    rng = random.Random(7)
    for cache_type in (NgramCache, NativeNgramCache):
        cache = cache_type(min_match_window_size=1, max_match_window_size=3, branch_length=4, max_bfs_breadth=4)
        for _ in range(40):
            cache.insert([rng.randrange(5) for _ in range(rng.randrange(2, 12))])
        for _ in range(60):
            tail = [rng.randrange(5) for _ in range(3)]
            full = cache.match(tail, num_draft_tokens=16, match_type=kind)
            for cap in range(1, 16):
                assert _same_tree(truncate_tree(full, cap), cache.match(tail, num_draft_tokens=cap, match_type=kind))
