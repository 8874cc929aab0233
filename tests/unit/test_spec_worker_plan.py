"""The worker's plan for a cheap proposer: matching every request first (a small batch, where
that costs little) and cutting the trees to the policy's sizes afterwards gives the trees and
policy state that the policy-first order gives, including steps where nothing matched. One
difference: the probe credit's cap (PROBE_CREDIT_PROBES probes' worth) applies as soon as a due
request shows a tree, where the policy-first order, which does not match requests that cannot
probe, applies it at the next probe. (A plan of None is every request decoding plainly.)"""
from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import pytest

from specserve.speculative.base import Proposer, SpecWorker
from specserve.speculative.params import SpecParams
from specserve.speculative.policy import CostCurve, RequestPolicyState, SpecPolicy
from specserve.speculative.state import RequestSpecState
from specserve.speculative.tree import DraftTree, root_only, truncate_tree

N = 12


class PrefixProposer(Proposer):
    """Each request's full tree (fixed), cut to the cap: a cheap proposer's contract."""

    is_cheap = True
    catches_up_lazily = True

    def __init__(self, full_trees: dict[str, DraftTree]) -> None:
        self.full_trees = full_trees

    def propose(self, engine, items, max_nodes):
        return [truncate_tree(self.full_trees[item.req.rid], cap) for item, cap in zip(items, max_nodes)]

    def draft_cost(self, batch_size, max_nodes):
        return 1e-4 * batch_size


def _random_tree(rng, root: int) -> DraftTree:
    size = rng.choice([1, 1, 1, 2, 5, N])
    parents = [-1] + [rng.randrange(i) for i in range(1, size)]
    return DraftTree.from_lists([root] + [rng.randrange(100) for _ in range(size - 1)], parents)


def _random_step(rng, bs):
    items, trees = [], {}
    for i in range(bs):
        state = RequestPolicyState(accepted=rng.choice([0.0, 1.0, 5.0]), rejected=rng.choice([0.0, 1.0, 4.0]),
                                   backoff=rng.choice([0, 4]), num_skipped=rng.randrange(6))
        last = rng.randrange(100)
        req = SimpleNamespace(rid=f"r{i}", spec_state=RequestSpecState(policy=state), output_ids=[1] * 4 + [last],
                              last_id=last, input_ids=[1] * 10, seq_len=15,
                              sampling=SimpleNamespace(max_new_tokens=64))
        items.append(SimpleNamespace(req=req, new_slots=[i]))
        trees[req.rid] = _random_tree(rng, last)
    return items, trees


class TreeSlots:
    """The scheduler's ``extend_decode`` on an endless pool."""

    def extend_decode(self, item, num):
        item.new_slots.extend(range(100, 100 + num))
        return True


@pytest.mark.parametrize("seed", range(3))
def test_matching_first_plans_what_the_policy_first_order_plans(seed, monkeypatch):
    rng = random.Random(seed)
    engine = SimpleNamespace(context_len=4096, scheduler=TreeSlots())
    orders, credits = {True: 0, False: 0}, {}
    for trial in range(150):
        bs = rng.choice([1, 2, 4])
        items, full_trees = _random_step(rng, bs)
        curve = rng.choice([CostCurve([1, 4, 16], [5.0, 8.0, 20.0]), CostCurve([1, 16], [5.0, 5.5])])
        policy = SpecPolicy(curve, lambda k, n: 1e-4 * k, num_draft_tokens=N, is_always=rng.random() < 0.1)
        policy.probe_credit = rng.choice([0.0, float("inf")])
        plans = {}
        for first in (True, False):
            worker = SpecWorker(SpecParams("NGRAM", 0, 0, N), PrefixProposer(full_trees), copy.deepcopy(policy))
            monkeypatch.setattr(worker, "_proposing_first_is_cheap", lambda bs, n, first=first: first)
            step_items = copy.deepcopy(items)
            trees = worker._plan(engine, step_items) or [root_only(item.req.last_id) for item in step_items]
            assert [len(item.new_slots) for item in step_items] == [t.num_nodes for t in trees]
            plans[first] = ([(t.draft_tokens.tolist(), t.parents.tolist()) for t in trees],
                            {k: v for k, v in vars(worker.policy).items() if k not in ("cost", "probe_credit")},
                            [item.req.spec_state.policy for item in step_items])
            credits[first] = worker.policy.probe_credit
            orders[first] += any(not t.is_root_only for t in trees)
        assert plans[True] == plans[False], trial
        assert credits[True] <= credits[False], trial
    assert orders[True] > 10        # steps that drafted, not only steps where nothing matched


def test_a_busy_batch_weighs_before_matching():
    """Where matching every request would cost more than PROPOSE_FIRST_SHARE of a plain step,
    the policy's bounds come first (what keeps a busy server at plain speed)."""
    policy = SpecPolicy(CostCurve([1, 16], [5e-3, 30e-3]), lambda k, n: 1e-4 * k, num_draft_tokens=N)
    worker = SpecWorker(SpecParams("NGRAM", 0, 0, N), PrefixProposer({}), policy)
    assert worker._proposing_first_is_cheap(1, N)
    assert not worker._proposing_first_is_cheap(16, N)
