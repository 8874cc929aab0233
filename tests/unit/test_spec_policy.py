"""The speculation policy on synthetic cost curves."""
from __future__ import annotations

from specserve.spec.policy import (PROBE_MAX_BACKOFF, PROBE_NODES, CostCurve, RequestPolicyState, SpecPolicy,
                                   measure_cost_curve)

# memory-bound up to 16 tokens, then linear (a GPU-like curve, in ms)
FLAT_THEN_LINEAR = CostCurve([1, 16, 64, 256], [10.0, 11.0, 30.0, 110.0])
# compute-bound from the start (a CPU-like curve)
LINEAR = CostCurve([1, 4, 16, 64], [10.0, 20.0, 50.0, 170.0])


def _states(n, alpha):
    return [RequestPolicyState(alpha=alpha, backoff=10**6) for _ in range(n)]


def test_cost_curve_interpolates_and_extrapolates():
    assert FLAT_THEN_LINEAR(1) == 10.0 and FLAT_THEN_LINEAR(0.5) == 10.0
    assert abs(FLAT_THEN_LINEAR(40) - 20.5) < 1e-9
    assert abs(FLAT_THEN_LINEAR(512) - 216.66666) < 1e-3     # slope of the last segment
    assert CostCurve([2], [4.0])(8) == 16.0                   # one point: proportional


def test_speculates_when_small_batch_and_good_acceptance():
    policy = SpecPolicy(FLAT_THEN_LINEAR, lambda k: 0.0, num_draft_tokens=4)
    assert policy.select(_states(1, 3.0), [4]) == [4]
    assert policy.select(_states(4, 3.0), [4] * 4) == [4] * 4


def test_busy_server_falls_back_to_plain():
    policy = SpecPolicy(FLAT_THEN_LINEAR, lambda k: 0.0, num_draft_tokens=12)
    sizes = policy.select(_states(64, 2.0), [12] * 64)
    assert sizes.count(12) < 64 and set(sizes) <= {1, 12}
    assert policy.select(_states(256, 2.0), [12] * 256) == [1] * 256
    assert 0 < policy.max_batch_size(alpha=2.0) < 64


def test_compute_bound_needs_high_acceptance():
    policy = SpecPolicy(LINEAR, lambda k: 0.0, num_draft_tokens=4)
    assert policy.select(_states(1, 1.5), [4]) == [1]   # c(4) = 2 c(1) > 1.5 c(1)
    assert policy.select(_states(1, 3.0), [4]) == [4]


def test_best_requests_speculate_first():
    policy = SpecPolicy(LINEAR, lambda k: 0.0, num_draft_tokens=4)
    states = _states(4, 1.1)
    states[2].alpha = 4.0
    assert policy.select(states, [4] * 4) == [1, 1, 4, 1]


def test_draft_cost_counts():
    free = SpecPolicy(FLAT_THEN_LINEAR, lambda k: 0.0, num_draft_tokens=4)
    costly = SpecPolicy(FLAT_THEN_LINEAR, lambda k: 30.0 * k, num_draft_tokens=4)
    assert free.select(_states(1, 2.0), [4]) == [4]
    assert costly.select(_states(1, 2.0), [4]) == [1]


def test_root_only_trees_never_count():
    policy = SpecPolicy(FLAT_THEN_LINEAR, lambda k: 0.0, num_draft_tokens=4)
    assert policy.select(_states(2, 3.0), [1, 4]) == [1, 4]


def test_probe_backoff_doubles_and_caps(monkeypatch):
    import specserve.spec.policy as policy_module

    monkeypatch.setattr(policy_module, "PROBE_BUDGET", (1.0, 1.0))     # credit is never the limit here
    policy = SpecPolicy(LINEAR, lambda k: 0.0, num_draft_tokens=4)
    state = RequestPolicyState(alpha=1.0)
    sizes = [policy.select([state], [12])[0] for _ in range(300)]
    probes = [i for i, n in enumerate(sizes) if n > 1]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes[0] == 0 and gaps[:4] == [3, 5, 9, 17] and max(gaps) == PROBE_MAX_BACKOFF + 1
    assert {sizes[i] for i in probes} == {PROBE_NODES}       # probes use small trees


def test_probes_spend_a_bounded_share_of_step_time():
    from specserve.spec.policy import PROBE_BUDGET

    policy = SpecPolicy(CostCurve([1, 64, 256], [10.0, 11.0, 40.0]), lambda k: 0.0, num_draft_tokens=12)
    states = [RequestPolicyState(alpha=1.0) for _ in range(16)]
    extra = plain = 0.0
    for _ in range(2000):
        sizes = policy.select(states, [12] * 16)
        for state, n in zip(states, sizes):
            if n > 1:
                policy.observe(state, 1)                         # every probe fails
        base = policy.cost(16, 16, 1, 0)
        plain += base
        extra += policy.cost(16, sum(sizes), max(sizes), sum(n > 1 for n in sizes)) - base
    assert 0 < extra <= PROBE_BUDGET[0] * plain * 1.2       # failed probes drive the budget to its minimum


def test_step_cost_learns_scale_and_padding():
    policy = SpecPolicy(LINEAR, lambda k: 0.0, num_draft_tokens=12)
    for _ in range(100):
        policy.observe_step([1] * 16, 2 * LINEAR(16))                  # batches cost twice the curve
    assert abs(policy.cost.scale - 2.0) < 0.01
    for _ in range(100):
        policy.observe_step([12] + [1] * 15, 2 * LINEAR(27) + 15 * 11 * 0.5)
    assert abs(policy.cost.pad - 0.5) < 0.01
    assert abs(policy.cost(16, 27, 12, 1) - (2 * LINEAR(27) + 82.5)) < 0.1
    assert abs(policy.cost(1, 12, 12, 1) - 2 * LINEAR(12)) < 0.05     # one request: no padding


def test_no_probe_when_even_full_acceptance_cannot_pay():
    policy = SpecPolicy(LINEAR, lambda k: 1000.0, num_draft_tokens=4)
    state = RequestPolicyState(alpha=None)
    assert all(policy.select([state], [4])[0] == 1 for _ in range(100))


def test_observe_updates_request_and_global_estimates():
    policy = SpecPolicy(LINEAR, lambda k: 0.0, num_draft_tokens=4)
    state = RequestPolicyState()
    policy.observe(state, 4)
    assert state.alpha == 4.0 and policy.alpha > 2.0
    policy.observe(state, 1)
    assert 1.0 < state.alpha < 4.0


def test_fully_accepted_probe_raises_estimate_at_once():
    policy = SpecPolicy(LINEAR, lambda k: 0.0, num_draft_tokens=12)
    state = RequestPolicyState(alpha=1.0, backoff=32)
    policy.observe(state, 4, is_fully_accepted=True)
    assert state.alpha == 4.0 and state.backoff == 0
    policy.observe(state, 1)
    assert state.alpha < 4.0


def test_always_mode():
    policy = SpecPolicy(LINEAR, lambda k: 1e9, num_draft_tokens=4, is_always=True)
    assert policy.select(_states(3, 1.0), [4, 1, 2]) == [4, 1, 2]


def test_measure_cost_curve_is_monotone_and_respects_budget():
    calls = []

    def forward(width):
        calls.append(width)

    curve = measure_cost_curve(forward, [1, 16], [4, 64], budget_s=10.0)
    assert curve.widths == [1, 4, 16, 64] and curve.seconds == sorted(curve.seconds)
    calls.clear()
    curve = measure_cost_curve(forward, [1, 16], [4, 64], budget_s=0.0)
    assert curve.widths == [1, 16]
