"""The NGRAM assist's routing: NGRAM matches every request first, within the assist's tree size;
the draft model proposes only for the requests NGRAM had nothing for, within its own N, and
learns which requests it skipped; every hook after verification reaches the proposer it is for."""
from __future__ import annotations

from types import SimpleNamespace

from specserve.speculative.base import Proposer
from specserve.speculative.ngram_assist import NgramAssistedProposer
from specserve.speculative.params import SpecParams
from specserve.speculative.tree import DraftTree, chain, root_only


class Recorder(Proposer):
    """Returns the trees it is given per request id and records every call."""

    def __init__(self, params: SpecParams, trees: dict[str, DraftTree], follows_plain_steps=False) -> None:
        super().__init__(SimpleNamespace(params=params))
        self.trees, self.calls = trees, []
        self.follows_plain_steps = follows_plain_steps

    def propose(self, engine, items, max_nodes):
        self.calls.append(("propose", [i.req.rid for i in items], list(max_nodes)))
        return [DraftTree.from_lists(self.trees[i.req.rid].token_list()[:cap],
                                     self.trees[i.req.rid].parents.tolist()[:cap])
                for i, cap in zip(items, max_nodes)]

    def on_skipped(self, engine, items):
        self.calls.append(("skipped", [i.req.rid for i in items]))

    def on_verified(self, engine, items, emitted):
        self.calls.append(("verified", [i.req.rid for i in items]))

    def on_accepted(self, engine, items, trees, results):
        self.calls.append(("accepted", [i.req.rid for i in items]))

    def draft_cost(self, batch_size, max_nodes):
        return batch_size * max_nodes * 1e-3


def _item(rid: str, last: int):
    return SimpleNamespace(req=SimpleNamespace(rid=rid, last_id=last), new_slots=[])


def test_ngram_first_within_its_size_and_the_draft_model_for_the_rest():
    params = SpecParams("EAGLE3", 1, 1, 2, assist_nodes=3)
    drafter = Recorder(SpecParams("EAGLE3", 1, 1, 2), {r: chain([r_, 7]) for r, r_ in (("a", 1), ("b", 2), ("c", 3))},
                       follows_plain_steps=True)
    ngram = Recorder(SpecParams("NGRAM", 0, 0, 12), {"a": chain([1, 4, 5, 6, 7]), "b": root_only(2),
                                                     "c": chain([3, 8, 9])})
    assisted = NgramAssistedProposer(SimpleNamespace(params=params), drafter, ngram)
    items = [_item("a", 1), _item("b", 2), _item("c", 3)]
    trees = assisted.propose(None, items, [6, 6, 2])
    assert ngram.calls == [("propose", ["a", "b", "c"], [3, 3, 2])]          # the assist's size caps NGRAM
    assert drafter.calls == [("skipped", ["a", "c"]), ("propose", ["b"], [2])]  # the drafter's own N caps it
    assert [t.token_list() for t in trees] == [[1, 4, 5], [2, 7], [3, 8]]
    assert assisted.stats() == {"request_steps_drafted_by_ngram": 2}
    assert assisted.follows_plain_steps and not assisted.catches_up_lazily and not assisted.is_cheap
    assisted.on_verified(None, items, [[4], [7], [8]])
    assisted.on_accepted(None, items, trees, [])
    assert ngram.calls[-1] == ("verified", ["a", "b", "c"])                   # NGRAM's cache learns every token
    assert drafter.calls[-2:] == [("verified", ["a", "b", "c"]), ("accepted", ["a", "b", "c"])]
    assert assisted.draft_cost(4, 6) == drafter.draft_cost(4, 2) + ngram.draft_cost(4, 6)
