"""``--speculative-ngram-assist N``: NGRAM drafts first, a draft model where it has no match.

A draft model (EAGLE, EAGLE3 and NEXTN heads, a STANDALONE model) drafts every step it is let
to; NGRAM drafts only where the context's tail recurs, in the prompt, in what the server has
seen, or in its corpus of the target's own answers, and there its trees run longer (copying,
set phrases, the steps of a worked answer). This wrapper lets NGRAM match each request first,
trees of up to N nodes, and the draft model propose only for the requests it found nothing for,
so a step that copies skips the draft forward. The worker weighs the two kinds of tree apart
(``SpecWorker._plan_in_two_parts``): each request's acceptance of NGRAM's trees and of the draft
model's is counted apart, and a request with an NGRAM match verifies the head's chain instead
where that promises more (corpus matches on chat, which the model rarely follows). The draft
model still reads every verified token: its features or tokens reach it through the same hooks
as when it drafts, and its next catch-up covers the steps NGRAM drafted.

Measured before this was built (a prototype, 2026-11-28, 2-core AMD EPYC Zen4, batch 1, greedy,
every step drafting, 28 prompts in turns): EAGLE3 (1,1,2) with NGRAM trees of 4 nodes 1.41x
plain decoding, against EAGLE3 alone 1.15x and NGRAM alone (its policy, corpus) 1.36x; chat
1.23x against 1.12x and 1.13x. Trees of 12 nodes did worse (1.16x): wide verifies of corpus
trees that chat rarely accepts.
"""
from __future__ import annotations

from specserve.speculative.base import Proposer, ProposerContext
from specserve.speculative.tree import DraftTree


class NgramAssistedProposer(Proposer):
    """``ngram``'s trees where it matches, ``drafter``'s elsewhere (see the module doc); both are
    built by the registry (``base.create_spec_worker``), so this module imports no proposer.
    It proposes in two parts (``Proposer.proposes_in_two_parts``): NGRAM's trees first, then the
    draft model's for the requests the policy picks among those NGRAM had nothing for."""

    is_cheap = False
    proposes_in_two_parts = True
    first_kind, rest_kind = "ngram", "draft"

    def __init__(self, ctx: ProposerContext, drafter: Proposer, ngram: Proposer) -> None:
        super().__init__(ctx)
        self.drafter, self.ngram = drafter, ngram
        self.catches_up_lazily = drafter.catches_up_lazily       # NGRAM reads what it missed itself
        self.follows_plain_steps = drafter.follows_plain_steps
        self.num_ngram_trees = 0                                   # request-steps NGRAM drafted
        self.ngram_rids: set[str] = set()              # the requests verifying NGRAM's trees this step

    @property
    def last_switch_seconds(self) -> float:
        return self.drafter.last_switch_seconds

    @last_switch_seconds.setter
    def last_switch_seconds(self, seconds: float) -> None:
        self.drafter.last_switch_seconds = seconds

    def on_prefill(self, engine, items: list) -> None:
        self.drafter.on_prefill(engine, items)

    def propose(self, engine, items: list, max_nodes: list[int]) -> list[DraftTree]:
        """Both parts in one call (the worker's path where matching everyone first costs too much)."""
        first = self.propose_first(engine, items, max_nodes)
        matched = [item for item, tree in zip(items, first) if tree is not None]
        if matched:                    # the drafter skips them: the target writes their trees' slots
            self.drafter.on_skipped(engine, matched)
        rest = [i for i, tree in enumerate(first) if tree is None]
        if rest:
            drafted = self.propose_rest(engine, [items[i] for i in rest], [max_nodes[i] for i in rest])
            for i, tree in zip(rest, drafted):
                first[i] = tree
        return first

    def propose_first(self, engine, items: list, max_nodes: list[int]) -> list[DraftTree | None]:
        """NGRAM's tree for each request (at most the assist's size), None where it matched nothing."""
        trees = self.ngram.propose(engine, items, [min(n, self.params.assist_nodes) for n in max_nodes])
        self.ngram_rids = {item.req.rid for item, tree in zip(items, trees) if not tree.is_root_only}
        return [None if tree.is_root_only else tree for tree in trees]

    def first_cost(self, batch_size: int, max_nodes: int) -> float:
        return self.ngram.draft_cost(batch_size, min(max_nodes, self.params.assist_nodes))

    def rest_cap(self, max_nodes: int) -> int:
        """The draft model's tree size within ``max_nodes``: its own N at most."""
        return min(max_nodes, self.drafter.params.num_draft_tokens)

    def rest_depth(self, max_nodes: int) -> int:
        """The depth of the draft model's deepest tree within ``max_nodes``."""
        return self.drafter.max_depth(self.rest_cap(max_nodes))

    def propose_rest(self, engine, items: list, max_nodes: list[int]) -> list[DraftTree]:
        """The draft model's trees; these requests verify them, whatever NGRAM matched for them."""
        self.ngram_rids.difference_update(item.req.rid for item in items)
        return self.drafter.propose(engine, items, [self.rest_cap(n) for n in max_nodes])

    def tree_kind(self, item) -> str:
        return self.first_kind if item.req.rid in self.ngram_rids else self.rest_kind

    def on_skipped(self, engine, items: list) -> None:
        self.drafter.on_skipped(engine, items)

    def on_verified(self, engine, items: list, emitted: list[list[int]]) -> None:
        self.ngram.on_verified(engine, items, emitted)
        self.drafter.on_verified(engine, items, emitted)

    def on_accepted(self, engine, items: list, trees: list[DraftTree], results: list) -> None:
        self.num_ngram_trees += sum(not tree.is_root_only and item.req.rid in self.ngram_rids
                                    for item, tree in zip(items, trees))
        self.drafter.on_accepted(engine, items, trees, results)

    def on_plain_step(self, engine, items: list) -> None:
        self.drafter.on_plain_step(engine, items)

    def draft_cost(self, batch_size: int, max_nodes: int) -> float:
        """The draft model's for every request (where NGRAM matched, less) plus NGRAM's matching."""
        return self.drafter.draft_cost(batch_size, self.rest_cap(max_nodes)) + self.first_cost(batch_size, max_nodes)

    def measure_cost(self) -> None:
        self.drafter.measure_cost()

    def stats(self) -> dict[str, int]:
        return {"request_steps_drafted_by_ngram": self.num_ngram_trees}
