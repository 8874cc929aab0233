"""BlockPool: page allocation, refcounts, and slot lists across page boundaries."""
import random

import pytest

from specserve.cache.block_pool import RUN_GAP, BlockPool


def test_sizes_of_a_fresh_pool():
    pool = BlockPool(num_pages=8, page_size=4)
    assert pool.page_size == 4
    assert pool.capacity_tokens == 32
    assert pool.num_free_pages == 8
    assert pool.num_free_tokens == 32


def test_alloc_and_decref_round_trip():
    pool = BlockPool(num_pages=4)
    pages = pool.alloc_pages(3)
    assert pages == [0, 1, 2]                       # page 0 is a normal page
    assert pool.num_free_pages == 1
    assert all(pool.refcount(p) == 1 for p in pages)
    pool.decref(pages)
    assert pool.num_free_pages == 4
    assert pool.alloc_pages(0) == []


def test_alloc_too_many_returns_none_and_changes_nothing():
    pool = BlockPool(num_pages=4)
    pool.alloc_pages(2)
    assert pool.alloc_pages(3) is None
    assert pool.num_free_pages == 2
    with pytest.raises(ValueError):
        pool.alloc_pages(-1)


def test_shared_page_is_freed_by_its_last_holder():
    pool = BlockPool(num_pages=2)
    [page] = pool.alloc_pages(1)
    pool.incref([page])
    assert pool.refcount(page) == 2
    pool.decref([page])
    assert pool.num_free_pages == 1
    pool.decref([page])
    assert pool.num_free_pages == 2


def test_refcount_errors():
    pool = BlockPool(num_pages=2)
    with pytest.raises(ValueError):
        pool.decref([0])                            # free page
    with pytest.raises(ValueError):
        pool.incref([1])                            # free page
    with pytest.raises(IndexError):
        pool.decref([2])
    with pytest.raises(ValueError):
        BlockPool(num_pages=0)
    with pytest.raises(ValueError):
        BlockPool(num_pages=1, page_size=0)


def test_extend_with_page_size_one():
    pool = BlockPool(num_pages=5)
    slots = pool.extend_slots([], 3)
    slots += pool.extend_slots(slots, 2)
    assert slots == [0, 1, 2, 3, 4]
    assert pool.extend_slots(slots, 1) is None
    assert pool.extend_slots(slots, 0) == []


def test_extend_fills_partial_page_before_new_pages():
    pool = BlockPool(num_pages=4, page_size=4)
    slots = pool.extend_slots([], 3)
    assert slots == [0, 1, 2]
    assert pool.num_free_pages == 3
    more = pool.extend_slots(slots, 6)
    assert more == [3, 4, 5, 6, 7, 8]
    assert pool.num_free_pages == 1
    slots += more
    assert pool.pages_of(slots) == [0, 1, 2]
    slots += pool.extend_slots(slots, 3)                # page 2 has room: no new page
    assert slots[-3:] == [9, 10, 11]
    assert pool.num_free_pages == 1


def test_extend_without_enough_pages_allocates_nothing():
    pool = BlockPool(num_pages=2, page_size=4)
    slots = pool.extend_slots([], 3)
    assert pool.extend_slots(slots, 6) is None           # 1 offset left + 2 new pages
    assert pool.num_free_pages == 1
    assert len(pool.extend_slots(slots, 5)) == 5


def test_extend_refuses_to_write_into_a_shared_partial_page():
    pool = BlockPool(num_pages=2, page_size=4)
    slots = pool.extend_slots([], 2)
    pool.incref(pool.pages_of(slots))
    with pytest.raises(ValueError):
        pool.extend_slots(slots, 1)


@pytest.mark.parametrize("page_size", [1, 4])
def test_truncate_frees_only_pages_past_the_kept_prefix(page_size):
    pool = BlockPool(num_pages=12, page_size=page_size)
    slots = pool.extend_slots([], 10)
    used_pages = pool.num_pages - pool.num_free_pages
    kept = pool.truncate_slots(slots, 5)
    assert kept is slots and len(kept) == 5
    assert pool.num_pages - pool.num_free_pages == -(-5 // page_size)
    assert pool.truncate_slots(slots, 7) == slots        # growing is a no-op
    pool.truncate_slots(slots, 4)                        # page boundary for page_size 4
    assert pool.num_pages - pool.num_free_pages == -(-4 // page_size)
    pool.truncate_slots(slots, 0)
    assert slots == [] and pool.num_free_pages == pool.num_pages
    assert used_pages == -(-10 // page_size)
    with pytest.raises(ValueError):
        pool.truncate_slots(slots, -1)


def test_speculative_extend_then_reject_reuses_the_same_page():
    pool = BlockPool(num_pages=3, page_size=4)
    slots = pool.extend_slots([], 5)                     # pages 0, 1 (1 used)
    for accepted in (2, 0, 3):
        draft = pool.extend_slots(slots, 4)              # fills page 1, then page 2
        slots += draft
        pool.truncate_slots(slots, len(slots) - 4 + accepted)
    assert len(slots) == 5 + 2 + 0 + 3
    assert pool.pages_of(slots) == [0, 1, 2]
    assert slots == list(range(10))
    pool.release_slots(slots)
    assert pool.num_free_pages == 3


def test_truncate_keeps_a_page_shared_with_another_holder():
    pool = BlockPool(num_pages=4, page_size=2)
    slots = pool.extend_slots([], 6)
    pool.incref(pool.pages_of(slots[:4]))                # e.g. a prefix cache
    pool.truncate_slots(slots, 1)
    assert pool.num_free_pages == 2                      # page 2 freed, page 1 cached
    pool.release_slots(slots)
    pool.decref([0, 1])
    assert pool.num_free_pages == 4


def test_release_and_pages_of_count_each_page_once():
    pool = BlockPool(num_pages=4, page_size=4)
    slots = pool.extend_slots([], 9)
    assert pool.pages_of(slots) == [0, 1, 2]
    assert pool.pages_of(slots[2:6]) == [0, 1]
    assert pool.pages_of([]) == []
    pool.release_slots(slots)
    assert pool.num_free_pages == 4
    with pytest.raises(ValueError):
        pool.release_slots(slots)


def test_freed_pages_are_reused():
    pool = BlockPool(num_pages=2, page_size=2)
    first = pool.extend_slots([], 4)
    pool.release_slots(first)
    second = pool.extend_slots([], 4)
    assert sorted(pool.pages_of(second)) == [0, 1]
    assert pool.num_free_pages == 0


def test_a_request_that_keeps_one_slot_of_each_reservation_stays_contiguous():
    """A speculative step reserves N slots and keeps one when the draft is declined; the slots
    given back come out again in the order given, so the request's slots run on in memory as in
    plain decoding (scattered rows made its attention ~9% slower)."""
    pool = BlockPool(num_pages=64)
    kept = []
    for _ in range(20):
        reserved = pool.alloc_pages(12)
        kept.append(reserved[0])
        pool.decref(reserved[1:])
    assert kept == list(range(kept[0], kept[0] + 20))
    assert pool.num_free_pages == 64 - 20


def test_pages_freed_together_come_back_in_the_order_given():
    pool = BlockPool(num_pages=8)
    pages = pool.alloc_pages(5)
    pool.decref([pages[3], pages[1], pages[4]])
    assert pool.alloc_pages(3) == [pages[3], pages[1], pages[4]]


def test_requests_decoding_together_keep_their_slots_in_runs():
    """Pages of one slot: each request's first slots sit in the middle of a free stretch, and
    its next slots follow its last one, so requests that decode in turns no longer take slots
    in turn (their K/V rows a batch apart)."""
    pool = BlockPool(num_pages=4096)
    requests = [pool.extend_slots([], 10) for _ in range(3)]
    for _ in range(100):
        for slots in requests:
            slots += pool.extend_slots(slots, 1)
    for slots in requests:
        assert slots == list(range(slots[0], slots[0] + 110))
    held = [s for slots in requests for s in slots]
    assert len(set(held)) == len(held) and pool.num_free_pages == 4096 - 330


def test_a_run_that_meets_another_request_goes_on_in_a_new_run():
    pool = BlockPool(num_pages=4096)
    first = pool.extend_slots([], 4)
    second = pool.extend_slots([], 4)
    assert second[0] - first[-1] - 1 == RUN_GAP            # the gap between them is the first's room
    first += pool.extend_slots(first, RUN_GAP + 2)          # fills its room, then 2 in a new run
    assert first[4:4 + RUN_GAP] == list(range(first[3] + 1, first[3] + 1 + RUN_GAP))
    assert first[-1] == first[-2] + 1 and first[-2] > second[-1]
    first += pool.extend_slots(first, 5)                    # which goes on where it started
    assert first[-7:] == list(range(first[-7], first[-7] + 7))
    assert not set(first) & set(second) and len(set(first)) == len(first)


def test_run_gap_zero_is_the_free_list_order_alone():
    """What `decode_attention --free-list` lays out: no run is continued either."""
    pool = BlockPool(num_pages=64, run_gap=0)
    first, second = pool.extend_slots([], 2), pool.extend_slots([], 2)
    pool.release_slots(first)
    assert second + pool.extend_slots(second, 1) == [2, 3, 0]       # the free list's top, not slot 4


def test_a_pool_too_small_for_runs_hands_out_slots_in_order():
    pool = BlockPool(num_pages=100)
    assert pool.extend_slots([], 3) == [0, 1, 2]


def test_slots_taken_out_of_order_are_never_handed_out_twice():
    """Random requests growing, shrinking and ending in a pool of one-slot pages: every slot held
    once, the free count exact, and a full pool refusing without taking anything."""
    rng = random.Random(0)
    pool = BlockPool(num_pages=1500)
    live: list[list[int]] = []
    for _ in range(3000):
        action = rng.random()
        if action < 0.25 or not live:
            slots = pool.extend_slots([], rng.randint(1, 300))
            if slots is not None:
                live.append(slots)
        elif action < 0.75:
            slots = rng.choice(live)
            more = pool.extend_slots(slots, rng.randint(1, 12))
            if more is not None:
                slots += more
        elif action < 0.9:
            slots = rng.choice(live)
            pool.truncate_slots(slots, rng.randint(0, len(slots)))
        else:
            pool.release_slots(live.pop(rng.randrange(len(live))))
        held = [s for slots in live for s in slots]
        assert len(set(held)) == len(held)
        assert pool.num_free_pages == 1500 - len(held)
    free_before = pool.num_free_pages
    assert pool.extend_slots([], free_before + 1) is None and pool.num_free_pages == free_before
    assert len(pool.extend_slots([], free_before)) == free_before and pool.num_free_pages == 0


def test_free_list_entries_left_by_runs_are_dropped_and_never_double_count():
    """A request that takes the slot after its last one and gives it back, again and again, leaves
    an entry on the free list each time (the slot was taken out of its order): the list is
    compacted past twice the pool's size, and the whole pool still comes out once each."""
    pool = BlockPool(num_pages=300)
    slots = pool.extend_slots([], 10)
    for _ in range(1000):
        slots += pool.extend_slots(slots, 1)
        pool.truncate_slots(slots, 10)
        assert len(pool._free_pages) <= 2 * pool.num_pages
    pool.release_slots(slots)
    everything = pool.alloc_pages(300)
    assert sorted(everything) == list(range(300)) and pool.num_free_pages == 0
