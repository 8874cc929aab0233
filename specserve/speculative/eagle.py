"""EAGLE-family proposer (EAGLE-2 serving of EAGLE / EAGLE3 / NEXTN heads): a one-layer
draft head that reads the target's features drafts an EAGLE-2 dynamic tree
(``dynamic_tree.py``; K == 1 gives a chain).

Entries. Draft entry ``i`` consumes token ``x[i+1]`` and the target feature ``f[i]``
(the target's state at position ``i``, which predicted ``x[i+1]``) and predicts
``x[i+2]``; its rope position is ``i`` (SGLang's convention). With the target KV
holding positions ``0 .. t-1`` and root ``x[t]``, entries ``0 .. t-1`` are computable;
entry ``t-1``'s output gives the root's children. A frontier node at depth ``d``
consumes its token and its parent's draft output at position ``t - 1 + d``.

Features. The target runner keeps the features of every forward
(``capture_features``): prefill chunks and verified paths append theirs to the
request's pending list; the next catch-up (lazy: only when the policy lets the
request draft) extends the draft over all pending entries at once, so requests
that never speculate cost no draft compute.

Draft KV layout (as STANDALONE): entry ``i`` lives in the target's slot of
position ``i`` (radix-shared prefixes share draft KV; ``is_valid`` tracks which
slots hold current draft KV), plus a scratch region for tree nodes. Draft rows:
K per scheduler row; row ``K*r`` holds the request's entries (a prefix taken from
the radix cache keeps only its valid entries, so rows may be shorter than the
sequence, and positions are explicit), rows ``K*r + k`` add frontier node k's path.
"""
from __future__ import annotations

import torch
from torch import Tensor

from specserve.core import Request
from specserve.runner.head_runner import HeadOutput, HeadRunner
from specserve.runner.model_runner import ExtendSpec
from specserve.speculative import dynamic_tree as dt
from specserve.speculative.base import ProposerContext, draft_quantization
from specserve.speculative.mirrored_draft import MirroredDraftProposer
from specserve.speculative.state import spec_state, tail_ids
from specserve.speculative.tree import DraftTree, chain as chain_tree, truncate_tree


class EagleProposer(MirroredDraftProposer):
    cost_budget_s = 0.3
    follows_plain_steps = True       # a step nobody drafts in: the features come through on_plain_step

    def __init__(self, ctx: ProposerContext) -> None:
        super().__init__(ctx)
        from specserve.models.draft_heads import load_draft_head

        target, params, args = ctx.target_runner, ctx.params, ctx.server_args
        self.head = load_draft_head(params.algorithm, args.speculative_draft_model_path, target.model,
                                    ctx.target_path, dtype=target.dtype, device=str(target.device),
                                    max_position=ctx.context_len + params.num_draft_tokens + self.num_steps + 2,
                                    token_map_path=args.speculative_token_map,
                                    quantization=draft_quantization(args, target.device.type))
        target.model.aux_layer_ids = tuple(self.head.aux_layer_ids)
        target.capture_features = self.head.feature_kind
        self.runner = HeadRunner(self.head, num_kv_slots=self.num_draft_slots,
                                 max_rows=ctx.num_rows * self.topk, max_row_len=ctx.context_len + self.num_steps + 2)
        ids = torch.arange(self.head.draft_vocab_size, device=target.device)
        mapped = self.head.draft_to_target(ids)
        self.token_map = None if torch.equal(mapped, ids) else mapped
        self.target_ids = None if self.token_map is None else self.token_map.tolist()   # chains map on the host

    # ---- target features ----------------------------------------------------------
    def on_prefill(self, engine, items: list) -> None:
        features = self.ctx.target_runner.last_features
        offset = 0
        for item in items:
            n, req = item.num_new_tokens, item.req
            self._mark(item.new_slots, False)
            state = _state(req)
            start = req.num_computed - n
            if state.admission is not req.kv_slots:           # (re)admitted: a fresh draft row
                state.reset(req.kv_slots, start)
            state.push(features[offset:offset + n], start)
            offset += n

    def on_accepted(self, engine, items: list, trees: list[DraftTree], results: list) -> None:
        """The features of each verified path (root + accepted drafts) become pending entries."""
        features = self.ctx.target_runner.last_features
        offset = 0
        for item, tree, res in zip(items, trees, results):
            _state(item.req).push_rows(features, [offset + i for i in res.accepted_indices])
            offset += tree.num_nodes

    def on_plain_step(self, engine, items: list) -> None:
        """Row i of the step's features is item i's one pending entry (``on_accepted`` of root-only
        trees, without their per-request lists and slices)."""
        features = self.ctx.target_runner.last_features
        for row, item in enumerate(items):
            _state(item.req).push_range(features, row, row + 1)

    # ---- drafting -----------------------------------------------------------------
    def propose(self, engine, items: list, max_nodes: list[int]) -> list[DraftTree]:
        root = self._catch_up(engine, items)
        if self.topk == 1:
            return self._propose_chains(engine, items, max_nodes, root)
        pool, frontier = dt.first_step(torch.log_softmax(root.logits.float(), dim=-1), self.topk, self.token_map)
        if self.num_steps > 1:
            pool = self._grow(engine, items, pool, frontier, root.hidden)
        roots = torch.tensor([item.req.last_id for item in items])
        tokens, parents = (x.cpu() for x in dt.rerank(pool, roots, self.params.num_draft_tokens))
        for item in items:
            self._mark(item.new_slots, False)          # the target writes tree nodes there
        return [truncate_tree(DraftTree(tokens[b], parents[b]), cap) for b, cap in enumerate(max_nodes)]

    def _propose_chains(self, engine, items: list, max_nodes: list[int], root: HeadOutput) -> list[DraftTree]:
        """K == 1: each step's most likely token; the tree is the chain's first N - 1 tokens
        (what ``dt.rerank`` picks from a chain, whose scores only fall), without the scores.
        Only the steps the longest tree keeps are drafted (``draft_steps``)."""
        chain = [self._target_ids(root.ids)]
        hidden, paths = root.hidden, [[[]] for _ in items]
        steps = self.draft_steps(max(max_nodes))
        for step in range(1, steps):
            tokens = [[t] for t in chain[-1]]
            drafted = self.runner.forward(self._frontier_specs(engine, items, step, tokens, paths), hidden)
            chain.append(self._target_ids(drafted.ids))
            hidden = drafted.hidden
            paths = [[path[0] + [self._scratch(b, step, 0)]] for b, path in enumerate(paths)]
        length = min(self.params.num_draft_tokens - 1, steps)
        drafted = list(zip(*chain[:length]))                                        # [bs][length]
        for item in items:
            self._mark(item.new_slots, False)          # the target writes tree nodes there
        return [chain_tree([item.req.last_id, *drafted[b]][:cap])
                for b, (item, cap) in enumerate(zip(items, max_nodes))]

    def _target_ids(self, draft_ids: Tensor) -> list[int]:
        """The target ids of these draft ids (each row's most likely draft token)."""
        ids = draft_ids.tolist()
        return ids if self.target_ids is None else [self.target_ids[i] for i in ids]

    def _catch_up(self, engine, items: list) -> HeadOutput:
        """Extend every request's draft over its pending entries. Returns the head's output of each
        request's last entry: hidden [bs, H], logits [bs, V_draft] and their argmax."""
        specs, features = [], []
        for item in items:
            req, state = item.req, _state(item.req)
            row = self._base_row(engine, req)
            if state.needs_sync:
                self._sync_row(req, state, row)
            t = req.num_computed
            start = state.next_entry
            if t <= start or state.pending_end != t:
                raise RuntimeError(f"EAGLE draft of {req.rid}: entries {start}..{t - 1}, features up to "
                                   f"{state.pending_end} (internal bookkeeping error)")
            slots = req.kv_slots[start:t]
            specs.append(ExtendSpec(row=row, prefix_len=state.row_len, token_ids=tail_ids(req, t - start),
                                    new_slots=slots, positions=list(range(start, t))))
            features.append(state.take_pending())
            self._mark(slots, True)
            state.row_len += t - start
            state.next_entry = t
        return self._catch_up_forward(specs, torch.cat(features))

    def _sync_row(self, req: Request, state: "_EagleState", row: int) -> None:
        """First draft of an admission: keep the valid draft entries of a radix-cached prefix.
        (The entry before the first computed position depends on a token the prefix's
        earlier owner may not share, so it is never reused.)"""
        shared = state.next_entry
        kept = [s for s in req.kv_slots[:max(shared - 1, 0)] if self.is_valid[s]]
        self.runner.set_row_slots(row, 0, kept)       # their rope positions live in their keys
        state.row_len = len(kept)
        state.needs_sync = False

    def _grow(self, engine, items: list, pool: dt.TreePool, frontier: dt.Frontier,
              root_hidden: Tensor) -> dt.TreePool:
        """Draft steps 1 .. S-1: forward the frontier (each node fed its parent's output)."""
        bs, k = len(items), self.topk
        self._copy_base_rows(engine, items, max(_state(item.req).row_len for item in items))
        hidden = root_hidden.repeat_interleave(k, dim=0)                          # [bs*K, H]
        paths = [[[] for _ in range(k)] for _ in range(bs)]
        tokens = frontier.tokens.cpu().tolist()
        batch_index = torch.arange(bs, device=hidden.device).unsqueeze(1)
        for step in range(1, self.num_steps):
            out, logits, _ = self.runner.forward(self._frontier_specs(engine, items, step, tokens, paths), hidden)
            logprobs = torch.log_softmax(logits.float(), dim=-1).view(bs, k, -1)
            pool, frontier = dt.expand_step(pool, frontier, logprobs, k, self.token_map)
            if step + 1 < self.num_steps:
                hidden = out.view(bs, k, -1)[batch_index, frontier.parent_slot].reshape(bs * k, -1)
                tokens, parent_slot = torch.stack([frontier.tokens, frontier.parent_slot]).cpu().tolist()
                paths = [[paths[b][p] + [self._scratch(b, step, p)] for p in parent_slot[b]] for b in range(bs)]
        return pool

    def _frontier_specs(self, engine, items: list, step: int, tokens: list[list[int]],
                        paths: list[list[list[int]]]) -> list[ExtendSpec]:
        specs = []
        for b, item in enumerate(items):
            base, state = self._base_row(engine, item.req), _state(item.req)
            position = item.req.num_computed - 1 + step
            for k in range(self.topk):
                self.runner.set_row_slots(base + k, state.row_len, paths[b][k])
                specs.append(ExtendSpec(row=base + k, prefix_len=state.row_len + step - 1,
                                        token_ids=[tokens[b][k]], new_slots=[self._scratch(b, step, k)],
                                        positions=[position]))
        return specs

    # ---- cost -----------------------------------------------------------------------
    def measure_cost(self) -> None:
        def forward(slots: list[int]) -> None:
            hidden = torch.zeros(len(slots), self.head.feature_size, dtype=self.runner.dtype,
                                 device=self.runner.device)
            self.runner.forward([ExtendSpec(row=0, prefix_len=0, token_ids=[0] * len(slots), new_slots=slots)],
                                hidden)

        self._measure_cost(forward)


class _EagleState:
    """Per-request draft bookkeeping: entries computed, row length, pending target features."""

    __slots__ = ("admission", "next_entry", "row_len", "needs_sync", "pending", "pending_end")

    def __init__(self) -> None:
        self.reset(None, 0)

    def reset(self, admission, start: int) -> None:
        self.admission = admission          # the req.kv_slots list of this admission
        self.next_entry = start             # first entry not yet computed
        self.row_len = 0                    # entries in the request's base draft row
        self.needs_sync = True              # base row not built since admission
        # target features of positions next_entry .. pending_end - 1, as (tensor, first row, end
        # row) of forwards' own tensors (never written again), sliced when a catch-up reads them
        self.pending: list[tuple[Tensor, int, int]] = []
        self.pending_end = start

    def push(self, features: Tensor, start: int) -> None:
        if start != self.pending_end:
            raise RuntimeError(f"EAGLE features for position {start}, expected {self.pending_end}")
        self.push_range(features, 0, features.shape[0])

    def push_rows(self, features: Tensor, rows: list[int]) -> None:
        """These rows of a forward's ``features`` at the next pending positions: a range where they
        are consecutive (a chain's accepted prefix), else a copy."""
        if rows[-1] - rows[0] == len(rows) - 1:
            self.push_range(features, rows[0], rows[-1] + 1)
        else:
            index = torch.tensor(rows, device=features.device)
            self.push_range(features.index_select(0, index), 0, len(rows))

    def push_range(self, features: Tensor, start: int, end: int) -> None:
        """Rows ``start .. end - 1`` of a forward's ``features`` at the next pending positions."""
        self.pending.append((features, start, end))
        self.pending_end += end - start

    def take_pending(self) -> Tensor:
        pending, self.pending = self.pending, []
        if len(pending) == 1:
            features, start, end = pending[0]
            return features[start:end]
        return torch.cat([features[start:end] for features, start, end in pending])


def _state(req: Request) -> _EagleState:
    state = spec_state(req)
    if state.proposer is None:
        state.proposer = _EagleState()
    return state.proposer
