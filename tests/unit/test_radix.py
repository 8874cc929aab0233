"""RadixCache: match/insert/split/evict/lock, LRU, page alignment, and a
randomized simulation of requests checked against brute force and refcounts."""
import random
from collections import Counter

import pytest

from specserve.cache.block_pool import BlockPool
from specserve.cache.radix import RadixCache


# ----------------------------------------------------------------- helpers
class Req:
    """Minimal request: token ids with computed KV, their slots, its locked node."""

    def __init__(self, tokens, slots, node):
        self.tokens, self.slots, self.node = tokens, slots, node


def start(pool, cache, prompt):
    """Scheduler-side admission: match prompt[:-1], adopt the prefix, allocate the rest."""
    slots, node = cache.match_prefix(prompt[:-1])
    pool.incref(pool.pages_of(slots))
    cache.lock(node)
    new = pool.extend_slots(slots, len(prompt) - len(slots))
    assert new is not None
    return Req(list(prompt), slots + new, node)


def finish(pool, cache, req):
    present = cache.insert(req.tokens, req.slots)
    cache.unlock(req.node)
    pool.release_slots(req.slots)
    return present


def run(pool, cache, prompt):
    return finish(pool, cache, start(pool, cache, prompt))


def nodes_of(cache):
    stack, nodes = list(cache.root_node.children.values()), []
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    return nodes


def stored_sequences(cache):
    """Token ids of every root-to-node path."""
    sequences, stack = [], [(child, []) for child in cache.root_node.children.values()]
    while stack:
        node, prefix = stack.pop()
        path = prefix + node.key
        sequences.append(path)
        stack.extend((child, path) for child in node.children.values())
    return sequences


def check_invariants(pool, cache, running):
    """Refcounts equal holders; free + evictable + request-held pages == all pages."""
    tree_pages = [p for node in nodes_of(cache) for p in pool.pages_of(node.value)]
    assert len(tree_pages) == len(set(tree_pages))
    assert sum(len(node.key) for node in nodes_of(cache)) == cache.total_size()
    expected = Counter(tree_pages)
    request_pages = set()
    for req in running:
        pages = pool.pages_of(req.slots)
        expected.update(pages)
        request_pages.update(pages)
    for page in range(pool.num_pages):
        assert pool.refcount(page) == expected[page], page
    page_size = pool.page_size
    assert cache.evictable_size() % page_size == 0
    assert (pool.num_free_tokens + cache.evictable_size() + len(request_pages) * page_size
            == pool.capacity_tokens)


def aligned_lcp(a, b, page_size):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n - n % page_size


# ------------------------------------------------------------ basic cases
def test_insert_then_match_returns_the_cached_slots():
    pool = BlockPool(num_pages=16)
    cache = RadixCache(pool)
    req = start(pool, cache, [1, 2, 3, 4, 5, 6])
    slots = list(req.slots)
    assert finish(pool, cache, req) == 0
    assert cache.total_size() == 6 and cache.evictable_size() == 6
    assert pool.num_free_pages == 10                     # the tree keeps its 6 pages
    matched, node = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert matched == slots and node.key == [1, 2, 3, 4, 5, 6]
    assert cache.match_prefix([9, 1]) == ([], cache.root_node)
    check_invariants(pool, cache, [])


def test_partial_match_splits_the_node():
    pool = BlockPool(num_pages=16)
    cache = RadixCache(pool)
    run(pool, cache, [1, 2, 3, 4, 5, 6])
    matched, node = cache.match_prefix([1, 2, 3, 9])
    assert len(matched) == 3 and node.key == [1, 2, 3]
    assert [child.key for child in node.children.values()] == [[4, 5, 6]]
    assert cache.total_size() == 6                       # splitting stores nothing new
    assert run(pool, cache, [1, 2, 3, 7, 8]) == 3
    assert sorted(map(tuple, stored_sequences(cache))) == [
        (1, 2, 3), (1, 2, 3, 4, 5, 6), (1, 2, 3, 7, 8)]
    check_invariants(pool, cache, [])


def test_insert_keeps_the_tree_slots_for_tokens_it_already_has():
    pool = BlockPool(num_pages=16)
    cache = RadixCache(pool)
    first = start(pool, cache, [1, 2, 3, 4])
    second = start(pool, cache, [1, 2, 3, 4])          # computed twice, other slots
    assert finish(pool, cache, first) == 0
    tree_slots = list(first.slots)
    assert finish(pool, cache, second) == 4              # second's pages go back
    assert pool.num_free_pages == 12
    assert cache.match_prefix([1, 2, 3, 4])[0] == tree_slots
    check_invariants(pool, cache, [])


def test_insert_validates_its_arguments():
    pool = BlockPool(num_pages=4, page_size=2)
    cache = RadixCache(pool)
    with pytest.raises(ValueError):
        cache.insert([1, 2], [0])
    pool.alloc_pages(1)
    with pytest.raises(ValueError):
        cache.insert([1, 2], [1, 2])                     # does not start a page


def test_matching_and_inserting_are_page_aligned():
    pool = BlockPool(num_pages=8, page_size=4)
    cache = RadixCache(pool)
    prompt = list(range(100, 110))                       # 10 tokens: 2 whole pages + 2
    assert run(pool, cache, prompt) == 0
    assert cache.total_size() == 8
    assert pool.num_free_pages == 6
    assert len(cache.match_prefix(prompt[:7])[0]) == 4
    assert len(cache.match_prefix(prompt)[0]) == 8
    diverging = prompt[:6] + [0] + prompt[7:]            # differs inside the 2nd page
    slots, node = cache.match_prefix(diverging)
    assert len(slots) == 4 and slots == list(range(4))
    assert len(node.key) == 4
    assert run(pool, cache, diverging) == 4
    assert cache.total_size() == 12
    check_invariants(pool, cache, [])


def test_locked_nodes_are_never_evicted():
    pool = BlockPool(num_pages=16)
    cache = RadixCache(pool)
    run(pool, cache, [1, 2, 3, 4])
    run(pool, cache, [1, 2, 5, 6])
    running = start(pool, cache, [1, 2, 3, 4, 7])       # locks [1, 2] and [3, 4]
    assert cache.protected_size() == 4 and cache.evictable_size() == 2
    assert cache.evict(100) == 2                         # only [5, 6]
    assert cache.total_size() == 4
    check_invariants(pool, cache, [running])
    finish(pool, cache, running)
    assert cache.protected_size() == 0 and cache.evictable_size() == 5
    assert cache.evict(100) == 5
    assert pool.num_free_pages == 16


def test_unlock_of_an_unlocked_node_raises():
    pool = BlockPool(num_pages=8)
    cache = RadixCache(pool)
    run(pool, cache, [1, 2, 3])
    _, node = cache.match_prefix([1, 2, 3])
    with pytest.raises(ValueError):
        cache.unlock(node)


def test_evict_follows_least_recent_use():
    pool = BlockPool(num_pages=16)
    cache = RadixCache(pool)
    for first in (10, 20, 30):
        run(pool, cache, [first, 1, 2, 3])
    cache.match_prefix([10, 1, 2, 3])                    # [10, ...] is now the freshest
    assert cache.evict(1) == 4                           # whole leaf: [20, ...]
    assert len(cache.match_prefix([20, 1, 2, 3])[0]) == 0
    assert cache.evict(4) == 4                           # then [30, ...]
    assert len(cache.match_prefix([30, 1, 2, 3])[0]) == 0
    assert len(cache.match_prefix([10, 1, 2, 3])[0]) == 4
    check_invariants(pool, cache, [])


def test_evict_climbs_to_parents_that_become_leaves():
    pool = BlockPool(num_pages=16)
    cache = RadixCache(pool)
    run(pool, cache, [1, 2, 3, 4])
    run(pool, cache, [1, 2, 5, 6])
    run(pool, cache, [8, 9])
    cache.match_prefix([8, 9])
    assert cache.evict(5) == 6                           # [3,4], [5,6], then [1,2]
    assert [seq for seq in stored_sequences(cache)] == [[8, 9]]
    assert cache.evict(0) == 0
    assert cache.evict(10) == 2
    assert pool.num_free_pages == 16 and cache.total_size() == 0


def test_evicted_pages_still_held_by_a_request_stay_allocated():
    pool = BlockPool(num_pages=8)
    cache = RadixCache(pool)
    run(pool, cache, [1, 2, 3, 4])
    slots, node = cache.match_prefix([1, 2, 3])
    pool.incref(pool.pages_of(slots))                    # adopted but (wrongly) not locked
    cache.evict(10)
    assert pool.num_free_pages == 8 - 3
    pool.release_slots(slots)
    assert pool.num_free_pages == 8


def test_disabled_cache_stores_nothing():
    pool = BlockPool(num_pages=8)
    cache = RadixCache(pool, disabled=True)
    assert run(pool, cache, [1, 2, 3, 4]) == 0
    assert cache.match_prefix([1, 2, 3, 4]) == ([], cache.root_node)
    assert cache.total_size() == 0 and cache.evict(10) == 0
    assert pool.num_free_pages == 8


def test_reset_releases_tree_refs_even_while_requests_run():
    pool = BlockPool(num_pages=16, page_size=2)
    cache = RadixCache(pool)
    run(pool, cache, [1, 2, 3, 4, 5])
    running = start(pool, cache, [1, 2, 3, 4, 9])
    cache.reset()
    assert cache.total_size() == 0 and cache.protected_size() == 0
    assert pool.num_free_pages == 16 - 3                 # running still holds its 3 pages
    check_invariants(pool, cache, [running])
    cache.unlock(running.node)                           # ignored: the node was dropped
    pool.release_slots(running.slots)
    assert pool.num_free_pages == 16
    assert cache.match_prefix([1, 2, 3, 4]) == ([], cache.root_node)


def test_pretty_lists_every_node():
    pool = BlockPool(num_pages=16)
    cache = RadixCache(pool)
    run(pool, cache, [1, 2, 3, 4])
    run(pool, cache, [1, 2, 5])
    text = cache.pretty()
    assert text.startswith("root") and len(text.splitlines()) == 4
    assert "[1, 2] len=2" in text


# ------------------------------------------------------------- randomized
def random_prompt(rng, bases):
    base = rng.choice(bases)
    prompt = base[:rng.randrange(len(base) + 1)]
    prompt += [rng.randrange(30) for _ in range(rng.randrange(1, 7))]
    return prompt


@pytest.mark.parametrize("page_size", [1, 4])
def test_random_matches_equal_brute_force_longest_prefix(page_size):
    rng = random.Random(1234 + page_size)
    pool = BlockPool(num_pages=2000, page_size=page_size)
    cache = RadixCache(pool)
    bases = [[rng.randrange(30) for _ in range(rng.randrange(4, 20))] for _ in range(5)]
    inserted, slot_owner = [], {}                      # slot -> token prefix computed there
    for _ in range(150):
        prompt = random_prompt(rng, bases)
        slots, node = cache.match_prefix(prompt[:-1])
        expected = max((aligned_lcp(prompt[:-1], seq, page_size) for seq in inserted), default=0)
        assert len(slots) == expected
        assert all(slot_owner[s] == tuple(prompt[:i + 1]) for i, s in enumerate(slots))
        pool.incref(pool.pages_of(slots))
        cache.lock(node)
        new = pool.extend_slots(slots, len(prompt) - len(slots))
        for i, slot in enumerate(new, start=len(slots)):
            slot_owner[slot] = tuple(prompt[:i + 1])
        finish(pool, cache, Req(prompt, slots + new, node))
        inserted.append(prompt[:len(prompt) - len(prompt) % page_size])
    check_invariants(pool, cache, [])
    cache.reset()
    assert pool.num_free_pages == pool.num_pages


def allocate(pool, cache, slots, num):
    """Extend with eviction on shortage, as the scheduler would."""
    new = pool.extend_slots(slots, num)
    if new is None:
        cache.evict(num + pool.page_size)
        new = pool.extend_slots(slots, num)
    return new


def write_kv(pool, kv, tokens, slots, start_index):
    """Fake KV: the token prefix whose last token was computed into each slot."""
    for i in range(start_index, len(tokens)):
        assert pool.refcount(pool.page_of(slots[i])) == 1   # never write a shared page
        kv[slots[i]] = tuple(tokens[:i + 1])


def admit(rng, pool, cache, kv, bases):
    prompt = random_prompt(rng, bases)
    slots, node = cache.match_prefix(prompt[:-1])
    assert all(kv[s] == tuple(prompt[:i + 1]) for i, s in enumerate(slots))
    pool.incref(pool.pages_of(slots))
    cache.lock(node)
    new = allocate(pool, cache, slots, len(prompt) - len(slots))
    if new is None:                                      # pool full of running requests
        finish(pool, cache, Req(prompt[:len(slots)], slots, node))
        return None
    req = Req(prompt, slots + new, node)
    write_kv(pool, kv, prompt, req.slots, len(slots))
    return req


def speculative_step(rng, pool, cache, kv, req):
    """Draft k tokens, compute them, keep a random accepted prefix."""
    num_draft = rng.randrange(1, 5)
    draft = allocate(pool, cache, req.slots, num_draft)
    if draft is None:
        return
    old_len = len(req.slots)
    req.slots += draft
    req.tokens += [rng.randrange(30) for _ in range(num_draft)]
    write_kv(pool, kv, req.tokens, req.slots, old_len)
    accepted = rng.randrange(num_draft + 1)
    pool.truncate_slots(req.slots, old_len + accepted)
    del req.tokens[old_len + accepted:]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_serving_with_eviction_keeps_refcounts_balanced(page_size, seed):
    rng = random.Random(seed * 10 + page_size)
    pool = BlockPool(num_pages=96 // page_size + 8, page_size=page_size)
    cache = RadixCache(pool)
    bases = [[rng.randrange(30) for _ in range(rng.randrange(4, 24))] for _ in range(4)]
    kv, running, num_evicting = {}, [], 0
    for _ in range(400):
        roll = rng.random()
        if roll < 0.3 or not running:
            req = admit(rng, pool, cache, kv, bases)
            running += [req] if req else []
        elif roll < 0.8:
            speculative_step(rng, pool, cache, kv, rng.choice(running))
        else:
            req = running.pop(rng.randrange(len(running)))
            assert all(kv[s] == tuple(req.tokens[:i + 1]) for i, s in enumerate(req.slots))
            finish(pool, cache, req)
        num_evicting += pool.num_free_pages == 0
        check_invariants(pool, cache, running)
    assert num_evicting > 0                              # the pool did run dry
    for req in running:
        finish(pool, cache, req)
    check_invariants(pool, cache, [])
    cache.reset()
    assert pool.num_free_pages == pool.num_pages
