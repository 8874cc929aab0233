"""NgramCache: longest-window matching, BFS vs PROB shapes, LRU capacity, tree invariants."""
from __future__ import annotations

import random

import pytest

from specserve.config import ServerArgs
from specserve.speculative.ngram_cache import NgramCache
from specserve.speculative.tree import depths


def _shape(tree) -> tuple[list[int], list[int]]:
    return tree.draft_tokens.tolist(), tree.parents.tolist()


def test_counts_every_ngram_occurrence():
    cache = NgramCache(max_match_window_size=2, branch_length=1)  # n-grams up to length 3
    cache.insert([1, 2, 1, 2, 3])
    assert cache.ngram_count([1, 2]) == 2
    assert cache.ngram_count([2]) == 2
    assert cache.ngram_count([1, 2, 3]) == 1
    assert cache.ngram_count([2, 1, 2, 3]) == 0  # longer than max_depth = 3
    assert cache.ngram_count([3, 1]) == 0
    assert cache.num_nodes == 9  # 1 2 3 / 12 21 23 / 121 212 123


def test_incremental_insert_equals_full_insert():
    rng = random.Random(0)
    seq = [rng.randrange(5) for _ in range(60)]
    full = NgramCache(max_match_window_size=3, branch_length=2)
    full.insert(seq)
    inc = NgramCache(max_match_window_size=3, branch_length=2)
    pos = 0
    while pos < len(seq):
        step = rng.randint(1, 4)
        pos = min(pos + step, len(seq))
        inc.insert_incremental(seq[:pos], min(step, pos))
    assert inc.num_nodes == full.num_nodes
    for i in range(len(seq)):
        for n in range(1, 6):
            gram = seq[i:i + n]
            assert inc.ngram_count(gram) == full.ngram_count(gram), gram


def test_returned_window_keys_replace_rehashing():
    """The keys insert_incremental returns, passed to the next insert and to match, give the same
    counts and trees as hashing the windows again."""
    rng = random.Random(5)
    fresh, cached = NgramCache(), NgramCache()
    tokens = [rng.randrange(40) for _ in range(30)]
    fresh.insert(tokens)
    keys = cached.insert_incremental(tokens, len(tokens))
    for _ in range(50):
        new = [rng.randrange(40) for _ in range(rng.choice([1, 2, 4]))]
        tokens += new
        fresh.insert_incremental(tokens, len(new))
        keys = cached.insert_incremental(tokens, len(new), keys)
        a, b = fresh.match(tokens[-12:]), cached.match(tokens[-12:], suffix_keys=keys)
        assert a.draft_tokens.tolist() == b.draft_tokens.tolist() and a.parents.tolist() == b.parents.tolist()
    assert all(fresh.ngram_count(tokens[i:i + n]) == cached.ngram_count(tokens[i:i + n])
               for i in range(len(tokens)) for n in (1, 3, 7))


def test_match_prefers_longest_window():
    cache = NgramCache(min_match_window_size=1, max_match_window_size=3, branch_length=4,
                       min_bfs_breadth=1, max_bfs_breadth=3, num_draft_tokens=8)
    cache.insert([1, 2, 3, 4, 5])
    cache.insert([8, 3, 7, 6])
    # window "1 2 3" matches: one continuation, breadth 1 (long match is trusted)
    assert _shape(cache.match([0, 1, 2, 3])) == ([3, 4, 5], [-1, 0, 1])
    # only the window "3" matches: breadth 3, most recent continuation first
    assert _shape(cache.match([9, 3])) == ([3, 7, 4, 6, 5], [-1, 0, 0, 1, 2])
    # "2 3" (window 2) beats "3"
    assert _shape(cache.match([2, 3]))[0][:2] == [3, 4]


def test_no_match_gives_root_only_tree():
    cache = NgramCache(max_match_window_size=3, branch_length=4)
    cache.insert([1, 2, 3, 4, 5])
    assert _shape(cache.match([4, 5])) == ([5], [-1])  # seen, but never continued
    assert _shape(cache.match([42])) == ([42], [-1])
    assert NgramCache().match([7]).is_root_only


def _bfs_prob_cache(match_type: str) -> NgramCache:
    cache = NgramCache(max_match_window_size=2, branch_length=3, min_bfs_breadth=2,
                       max_bfs_breadth=2, match_type=match_type, num_draft_tokens=4)
    cache.insert([10, 11, 12])  # A C F, once, oldest
    for _ in range(3):
        cache.insert([10, 20, 21, 22])  # A B D E, three times, most recent
    return cache


def test_bfs_shape_is_level_by_level():
    cache = _bfs_prob_cache("BFS")
    assert _shape(cache.match([10])) == ([10, 20, 11, 21], [-1, 0, 0, 1])


def test_prob_shape_is_best_first():
    cache = _bfs_prob_cache("PROB")
    # P(B|A) = 3/4 and B D E is certain after it: 0.75 > P(C|A) = 0.25
    assert _shape(cache.match([10])) == ([10, 20, 21, 22], [-1, 0, 1, 2])
    assert _shape(cache.match([10], num_draft_tokens=5)) == ([10, 20, 21, 22, 11], [-1, 0, 1, 2, 0])
    assert _shape(cache.match([10], match_type="BFS")) == ([10, 20, 11, 21], [-1, 0, 0, 1])


def test_capacity_evicts_least_recently_used():
    cache = NgramCache(capacity=6, max_match_window_size=1, branch_length=1)  # uni- and bigrams
    cache.insert([1, 2])  # nodes 1, 12, 2
    cache.insert([3, 4])  # nodes 3, 34, 4 -> full
    assert cache.num_nodes == 6
    assert _shape(cache.match([1])) == ([1, 2], [-1, 0])  # refreshes 1 and 12
    cache.insert([5, 6])  # evicts the 3 least recently used: 2, 3, 34
    assert cache.num_nodes == 6
    assert cache.ngram_count([3, 4]) == 0 and cache.ngram_count([3]) == 0 and cache.ngram_count([2]) == 0
    assert cache.ngram_count([1, 2]) == 1 and cache.ngram_count([5, 6]) == 1
    assert _shape(cache.match([1])) == ([1, 2], [-1, 0])
    assert cache.match([3]).is_root_only


def test_capacity_bound_under_load():
    rng = random.Random(1)
    cache = NgramCache(capacity=500, max_match_window_size=4, branch_length=4, num_draft_tokens=6)
    seq: list[int] = []
    for _ in range(200):
        new = [rng.randrange(12) for _ in range(rng.randint(1, 5))]
        seq += new
        cache.insert_incremental(seq, len(new))
        assert cache.num_nodes <= 500
        tree = cache.match(seq[-6:])
        assert tree.num_nodes <= 6 and tree.root_token == seq[-1]


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_trees_obey_invariants(match_type):
    rng = random.Random(2)
    branch_length = 3
    cache = NgramCache(max_match_window_size=4, branch_length=branch_length, max_bfs_breadth=4,
                       match_type=match_type)
    corpus = [rng.randrange(8) for _ in range(400)]
    cache.insert(corpus)
    num_matched = 0
    for trial in range(60):
        num_draft_tokens = 1 + trial % 10
        start = rng.randrange(len(corpus) - 6)
        context = corpus[start:start + 5] if trial % 2 else [rng.randrange(9) for _ in range(5)]
        tree = cache.match(context, num_draft_tokens=num_draft_tokens)
        tokens, parents = _shape(tree)
        num_matched += len(tokens) > 1
        assert tokens[0] == context[-1]
        assert len(tokens) <= num_draft_tokens
        assert all(0 <= p < i for i, p in enumerate(parents) if i)  # parents before children
        assert int(depths(tree.parents).max()) <= branch_length
        for node in range(1, len(tokens)):  # every root-to-node path occurred in the corpus
            path = [node]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            assert cache.ngram_count([tokens[i] for i in reversed(path)]) > 0
        siblings = {}
        for i, p in enumerate(parents[1:], start=1):
            siblings.setdefault(p, []).append(tokens[i])
        assert all(len(s) == len(set(s)) for s in siblings.values())
    assert num_matched > 20


def test_from_server_args_and_validation():
    cache = NgramCache.from_server_args(ServerArgs(speculative_ngram_match_type="PROB"))
    assert cache.capacity == 10_000_000 and cache.match_type == "PROB"
    assert cache.num_draft_tokens == 12 and cache.max_depth == 12 + 18
    with pytest.raises(ValueError):
        NgramCache(match_type="DFS")
    with pytest.raises(ValueError):
        NgramCache(min_match_window_size=5, max_match_window_size=2)
    with pytest.raises(ValueError):
        NgramCache().match([])
