"""Continuous-batching scheduler: FCFS admission, chunked prefill, KV budget.

Pure Python: it decides which requests run and how many new tokens each
computes this step, and does all KV slot bookkeeping (block pool + radix
cache). It never touches tensors, so it is tested without a model.

A step is either a *prefill* step (requests with more than one uncomputed
token: new prompts, chunks of long prompts, re-admitted retracted requests)
or a *decode* step (every running request computes its last sampled token,
plus draft tokens when speculating). Prefill steps and decode steps alternate
while both have work, so decoding never stalls behind a stream of prompts, and
while requests are decoding a prefill step takes at most
``prefill_budget_while_decoding`` tokens, so the gap between two of their tokens
is at most one short prefill step plus one decode step (a burst of new prompts
is spread over several short steps instead of one long one).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from specserve.cache.block_pool import BlockPool
from specserve.cache.radix import RadixCache
from specserve.core import Request, RequestStatus

logger = logging.getLogger(__name__)

DECODE_RESERVE_TOKENS = 64   # KV kept free per running request when admitting new ones


@dataclass
class ScheduledItem:
    req: Request
    num_new_tokens: int          # tokens computed this step (decode: 1, plus drafts later)
    new_slots: list[int]


@dataclass
class ScheduledBatch:
    is_prefill: bool
    items: list[ScheduledItem] = field(default_factory=list)

    @property
    def requests(self) -> list[Request]:
        return [item.req for item in self.items]


class Scheduler:
    def __init__(self, pool: BlockPool, radix: RadixCache, *, max_running_requests: int,
                 chunk_size: int, num_rows: int, decode_width: int = 1,
                 prefill_budget_while_decoding: int | None = None) -> None:
        self.pool, self.radix = pool, radix
        self.max_running = max_running_requests
        self.chunk_size = chunk_size
        self.prefill_budget_while_decoding = min(chunk_size, prefill_budget_while_decoding or chunk_size)
        self.decode_width = decode_width     # KV slots a decode step may take per request (see below)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_rows = list(range(num_rows - 1, -1, -1))
        self.row_of: dict[str, int] = {}
        self._last_was_prefill = False
        self.num_retractions = 0

    # ---- queue -----------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, rid: str) -> Request | None:
        for req in self.running:
            if req.rid == rid:
                return req
        for req in self.waiting:
            if req.rid == rid:
                return req
        return None

    def abort(self, rid: str) -> Request | None:
        """Remove a request wherever it is, freeing its KV. Returns it (or None)."""
        req = self.find(rid)
        if req is None:
            return None
        if req in self.waiting:
            self.waiting.remove(req)
        else:
            self.release(req)
        req.finish("abort")
        return req

    # ---- scheduling --------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        decoding = [r for r in self.running if not _needs_prefill(r)]
        prefer_decode = self._last_was_prefill and decoding
        if not prefer_decode:
            batch = self._schedule_prefill(self.prefill_budget_while_decoding if decoding else self.chunk_size)
            if batch.items:
                self._last_was_prefill = True
                return batch
        self._last_was_prefill = False
        batch = self._schedule_decode()
        return batch if batch.items else None

    def _schedule_prefill(self, budget: int) -> ScheduledBatch:
        batch = ScheduledBatch(is_prefill=True)
        for req in [r for r in self.running if _needs_prefill(r)]:
            budget -= self._add_prefill_chunk(batch, req, budget)
            if budget <= 0:
                return batch
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            if not self._admit(req):
                break
            self.waiting.popleft()
            budget -= self._add_prefill_chunk(batch, req, budget)
        return batch

    def _add_prefill_chunk(self, batch: ScheduledBatch, req: Request, budget: int) -> int:
        n = min(req.seq_len - req.num_computed, budget)
        slots = self.allocate(req, n)
        if slots is None:
            return 0
        batch.items.append(ScheduledItem(req, n, slots))
        return n

    def _admit(self, req: Request) -> bool:
        """Match the prefix cache, take a row, check the KV budget.

        Admitted only if the KV every running request and this one may still
        need (uncomputed tokens plus a decode reserve) fits in what is free or
        evictable, so later chunks of a long prompt never starve. The matched
        prefix is locked before the check: adopted, it is no room for anyone.
        """
        slots, node = self.radix.match_prefix(req.all_ids[:-1])
        self.radix.lock(node)
        need = self._future_tokens(req, len(slots)) + sum(
            self._future_tokens(r, len(r.kv_slots)) for r in self.running)
        if self.running and self.available_tokens() < need:
            self.radix.unlock(node)
            return False
        self.pool.incref(self.pool.pages_of(slots))
        req.prefix_node = node
        req.kv_slots = list(slots)
        req.num_computed = len(slots)
        req.cached_tokens = min(len(slots), len(req.input_ids))
        req.status = RequestStatus.RUNNING
        self.row_of[req.rid] = self.free_rows.pop()
        self.running.append(req)
        return True

    def _future_tokens(self, req: Request, num_held: int) -> int:
        """KV slots (whole pages) ``req`` may still take beyond the ``num_held`` it holds:
        its uncomputed tokens, then up to DECODE_RESERVE_TOKENS decode steps."""
        remaining = req.sampling.max_new_tokens - len(req.output_ids)
        tokens = req.seq_len - num_held + min(max(remaining, 0), DECODE_RESERVE_TOKENS) + self.decode_width
        page = self.pool.page_size
        return (-(-(num_held + tokens) // page) - -(-num_held // page)) * page

    def _schedule_decode(self) -> ScheduledBatch:
        """Every decoding request with one new slot. Admission keeps ``decode_width`` slots a
        request free, but a speculative step takes the slots of a tree past its root only for
        the requests that draft (``extend_decode``): most steps draft for nobody, and reserving
        12 slots a request to give 11 back cost ~0.1 ms of a 10 ms step at 16 requests."""
        batch = ScheduledBatch(is_prefill=False)
        for req in list(self.running):
            if _needs_prefill(req) or req not in self.running:
                continue
            slots = self._allocate_or_retract(req, 1)
            if slots is not None:
                batch.items.append(ScheduledItem(req, 1, slots))
        return batch

    def extend_decode(self, item: ScheduledItem, num: int) -> bool:
        """``num`` more slots after a decode item's own (a draft tree's nodes past the root),
        evicting cached prefixes if needed but retracting nobody. False, nothing taken, if the
        pool lacks them: that request decodes plainly this step."""
        slots = self._extend_evicting(item.new_slots[-1:] or item.req.kv_slots[-1:], num)
        if slots is None:
            return False
        item.new_slots.extend(slots)
        return True

    def _allocate_or_retract(self, req: Request, n: int) -> list[int] | None:
        while True:
            slots = self.allocate(req, n)
            if slots is not None:
                return slots
            victim = self._pick_victim(exclude=req)
            if victim is None:
                return None
            self.retract(victim)

    def _pick_victim(self, exclude: Request) -> Request | None:
        """The youngest request admitted after ``exclude`` (not yet scheduled this step)."""
        later = self.running[self.running.index(exclude) + 1:]
        return later[-1] if later else None

    # ---- KV bookkeeping ------------------------------------------------------
    def available_tokens(self) -> int:
        return self.pool.num_free_tokens + self.radix.evictable_size()

    def allocate(self, req: Request, n: int) -> list[int] | None:
        """n new slots after req.kv_slots, evicting cached prefixes if needed."""
        return self._extend_evicting(req.kv_slots, n)

    def _extend_evicting(self, slots: list[int], n: int) -> list[int] | None:
        """``pool.extend_slots(slots, n)``, evicting cached prefixes and trying once more if the
        pool lacks the pages."""
        new = self.pool.extend_slots(slots, n)
        if new is None:
            self.radix.evict(n + self.pool.page_size)
            new = self.pool.extend_slots(slots, n)
        return new

    def commit(self, req: Request, new_slots: list[int]) -> None:
        """The step computed these tokens: they are now part of the request's KV."""
        req.kv_slots.extend(new_slots)
        req.num_computed = len(req.kv_slots)

    def commit_all(self, items: list[ScheduledItem]) -> None:
        """``commit`` every item's new slots (a prefill, or a decode step nobody drafted in)."""
        for item in items:
            self.commit(item.req, item.new_slots)

    def free_uncommitted(self, new_slots: list[int], kept: int, req: Request) -> None:
        """Release slots allocated for a step but not kept (rejected drafts)."""
        if kept < len(new_slots):
            tmp = req.kv_slots + new_slots
            self.pool.truncate_slots(tmp, len(req.kv_slots) + kept)

    def release(self, req: Request) -> None:
        """Cache the request's computed prefix, then drop its KV and row."""
        if len(req.kv_slots) > req.seq_len:   # KV past a stop inside an accepted draft run
            self.pool.truncate_slots(req.kv_slots, req.seq_len)
        if req.kv_slots:
            self.radix.insert(req.all_ids[:len(req.kv_slots)], req.kv_slots)
        if req.prefix_node is not None:
            self.radix.unlock(req.prefix_node)
            req.prefix_node = None
        self.pool.release_slots(req.kv_slots)
        req.kv_slots = []
        req.num_computed = 0
        if req in self.running:
            self.running.remove(req)
        row = self.row_of.pop(req.rid, None)
        if row is not None:
            self.free_rows.append(row)

    def retract(self, req: Request) -> None:
        """Preempt a running request: free its KV, requeue it first (it recomputes later)."""
        logger.info("KV cache full: retracting request %s (%d tokens)", req.rid, req.seq_len)
        self.release(req)
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_retractions += 1


def _needs_prefill(req: Request) -> bool:
    return req.seq_len - req.num_computed > 1
