"""STANDALONE proposer: a small causal LM with the target's tokenizer drafts a
dynamic tree (``dynamic_tree.py``; K == 1 gives a chain).

Draft KV layout. The draft has its own ModelRunner (its layers, its KV tensors,
its req->slot rows). Its slot space mirrors the target's: the draft KV of the
token in target slot ``s`` lives in draft slot ``s``, so prefixes shared through
the radix cache are shared by the draft too. Past the target's slots lies a
scratch region, ``K * (S - 1)`` slots per batch position, for the tree nodes of
the current step; they are overwritten every step (rejected branches cost nothing
to drop). ``is_valid[s]`` records whether draft slot ``s`` holds the draft KV of
what the target holds in ``s`` (the target also writes slots the draft has not
caught up with yet: verified tree nodes, plain-decoded tokens).

Draft rows: K per scheduler row. Row ``K * r`` holds request r's committed
prefix; during a step, frontier node k of the tree uses row ``K * r + k`` =
committed prefix + its own ancestors (scratch slots), so every node attends to
exactly its path with plain causal attention.

Per decode step, for the requests the policy lets speculate:

1. catch-up (draft step 0): one extend over the tokens the draft has not seen
   (the previous step's accepted tokens and the new root; more after plain
   steps), writing their draft KV into the target slots they occupy (the root
   into the step's first new slot); its last logits give the root's children;
2. S - 1 frontier steps, one forward of K tokens per request each;
3. rerank the pool to N nodes.

A pruned-vocabulary draft (``train/prune_vocab.py``: its checkpoint carries ``d2t`` as EAGLE-3
heads do) embeds and proposes only its own ids: target ids are mapped to draft ids on the way
in (ids it dropped share its last row) and its logits map back like FR-Spec's below.

FR-Spec (``--speculative-token-map``): the draft's LM head keeps only the map's rows
(``token_map.py``), so its logits are [T, V_hot] and the tree builder maps hot indices
back to target ids; a step then costs a fraction of the full head's [T, V] matmul.

Requests left out of a step are not drafted; the next catch-up covers the gap.
Prefill is lazy: the prefill hook only marks the slots the target wrote as stale;
the first catch-up of a request computes the draft KV of its whole context,
except a shared (radix) prefix whose draft KV is already valid. So requests the
policy never lets speculate (a busy server) cost no draft compute at all.
"""
from __future__ import annotations

import logging

import torch

from specserve.core import Request
from specserve.runner.model_runner import ExtendSpec, ModelRunner
from specserve.speculative import dynamic_tree as dt
from specserve.speculative.base import ProposerContext, draft_quantization
from specserve.speculative.mirrored_draft import MirroredDraftProposer
from specserve.speculative.state import spec_state, tail_ids
from specserve.speculative.token_map import input_id_map, read_token_map, restricted_lm_head
from specserve.speculative.tree import DraftTree, truncate_tree

logger = logging.getLogger(__name__)


class DraftModelProposer(MirroredDraftProposer):
    catches_up_lazily = True     # _catch_up extends the draft over every token since draft_len

    def __init__(self, ctx: ProposerContext) -> None:
        super().__init__(ctx)
        cfg, weights = ctx.draft_checkpoint
        target = ctx.target_runner
        self.runner = ModelRunner(cfg, weights, dtype=target.dtype, device=str(target.device),
                                  max_position=ctx.context_len + ctx.params.num_draft_tokens + self.num_steps + 1,
                                  num_kv_slots=self.num_draft_slots, page_size=1, max_rows=ctx.num_rows * self.topk,
                                  max_row_len=ctx.context_len + self.num_steps + 2,
                                  quantization=draft_quantization(ctx.server_args, target.device.type))
        self.input_map: list[int] | None = None              # target id -> draft id (a pruned vocabulary)
        if ctx.draft_vocab_ids is not None:                   # the draft's own vocabulary
            self.token_map = ctx.draft_vocab_ids.to(self.runner.device)
            self.input_map = input_id_map(ctx.draft_vocab_ids, ctx.target_config.vocab_size)
            logger.info("STANDALONE draft with a pruned vocabulary of %d target ids", self.token_map.numel())
        else:
            self.token_map = self._restrict_to_token_map()  # [V_hot] target ids, or None (whole vocabulary)

    def _restrict_to_token_map(self) -> torch.Tensor | None:
        """FR-Spec: replace the draft's LM head by its ``--speculative-token-map`` rows."""
        args = self.ctx.server_args
        if args.speculative_token_map is None:
            return None
        model = self.runner.model
        token_map = read_token_map(args.speculative_token_map, model.config.vocab_size, self.topk)
        model.lm_head = restricted_lm_head(model.lm_head, token_map,
                                           draft_quantization(args, self.runner.device.type))
        logger.info("STANDALONE draft proposes from the %d token ids of %s (FR-Spec)", token_map.numel(),
                    args.speculative_token_map)
        return token_map.to(self.runner.device)

    # ---- prefill ----------------------------------------------------------------------
    def on_prefill(self, engine, items: list) -> None:
        """The target wrote these slots; the draft catches up lazily, the first time the
        policy lets the request speculate (a busy server that never speculates pays nothing)."""
        for item in items:
            self._mark(item.new_slots, False)
            state = _state(item.req)
            state.draft_len, state.needs_sync = 0, True     # (re)admitted: its draft row is stale

    def _first_invalid(self, slots: list[int], end: int) -> int:
        """First position < end whose draft KV is missing (``end`` if none)."""
        is_valid = self.is_valid
        for pos in range(end):
            if not is_valid[slots[pos]]:
                return pos
        return end

    # ---- decode -----------------------------------------------------------------------
    def propose(self, engine, items: list, max_nodes: list[int]) -> list[DraftTree]:
        root_logits = self._catch_up(engine, items)                                   # [bs, V_draft]
        pool, frontier = dt.first_step(torch.log_softmax(root_logits.float(), dim=-1), self.topk, self.token_map)
        steps = self.draft_steps(max(max_nodes))
        if steps > 1:
            pool = self._grow(engine, items, pool, frontier, steps)
        roots = torch.tensor([item.req.last_id for item in items])
        tokens, parents = (x.cpu() for x in dt.rerank(pool, roots, self.ctx.params.num_draft_tokens))
        for item in items:
            self._mark(item.new_slots[1:], False)       # the target writes tree nodes there
        return [truncate_tree(DraftTree(tokens[b], parents[b]), cap) for b, cap in enumerate(max_nodes)]

    def _catch_up(self, engine, items: list) -> torch.Tensor:
        """Extend over all tokens the draft has not seen, root included. Returns logits [bs, V_draft]
        (V_draft: the vocabulary, or the token map's V_hot)."""
        specs = []
        for item in items:
            req, state = item.req, _state(item.req)
            row = self._base_row(engine, req)
            if state.needs_sync:       # first speculation since admission: reuse valid (shared) prefix KV
                state.draft_len = self._first_invalid(req.kv_slots, len(req.kv_slots))
                self.runner.set_row_slots(row, 0, req.kv_slots[:state.draft_len])
                state.needs_sync = False
            start = state.draft_len
            slots = req.kv_slots[start:] + item.new_slots[:1]
            token_ids = self._draft_ids(tail_ids(req, req.seq_len - start))
            specs.append(ExtendSpec(row=row, prefix_len=start, token_ids=token_ids, new_slots=slots))
            self._mark(slots, True)
            state.draft_len = req.seq_len
        return self._catch_up_forward(specs)

    def _grow(self, engine, items: list, pool: dt.TreePool, frontier: dt.Frontier, steps: int) -> dt.TreePool:
        """Draft steps 1 .. steps-1: forward the frontier, expand it by top-K."""
        bs, k = len(items), self.topk
        self._copy_base_rows(engine, items, max(item.req.seq_len for item in items))
        paths = [[[] for _ in range(k)] for _ in range(bs)]      # ancestors' scratch slots per node
        tokens = frontier.tokens.cpu().tolist()                  # host copy: ExtendSpec takes lists
        for step in range(1, steps):
            logits = self.runner.forward(self._frontier_specs(engine, items, step, tokens, paths))
            logprobs = torch.log_softmax(logits.float(), dim=-1).view(bs, k, -1)   # [bs, K, V_draft]
            pool, frontier = dt.expand_step(pool, frontier, logprobs, k, self.token_map)
            if step + 1 < steps:
                tokens, parent_slot = torch.stack([frontier.tokens, frontier.parent_slot]).cpu().tolist()
                paths = [[paths[b][p] + [self._scratch(b, step, p)] for p in parent_slot[b]]
                         for b in range(bs)]
        return pool

    def _frontier_specs(self, engine, items: list, step: int, tokens: list[list[int]],
                        paths: list[list[list[int]]]) -> list[ExtendSpec]:
        specs = []
        for b, item in enumerate(items):
            base, committed = self._base_row(engine, item.req), item.req.seq_len
            for k in range(self.topk):
                self.runner.set_row_slots(base + k, committed, paths[b][k])
                specs.append(ExtendSpec(row=base + k, prefix_len=committed + step - 1,
                                        token_ids=self._draft_ids([tokens[b][k]]),
                                        new_slots=[self._scratch(b, step, k)]))
        return specs

    def _draft_ids(self, target_ids: list[int]) -> list[int]:
        """The draft's ids of target tokens (the same ids unless the draft's vocabulary is pruned)."""
        table = self.input_map
        return target_ids if table is None else [table[t] for t in target_ids]

    # ---- cost -------------------------------------------------------------------------
    def measure_cost(self) -> None:
        self._measure_cost(lambda slots: self.runner.forward(
            [ExtendSpec(row=0, prefix_len=0, token_ids=[0] * len(slots), new_slots=slots)]))


class _DraftState:
    __slots__ = ("draft_len", "needs_sync")

    def __init__(self) -> None:
        self.draft_len = 0         # tokens of req.all_ids whose draft KV is in the request's base row
        self.needs_sync = True     # base row not set up since (re)admission


def _state(req: Request) -> _DraftState:
    state = spec_state(req)
    if state.proposer is None:
        state.proposer = _DraftState()
    return state.proposer


