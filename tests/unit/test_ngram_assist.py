"""The NGRAM assist's routing: NGRAM matches every request first, within the assist's tree size;
the draft model proposes only for the requests NGRAM had nothing for, within its own N, and
learns which requests it skipped; every hook after verification reaches the proposer it is for."""
from __future__ import annotations

import copy
from types import SimpleNamespace

from specserve.speculative.base import Proposer, SpecWorker
from specserve.speculative.ngram_assist import NgramAssistedProposer
from specserve.speculative.params import SpecParams
from specserve.speculative.policy import REQUEST_DECAY, CostCurve, RequestPolicyState, SpecPolicy
from specserve.speculative.state import RequestSpecState
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
        return batch_size * max_nodes * self.seconds_per_node

    seconds_per_node = 1e-3


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
    assert assisted.follows_plain_steps and not assisted.catches_up_lazily and not assisted.is_cheap
    assisted.on_verified(None, items, [[4], [7], [8]])
    assisted.on_accepted(None, items, trees, [])
    assert assisted.stats() == {"request_steps_drafted_by_ngram": 2}
    assert [assisted.tree_kind(item) for item in items] == ["ngram", "draft", "ngram"]
    assert ngram.calls[-1] == ("verified", ["a", "b", "c"])                   # NGRAM's cache learns every token
    assert drafter.calls[-2:] == [("verified", ["a", "b", "c"]), ("accepted", ["a", "b", "c"])]
    assert assisted.draft_cost(4, 6) == drafter.draft_cost(4, 2) + ngram.draft_cost(4, 3)


class TreeSlots:
    """The scheduler's ``extend_decode`` on an endless pool."""

    def extend_decode(self, item, num):
        item.new_slots.extend(range(100, 100 + num))
        return True


def _request(rid: str, last: int, kind: str, counts: dict[str, tuple[float, float]]):
    """A decoding request whose acceptance counts of each kind of tree are ``counts``, ``kind``'s active."""
    accepted, rejected = counts[kind]
    state = RequestPolicyState(accepted=accepted, rejected=rejected, kind=kind, backoff=64,   # no probe due
                               other_counts={k: v for k, v in counts.items() if k != kind})
    req = SimpleNamespace(rid=rid, last_id=last, output_ids=[1, last], input_ids=[1] * 10, seq_len=12,
                          sampling=SimpleNamespace(max_new_tokens=64), spec_state=RequestSpecState(policy=state))
    return SimpleNamespace(req=req, new_slots=[0])


def test_the_worker_weighs_ngrams_trees_and_the_draft_models_each_against_their_own_acceptance():
    """Planned in two parts: NGRAM's trees for every request first, at their real sizes; each request
    weighed with its counts of the kind of tree it would verify (``a`` accepts NGRAM's trees and not
    the head's, ``b`` and ``c`` the other way round: under the counts they held last, none would
    draft). ``c``'s NGRAM tree promises less than the head's chain: the head drafts for ``b`` and
    ``c``, and the counts of the kind each left aside decay. Verifying counts each kind apart."""
    params = SpecParams("EAGLE3", 1, 1, 2, assist_nodes=8)
    drafter = Recorder(SpecParams("EAGLE3", 1, 1, 2), {"b": chain([2, 7]), "c": chain([3, 9])},
                       follows_plain_steps=True)
    ngram = Recorder(SpecParams("NGRAM", 0, 0, 12), {"a": chain([1, 4, 5, 6]), "b": root_only(2),
                                                     "c": chain([3, 8, 8])})
    ngram.seconds_per_node = 1e-7                   # matching everyone first is cheap
    assisted = NgramAssistedProposer(SimpleNamespace(params=params), drafter, ngram)
    policy = SpecPolicy(CostCurve([1, 4, 16], [5e-3, 6e-3, 20e-3]), lambda k, n: 1e-4 * k, num_draft_tokens=8)
    worker = SpecWorker(params, assisted, policy)
    good, bad = (20.0, 0.0), (0.0, 20.0)
    items = [_request("a", 1, "draft", {"ngram": good, "draft": bad}),
             _request("b", 2, "ngram", {"ngram": bad, "draft": good}),
             _request("c", 3, "ngram", {"ngram": bad, "draft": good})]
    control = copy.deepcopy(policy).select([copy.deepcopy(i.req.spec_state.policy) for i in items],
                                           [4, 2, 3], [3, 1, 2])
    assert control == [1, 1, 1]
    engine = SimpleNamespace(context_len=4096, scheduler=TreeSlots())
    trees = worker._plan(engine, items)
    assert [t.token_list() for t in trees[1:]] == [[2, 7], [3, 9]]
    assert trees[0].num_nodes > 2 and trees[0].token_list() == [1, 4, 5, 6][:trees[0].num_nodes]  # sized by the policy
    assert drafter.calls == [("propose", ["b", "c"], [2, 2]), ("skipped", ["a"])]
    states = [item.req.spec_state.policy for item in items]
    assert [(s.kind, s.accepted, s.rejected) for s in states] == [("ngram", *good), ("draft", *good), ("draft", *good)]
    decayed = tuple(REQUEST_DECAY * n for n in bad)
    assert states[0].other_counts == {"draft": decayed} and states[2].other_counts == {"ngram": decayed}
    assert states[1].other_counts == {"ngram": bad}                            # b had no NGRAM tree
    worker._record(SimpleNamespace(stats=SimpleNamespace(spec_verify_ct=0, spec_accepted_tokens=0)),
                   [SimpleNamespace(req=SimpleNamespace(**vars(i.req), spec_verify_ct=0, spec_accepted_tokens=0))
                    for i in items], trees, [SimpleNamespace(accept_len=n) for n in (0, 1, 1)])
    assert states[0].kind == "ngram" and states[0].rejected > good[1]          # a's NGRAM tree failed
    assert [assisted.tree_kind(item) for item in items] == ["ngram", "draft", "draft"]
    assert states[2].kind == "draft" and states[2].accepted == REQUEST_DECAY * good[0] + 1   # c's chain
    assert states[2].other_counts == {"ngram": decayed}
    assisted.on_accepted(None, items, trees, [])
    assert assisted.stats() == {"request_steps_drafted_by_ngram": 1}           # a's alone


def test_a_requests_counts_of_each_kind_are_kept_apart():
    state = RequestPolicyState(accepted=3.0, rejected=1.0, num_skipped=2)
    state.use_counts_of("ngram")
    assert (state.accepted, state.rejected, state.has_history) == (0.0, 0.0, False)
    state.accepted = 5.0
    state.use_counts_of("ngram")
    assert state.accepted == 5.0
    state.use_counts_of("")
    assert (state.accepted, state.rejected, state.kind, state.num_skipped) == (3.0, 1.0, "", 2)
    assert state.other_counts == {"ngram": (5.0, 0.0)}


def test_the_global_figures_of_each_kind_are_kept_apart():
    """The head's chains failing everywhere pull down neither the rate a fresh request's NGRAM trees
    start from nor their calibration; a fresh request with both kinds on offer takes NGRAM's."""
    policy = SpecPolicy(CostCurve([1, 4, 16], [5e-3, 6e-3, 20e-3]), lambda k, n: 1e-4 * k, num_draft_tokens=8)
    for _ in range(30):
        chain, copier = RequestPolicyState(kind="draft", predicted=1.0), RequestPolicyState(kind="ngram", predicted=3.0)
        policy.observe(chain, 0, 1)
        policy.observe(copier, 3, 3)
    assert policy.figures("draft").rate < 0.1 and policy.figures("ngram").rate > 0.9
    assert policy.figures("ngram").calibration > 0.9 and policy.figures("draft").calibration < 0.1
    fresh = RequestPolicyState()
    assert policy.pick_kind(fresh, {"ngram": 3, "draft": 1}) == "ngram"
    assert policy.rate(fresh) > 0.9
    assert 0.1 < policy.global_rate < 0.9                               # the logs' figure pools both
