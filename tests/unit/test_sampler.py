"""Sampler: greedy, temperature, top-k/top-p/min-p, penalties, draws, logprobs.

References are written as plain per-row loops, independent of the batched code.
"""
from __future__ import annotations

import math

import pytest
import torch

from specserve.core import Request, SamplingParams
from specserve.runner.sampler import (
    PenaltyState,
    SamplingBatch,
    apply_penalties,
    argmax_rows,
    compute_logprobs,
    is_plain_greedy,
    processed_probs,
    sample,
    sample_requests,
)

VOCAB = 64


# ---------------------------------------------------------------- references


def reference_probs(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row, the documented semantics, spelled out with Python loops."""
    vocab = logits_row.shape[0]
    if params.is_greedy:
        probs = torch.zeros(vocab, dtype=torch.float64)
        probs[int(torch.argmax(logits_row))] = 1.0
        return probs
    probs32 = torch.softmax(logits_row.float() / params.temperature, dim=-1)
    probs = [float(p) for p in probs32]
    ranked = sorted(probs, reverse=True)
    top_k = vocab if params.top_k < 1 else min(params.top_k, vocab)
    threshold = ranked[top_k - 1] if top_k < vocab else 0.0
    if params.top_p < 1.0:
        top_k_set = [p for p in ranked if p >= threshold]
        nucleus = params.top_p * sum(top_k_set)
        mass_before, last_kept = 0.0, top_k_set[0]
        for p in top_k_set:
            if mass_before < nucleus:
                last_kept = p
            mass_before += p
        threshold = max(threshold, last_kept)
    threshold = max(threshold, params.min_p * ranked[0])
    kept = torch.tensor([p if p >= threshold else 0.0 for p in probs], dtype=torch.float64)
    return kept / kept.sum()


def reference_penalties(
    logits_row: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    out = logits_row.double().clone()
    for token in set(prompt) | set(output):
        value = out[token]
        rep = params.repetition_penalty
        out[token] = value / rep if value > 0 else value * rep
    for token in set(output):
        out[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return out


def chi_square_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit over the categories with expected mass."""
    n = observed.sum().double()
    support = expected_probs > 0
    expected = expected_probs[support].double() * n
    stat = ((observed[support].double() - expected) ** 2 / expected).sum()
    dof = torch.tensor(int(support.sum()) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def make_batch(params: list[SamplingParams], vocab: int = VOCAB, **kwargs) -> SamplingBatch:
    return SamplingBatch.from_params(params, "cpu", vocab, **kwargs)


def same_history_penalties(
    params: list[SamplingParams], prompt: list[int], output: list[int], vocab: int
) -> PenaltyState | None:
    rows = len(params)
    return PenaltyState.from_histories(params, [prompt] * rows, [output] * rows, "cpu", vocab)


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


# ---------------------------------------------------------------- greedy


def test_all_greedy_is_argmax():
    logits = random_logits(9)
    batch = make_batch([SamplingParams(temperature=0.0)] * 9)
    assert batch.is_all_greedy and not batch.need_top_p_k_min_p
    assert torch.equal(sample(logits, batch), torch.argmax(logits, dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_equals_torch_argmax_with_ties_and_nans(dtype):
    values = torch.randint(-3, 4, (64, 257)).to(dtype)             # many ties: the first maximum
    values[5, 17] = values[9, 200] = values[9, 3] = float("nan")     # a NaN counts as the largest
    values[7] = float("-inf")
    values[11] = torch.tensor(0.0).to(dtype)                         # +0 ties with -0 below
    values[11, :100] = -0.0
    expected = torch.tensor([int(row.argmax()) for row in values])  # torch's, one row at a time
    assert argmax_rows(values).tolist() == expected.tolist()
    assert argmax_rows(values.t().contiguous().t()).tolist() == expected.tolist()   # strided rows


def test_greedy_rows_in_mixed_batch_and_bf16():
    logits = random_logits(6).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=1),  # top_k == 1 is greedy
        SamplingParams(temperature=1.2, top_p=0.5),
        SamplingParams(temperature=0.0, top_p=0.3, top_k=5),
        SamplingParams(temperature=1.0, min_p=0.2),
    ]
    tokens = sample(logits, make_batch(params))
    argmax = torch.argmax(logits.float(), dim=-1)
    for row in (0, 2, 4):
        assert tokens[row] == argmax[row]
    probs = processed_probs(logits, make_batch(params))
    assert torch.equal(probs[0], torch.nn.functional.one_hot(argmax[0], VOCAB).float())


def test_greedy_uses_penalized_logits():
    logits = torch.zeros(1, 8)
    logits[0, 3], logits[0, 5] = 2.0, 1.5
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    penalties = PenaltyState.from_histories(params, [[3]], [[]], "cpu", 8)
    batch = make_batch(params, vocab=8, penalties=penalties)
    assert sample(logits, batch).tolist() == [5]


# ---------------------------------------------------------------- distribution


def test_temperature_scaling():
    logits = random_logits(3)
    temperatures = [0.3, 1.0, 2.5]
    batch = make_batch([SamplingParams(temperature=t) for t in temperatures])
    probs = processed_probs(logits, batch)
    for row, t in enumerate(temperatures):
        assert torch.allclose(probs[row], torch.softmax(logits[row] / t, dim=-1), atol=1e-7)


def test_disabled_filters_leave_rows_unchanged():
    logits = random_logits(2)
    params = [
        SamplingParams(temperature=0.8, top_p=1.0, top_k=-1, min_p=0.0),
        SamplingParams(temperature=0.8, top_k=VOCAB),
    ]
    expected = torch.softmax(logits / 0.8, dim=-1)
    assert torch.equal(processed_probs(logits, make_batch(params)), expected)
    # Still bit-for-bit unchanged when another row forces the filtering path.
    mixed = params + [SamplingParams(temperature=0.8, top_p=0.5, top_k=7, min_p=0.1)]
    probs = processed_probs(random_logits(3), make_batch(mixed))
    assert torch.equal(probs[:2], torch.softmax(random_logits(3)[:2] / 0.8, dim=-1))


FILTER_CASES = [
    dict(top_k=5),
    dict(top_k=1000),
    dict(top_p=0.6),
    dict(top_p=0.95),
    dict(min_p=0.05),
    dict(top_k=10, top_p=0.7),
    dict(top_k=20, top_p=0.9, min_p=0.02),
    dict(top_p=0.3, min_p=0.5),
]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_filters_match_reference(temperature: float):
    logits = random_logits(len(FILTER_CASES), seed=int(temperature * 10))
    params = [SamplingParams(temperature=temperature, **case) for case in FILTER_CASES]
    probs = processed_probs(logits, make_batch(params))
    for row, p in enumerate(params):
        expected = reference_probs(logits[row], p)
        assert torch.equal(probs[row] > 0, expected > 0), (row, p)
        assert torch.allclose(probs[row].double(), expected, atol=1e-6), (row, p)
    assert torch.allclose(probs.sum(dim=-1), torch.ones(len(params)), atol=1e-5)


# From flat (nucleus wider than every candidate set, full sort) to peaked.
@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])
def test_top_p_over_large_vocab_matches_reference(scale: float):
    vocab = 6000
    logits = random_logits(4, vocab=vocab, seed=3, scale=scale)
    params = [
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=2000, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=40),
        SamplingParams(temperature=1.0),
    ]
    probs = processed_probs(logits, make_batch(params, vocab=vocab))
    for row, p in enumerate(params):
        alone = processed_probs(logits[row : row + 1], make_batch([p], vocab=vocab))[0]
        expected = reference_probs(logits[row], p)
        for got in (probs[row], alone):  # other rows change how many candidates are ranked
            assert torch.equal(got > 0, expected > 0), (row, p)
            assert torch.allclose(got.double(), expected, atol=1e-6)


def test_hand_built_batch_matches_from_params():
    logits = random_logits(len(FILTER_CASES), seed=5)
    params = [SamplingParams(temperature=0.8, **case) for case in FILTER_CASES]
    planned = make_batch(params)
    hand_built = SamplingBatch(
        temperatures=planned.temperatures, top_ps=planned.top_ps, top_ks=planned.top_ks,
        min_ps=planned.min_ps, is_all_greedy=False, need_top_p_k_min_p=True,
        generators=[None] * len(params),
    )
    assert torch.allclose(processed_probs(logits, hand_built), processed_probs(logits, planned))


def test_ties_at_the_top_k_and_top_p_boundary_are_kept():
    logits = torch.tensor([[3.0, 3.0, 3.0, 1.0, 0.0, -1.0, 3.0, 0.5]])
    for params in (SamplingParams(top_k=2), SamplingParams(top_p=0.3)):
        probs = processed_probs(logits, make_batch([params], vocab=8))[0]
        assert (probs > 0).tolist() == [True, True, True, False, False, False, True, False]
        assert torch.allclose(probs[probs > 0], torch.full((4,), 0.25))


def test_processed_probs_sum_to_one():
    logits = random_logits(len(FILTER_CASES) + 2, seed=9)
    params = [SamplingParams(temperature=0.9, **c) for c in FILTER_CASES]
    params += [SamplingParams(temperature=0.0), SamplingParams(frequency_penalty=1.0)]
    penalties = same_history_penalties(params, prompt=[1], output=[2, 2], vocab=VOCAB)
    probs = processed_probs(logits, make_batch(params, penalties=penalties))
    assert torch.allclose(probs.sum(dim=-1), torch.ones(len(params)), atol=1e-5)
    assert (probs >= 0).all()


# ---------------------------------------------------------------- penalties


def test_penalties_match_reference():
    logits = random_logits(5, seed=4)
    params = [
        SamplingParams(frequency_penalty=0.7),
        SamplingParams(presence_penalty=-0.4, repetition_penalty=1.3),
        SamplingParams(),  # no penalty: untouched
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=1.1),
        SamplingParams(repetition_penalty=1.5),
    ]
    prompts = [[1, 2, 3], [4, 4, 5], [6], [7, 8, 9, 9], [10, 11]]
    outputs = [[2, 2, 12], [5, 13, 13, 13], [6, 6], [9, 14], []]
    penalties = PenaltyState.from_histories(params, prompts, outputs, "cpu", VOCAB)
    assert penalties is not None
    penalized = apply_penalties(logits, penalties)
    for row, p in enumerate(params):
        expected = reference_penalties(logits[row], p, prompts[row], outputs[row])
        assert torch.allclose(penalized[row].double(), expected, atol=1e-5), row
    assert torch.equal(penalized[2], logits[2])


def test_penalty_state_is_none_without_penalties():
    params = [SamplingParams(), SamplingParams(temperature=0.0)]
    assert PenaltyState.from_histories(params, [[1], [2]], [[3], [4]], "cpu", VOCAB) is None
    assert apply_penalties(torch.ones(2, 4), None).dtype == torch.float32


def test_from_requests_repeats_rows_and_counts_draft_ancestors():
    sampling = SamplingParams(frequency_penalty=1.0)
    generator = torch.Generator().manual_seed(5)
    first = Request("a", [1, 2], sampling, output_ids=[3], generator=generator)
    second = Request("b", [4], SamplingParams(temperature=0.0))
    batch = SamplingBatch.from_requests(
        [first, second], "cpu", VOCAB, rows_per_request=[2, 1], draft_ids_per_row=[[], [3], []]
    )
    assert batch.num_rows == 3 and batch.generators == [generator, generator, None]
    penalized = apply_penalties(torch.zeros(3, VOCAB), batch.penalties)
    assert penalized[:, 3].tolist() == [-1.0, -2.0, 0.0]
    assert penalized.count_nonzero() == 2


def test_out_of_range_history_token_is_rejected():
    params = [SamplingParams(presence_penalty=1.0)]
    with pytest.raises(ValueError, match="out of range"):
        PenaltyState.from_histories(params, [[0]], [[VOCAB]], "cpu", VOCAB)


# ---------------------------------------------------------------- draws


def test_sample_draws_from_processed_probs():
    vocab, num_draws = 12, 20_000
    logits = random_logits(1, vocab=vocab, seed=11, scale=1.5)
    params = SamplingParams(temperature=0.9, top_k=9, top_p=0.92, min_p=0.03)
    target = processed_probs(logits, make_batch([params], vocab=vocab))[0]
    assert 3 <= int((target > 0).sum()) < vocab
    torch.manual_seed(1234)
    tokens = sample(logits.expand(num_draws, vocab), make_batch([params] * num_draws, vocab=vocab))
    observed = torch.bincount(tokens, minlength=vocab)
    assert observed[target == 0].sum() == 0
    assert chi_square_pvalue(observed, target) > 0.001


def test_seeded_draws_follow_processed_probs():
    vocab, num_draws = 10, 20_000
    logits = random_logits(1, vocab=vocab, seed=12, scale=1.0)
    params = SamplingParams(temperature=1.3, presence_penalty=0.5)
    one_row = make_batch(
        [params], vocab=vocab, penalties=same_history_penalties([params], [0], [1], vocab)
    )
    target = processed_probs(logits, one_row)[0]
    generator = torch.Generator().manual_seed(99)  # one seeded request owning every row
    many_rows = make_batch(
        [params] * num_draws,
        vocab=vocab,
        penalties=same_history_penalties([params] * num_draws, [0], [1], vocab),
        generators=[generator] * num_draws,
    )
    observed = torch.bincount(sample(logits.expand(num_draws, vocab), many_rows), minlength=vocab)
    assert chi_square_pvalue(observed, target) > 0.001


def _seeded_tokens(
    logits_row: torch.Tensor, params: SamplingParams, others: list, position: int
) -> list[int]:
    """20 draws of a seeded row put at ``position`` among ``others`` (params, logits, generator)."""
    vocab = logits_row.shape[0]
    generator = torch.Generator().manual_seed(2024)
    tokens = []
    for _ in range(20):
        rows = list(others)
        rows.insert(position, (params, logits_row, generator))
        batch = make_batch([r[0] for r in rows], vocab=vocab, generators=[r[2] for r in rows])
        logits = torch.stack([r[1] for r in rows])
        tokens.append(int(sample(logits, batch)[position]))
    return tokens


def test_seeded_tokens_do_not_depend_on_the_batch():
    vocab = 3000
    logits = random_logits(4, vocab=vocab, seed=21, scale=0.3)
    ours = SamplingParams(temperature=1.5, top_k=300, top_p=0.95, min_p=0.001)
    alone = _seeded_tokens(logits[0], ours, [], 0)
    crowd = [
        (SamplingParams(temperature=1.0), logits[2], None),
        # Flat open nucleus: this batch ranks more candidates, then sorts the whole vocabulary.
        (SamplingParams(temperature=0.7, top_p=0.99), logits[1], torch.Generator().manual_seed(7)),
        (SamplingParams(temperature=0.0), logits[3], None),
        (SamplingParams(temperature=1.0, top_k=3), logits[3], None),
    ]
    assert len(set(alone)) > 5
    assert _seeded_tokens(logits[0], ours, crowd, 2) == alone
    assert _seeded_tokens(logits[0], ours, crowd[:1], 1) == alone


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_log_softmax_gathers():
    logits = random_logits(4, seed=31).to(torch.bfloat16)
    tokens = torch.tensor([0, 5, 63, 17])
    chosen, top_ids, top_logprobs = compute_logprobs(logits, tokens, top_n=5)
    reference = torch.log_softmax(logits.float(), dim=-1)
    assert torch.allclose(chosen, reference.gather(1, tokens[:, None]).squeeze(1))
    values, ids = reference.topk(5, dim=-1)
    assert torch.equal(top_ids, ids) and torch.allclose(top_logprobs, values)
    assert top_ids.shape == (4, 5) and top_logprobs.dtype == torch.float32
    chosen0, ids0, values0 = compute_logprobs(logits, tokens, top_n=0)
    assert ids0.shape == (4, 0) and values0.shape == (4, 0) and torch.equal(chosen0, chosen)
    assert math.isclose(float(torch.exp(reference[0]).sum()), 1.0, rel_tol=1e-5)


def test_plain_greedy_requests_skip_the_batch_and_get_its_tokens():
    """Greedy requests without penalties take the logits' argmax without a SamplingBatch
    (``is_plain_greedy``, ``sample_requests``): the tokens ``sample`` gives them through one; a penalty or a sampled
    request needs the batch."""
    greedy = [Request(f"g{i}", [1, 2, i], SamplingParams(temperature=0.0)) for i in range(3)]
    top1 = Request("k", [5], SamplingParams(temperature=0.8, top_k=1))         # greedy by top_k
    assert is_plain_greedy(greedy + [top1])
    logits = random_logits(4, seed=7)
    batch = SamplingBatch.from_requests(greedy + [top1], "cpu", VOCAB)
    assert torch.equal(argmax_rows(logits), sample(logits, batch))
    assert torch.equal(sample_requests(logits, VOCAB, greedy + [top1]), sample(logits, batch))
    assert not is_plain_greedy(greedy + [Request("p", [1], SamplingParams(temperature=0.0, repetition_penalty=1.3))])
    assert not is_plain_greedy(greedy + [Request("s", [1], SamplingParams(temperature=0.7))])
