"""Scheduler: admission, chunked prefill, alternation, retraction, prefix reuse, abort.

The scheduler is driven with a real BlockPool and RadixCache and a fake model
step: "computing" a token writes a fingerprint of its prefix into a shadow KV
store, and the next token is a deterministic function of the sequence so far.
After every step the test checks that every running request's slots (and every
slot the prefix cache stores) hold the fingerprints of exactly the tokens they
claim, that page refcounts equal the holders, and that the finished requests
generated what an uninterrupted run would have.
"""
from __future__ import annotations

import random
from collections import Counter

import pytest

from specserve.cache.block_pool import BlockPool
from specserve.cache.radix import RadixCache
from specserve.core import Request, RequestStatus, SamplingParams
from specserve.scheduler import Scheduler

VOCAB = 97


def fingerprints(ids: list[int]) -> list[int]:
    """fingerprints(ids)[i] identifies ids[:i + 1] (what the KV of token i depends on)."""
    out, h = [], 17
    for token in ids:
        h = (h * 1_000_003 + token + 1) % (1 << 61)
        out.append(h)
    return out


def next_token(ids: list[int]) -> int:
    return fingerprints(ids)[-1] % VOCAB


def expected_output(prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_new_tokens):
        ids.append(next_token(ids))
    return ids[len(prompt):]


class Sim:
    """A Scheduler plus a fake forward pass, with invariant checks after each step."""

    def __init__(self, *, num_pages: int, page_size: int = 1, max_running: int = 8,
                 chunk_size: int = 64, decode_width: int = 1, disable_radix: bool = False,
                 prefill_budget_while_decoding: int | None = None) -> None:
        self.pool = BlockPool(num_pages, page_size)
        self.radix = RadixCache(self.pool, disabled=disable_radix)
        self.sched = Scheduler(self.pool, self.radix, max_running_requests=max_running,
                               chunk_size=chunk_size, num_rows=max_running, decode_width=decode_width,
                               prefill_budget_while_decoding=prefill_budget_while_decoding)
        self.max_running = max_running
        self.chunk_size = chunk_size
        self.decode_width = decode_width
        self.kv: dict[int, int] = {}            # slot -> fingerprint of the token computed there
        self.finished: list[Request] = []
        self.batches: list[tuple[bool, list[tuple[str, int]]]] = []   # (is_prefill, [(rid, n)])
        self.reqs: dict[str, Request] = {}

    # ---- requests ---------------------------------------------------------
    def add(self, rid: str, prompt: list[int], max_new_tokens: int) -> Request:
        req = Request(rid=rid, input_ids=list(prompt), sampling=SamplingParams(max_new_tokens=max_new_tokens))
        self.reqs[rid] = req
        self.sched.add(req)
        return req

    # ---- one step -----------------------------------------------------------
    def step(self):
        batch = self.sched.schedule()
        if batch is None:
            assert not self.sched.has_work(), "scheduler returned no batch while requests wait (deadlock)"
            return None
        self.batches.append((batch.is_prefill, [(it.req.rid, it.num_new_tokens) for it in batch.items]))
        assert batch.items
        self._check_batch_shape(batch)
        if not batch.is_prefill and self.decode_width > 1:    # a speculative step's tree slots
            for item in batch.items:
                self.sched.extend_decode(item, self.decode_width - 1)
        to_sample = []
        for item in batch.items:
            req = item.req
            start = req.num_computed
            assert start == len(req.kv_slots)
            assert start + item.num_new_tokens <= req.seq_len
            prints = fingerprints(req.all_ids[:start + item.num_new_tokens])
            for j, slot in enumerate(item.new_slots[:item.num_new_tokens]):
                assert self.pool.refcount(self.pool.page_of(slot)) == 1, "writing into a shared page"
                self.kv[slot] = prints[start + j]
            if len(item.new_slots) > item.num_new_tokens:   # unused lookahead slots
                self.sched.free_uncommitted(item.new_slots, item.num_new_tokens, req)
            self.sched.commit(req, item.new_slots[:item.num_new_tokens])
            if req.num_computed == req.seq_len:
                to_sample.append(req)
        for req in to_sample:   # like the engine: sample, then finish and release
            req.output_ids.append(next_token(req.all_ids))
            if len(req.output_ids) >= req.sampling.max_new_tokens:
                req.finish("length")
                self.sched.release(req)
                self.finished.append(req)
        self.check()
        return batch

    def run(self, max_steps: int = 10_000, on_step=None) -> None:
        for i in range(max_steps):
            if on_step is not None:
                on_step(self, i)
            if self.step() is None and not self.sched.has_work():
                return
        raise AssertionError(f"not done after {max_steps} steps")

    # ---- invariants -----------------------------------------------------------
    def _check_batch_shape(self, batch) -> None:
        rids = [it.req.rid for it in batch.items]
        assert len(rids) == len(set(rids))
        for item in batch.items:
            assert item.req in self.sched.running
            assert item.req.status is RequestStatus.RUNNING
            if batch.is_prefill:
                assert item.num_new_tokens >= 1
                assert len(item.new_slots) == item.num_new_tokens
            else:
                assert item.num_new_tokens == 1
                assert item.req.seq_len - item.req.num_computed == 1
                assert len(item.new_slots) == 1
        if batch.is_prefill:
            assert sum(it.num_new_tokens for it in batch.items) <= self.chunk_size

    def check(self) -> None:
        sched, pool, radix = self.sched, self.pool, self.radix
        assert len(sched.running) <= self.max_running
        assert sorted(sched.row_of) == sorted(r.rid for r in sched.running)
        rows = list(sched.row_of.values())
        assert len(set(rows)) == len(rows) and not set(rows) & set(sched.free_rows)
        assert len(rows) + len(sched.free_rows) == self.max_running
        holders: Counter = Counter()
        for req in sched.running:
            assert req.status is RequestStatus.RUNNING
            assert len(req.kv_slots) == req.num_computed <= req.seq_len
            prints = fingerprints(req.all_ids)
            for i, slot in enumerate(req.kv_slots):
                assert self.kv.get(slot) == prints[i], f"{req.rid}: slot {slot} of token {i} holds other KV"
            holders.update(pool.pages_of(req.kv_slots))
        for req in sched.waiting:
            assert req.status is RequestStatus.WAITING
            assert req.kv_slots == [] and req.num_computed == 0 and req.rid not in sched.row_of
        for path, value in self._tree_entries():
            prints = fingerprints(path)
            for i, slot in enumerate(value):
                assert self.kv.get(slot) == prints[len(path) - len(value) + i], "cached slot holds other KV"
            holders.update(pool.pages_of(value))
        for page in range(pool.num_pages):
            assert pool.refcount(page) == holders[page], f"page {page}: refcount != holders"
        assert pool.num_free_pages == sum(1 for p in range(pool.num_pages) if holders[p] == 0)

    def _tree_entries(self):
        stack = [(child, []) for child in self.radix.root_node.children.values()]
        while stack:
            node, prefix = stack.pop()
            path = prefix + node.key
            yield path, node.value
            stack.extend((child, path) for child in node.children.values())

    def assert_all_freed(self) -> None:
        assert not self.sched.has_work()
        assert self.radix.protected_size() == 0
        assert self.pool.num_free_tokens + self.radix.evictable_size() == self.pool.capacity_tokens
        assert self.sched.free_rows and len(self.sched.free_rows) == self.max_running


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


# ---------------------------------------------------------------- admission
def test_fcfs_admission_and_max_running():
    sim = Sim(num_pages=512, max_running=2)
    reqs = [sim.add(f"r{i}", prompt_of(i, 5 + i), 3 + i) for i in range(5)]
    sim.step()
    assert sim.batches[0] == (True, [("r0", 5), ("r1", 6)])
    assert [r.rid for r in sim.sched.running] == ["r0", "r1"]
    assert [r.rid for r in sim.sched.waiting] == ["r2", "r3", "r4"]
    admitted = []
    seen = set()

    def record(s, _):
        for req in s.sched.running:
            if req.rid not in seen:
                seen.add(req.rid)
                admitted.append(req.rid)
        assert len(s.sched.running) <= 2
    sim.run(on_step=record)
    record(sim, None)
    assert admitted == ["r0", "r1", "r2", "r3", "r4"]
    for req in reqs:
        assert req.output_ids == expected_output(req.input_ids, req.sampling.max_new_tokens)
    sim.assert_all_freed()


def test_fcfs_head_of_line_is_not_skipped():
    """A waiting request that does not fit blocks smaller ones behind it (no overtaking)."""
    sim = Sim(num_pages=200, max_running=8)
    sim.add("running", prompt_of(1, 20), 60)
    sim.step()
    too_big = sim.add("too-big", prompt_of(2, 120), 10)   # 131 + running's 61 > 179 free
    small = sim.add("small", prompt_of(3, 3), 2)          # would fit
    sim.step()
    sim.step()
    assert [r.rid for r in sim.sched.waiting] == ["too-big", "small"]

    def small_not_first(s, _):
        if small.status is not RequestStatus.WAITING:
            assert too_big.status is not RequestStatus.WAITING
    sim.run(on_step=small_not_first)
    assert too_big.output_ids == expected_output(too_big.input_ids, 10)
    sim.assert_all_freed()


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_splits_long_prompt(page_size):
    sim = Sim(num_pages=256 // page_size, page_size=page_size, chunk_size=16)
    req = sim.add("long", prompt_of(7, 50), 4)
    sim.run()
    prefills = [items for is_prefill, items in sim.batches if is_prefill]
    assert [n for items in prefills for _, n in items][:4] == [16, 16, 16, 2]
    assert all(sum(n for _, n in items) <= 16 for items in prefills)
    assert req.output_ids == expected_output(req.input_ids, 4)
    sim.assert_all_freed()


def test_chunk_budget_is_shared_between_requests():
    sim = Sim(num_pages=512, chunk_size=16)
    sim.add("a", prompt_of(1, 10), 6)
    sim.add("b", prompt_of(2, 30), 6)
    sim.step()
    assert sim.batches[0] == (True, [("a", 10), ("b", 6)])
    sim.run()
    for is_prefill, items in sim.batches:
        if is_prefill:
            assert sum(n for _, n in items) <= 16
    sim.assert_all_freed()


def test_prefill_and_decode_alternate():
    """A request decodes while another's long prompt is chunked: steps alternate."""
    sim = Sim(num_pages=512, chunk_size=8)
    sim.add("short", prompt_of(1, 4), 12)
    sim.step()                                  # prefill "short" (first token sampled)
    sim.add("long", prompt_of(2, 40), 4)
    for _ in range(10):
        sim.step()
    kinds = [p for p, _ in sim.batches[1:11]]
    assert kinds == [False, True] * 5
    decodes = [items for p, items in sim.batches[1:11] if not p]
    assert all(items == [("short", 1)] for items in decodes)
    prefills = [items for p, items in sim.batches[1:11] if p]
    assert all(items == [("long", 8)] for items in prefills)
    sim.run()
    sim.assert_all_freed()


def test_decode_only_when_nothing_to_prefill():
    sim = Sim(num_pages=512)
    sim.add("a", prompt_of(1, 4), 5)
    sim.add("b", prompt_of(2, 4), 5)
    sim.run()
    kinds = [p for p, _ in sim.batches]
    assert kinds == [True] + [False] * 4
    assert all(items == [("a", 1), ("b", 1)] for p, items in sim.batches[1:])
    sim.assert_all_freed()


@pytest.mark.parametrize("page_size", [1, 4])
def test_tree_slots_taken_per_step_and_unused_ones_freed(page_size):
    sim = Sim(num_pages=512 // page_size, page_size=page_size, decode_width=3)
    reqs = [sim.add(f"r{i}", prompt_of(i, 6 + i), 9) for i in range(3)]
    sim.run()
    assert any(not p for p, _ in sim.batches)
    for req in reqs:
        assert req.output_ids == expected_output(req.input_ids, 9)
    sim.assert_all_freed()


@pytest.mark.parametrize("page_size", [1, 4])
def test_tree_slots_follow_the_step_slot_or_are_refused_whole(page_size):
    """A decode item's extra slots continue its own (within its page first); when the pool
    lacks them, nothing is taken and the item keeps its one slot."""
    sim = Sim(num_pages=16 // page_size, page_size=page_size, decode_width=4, disable_radix=True)
    req = sim.add("r", prompt_of(0, 5), 4)
    sim.step()
    item = sim.sched.schedule().items[0]
    assert item.new_slots == [req.kv_slots[-1] + 1] or page_size == 1
    free = sim.pool.num_free_tokens
    assert sim.sched.extend_decode(item, 3)
    assert len(item.new_slots) == 4 and len(set(item.new_slots)) == 4
    if page_size > 1:
        assert item.new_slots[:3] == list(range(item.new_slots[0], item.new_slots[0] + 3))
    taken = free - sim.pool.num_free_tokens
    assert not sim.sched.extend_decode(item, sim.pool.num_free_tokens + page_size + 1)
    assert len(item.new_slots) == 4 and free - sim.pool.num_free_tokens == taken


# ---------------------------------------------------------------- retraction
@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_youngest_first_requeued_at_front_and_kv_released(page_size):
    # Decode reserves are capped, so three long generations are admitted together and
    # outgrow the pool: 3 * (10 + 100) = 330 tokens > 300.
    sim = Sim(num_pages=300 // page_size, page_size=page_size, max_running=3)
    reqs = [sim.add(f"r{i}", prompt_of(i, 10), 100) for i in range(4)]
    sim.step()
    assert [r.rid for r in sim.sched.running] == ["r0", "r1", "r2"]
    for _ in range(300):
        if sim.sched.num_retractions:
            break
        before = {r.rid: len(r.output_ids) for r in sim.sched.running}
        sim.step()
    victim = sim.reqs["r2"]
    assert victim.status is RequestStatus.WAITING
    assert [r.rid for r in sim.sched.waiting] == ["r2", "r3"]
    assert victim.kv_slots == [] and victim.num_computed == 0 and victim.prefix_node is None
    assert len(victim.output_ids) == before["r2"]          # generated tokens are kept
    assert [r.rid for r in sim.sched.running] == ["r0", "r1"]
    assert "r2" not in sim.sched.row_of
    sim.run()
    assert sim.sched.num_retractions >= 1
    for req in reqs:
        assert req.output_ids == expected_output(req.input_ids, 100), req.rid
    sim.assert_all_freed()


# ---------------------------------------------------------------- prefix cache
@pytest.mark.parametrize("page_size", [1, 4])
def test_prefix_cache_reuse_on_admission(page_size):
    sim = Sim(num_pages=256 // page_size, page_size=page_size)
    shared = prompt_of(5, 18)
    first = sim.add("first", shared, 3)
    sim.run()
    assert first.cached_tokens == 0
    second = sim.add("second", shared + [1, 2, 3, 4, 5], 3)
    sim.step()
    aligned = 18 - 18 % page_size
    assert second.cached_tokens == aligned
    assert sim.batches[-1] == (True, [("second", 23 - aligned)])
    sim.run()
    same = sim.add("same", shared, 3)          # identical prompt: all but the last token
    sim.step()
    assert same.cached_tokens == 17 - 17 % page_size
    sim.run()
    assert second.output_ids == expected_output(second.input_ids, 3)
    assert same.output_ids == first.output_ids
    sim.assert_all_freed()


def test_prefix_shared_by_running_requests_is_protected():
    sim = Sim(num_pages=64)
    shared = prompt_of(5, 20)
    sim.add("seed", shared, 1)
    sim.run()
    a = sim.add("a", shared + [1], 5)
    b = sim.add("b", shared + [2], 5)
    sim.step()
    assert a.cached_tokens == 20 and b.cached_tokens == 20
    assert sim.radix.protected_size() >= 20
    assert a.kv_slots[:20] == b.kv_slots[:20]
    sim.run()
    sim.assert_all_freed()


def test_radix_disabled_never_reports_cached_tokens():
    sim = Sim(num_pages=128, disable_radix=True)
    shared = prompt_of(5, 20)
    sim.add("a", shared, 3)
    sim.run()
    b = sim.add("b", shared, 3)
    sim.run()
    assert b.cached_tokens == 0
    assert sim.radix.total_size() == 0
    assert sim.pool.num_free_tokens == sim.pool.capacity_tokens
    sim.assert_all_freed()


# ---------------------------------------------------------------- abort
@pytest.mark.parametrize("page_size", [1, 4])
def test_abort_waiting_and_running(page_size):
    sim = Sim(num_pages=256 // page_size, page_size=page_size, max_running=1)
    run = sim.add("run", prompt_of(1, 9), 20)
    wait = sim.add("wait", prompt_of(2, 9), 20)
    sim.step()
    sim.step()
    assert run in sim.sched.running and wait in sim.sched.waiting
    assert sim.sched.abort("wait") is wait
    assert wait.is_finished and wait.finish_reason == {"type": "abort"}
    assert wait not in sim.sched.waiting
    assert sim.sched.abort("run") is run
    assert run.is_finished and run.finish_reason == {"type": "abort"}
    assert not sim.sched.has_work() and run.kv_slots == []
    assert sim.sched.abort("run") is None and sim.sched.abort("nope") is None
    assert sim.sched.schedule() is None
    sim.check()
    sim.assert_all_freed()
    # the aborted request's computed prefix stays cached for a later identical prompt
    again = sim.add("again", prompt_of(1, 9), 20)
    sim.step()
    assert again.cached_tokens == 8 - 8 % page_size
    sim.run()
    assert again.output_ids == expected_output(again.input_ids, 20)
    sim.assert_all_freed()


def test_abort_mid_chunked_prefill_frees_kv():
    sim = Sim(num_pages=128, chunk_size=8)
    req = sim.add("long", prompt_of(3, 40), 5)
    sim.step()
    sim.step()
    assert req.num_computed == 16
    sim.sched.abort("long")
    sim.check()
    sim.assert_all_freed()


# ---------------------------------------------------------------- randomized
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(6))
def test_randomized_simulation(page_size, seed):
    run_random_simulation(seed, page_size)


def run_random_simulation(seed: int, page_size: int, max_seq: int = 160) -> None:
    """Random arrivals sharing prefixes, random aborts, a small pool: outputs and invariants hold."""
    rng = random.Random(seed * 10 + page_size)
    chunk = rng.choice([4, 8, 16, 64, 256, 1024])
    decode_width = rng.choice([1, 1, 2, 3])
    max_running = rng.choice([2, 3, 5, 8])
    num_pages = -(-(max_seq + decode_width + rng.randrange(0, max_seq)) // page_size)
    sim = Sim(num_pages=num_pages, page_size=page_size, max_running=max_running,
              chunk_size=chunk, decode_width=decode_width, disable_radix=rng.random() < 0.15)
    bases = [prompt_of(seed * 100 + i, rng.randrange(5, max_seq // 2)) for i in range(3)]
    arrivals = []
    for i in range(24):
        base = rng.choice(bases)
        suffix = prompt_of(seed * 1000 + i, rng.randrange(0, max_seq // 4))
        prompt = base[:rng.randrange(1, len(base) + 1)] + suffix
        room = max_seq - len(prompt)
        is_long = rng.random() < 0.5          # long generations outgrow their decode reserve
        max_new = rng.randrange(max(1, room - 30) if is_long else 1, room + 1)
        arrivals.append((rng.randrange(0, 30), f"q{i}", prompt, max_new))
    arrivals.sort()
    aborted = set()

    def on_step(s, step):
        while arrivals and arrivals[0][0] <= step:
            _, rid, prompt, max_new = arrivals.pop(0)
            s.add(rid, prompt, max_new)
        live = [r for r in s.reqs.values() if not r.is_finished]
        if live and rng.random() < 0.03:
            victim = rng.choice(live)
            assert s.sched.abort(victim.rid) is victim
            aborted.add(victim.rid)
            s.check()

    for step in range(20_000):
        on_step(sim, step)
        if sim.step() is None and not arrivals and not sim.sched.has_work():
            break
    else:
        raise AssertionError("simulation did not finish")
    assert len(sim.finished) + len(aborted) == 24
    for req in sim.finished:
        assert req.output_ids == expected_output(req.input_ids, req.sampling.max_new_tokens), req.rid
    sim.assert_all_freed()


# ---------------------------------------------------------------- admission budget
def test_admission_does_not_count_the_matched_prefix_as_free():
    """The cached prefix a new request adopts is locked by it, so it is not room for its decode."""
    sim = Sim(num_pages=100)
    shared = prompt_of(9, 60)
    sim.add("seed", shared, 1)
    sim.run()                                  # 60 cached, evictable tokens
    sim.add("x", prompt_of(8, 10), 20)
    sim.step()
    sim.add("y", shared + [1], 20)             # needs 1 new token, but 21 for its decode
    for _ in range(3):
        sim.step()
    # free 30 tokens after y's prefix is locked: x (20) and y (21) cannot both be served
    assert [r.rid for r in sim.sched.waiting] == ["y"]
    sim.run()
    assert sim.sched.num_retractions == 0
    sim.assert_all_freed()


def test_long_prompt_is_admitted_only_when_all_its_chunks_fit():
    sim = Sim(num_pages=160, chunk_size=16)
    sim.add("x", prompt_of(1, 10), 40)
    sim.step()
    sim.add("long", prompt_of(2, 100), 10)     # 100 + 11 + x's 40 > 150 free: must wait
    for _ in range(4):
        sim.step()
    assert [r.rid for r in sim.sched.waiting] == ["long"]
    sim.run()
    assert sim.sched.num_retractions == 0
    sim.assert_all_freed()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(8))
def test_short_generations_never_need_retraction(page_size, seed):
    """Admission keeps every running request's remaining prompt and decode reserve free, so
    requests whose whole output fits the reserve are never retracted."""
    from specserve.scheduler import DECODE_RESERVE_TOKENS

    rng = random.Random(seed)
    chunk = rng.choice([8, 16, 64, 512])
    decode_width = rng.choice([1, 2])
    sim = Sim(num_pages=-(-rng.randrange(140, 260) // page_size), page_size=page_size,
              max_running=rng.choice([3, 8]), chunk_size=chunk, decode_width=decode_width)
    bases = [prompt_of(seed * 100 + i, rng.randrange(10, 60)) for i in range(3)]
    arrivals = []
    for i in range(20):
        prompt = rng.choice(bases)[:rng.randrange(1, 60)] + prompt_of(seed * 1000 + i, rng.randrange(0, 12))
        arrivals.append((rng.randrange(0, 80), f"q{i}", prompt, rng.randrange(1, DECODE_RESERVE_TOKENS + 1)))
    arrivals.sort()

    def on_step(s, step):
        while arrivals and arrivals[0][0] <= step:
            _, rid, prompt, max_new = arrivals.pop(0)
            s.add(rid, prompt, max_new)

    for step in range(5000):
        on_step(sim, step)
        if sim.step() is None and not arrivals:
            break
    assert len(sim.finished) == 20
    assert sim.sched.num_retractions == 0
    sim.assert_all_freed()


def test_prefill_steps_shrink_to_their_budget_while_requests_decode() -> None:
    """A burst of prompts arriving while one request decodes is prefilled in steps of at most
    the budget, each followed by a decode step; alone (nobody decoding) a prompt takes the
    whole chunk. Outputs stay what uninterrupted runs give."""
    sim = Sim(num_pages=4096, chunk_size=64, prefill_budget_while_decoding=16)
    rng = random.Random(5)
    sim.add("first", [rng.randrange(VOCAB) for _ in range(40)], 30)

    def burst(sim_: Sim, i: int) -> None:
        if i == 3:
            for k in range(4):
                sim_.add(f"late{k}", [rng.randrange(VOCAB) for _ in range(30)], 5)

    sim.run(on_step=burst)
    first_prefill = sim.batches[0]
    assert first_prefill[0] and first_prefill[1] == [("first", 40)]
    later_prefills = [sum(n for _, n in items) for is_prefill, items in sim.batches[1:] if is_prefill]
    assert later_prefills and max(later_prefills) <= 16
    assert sum(later_prefills) == 4 * 30
    for req in sim.finished:
        assert req.output_ids == expected_output(req.input_ids, req.sampling.max_new_tokens)
