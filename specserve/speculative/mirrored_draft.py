"""What the STANDALONE and EAGLE-family proposers share: a draft KV cache whose slots
mirror the target's (``is_valid`` says which target slots hold current draft KV), a
scratch region for the tree nodes of a step, K draft rows per scheduler row, and the
draft-cost timing."""
from __future__ import annotations

import time
from typing import Callable

import torch

from specserve.core import Request
from specserve.speculative.base import Proposer, ProposerContext, catch_up_share, sync_fn
from specserve.speculative.policy import CostCurve, measure_cost_curve


class MirroredDraftProposer(Proposer):
    """Subclasses set ``self.runner`` (a ModelRunner or HeadRunner) and ``cost_budget_s``."""

    cost_budget_s = 0.4

    def __init__(self, ctx: ProposerContext) -> None:
        super().__init__(ctx)
        self.topk, self.num_steps = ctx.params.topk, ctx.params.num_steps
        self.num_target_slots = ctx.pool.capacity_tokens
        self.scratch_per_row = self.topk * max(self.num_steps - 1, 0)
        self.num_draft_slots = self.num_target_slots + ctx.num_rows * self.scratch_per_row
        self.is_valid = bytearray(self.num_target_slots)
        self.cost = CostCurve([1], [0.0])

    def on_skipped(self, engine, items: list) -> None:
        for item in items:
            self._mark(item.new_slots, False)

    def _catch_up_forward(self, specs: list, *inputs):
        """``self.runner.forward(specs, *inputs)`` for the catch-up over each request's unseen
        positions; sets ``last_switch_seconds`` (``catch_up_share`` of its time)."""
        began = time.perf_counter()
        out = self.runner.forward(specs, *inputs)
        self.last_switch_seconds = catch_up_share([len(spec.token_ids) for spec in specs],
                                                  self.params.num_draft_tokens, time.perf_counter() - began)
        return out

    # ---- rows and slots ---------------------------------------------------------------
    def _base_row(self, engine, req: Request) -> int:
        return engine.scheduler.row_of[req.rid] * self.topk

    def _scratch(self, batch_index: int, step: int, k: int) -> int:
        return self.num_target_slots + batch_index * self.scratch_per_row + (step - 1) * self.topk + k

    def _mark(self, slots: list[int], value: bool) -> None:
        flag = 1 if value else 0
        is_valid = self.is_valid
        for slot in slots:
            if slot < self.num_target_slots:
                is_valid[slot] = flag

    def _copy_base_rows(self, engine, items: list, width: int) -> None:
        """Rows K*r+1 .. K*r+K-1 get the first ``width`` entries of row K*r (one device copy)."""
        if self.topk == 1:
            return
        bases = [self._base_row(engine, item.req) for item in items]
        table = self.runner.req_to_token
        dst = torch.tensor([b + k for b in bases for k in range(1, self.topk)], device=table.device)
        src = torch.tensor([b for b in bases for _ in range(1, self.topk)], device=table.device)
        table[dst, :width] = table[src, :width]

    # ---- cost -------------------------------------------------------------------------
    def _measure_cost(self, forward_on_slots: Callable[[list[int]], None]) -> None:
        """Time draft forwards over target-mirror slots 0..w-1, marked stale afterwards
        (so nothing valid is overwritten)."""
        def forward(width: int) -> None:
            slots = list(range(width))
            forward_on_slots(slots)
            self._mark(slots, False)

        limit = min(self.num_target_slots, self.ctx.context_len)
        self.cost = measure_cost_curve(forward, [w for w in (1, 16) if w <= limit] or [1],
                                       [w for w in (4, 64) if w <= limit], self.cost_budget_s,
                                       sync_fn(self.runner.device))

    def max_depth(self, max_nodes: int) -> int:
        return min(self.num_steps, max_nodes - 1)

    def draft_steps(self, max_nodes: int) -> int:
        """Draft forwards a propose runs for trees of at most ``max_nodes`` nodes: a chain (K = 1)
        only those of the tokens it keeps (its first n - 1 tokens do not depend on the steps
        after them); a tree all S (rerank chooses among every step's nodes)."""
        if self.topk > 1:
            return self.num_steps
        return max(1, min(self.num_steps, max_nodes - 1))

    def draft_cost(self, batch_size: int, max_nodes: int) -> float:
        """Catch-up (about 2 tokens per request) plus a frontier forward of K tokens each for
        the draft steps after the first."""
        steps = self.draft_steps(max_nodes)
        return self.cost(2 * batch_size) + (steps - 1) * self.cost(batch_size * self.topk)
