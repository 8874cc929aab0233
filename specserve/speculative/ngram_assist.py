"""``--speculative-ngram-assist N``: NGRAM drafts first, a draft model where it has no match.

A draft model (EAGLE, EAGLE3 and NEXTN heads, a STANDALONE model) drafts every step it is let
to; NGRAM drafts only where the context's tail recurs, in the prompt, in what the server has
seen, or in its corpus of the target's own answers, and there its trees run longer (copying,
set phrases, the steps of a worked answer). This wrapper lets NGRAM match each request first,
trees of up to N nodes, and the draft model propose only for the requests it found nothing for,
so a step that copies skips the draft forward. The draft model still reads every verified
token: its features or tokens reach it through the same hooks as when it drafts, and its next
catch-up covers the steps NGRAM drafted.

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
    built by the registry (``base.create_spec_worker``), so this module imports no proposer."""

    is_cheap = False

    def __init__(self, ctx: ProposerContext, drafter: Proposer, ngram: Proposer) -> None:
        super().__init__(ctx)
        self.drafter, self.ngram = drafter, ngram
        self.catches_up_lazily = drafter.catches_up_lazily       # NGRAM reads what it missed itself
        self.follows_plain_steps = drafter.follows_plain_steps
        self.num_ngram_trees = 0                                   # request-steps NGRAM drafted

    @property
    def last_switch_seconds(self) -> float:
        return self.drafter.last_switch_seconds

    @last_switch_seconds.setter
    def last_switch_seconds(self, seconds: float) -> None:
        self.drafter.last_switch_seconds = seconds

    def on_prefill(self, engine, items: list) -> None:
        self.drafter.on_prefill(engine, items)

    def propose(self, engine, items: list, max_nodes: list[int]) -> list[DraftTree]:
        trees = self.ngram.propose(engine, items, [min(n, self.params.assist_nodes) for n in max_nodes])
        matched = [item for item, tree in zip(items, trees) if not tree.is_root_only]
        if matched:                    # the drafter skips them: the target writes their trees' slots
            self.num_ngram_trees += len(matched)
            self.drafter.on_skipped(engine, matched)
        rest = [i for i, tree in enumerate(trees) if tree.is_root_only]
        if rest:
            drafted = self.drafter.propose(engine, [items[i] for i in rest],
                                           [min(max_nodes[i], self.drafter.params.num_draft_tokens) for i in rest])
            for i, tree in zip(rest, drafted):
                trees[i] = tree
        return trees

    def on_skipped(self, engine, items: list) -> None:
        self.drafter.on_skipped(engine, items)

    def on_verified(self, engine, items: list, emitted: list[list[int]]) -> None:
        self.ngram.on_verified(engine, items, emitted)
        self.drafter.on_verified(engine, items, emitted)

    def on_accepted(self, engine, items: list, trees: list[DraftTree], results: list) -> None:
        self.drafter.on_accepted(engine, items, trees, results)

    def on_plain_step(self, engine, items: list) -> None:
        self.drafter.on_plain_step(engine, items)

    def draft_cost(self, batch_size: int, max_nodes: int) -> float:
        """The draft model's for every request (where NGRAM matched, less) plus NGRAM's matching."""
        drafter_nodes = min(max_nodes, self.drafter.params.num_draft_tokens)
        return self.drafter.draft_cost(batch_size, drafter_nodes) + self.ngram.draft_cost(batch_size, max_nodes)

    def measure_cost(self) -> None:
        self.drafter.measure_cost()

    def stats(self) -> dict[str, int]:
        return {"request_steps_drafted_by_ngram": self.num_ngram_trees}
