"""Proposer base class, the proposer registry (lazy imports) and the SpecWorker.

The engine calls, per step:

* ``SpecWorker.on_prefill(engine, batch)`` after a prefill forward (drafters
  ingest prompts: NGRAM feeds its cache, a draft model prefills its KV);
* ``SpecWorker.decode_step(engine, batch)`` instead of a plain decode forward:
  policy -> proposer.propose -> one target forward over every tree ->
  verification -> KV compaction -> stats. Returns ``{rid: TokenResult}``.

A proposer sees only its own state (``req.spec_state.proposer``; NGRAM's is
``req.spec_state.ngram``) and the engine's public parts (scheduler rows, runner, pool); it
imports speculative/base, tree and verify, never another proposer. One wrapper composes two:
``ngram_assist.py`` (``--speculative-ngram-assist``) lets NGRAM draft before a draft model.
"""
from __future__ import annotations

import importlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
from torch import Tensor

from specserve.core import TokenResult
from specserve.models.packed_linear import INTEGER_QUANTIZATION, Q8_ON_LOAD_QUANTIZATION
from specserve.runner.model_runner import in_inference_mode
from specserve.speculative import target_verify as tv
from specserve.speculative.params import SpecParams
from specserve.speculative.policy import CostCurve, SpecPolicy, measure_cost_curve
from specserve.speculative.state import RequestSpecState, spec_state, tail_ids  # noqa: F401 (re-export)
from specserve.speculative.tree import DraftTree, root_only, truncate_tree
from specserve.speculative.verify import AcceptResult, emitted_tokens

if TYPE_CHECKING:
    from specserve.cache.block_pool import BlockPool
    from specserve.config import ModelConfig, ServerArgs
    from specserve.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

PROPOSERS = {
    "NGRAM": ("specserve.speculative.ngram", "NgramProposer"),
    "STANDALONE": ("specserve.speculative.draft_model", "DraftModelProposer"),
    "EAGLE": ("specserve.speculative.eagle", "EagleProposer"),
    "EAGLE3": ("specserve.speculative.eagle", "EagleProposer"),
}
ASSISTED_PROPOSER = ("specserve.speculative.ngram_assist", "NgramAssistedProposer")
COST_WIDTHS_REQUIRED = (1, 2, 3, 4, 16)   # 2 and 3: the verify widths of short chains, most drafting steps
COST_WIDTHS_OPTIONAL = (8, 64, 256)
COST_CONTEXT = 192          # tokens of context the timed forwards attend to (see measure_target_cost)
TARGET_COST_BUDGET_S = 1.5
PROPOSE_FIRST_SHARE = 0.02     # of a plain step: what a cheap proposer may spend before the policy weighs
DRAFT_WARM_STEPS = 3           # a draft model's steps in a row before its step times teach the policy


@dataclass
class ProposerContext:
    """What a proposer may use to build itself."""

    server_args: "ServerArgs"
    params: SpecParams
    target_config: "ModelConfig"
    target_runner: "ModelRunner"
    pool: "BlockPool"
    num_rows: int                  # scheduler rows (max running requests)
    context_len: int
    draft_checkpoint: tuple["ModelConfig", Iterable] | None = None
    target_path: str | None = None      # the target's checkpoint (NEXTN heads live inside it)
    draft_vocab_ids: torch.Tensor | None = None   # a pruned-vocabulary draft's target ids (STANDALONE)
    pending_ngram_corpus: Any = None    # ngram.start_corpus_load's future, begun before the target loaded


def draft_quantization(args: "ServerArgs", device_type: str) -> str | None:
    """The draft's linear path. SGLang's rule: its own --speculative-draft-model-quantization,
    else the target's --quantization (CPU only). Beside a gguf target, the draft's linears
    without GGUF blocks (every EAGLE head, a safetensors STANDALONE draft) are rounded to Q8_0
    blocks at load (w8a8_int8), so drafting streams a quarter of float32's bytes;
    ``unquant`` keeps the draft in float."""
    if device_type != "cpu":
        return None
    own = getattr(args, "speculative_draft_model_quantization", None)
    if own:
        return None if own == "unquant" else own
    target = getattr(args, "quantization", None)
    integer = (INTEGER_QUANTIZATION, Q8_ON_LOAD_QUANTIZATION)
    return Q8_ON_LOAD_QUANTIZATION if target in integer else None


class Proposer:
    """Drafts one DraftTree per request. Subclasses override ``propose`` and the hooks they need.

    ``is_cheap``: proposing costs next to nothing (host-side lookups), so the worker
    proposes for every request first and lets the policy see the real tree sizes; a cheap
    proposer's tree at a smaller cap is a prefix of its tree at a larger one (the worker may
    match at the full cap and cut the trees to the sizes the policy prefers).
    ``catches_up_lazily``: the proposer reads what it missed from the request itself the
    next time it proposes, so a step where nobody speculates can be the engine's plain
    decode step, without the verify bookkeeping (what keeps a busy server at plain speed).
    ``follows_plain_steps``: such a step can be the plain decode step for this proposer too;
    it then gets ``on_plain_step``, which such a proposer implements (EAGLE heads read the
    step's target features there).
    ``proposes_in_two_parts``: a cheap part first (``propose_first``: a tree, or None where the
    other part would draft), then the costly part (``propose_rest``, within ``rest_cap``, trees of
    at most ``rest_depth``) for the requests the policy picks among the rest; the worker then
    weighs the cheap part's trees at their real sizes, each request against its acceptance of the
    kind of tree it would verify (``tree_kind``: ``RequestPolicyState.use_counts_of``). The NGRAM
    assist (``ngram_assist.py``) is one.
    ``last_switch_seconds``: set by proposers whose draft catches up on the positions it missed
    (EAGLE heads, draft models; ``catch_up_share``): the share of the catch-up forward spent on
    positions beyond what a verify leaves (``num_draft_tokens`` a request), i.e. on plain steps'
    positions: a one-off cost of switching a request on, not a cost of every drafting step.
    """

    is_cheap = False
    catches_up_lazily = False
    follows_plain_steps = False
    proposes_in_two_parts = False
    last_switch_seconds = 0.0  # of the last ``propose``: catching up on plain steps' positions

    def __init__(self, ctx: ProposerContext) -> None:
        self.ctx, self.params = ctx, ctx.params

    def on_prefill(self, engine, items: list) -> None:
        """After the target's prefill forward and commit of ``items`` (ScheduledItems)."""

    def propose(self, engine, items: list, max_nodes: list[int]) -> list[DraftTree]:
        """Trees for ``items`` (root = ``req.last_id``), tree i with <= max_nodes[i] nodes."""
        raise NotImplementedError

    def on_skipped(self, engine, items: list) -> None:
        """These items decode plainly this step (no ``propose``)."""

    def on_verified(self, engine, items: list, emitted: list[list[int]]) -> None:
        """Tokens each item will emit this step (before the engine's stop checks)."""

    def on_accepted(self, engine, items: list, trees: list[DraftTree], results: list[AcceptResult]) -> None:
        """After verification and KV compaction: the accepted path of every item's tree."""

    def on_plain_step(self, engine, items: list) -> None:
        """After a plain decode step of every item: ``follows_plain_steps`` proposers implement it."""
        raise NotImplementedError(f"{type(self).__name__} follows plain steps but has no on_plain_step")

    def tree_kind(self, item) -> str:
        """Whose tree ``item`` verified this step, for its acceptance counts (one kind by default)."""
        return ""

    def stats(self) -> dict[str, int]:
        """Counts of its own for ``/get_server_info``'s ``spec_policy`` (none by default)."""
        return {}

    def draft_cost(self, batch_size: int, max_nodes: int) -> float:
        """Estimated seconds of one ``propose`` over ``batch_size`` requests whose largest tree
        may have ``max_nodes`` nodes; never decreasing in either (the policy's bounds rely on it)."""
        return 0.0

    def max_depth(self, max_nodes: int) -> int:
        """Depth of the deepest tree ``propose`` may return with ``max_nodes`` nodes."""
        return max_nodes - 1

    def measure_cost(self) -> None:
        """Optional startup timing for ``draft_cost``."""


def catch_up_share(rows: list[int], per_request: int, seconds: float) -> float:
    """The part of a catch-up forward's ``seconds`` over requests catching up on ``rows`` positions
    each that went to positions beyond ``per_request`` a request (what a verify leaves), in
    proportion to their rows: ``Proposer.last_switch_seconds``."""
    total = sum(rows)
    return seconds * sum(max(r - per_request, 0) for r in rows) / total if total else 0.0


def get_proposer_class(algorithm: str) -> type[Proposer]:
    if algorithm not in PROPOSERS:
        raise NotImplementedError(f"speculative algorithm {algorithm} has no proposer yet")
    module, name = PROPOSERS[algorithm]
    return getattr(importlib.import_module(module), name)


def create_spec_worker(ctx: ProposerContext) -> "SpecWorker":
    proposer = get_proposer_class(ctx.params.algorithm)(ctx)
    if ctx.params.assist_nodes:                 # --speculative-ngram-assist: NGRAM drafts first
        assisted = getattr(importlib.import_module(ASSISTED_PROPOSER[0]), ASSISTED_PROPOSER[1])
        proposer = assisted(ctx, proposer, get_proposer_class("NGRAM")(ctx))
    t0 = time.perf_counter()
    curve = measure_target_cost(ctx)
    proposer.measure_cost()
    policy = SpecPolicy(curve, proposer.draft_cost, ctx.params.tree_cap,
                        is_always=ctx.params.policy == "always",
                        warm_steps=0 if proposer.is_cheap else DRAFT_WARM_STEPS)
    logger.info("speculative %s%s: S=%d K=%d N=%d; verify cost %s; draft cost(1)=%.1fms; speculation "
                "on up to batch size %d at accept len %.1f (startup timing %.2fs)", ctx.params.algorithm,
                f" (NGRAM first, trees of up to {ctx.params.assist_nodes} nodes)" if ctx.params.assist_nodes else "",
                ctx.params.num_steps, ctx.params.topk, ctx.params.num_draft_tokens, curve.describe(),
                proposer.draft_cost(1, ctx.params.num_draft_tokens) * 1e3, policy.max_batch_size(), policy.alpha,
                time.perf_counter() - t0)
    logger.info("%s", describe_policy(ctx.params.policy, policy))
    return SpecWorker(ctx.params, proposer, policy)


def describe_policy(name: str, policy: SpecPolicy) -> str:
    if name == "always":
        return "--speculative-policy always: every request speculates on every decode step"
    bs = policy.max_batch_size()
    pays = (f"pays up to batch size {bs} at the assumed accept length {policy.alpha:.1f}" if bs
            else "does not pay at any batch size at the assumed accept length")
    return (f"--speculative-policy auto: speculation {pays}; each step, requests whose drafts would not pay "
            f"decode plainly (same output), reported in /get_server_info; --speculative-policy always "
            f"forces it")


def measure_target_cost(ctx: ProposerContext, budget_s: float = TARGET_COST_BUDGET_S) -> CostCurve:
    """Target forward time at a few widths after COST_CONTEXT tokens of context (the middle of a
    128-token answer to a short prompt; fewer where the pool or the context length cannot hold
    them), using row 0 and free slots. Each verify row attends to the whole context: timed
    without one, W=4 read 1.13-1.24x W=1 where `verify-cost` at 256 tokens reads ~1.4x (2-core
    Xeon), so the policy took wide trees for cheaper than they are."""
    from specserve.runner.model_runner import forwards_after_context

    runner, pool = ctx.target_runner, ctx.pool
    limit = min(pool.num_free_tokens, ctx.context_len)       # slots, row length, rotary positions
    context = min(COST_CONTEXT, limit // 2)
    required = [w for w in COST_WIDTHS_REQUIRED if w <= limit - context] or [1]
    optional = [w for w in COST_WIDTHS_OPTIONAL if w <= limit - context]
    with forwards_after_context(runner, pool, [0] * context, max(required + optional)) as forward:
        return measure_cost_curve(forward, required, optional, budget_s, sync_fn(runner.device))


def sync_fn(device: torch.device):
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


class SpecWorker:
    """Runs speculative decode steps for any proposer (see the module docstring)."""

    def __init__(self, params: SpecParams, proposer: Proposer, policy: SpecPolicy) -> None:
        self.params, self.proposer, self.policy = params, proposer, policy
        # a step where nobody drafts can be the engine's plain decode step (Proposer's docstring)
        self.takes_plain_steps = proposer.catches_up_lazily or proposer.follows_plain_steps
        self.accept_histogram = [0] * params.tree_cap           # [accepted drafts] -> verifies
        self.num_draft_tokens_verified = 0                       # tree nodes past the root
        self.num_drafted_steps = self.num_plain_steps = 0        # per request and step: drafts or plain

    def on_prefill(self, engine, batch) -> None:
        self.proposer.on_prefill(engine, batch.items)

    @in_inference_mode
    def decode_step(self, engine, batch) -> dict[str, TokenResult]:
        items = batch.items
        start = time.perf_counter()
        trees = self._plan(engine, items)
        if trees is None or (self.takes_plain_steps and all(t.is_root_only for t in trees)):
            return self._plain_step(engine, items, start)
        self._count_steps(items, trees)
        proposer = self.proposer
        logits, forward_seconds = _timed(tv.verify_forward, engine, items, trees)
        logits = tv.ban_stop_tokens_before_min_new_tokens(items, trees, logits)
        results = tv.accept_trees(engine, items, trees, logits, self.params)
        emitted = [emitted_tokens(tree, res) for tree, res in zip(trees, results)]
        tv.compact_kv(engine, items, trees, results)
        self.proposer.on_accepted(engine, items, trees, results)
        self._record(engine, items, trees, results)
        self.proposer.on_verified(engine, items, emitted)
        out = tv.token_results(engine, items, trees, results, emitted, logits)
        # without the catch-up on plain steps' positions, which would teach the policy's per-step
        # overhead that every drafting step pays it (EAGLE3 probes after 64 plain steps: 4-12 ms;
        # the learned overhead rose to ~4 ms and kept the head declined)
        seconds = time.perf_counter() - start - proposer.last_switch_seconds      # synced above
        self.policy.observe_step([t.num_nodes for t in trees], seconds, forward_seconds)
        return out

    def _plain_step(self, engine, items: list, start: float) -> dict[str, TokenResult]:
        """Nobody speculates (``takes_plain_steps``): the engine's decode forward and sampling (each
        request holds the one slot the scheduler gave it); the step began at ``start``."""
        for item in items:
            spec_state(item.req).policy.num_plain_steps += 1
        self.num_plain_steps += len(items)
        logits, forward_seconds = _timed(engine.decode_forward, items)
        engine.scheduler.commit_all(items)
        out = engine.sample_one_each([item.req for item in items], logits)
        if not self.proposer.catches_up_lazily:
            self.proposer.on_plain_step(engine, items)
        self.policy.observe_step([1] * len(items), time.perf_counter() - start, forward_seconds)
        return out

    def _plan(self, engine, items: list) -> list[DraftTree] | None:
        """One tree per item: the proposer's for the requests the policy picks, root-only otherwise;
        None where every item decodes plainly and the proposer ``takes_plain_steps`` (no trees made:
        most steps of a busy server)."""
        proposer = self.proposer
        proposer.last_switch_seconds = 0.0
        caps = [max_tree_nodes(engine, item, self.params.tree_cap) for item in items]
        states = [spec_state(item.req).policy for item in items]
        if proposer.proposes_in_two_parts and self._proposing_first_is_cheap(len(items), max(caps),
                                                                              proposer.first_cost):
            return self._plan_in_two_parts(engine, items, caps, states)
        proposed = None
        if proposer.is_cheap and self._proposing_first_is_cheap(len(items), max(caps)):
            proposed = proposer.propose(engine, items, caps)
            if all(t.is_root_only for t in proposed):     # nothing matched: no weighing
                self.policy.select(states, [1] * len(items), [0] * len(items))
                return None if self.takes_plain_steps else proposed
        depth_caps = self._depth_caps(caps)
        can_pick = self.policy.may_pick_any(states, caps, depth_caps)
        if can_pick:                                 # size each request's tree to its acceptance
            caps = [self.policy.preferred_nodes(state, cap, len(items), self.proposer.max_depth)
                    for state, cap in zip(states, caps)]
            depth_caps = self._depth_caps(caps)
        if self.proposer.is_cheap:                   # the policy sees the real tree sizes
            trees = ([truncate_tree(t, cap) for t, cap in zip(proposed, caps)] if proposed is not None
                     else self._propose_cheap(engine, items, caps, depth_caps, states, can_pick))
            sizes = self.policy.select(states, [t.num_nodes for t in trees], [t.depth for t in trees], can_pick)
            sizes = _take_tree_slots(engine, items, sizes)
            return [truncate_tree(t, n) if n > 1 or t.is_root_only else root_only(t.root_token)
                    for t, n in zip(trees, sizes)]
        sizes = _take_tree_slots(engine, items, self.policy.select(states, caps, depth_caps, can_pick))
        if max(sizes) == 1:                          # nobody drafts (most steps of a busy server)
            self.proposer.on_skipped(engine, items)
            return None if self.takes_plain_steps else [root_only(item.req.last_id) for item in items]
        picked = [(item, n) for item, n in zip(items, sizes) if n > 1]
        skipped = [item for item, n in zip(items, sizes) if n == 1]
        drafted = iter(self.proposer.propose(engine, [i for i, _ in picked], [n for _, n in picked])
                       if picked else [])
        if skipped:
            self.proposer.on_skipped(engine, skipped)
        return [next(drafted) if n > 1 else root_only(item.req.last_id) for item, n in zip(items, sizes)]

    def _plan_in_two_parts(self, engine, items: list, caps: list[int], states: list) -> list[DraftTree] | None:
        """``_plan`` for a proposer that ``proposes_in_two_parts``: its cheap trees for every request
        first; a request with one takes it or the costly part's chain, whichever promises more at its
        acceptance of each (``SpecPolicy.pick_kind``). The cheap trees are weighed at their real sizes
        (as a cheap proposer's), the costly part's at its cap, each request against its acceptance of
        the kind of tree it would verify. The costly part then drafts for the requests picked among
        the rest; every other request skips it."""
        proposer = self.proposer
        first = self._first_or_rest(states, proposer.propose_first(engine, items, caps), caps)
        first, nodes, depths, can_pick = self._sized_two_parts(states, first, caps)
        sizes = _take_tree_slots(engine, items, self.policy.select(states, nodes, depths, can_pick))
        rest = [i for i, (tree, n) in enumerate(zip(first, sizes)) if tree is None and n > 1]
        drafted = proposer.propose_rest(engine, [items[i] for i in rest], [sizes[i] for i in rest]) if rest else []
        drafting = set(rest)
        skipped = [item for i, item in enumerate(items) if i not in drafting]
        if skipped:
            proposer.on_skipped(engine, skipped)
        if max(sizes) == 1 and self.takes_plain_steps:
            return None
        trees = [truncate_tree(tree, n) if tree is not None and n > 1 else root_only(item.req.last_id)
                 for item, tree, n in zip(items, first, sizes)]
        for i, tree in zip(rest, drafted):
            trees[i] = tree
        return trees

    def _first_or_rest(self, states: list, first: list, caps: list[int]) -> list:
        """``first`` with None where the request takes the costly part's chain: it had no cheap tree,
        or the chain promises more (``SpecPolicy.pick_kind``); each request's counts of its kind active."""
        proposer = self.proposer
        for i, (state, tree) in enumerate(zip(states, first)):
            if tree is None:
                state.use_counts_of(proposer.rest_kind)
                continue
            kinds = {proposer.first_kind: tree.depth, proposer.rest_kind: proposer.rest_depth(caps[i])}
            if self.policy.pick_kind(state, kinds) != proposer.first_kind:
                first[i] = None
        return first

    def _sized_two_parts(self, states: list, first: list, caps: list[int]) -> tuple[list, list[int], list[int], bool]:
        """The cheap trees cut to, and the costly part's caps set at, the sizes the policy prefers for
        each request (where ``may_pick_any`` says anyone may draft): (trees or None, nodes, depths,
        can_pick)."""
        proposer, bs = self.proposer, len(states)

        def shapes(trees: list, caps: list[int]) -> tuple[list[int], list[int]]:
            """Each request's nodes and depth: its cheap tree's, else the costly part's within its cap."""
            nodes = [tree.num_nodes if tree is not None else cap for tree, cap in zip(trees, caps)]
            return nodes, [tree.depth if tree is not None else proposer.rest_depth(n) for tree, n in zip(trees, nodes)]

        nodes, depths = shapes(first, [proposer.rest_cap(cap) for cap in caps])
        can_pick = self.policy.may_pick_any(states, nodes, depths)
        if can_pick:
            depth_of = [proposer.rest_depth if tree is None else proposer.max_depth for tree in first]
            nodes = [self.policy.preferred_nodes(s, n, bs, depth) for s, n, depth in zip(states, nodes, depth_of)]
            first = [truncate_tree(tree, n) if tree is not None else None for tree, n in zip(first, nodes)]
            nodes, depths = shapes(first, nodes)
        return first, nodes, depths, can_pick

    def _depth_caps(self, caps: list[int]) -> list[int]:
        """The proposer's ``max_depth`` of each cap (asked once per distinct cap)."""
        depth_of = {cap: self.proposer.max_depth(cap) for cap in set(caps)}
        return [depth_of[cap] for cap in caps]

    def _proposing_first_is_cheap(self, batch_size: int, max_nodes: int,
                                  cost: Callable[[int, int], float] | None = None) -> bool:
        """Whether a cheap proposer (or a two-part one's ``first_cost``: ``cost``) may propose for
        every request at the full cap before the policy weighs anything (the trees are cut to its
        sizes afterwards): when that costs at most PROPOSE_FIRST_SHARE of a plain step. Then a
        step where nothing matches (most steps of a chat answer with NGRAM) skips the policy's
        bounds and weighing: a declined NGRAM step cost 0.3-0.4 ms more than a plain one on a
        Zen3, ~0.1 ms after this and the one native call per match. On a busy server, where
        matching everyone would cost more, the policy's bounds come first."""
        seconds = (cost or self.proposer.draft_cost)(batch_size, max_nodes)
        return seconds <= PROPOSE_FIRST_SHARE * self.policy.cost(batch_size, batch_size, 1, 0)

    def _propose_cheap(self, engine, items: list, caps: list[int], depth_caps: list[int], states: list,
                       can_pick: bool) -> list[DraftTree]:
        """Every request's tree, unless no tree within the caps could be picked (``can_pick``
        False: a busy server): then only the trees ``SpecPolicy._probe`` may look at, in its
        order, up to the first with more than the root, and none where no probe can pass
        (``may_probe``); the others stay root-only (the proposer catches up later). The
        policy's choice is the same either way."""
        if not self.proposer.catches_up_lazily or can_pick:
            return self.proposer.propose(engine, items, caps)
        trees = [root_only(item.req.last_id) for item in items]
        if not self.policy.may_probe(states, caps, depth_caps):
            return trees
        for i in self.policy.probe_order(states, caps):
            trees[i] = self.proposer.propose(engine, [items[i]], [caps[i]])[0]
            if not trees[i].is_root_only:
                break
        return trees

    def _record(self, engine, items: list, trees: list[DraftTree], results: list[AcceptResult]) -> None:
        """Stats of the verifies that carried drafts (root-only trees are plain decode steps)."""
        for item, tree, res in zip(items, trees, results):
            if tree.is_root_only:
                continue
            req = item.req
            req.spec_verify_ct += 1
            req.spec_accepted_tokens += res.accept_len
            engine.stats.spec_verify_ct += 1
            engine.stats.spec_accepted_tokens += res.accept_len
            self.accept_histogram[res.accept_len] += 1
            self.num_draft_tokens_verified += tree.num_nodes - 1
            state = spec_state(req).policy
            state.use_counts_of(self.proposer.tree_kind(item))
            self.policy.observe(state, res.accept_len, tree.depth)

    def _count_steps(self, items: list, trees: list[DraftTree]) -> None:
        for item, tree in zip(items, trees):
            state = spec_state(item.req).policy
            if tree.is_root_only:
                state.num_plain_steps += 1
                self.num_plain_steps += 1
            else:
                state.num_drafted_steps += 1
                self.num_drafted_steps += 1

    def server_info(self) -> dict[str, Any]:
        """Speculation's figures for ``/get_server_info``, with the draft and token map in use (the
        engine's choice where the flags were left unset: the shipped draft, its map)."""
        p, args = self.params, self.proposer.ctx.server_args
        return {"speculative_draft_model_path": args.speculative_draft_model_path,
                "speculative_token_map": args.speculative_token_map,
                "speculative_ngram_corpus": args.speculative_ngram_corpus,
                "speculative_ngram_assist": p.assist_nodes,
                "spec_accept_histogram": list(self.accept_histogram),
                "spec_draft_tokens": self.num_draft_tokens_verified,
                "speculative_num_steps": p.num_steps, "speculative_eagle_topk": p.topk,
                "speculative_num_draft_tokens": p.num_draft_tokens, "speculative_policy": p.policy,
                "spec_policy": {"policy": p.policy, "accept_rate": self.policy.global_rate,
                                "calibration": self.policy.calibration,
                                "by_kind": {kind or "default": {"accept_rate": f.rate, "calibration": f.calibration}
                                            for kind, f in self.policy.kinds.items()},
                                "max_batch_size": self.policy.max_batch_size(),
                                "request_steps_drafted": self.num_drafted_steps,
                                "request_steps_plain": self.num_plain_steps, **self.proposer.stats()}}

    def request_meta(self, req) -> dict[str, Any]:
        """Per-request policy figures for ``meta_info`` (the engine merges them in)."""
        state = spec_state(req).policy
        return {"spec_policy": self.params.policy, "spec_drafted_steps": state.num_drafted_steps,
                "spec_plain_steps": state.num_plain_steps}


def _timed(forward: Callable[..., Tensor], *args) -> tuple[Tensor, float]:
    """``forward(*args)`` (logits) and its seconds, the device synced (the policy's step costs)."""
    began = time.perf_counter()
    logits = forward(*args)
    sync_fn(logits.device)()
    return logits, time.perf_counter() - began


def max_tree_nodes(engine, item, num_draft_tokens: int) -> int:
    """Nodes worth verifying: no more than the tokens the request may still emit or place."""
    req = item.req
    remaining = req.sampling.max_new_tokens - len(req.output_ids)
    room = engine.context_len - req.seq_len
    return max(1, min(num_draft_tokens, remaining, room))


def _take_tree_slots(engine, items: list, sizes: list[int]) -> list[int]:
    """The policy's tree sizes, each drafting request given the slots of its tree past the
    root (the scheduler gave each one slot); where the pool lacks them, 1 (a plain step)."""
    extend = engine.scheduler.extend_decode
    return [n if n == 1 or extend(item, n - 1) else 1 for item, n in zip(items, sizes)]
