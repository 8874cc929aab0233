"""The speculation policy on synthetic cost curves."""
from __future__ import annotations

from specserve.speculative.policy import (KEEP_MARGIN, MARGIN, PROBE_MAX_BACKOFF, PROBE_NODES, CostCurve, KindFigures,
                                   RequestPolicyState, SpecPolicy, expected_tokens, measure_cost_curve)

# memory-bound up to 16 tokens, then linear (a GPU-like curve, in ms)
FLAT_THEN_LINEAR = CostCurve([1, 16, 64, 256], [10.0, 11.0, 30.0, 110.0])
# compute-bound from the start (a CPU-like curve)
LINEAR = CostCurve([1, 4, 16, 64], [10.0, 20.0, 50.0, 170.0])


def _state(rate, backoff=10**6):
    """A request with a long, confident history at acceptance ``rate`` per draft token."""
    return RequestPolicyState(accepted=100.0 * rate, rejected=100.0 * (1 - rate), backoff=backoff)


def _states(n, rate):
    return [_state(rate) for _ in range(n)]


def _random_requests(rng, bs, fresh_share=0.0):
    """``bs`` requests with random acceptance histories (with probability ``fresh_share`` a new
    one, no history yet), backoffs and skipped steps, and their tree caps (1, 4 or 12 nodes)."""
    def request():
        if fresh_share and rng.random() >= 1.0 - fresh_share:
            return RequestPolicyState(backoff=rng.choice([0, 4]))
        return _state(rng.random(), backoff=rng.choice([0, 4, 10**6]))

    states = [request() for _ in range(bs)]
    for state in states:
        state.num_skipped = rng.randrange(8)
        state.num_drafting_in_row = 0 if state.num_skipped else rng.choice([0, 1, 5])
    return states, [rng.choice([1, 4, 12]) for _ in range(bs)]


def test_cost_curve_interpolates_and_extrapolates():
    assert FLAT_THEN_LINEAR(1) == 10.0 and FLAT_THEN_LINEAR(0.5) == 10.0
    assert abs(FLAT_THEN_LINEAR(40) - 20.5) < 1e-9
    assert abs(FLAT_THEN_LINEAR(512) - 216.66666) < 1e-3     # slope of the last segment
    assert CostCurve([2], [4.0])(8) == 16.0                   # one point: proportional


def test_speculates_when_small_batch_and_good_acceptance():
    policy = SpecPolicy(FLAT_THEN_LINEAR, lambda k, n: 0.0, num_draft_tokens=4)
    assert policy.select(_states(1, 0.8), [4], [3]) == [4]
    assert policy.select(_states(4, 0.8), [4] * 4, [3] * 4) == [4] * 4


def test_busy_server_falls_back_to_plain():
    policy = SpecPolicy(FLAT_THEN_LINEAR, lambda k, n: 0.0, num_draft_tokens=12)
    sizes = policy.select(_states(64, 0.5), [12] * 64, [11] * 64)
    assert sizes.count(12) < 64 and set(sizes) <= {1, 12}
    assert policy.select(_states(256, 0.5), [12] * 256, [11] * 256) == [1] * 256
    assert 0 < policy.max_batch_size(alpha=2.0) < 64


def test_compute_bound_needs_high_acceptance():
    policy = SpecPolicy(LINEAR, lambda k, n: 0.0, num_draft_tokens=4)
    assert policy.select(_states(1, 0.3), [4], [3]) == [1]   # c(4) = 2 c(1) > 1.42 c(1)
    assert policy.select(_states(1, 0.8), [4], [3]) == [4]


def test_best_requests_speculate_first():
    policy = SpecPolicy(LINEAR, lambda k, n: 0.0, num_draft_tokens=4)
    states = _states(4, 0.05)
    states[2] = _state(0.95)
    assert policy.select(states, [4] * 4, [3] * 4) == [1, 1, 4, 1]


def test_draft_cost_counts():
    free = SpecPolicy(FLAT_THEN_LINEAR, lambda k, n: 0.0, num_draft_tokens=4)
    costly = SpecPolicy(FLAT_THEN_LINEAR, lambda k, n: 30.0 * k, num_draft_tokens=4)
    assert free.select(_states(1, 0.5), [4], [3]) == [4]
    assert costly.select(_states(1, 0.5), [4], [3]) == [1]


def test_root_only_trees_never_count():
    policy = SpecPolicy(FLAT_THEN_LINEAR, lambda k, n: 0.0, num_draft_tokens=4)
    assert policy.select(_states(2, 0.8), [1, 4], [0, 3]) == [1, 4]


def test_probe_backoff_doubles_and_caps(monkeypatch):
    import specserve.speculative.policy as policy_module

    monkeypatch.setattr(policy_module, "PROBE_BUDGET", (1.0, 1.0))     # credit is never the limit here
    policy = SpecPolicy(LINEAR, lambda k, n: 0.0, num_draft_tokens=4)
    state = _state(0.0, backoff=0)
    sizes = [policy.select([state], [12], [11])[0] for _ in range(300)]
    probes = [i for i, n in enumerate(sizes) if n > 1]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes[0] == 0 and gaps[:4] == [3, 5, 9, 17] and max(gaps) == PROBE_MAX_BACKOFF + 1
    assert {sizes[i] for i in probes} == {PROBE_NODES}       # probes use small trees


def test_probes_spend_a_bounded_share_of_step_time():
    from specserve.speculative.policy import PROBE_BUDGET

    policy = SpecPolicy(CostCurve([1, 256, 1024], [10.0, 10.5, 40.0]), lambda k, n: 0.0, num_draft_tokens=12)
    states = [_state(0.0, backoff=0) for _ in range(16)]
    extra = plain = 0.0
    for _ in range(2000):
        sizes = policy.select(states, [12] * 16, [11] * 16)
        for state, n in zip(states, sizes):
            if n > 1:
                policy.observe(state, 0, 3)                      # every probe fails
        base = policy.cost(16, 16, 1, 0)
        plain += base
        extra += policy.cost(16, sum(sizes), max(sizes), sum(n > 1 for n in sizes)) - base
    assert 0 < extra <= PROBE_BUDGET[0] * plain * 1.2       # failed probes drive the budget to its minimum


def test_step_cost_learns_scale_and_padding():
    policy = SpecPolicy(LINEAR, lambda k, n: 0.0, num_draft_tokens=12)
    for _ in range(100):
        policy.observe_step([1] * 16, 2 * LINEAR(16))                  # batches cost twice the curve
    assert abs(policy.cost.scale - 2.0) < 0.01
    for _ in range(100):
        policy.observe_step([12] + [1] * 15, 2 * LINEAR(27) + 15 * 11 * 0.5)
    assert abs(policy.cost.scale * policy.cost.pad - 0.5) < 0.01      # pad in the machine's time at startup
    assert abs(policy.cost(16, 27, 12, 1) - (2 * LINEAR(27) + 82.5)) < 0.1
    assert abs(policy.cost(1, 12, 12, 1) - 2 * LINEAR(12)) < 0.05     # one request: no padding


def test_no_probe_when_even_full_acceptance_cannot_pay():
    policy = SpecPolicy(LINEAR, lambda k, n: 1000.0, num_draft_tokens=4)
    state = RequestPolicyState()
    assert all(policy.select([state], [4], [3])[0] == 1 for _ in range(100))


def test_observe_updates_request_and_global_estimates():
    policy = SpecPolicy(LINEAR, lambda k, n: 0.0, num_draft_tokens=4)
    state = RequestPolicyState()
    prior = policy.rate(state)
    policy.observe(state, 3, 3)                       # fully accepted: 3 accepted, no rejection
    assert policy.rate(state) > prior and policy.global_rate > 0.5
    high = policy.rate(state)
    policy.observe(state, 0, 3)                       # rejected at once
    assert policy.rate(state) < high


def test_small_full_probe_does_not_jump_to_a_deep_tree():
    policy = SpecPolicy(LINEAR, lambda k, n: 0.0, num_draft_tokens=12)
    state = RequestPolicyState(accepted=0.3, rejected=3.0, backoff=32)   # recent rejections
    policy.observe(state, 3, 3)
    assert state.backoff == 0
    assert 1.2 < expected_tokens(policy.rate(state), 11) < 4.0


def test_calibration_corrects_optimistic_predictions():
    policy = SpecPolicy(FLAT_THEN_LINEAR, lambda k, n: 0.0, num_draft_tokens=12)
    states = [_state(0.9) for _ in range(4)]
    assert policy.select(states, [12] * 4, [11] * 4) == [12] * 4
    for _ in range(200):                         # the rate says ~6 extra tokens, reality gives 0
        policy.select(states, [12] * 4, [11] * 4)
        for state in states:
            policy.observe(state, 0, 1)          # (depth 1 trees: "fully" rejected, rate stays high)
            state.accepted, state.rejected = 90.0, 10.0
    assert policy.calibration < 0.1
    assert policy.select(states, [12] * 4, [11] * 4) == [1] * 4


def test_expected_tokens_geometric():
    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 5) == 6.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12


def test_always_mode():
    policy = SpecPolicy(LINEAR, lambda k, n: 1e9, num_draft_tokens=4, is_always=True)
    assert policy.select(_states(3, 0.0), [4, 1, 2], [3, 0, 1]) == [4, 1, 2]


def test_measure_cost_curve_is_monotone_and_respects_budget():
    calls = []

    def forward(width):
        calls.append(width)

    curve = measure_cost_curve(forward, [1, 16], [4, 64], budget_s=10.0)
    assert curve.widths == [1, 4, 16, 64] and curve.seconds == sorted(curve.seconds)
    calls.clear()
    curve = measure_cost_curve(forward, [1, 16], [4, 64], budget_s=0.0)
    assert curve.widths == [1, 16]


def test_may_pick_any_bounds_select():
    """Where the bound says no, ``select`` picks nobody on any trees within the caps (at most the
    first due request of ``probe_order`` with a real tree probes); where ``select`` picks someone,
    the bound said yes."""
    import copy
    import random

    rng = random.Random(0)
    num_no = 0
    for trial in range(300):
        bs = rng.choice([1, 2, 4, 8, 16, 32])
        curve = rng.choice([FLAT_THEN_LINEAR, LINEAR])
        policy = SpecPolicy(curve, lambda k, n: 0.0, num_draft_tokens=12, warm_steps=rng.choice([0, 3]))
        states, caps = _random_requests(rng, bs)
        nodes = [rng.randint(1, c) for c in caps]
        depths = [(n - 1 if rng.random() < 0.7 else rng.randint(1, n - 1)) if n > 1 else 0 for n in nodes]  # chains often
        is_possible = policy.may_pick_any(states, caps, [c - 1 for c in caps])
        sizes = copy.deepcopy(policy).select(copy.deepcopy(states), nodes, depths)
        picked = [i for i, n in enumerate(sizes) if n > 1]
        if not is_possible:
            num_no += 1
            probes = [i for i in policy.probe_order(states, caps) if nodes[i] > 1]
            assert picked in ([], probes[:1]), trial
    assert 50 < num_no < 300        # both answers occur


def test_select_told_nobody_can_be_picked_chooses_the_same():
    """``select(..., can_pick=False)`` (what ``_plan`` passes when ``may_pick_any`` said no) skips
    weighing the requests and gives the same sizes and leaves the same policy and request state,
    also with a drafting cost and a negative learned overhead (the step cost never drops below
    the forward, which keeps ``may_pick_any`` a bound)."""
    import copy
    import random

    rng = random.Random(1)
    num_no = 0
    for trial in range(300):
        bs = rng.choice([1, 2, 4, 16])
        draft_ms = rng.choice([0.0, 0.5, 3.0])
        policy = SpecPolicy(rng.choice([FLAT_THEN_LINEAR, LINEAR]), lambda k, n, d=draft_ms: d * k,
                            num_draft_tokens=12, warm_steps=rng.choice([0, 3]))
        policy.cost.overhead = rng.choice([0.0, -2.0, -50.0, 1.0])
        policy.probe_credit = rng.choice([0.0, 5.0, float("inf")])
        states, caps = _random_requests(rng, bs)
        depths = [c - 1 for c in caps]
        if policy.may_pick_any(states, caps, depths):
            continue
        num_no += 1
        told, told_states = copy.deepcopy(policy), copy.deepcopy(states)
        full, full_states = copy.deepcopy(policy), copy.deepcopy(states)
        assert told.select(told_states, caps, depths, can_pick=False) == full.select(full_states, caps, depths), trial
        assert {k: v for k, v in vars(told).items() if k != "cost"} == {k: v for k, v in vars(full).items() if k != "cost"}
        assert vars(told.cost) == vars(full.cost) and told_states == full_states, trial
    assert num_no > 50


def test_may_pick_any_small_batch_yes_busy_server_no():
    policy = SpecPolicy(FLAT_THEN_LINEAR, lambda k, n: 0.0, num_draft_tokens=12)
    assert policy.may_pick_any(_states(1, 0.8), [12], [11])
    assert not policy.may_pick_any(_states(256, 0.3), [12] * 256, [11] * 256)
    assert not policy.may_pick_any([RequestPolicyState()] * 4, [12] * 4, [11] * 4)   # no history yet
    step = SpecPolicy(CostCurve([1, 2, 16], [10.0, 20.0, 20.5]), lambda k, n: 0.0, num_draft_tokens=12)
    assert step.select(_states(1, 0.8), [12], [11]) == [12]   # only a deep tree pays: the bound sees depth
    assert step.may_pick_any(_states(1, 0.8), [12], [11])
    assert SpecPolicy(LINEAR, lambda k, n: 0.0, 12, is_always=True).may_pick_any(_states(64, 0.1), [12] * 64, [11] * 64)


def test_probe_order_longest_skipped_first():
    states = [_state(0.5, backoff=b) for b in (2, 2, 0, 5)]
    for s, skipped in zip(states, (3, 7, 7, 4)):
        s.num_skipped = skipped
    assert SpecPolicy.probe_order(states, [4, 4, 4, 4]) == [1, 2, 0]    # index 3 is not due yet
    assert SpecPolicy.probe_order(states, [4, 1, 4, 4]) == [2, 0]       # no room for a tree


def test_no_probe_where_even_a_fully_accepted_probe_would_not_make_the_tree_pay():
    """At 16 requests on a CPU-like curve a 12-node tree pays only for a request known to be
    very good; one 4-node probe cannot show that, so none is spent (a 1-request batch probes)."""
    policy = SpecPolicy(CostCurve([1, 16, 64], [14.3, 20.2, 40.8]), lambda k, n: 0.0, num_draft_tokens=12)
    states = [RequestPolicyState(backoff=0) for _ in range(16)]
    assert all(policy.select(states, [12] * 16, [11] * 16) == [1] * 16 for _ in range(50))
    assert policy.select([RequestPolicyState(backoff=0)], [12], [11]) == [PROBE_NODES]


def test_tree_size_follows_acceptance_where_verification_is_compute_bound():
    """Steep cost: a request that accepts a lot takes a deeper tree than one that accepts
    little; flat cost (memory-bound verification): both take the whole cap."""
    steep = SpecPolicy(LINEAR, lambda k, n: 0.0, num_draft_tokens=12)
    def chain_depth(num_nodes):
        return num_nodes - 1

    high = steep.preferred_nodes(_state(0.9), 12, 1, chain_depth)
    low = steep.preferred_nodes(_state(0.3), 12, 1, chain_depth)
    assert 2 <= low < high <= 12
    flat = SpecPolicy(CostCurve([1, 16], [10.0, 10.0]), lambda k, n: 0.0, num_draft_tokens=12)
    assert flat.preferred_nodes(_state(0.3), 12, 1, chain_depth) == 12
    assert steep.preferred_nodes(RequestPolicyState(), 12, 1, chain_depth) == 12   # no history: the cap


def test_step_cost_learns_the_overhead_of_speculative_steps():
    """One request whose speculative steps cost 12 ms more than the curve says: the policy learns
    it and stops speculating where the tokens no longer cover it."""
    policy = SpecPolicy(LINEAR, lambda k, n: 0.0, num_draft_tokens=4)
    states = _states(1, 0.6)
    assert policy.select(states, [4], [3]) == [4]                        # 2.18 tokens / 20 ms
    for _ in range(100):
        policy.observe_step([4], LINEAR(4) + 12.0)
    assert abs(policy.cost.overhead - 12.0) < 0.01
    assert abs(policy.cost(1, 4, 4, 1) - (LINEAR(4) + 12.0)) < 0.01
    assert policy.cost(1, 1, 1, 0) == LINEAR(1)                          # plain steps keep no overhead
    assert policy.select(states, [4], [3]) == [1]                        # 2.18 tokens / 32 ms < 1 / 10 ms
    for _ in range(100):
        policy.observe_step([12, 1], LINEAR(13) + 12.0 + 11 * 0.5)      # padded: the rest is padding
    assert abs(policy.cost.pad - 0.5) < 0.01


def test_may_probe_bounds_the_probe():
    """Where no request may be picked and ``may_probe`` says no, ``select`` leaves every request
    plain on any trees within the caps (so a cheap proposer need not match them); both answers
    occur, and the policy state it leaves is the one ``select`` leaves on root-only trees."""
    import copy
    import random

    rng = random.Random(1)
    answers = {True: 0, False: 0}
    for trial in range(400):
        bs = rng.choice([1, 2, 4, 8, 16, 32])
        curve = rng.choice([FLAT_THEN_LINEAR, LINEAR])
        draft_seconds = rng.choice([0.0, 5.0])
        policy = SpecPolicy(curve, lambda k, n: draft_seconds, num_draft_tokens=12)
        policy.probe_credit = rng.choice([0.0, 0.5, 5.0, float("inf")])
        policy.probe_success = rng.random()
        states, caps = _random_requests(rng, bs, fresh_share=0.5)
        depth_caps = [c - 1 for c in caps]
        if policy.may_pick_any(states, caps, depth_caps):
            continue
        may = policy.may_probe(states, caps, depth_caps)
        answers[may] += 1
        if may:
            continue
        nodes = [rng.randint(1, c) for c in caps]
        depths = [rng.randint(1, n - 1) if n > 1 else 0 for n in nodes]
        assert copy.deepcopy(policy).select(copy.deepcopy(states), nodes, depths) == [1] * bs, trial
    assert answers[True] > 20 and answers[False] > 20, answers


def test_busy_server_probes_rarely_and_says_so_in_advance():
    """16 new requests on a curve where a fully accepted deep tree would pay: the first probe is
    taken, it fails, and from then on ``may_probe`` tells the proposer in advance that no probe
    will be (select agrees: the root-only trees it then gets are what it would pick)."""
    policy = SpecPolicy(CostCurve([1, 256, 1024], [10.0, 16.0, 60.0]), lambda k, n: 0.0, num_draft_tokens=12)
    states = [RequestPolicyState(backoff=0) for _ in range(16)]
    gated = probes = 0
    for _ in range(500):
        assert not policy.may_pick_any(states, [12] * 16, [11] * 16)
        if not policy.may_probe(states, [12] * 16, [11] * 16):
            gated += 1
            assert policy.select(states, [1] * 16, [0] * 16) == [1] * 16
            continue
        sizes = policy.select(states, [12] * 16, [11] * 16)
        for state, n in zip(states, sizes):
            if n > 1:
                probes += 1
                policy.observe(state, 0, 3)
    assert probes >= 1 and gated > 400, (probes, gated)


def test_measure_cost_curve_is_not_skewed_by_a_slow_spell(monkeypatch):
    """A machine three times slower for the first few forwards: one width timed after another,
    the spell would fall on the narrow widths only and flatten the curve; timed in rounds, every
    width keeps a clean run. (A fake clock that each forward advances by width ms.)"""
    from specserve.speculative import policy as policy_module

    clock = {"now": 0.0, "calls": 0}

    def forward(width):
        clock["calls"] += 1
        clock["now"] += width * 1e-3 * (3.0 if 2 <= clock["calls"] <= 5 else 1.0)

    monkeypatch.setattr(policy_module.time, "perf_counter", lambda: clock["now"])
    curve = measure_cost_curve(forward, [1, 3, 4, 16], [8], budget_s=10.0)
    assert curve.widths == [1, 3, 4, 8, 16]
    assert [round(t * 1e3, 6) for t in curve.seconds] == [1.0, 3.0, 4.0, 8.0, 16.0]


def test_a_chain_that_drafts_per_token_is_kept_short():
    """Drafting that costs a share of a step per drafted token (a chain drafts only the tokens
    its tree keeps: d(k, n) grows with n) makes a request accepting 0.6 take a shorter chain
    than free drafting does."""
    chain_depth = lambda n: n - 1    # noqa: E731
    free = SpecPolicy(CostCurve([1, 16], [10.0, 11.0]), lambda k, n: 0.0, num_draft_tokens=8)
    per_token = SpecPolicy(CostCurve([1, 16], [10.0, 11.0]), lambda k, n: 2.0 * k * (n - 1), num_draft_tokens=8)
    assert free.preferred_nodes(_state(0.6), 8, 1, chain_depth) == 8
    assert 2 <= per_token.preferred_nodes(_state(0.6), 8, 1, chain_depth) < 8
    assert per_token.cost(1, 3, 3, 1) - per_token.cost(1, 2, 2, 1) > 2.0       # the drafting of one more token


def test_a_requests_first_probe_is_not_charged():
    """Earlier requests spent the probe credit: a new request still probes once (an NGRAM
    request whose answer starts copying only after many steps), its later probes wait for
    credit again."""
    policy = SpecPolicy(LINEAR, lambda k, n: 0.0, num_draft_tokens=4)
    policy.probe_credit = 0.0
    new = RequestPolicyState()
    assert policy.may_probe([new], [4], [3])
    assert policy.select([new], [4], [3]) == [PROBE_NODES]
    policy.observe(new, 0, 3)                                # rejected: now it has a history
    assert [policy.select([new], [4], [3])[0] for _ in range(20)] == [1] * 20
    assert not policy.may_probe([new], [4], [3])


def test_a_draft_models_first_steps_after_plain_ones_teach_no_overhead(monkeypatch):
    """A draft model's first steps after plain ones (probes) cost one-off extras, such as weights
    that went cold: with ``warm_steps``, their time does not become the overhead of speculating,
    which would keep the policy declining a draft that pays once it drafts every step. A request
    that keeps drafting teaches it from its (warm_steps + 1)-th step in a row."""
    import specserve.speculative.policy as policy_module

    monkeypatch.setattr(policy_module, "PROBE_BUDGET", (1.0, 1.0))     # credit is never the limit here
    policy = SpecPolicy(LINEAR, lambda k, n: 0.0, num_draft_tokens=4, warm_steps=2)
    state = _state(0.0, backoff=0)
    probes = 0
    for _ in range(300):
        sizes = policy.select([state], [4], [3])
        probes += sizes[0] > 1
        policy.observe_step(sizes, LINEAR(sum(sizes)) + (20.0 if sizes[0] > 1 else 0.0))
        if sizes[0] > 1:
            policy.observe(state, 0, 3)
    assert probes > 5 and policy.cost.overhead == 0.0
    kept = _state(0.9)
    for step in range(4):
        assert policy.select([kept], [4], [3]) == [4] and policy.last_step_is_warm == (step >= 2)
        policy.observe_step([4], LINEAR(4) + 3.0)
    assert 0.0 < policy.cost.overhead < 3.0
    without = SpecPolicy(LINEAR, lambda k, n: 0.0, num_draft_tokens=4)       # NGRAM: every step teaches
    assert without.select([_state(0.9)], [4], [3]) == [4] and without.last_step_is_warm


def test_a_draft_models_request_keeps_drafting_within_the_margin():
    """Starting to draft needs MARGIN above plain decoding; a draft model's request that drafted
    the last step goes on while it comes within KEEP_MARGIN of it (stopping and starting again
    costs a catch-up and a cold draft). Without a draft model (NGRAM) both need MARGIN above."""
    curve = CostCurve([1, 2], [10.0, 10.0])            # a 2-node verify costs a plain step
    for rate, starts, keeps in ((MARGIN + 0.03, True, True), (0.0, False, True),
                                (-KEEP_MARGIN + 0.03, False, True), (-KEEP_MARGIN - 0.03, False, False)):
        tokens = 1.0 + 0.5                               # alpha of a request at acceptance 0.5, depth 1
        seconds = tokens * 10.0 / (1.0 + rate)           # so its tokens a ms are (1 + rate) x plain decoding's
        for warm_steps, expect_keep in ((3, keeps), (0, starts)):
            policy = SpecPolicy(curve, lambda k, n, d=seconds - 10.0: d, num_draft_tokens=2, warm_steps=warm_steps)
            state = _state(0.5)
            assert policy.select([state], [2], [1]) == ([2] if starts else [1]), (rate, warm_steps)
            state.num_drafting_in_row = 1
            assert policy.select([state], [2], [1]) == ([2] if expect_keep else [1]), (rate, warm_steps)


def test_probe_judges_the_tree_at_its_best_size():
    """Where wide verifies cost much, a fully accepted probe cannot make a 12-node tree pay but
    makes a 4-node one pay (the size ``preferred_nodes`` would then give it): the probe runs."""
    steep = CostCurve([1, 2, 4, 16], [10.0, 11.0, 13.0, 80.0])
    policy = SpecPolicy(steep, lambda k, n: 0.0, num_draft_tokens=12)
    state = RequestPolicyState(accepted=0.5, rejected=2.0, backoff=0)
    hopeful = 1.0 + 0.8 + 0.8 ** 2 + 0.8 ** 3                 # a 4-node chain at the probe's best case
    assert hopeful / steep(4) > 1.05 / steep(1) > expected_tokens(0.8, 11) / steep(12)
    assert policy.select([state], [12], [11]) == [PROBE_NODES]


def test_may_probe_bounds_a_probe_that_only_a_two_node_tree_pays_for():
    """After a fully accepted 4-node probe only a 2-node tree pays on this curve: ``select``
    probes, so ``may_probe`` must not say no (it once judged 2-node trees by a 2-node probe)."""
    curve = CostCurve([1, 2, 3, 4, 16], [10.0, 16.5, 23.0, 29.0, 200.0])
    policy = SpecPolicy(curve, lambda k, n: 0.0, num_draft_tokens=12)
    state = RequestPolicyState(accepted=0.5, rejected=2.0, backoff=0)
    assert not policy.may_pick_any([state], [12], [11])
    assert policy.may_probe([state], [12], [11])
    assert policy.select([state], [12], [11]) == [PROBE_NODES]


def test_the_probe_goes_to_probe_orders_first_request_not_drafting():
    """``_probe``'s one-pass choice is ``probe_order``'s first request whose size is still 1."""
    import random

    rng = random.Random(5)
    for trial in range(500):
        bs = rng.choice([1, 2, 4, 16])
        states, caps = _random_requests(rng, bs, fresh_share=0.3)
        sizes = [rng.choice([1, 1, cap]) for cap in caps]
        expected = next((i for i in SpecPolicy.probe_order(states, caps) if sizes[i] == 1), None)
        assert SpecPolicy._first_due(states, caps, sizes) == expected, trial


def test_a_step_with_nothing_to_draft_updates_the_policy_as_weighing_would():
    """``select`` on root-only trees skips the weighing (most NGRAM steps of a chat answer): its
    sizes and every update it makes (skipped steps, predictions, the picked share, the probe
    credit) are what the full weighing gives, in either mode and whatever ``can_pick`` says."""
    import copy
    import random

    rng = random.Random(3)
    for trial in range(300):
        bs = rng.choice([1, 2, 4, 16])
        policy = SpecPolicy(rng.choice([FLAT_THEN_LINEAR, LINEAR]), lambda k, n: 0.5, num_draft_tokens=12,
                            is_always=rng.random() < 0.2)
        policy.probe_credit = rng.choice([0.0, 0.5, float("inf")])
        policy.picked_share = rng.random()
        states, _ = _random_requests(rng, bs, fresh_share=0.3)
        fast_policy, fast_states = copy.deepcopy(policy), copy.deepcopy(states)
        can_pick = rng.random() < 0.5
        assert fast_policy.select(fast_states, [1] * bs, [0] * bs, can_pick) == [1] * bs
        assert policy._weigh(states, [1] * bs, [0] * bs, can_pick) == [1] * bs
        assert vars(fast_policy).keys() == vars(policy).keys()
        for name, value in vars(policy).items():
            if name != "cost":
                assert getattr(fast_policy, name) == value, (trial, name)
        assert fast_states == states, trial


# a CPU's verify curve in plain steps (W=1..8, 2-core AVX-512 Xeon, `bench verify-cost`)
CPU_CURVE = CostCurve([1, 2, 3, 4, 8], [1.0, 1.12, 1.27, 1.39, 2.12])


def test_a_fresh_request_probes_where_earlier_requests_pulled_the_estimates_down():
    """Chat requests left the global rate at 0.2 and the calibration at 0.6: a fresh request is
    still probed (judged by the neutral prior, the better of the two here), while one whose own
    probe failed waits for credit."""
    policy = SpecPolicy(CPU_CURVE, lambda k, n: 0.2, num_draft_tokens=2, warm_steps=2)
    policy.kinds[""] = KindFigures(accepted=0.2 * 20, rejected=0.8 * 20, realized_extra=6.0, predicted_extra=10.0)
    policy.probe_credit = 0.0
    fresh = RequestPolicyState()
    assert policy.may_probe([fresh], [2], [1])
    assert policy.select([fresh], [2], [1]) == [2]
    policy.observe(fresh, 0, 1)
    assert [policy.select([fresh], [2], [1])[0] for _ in range(20)] == [1] * 20


def _replay(policy, rates, rng, steps_per_request=100, step_seconds=1.4):
    """Requests in turn, one at a time, each ``steps_per_request`` decode steps with a (1,1,2)
    chain accepted with probability ``rates[i]``: the share of each request's steps that drafted."""
    shares = []
    for rate in rates:
        state, drafted = RequestPolicyState(), 0
        for _ in range(steps_per_request):
            can_pick = policy.may_pick_any([state], [2], [1])
            sizes = policy.select([state], [2], [1], can_pick)
            if sizes[0] > 1:
                drafted += 1
                policy.observe(state, int(rng.random() < rate), 1)
            policy.observe_step(sizes, step_seconds if sizes[0] > 1 else 1.0)
        shares.append(drafted / steps_per_request)
    return shares


def test_requests_that_accept_well_draft_after_a_stretch_that_did_not():
    """Eight chat-like requests (acceptance 0.3, where drafting does not pay) and then eight
    math-like ones (0.7, where it pays by ~20%): the math requests draft most of their steps
    (the global estimates the chat ones left behind once kept every later request plain)."""
    import random

    policy = SpecPolicy(CPU_CURVE, lambda k, n: 0.2, num_draft_tokens=2, warm_steps=2)
    shares = _replay(policy, [0.3] * 8 + [0.7] * 8, random.Random(0))
    assert sum(shares[:8]) / 8 < 0.3, shares
    assert sum(shares[8:]) / 8 > 0.5, shares


def test_step_cost_learns_a_plain_steps_host_work_beside_its_forward():
    """Steps reported with their forward's time, on a machine twice as slow as at startup:
    ``scale`` from the forwards, ``host`` from what a plain step spends outside it (in the
    startup machine's time, as the draft's), and every estimate carries ``host``."""
    policy = SpecPolicy(LINEAR, lambda k, n: 1.0, num_draft_tokens=4)
    for _ in range(100):
        policy.observe_step([1], 2 * LINEAR(1) + 3.0, 2 * LINEAR(1))
    assert abs(policy.cost.scale - 2.0) < 0.01 and abs(policy.cost.host - 1.5) < 0.01
    assert abs(policy.cost(1, 1, 1, 0) - (2 * LINEAR(1) + 3.0)) < 0.01
    assert abs(policy.cost(1, 4, 4, 1) - (2 * LINEAR(4) + 3.0 + 2 * 1.0)) < 0.01


def test_a_slow_spell_while_every_request_drafts_moves_the_scale_not_the_overhead():
    """The machine runs 1.6x slower while the only request drafts every step (its steps: the
    forward, a plain step's host work, the draft and 2 ms more, all 1.6x): reported with its
    forward, the spell moves ``scale`` and ``overhead`` stays 2 ms; reported as one figure, the
    spell went into ``overhead`` (where, once the request stopped drafting, it stayed)."""
    def slow_drafting_steps(policy, with_forward):
        for _ in range(100):
            policy.observe_step([1], LINEAR(1) + 1.0, LINEAR(1) if with_forward else None)
        for _ in range(100):
            forward = 1.6 * LINEAR(4)
            policy.observe_step([4], forward + 1.6 * (1.0 + 1.0 + 2.0), forward if with_forward else None)
        return policy.cost

    split = slow_drafting_steps(SpecPolicy(LINEAR, lambda k, n: 1.0, num_draft_tokens=4), True)
    assert abs(split.scale - 1.6) < 0.01 and abs(split.overhead - 2.0) < 0.05
    whole = slow_drafting_steps(SpecPolicy(LINEAR, lambda k, n: 1.0, num_draft_tokens=4), False)
    assert abs(whole.scale - (LINEAR(1) + 1.0) / LINEAR(1)) < 0.01          # the plain steps' alone
    assert whole.overhead > split.overhead + 0.4 * LINEAR(4)
