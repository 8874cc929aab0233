"""Speculative decoding on a tiny random Llama, through the whole engine.

* Sampling is lossless: over thousands of seeded requests, the 2nd and 3rd
  generated tokens (the ones speculation produces: the 1st comes from prefill)
  follow the exact target marginals (chi-square), for a draft-model chain, a
  draft-model tree, NGRAM trees and the two mixed in one batch (``--speculative-ngram-assist``:
  NGRAM's trees where the shared cache matches, the draft model's elsewhere); relaxed accept
  thresholds are detected.
* Greedy speculation equals plain decoding under page_size 4, chunked prefill,
  radix reuse and requests joining and leaving, and leaks no KV.
"""
from __future__ import annotations

import os

import pytest
import torch

from specserve.core import SamplingParams
from specserve.engine import Engine
from specserve.runner.model_runner import ExtendSpec
from specserve.runner.sampler import SamplingBatch, processed_probs

from tiny_llama import VOCAB, perturbed, random_weights, tiny_config, write_tiny_model

PROMPT = [1, 5, 9, 3]
PARAMS = {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 3, "ignore_eos": True}
NUM_SAMPLES = 3000
P_MIN = 1e-3


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    weights = random_weights(tiny_config(), seed=0)
    target = write_tiny_model(root / "target", weights)
    draft = write_tiny_model(root / "draft", perturbed(weights, seed=1, noise=0.3))
    return str(target), str(draft)


@pytest.fixture(scope="module", autouse=True)
def always_speculate():
    old = os.environ.get("SPECSERVE_SPEC_POLICY")
    os.environ["SPECSERVE_SPEC_POLICY"] = "always"   # the CPU cost model would often say "plain"
    yield
    if old is None:
        os.environ.pop("SPECSERVE_SPEC_POLICY")
    else:
        os.environ["SPECSERVE_SPEC_POLICY"] = old


def _engine(model: str, **kwargs) -> Engine:
    settings = dict({"max_total_tokens": 8192, "context_length": 256}, **kwargs)
    return Engine(model_path=model, dtype="float32", max_running_requests=64, **settings)


def _spec_kwargs(kind: str, draft: str) -> dict:
    if kind == "ngram":
        return {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4}
    steps, topk, n = (2, 1, 3) if kind == "chain" else (2, 2, 4)
    assist = {"speculative_ngram_assist": 4} if kind == "assisted" else {}
    return {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": draft,
            "speculative_num_steps": steps, "speculative_eagle_topk": topk, "speculative_num_draft_tokens": n,
            **assist}


# ---- exact reference -------------------------------------------------------------------

def _next_probs(engine: Engine, sequences: list[list[int]]) -> torch.Tensor:
    """Target distribution (PARAMS applied) after each sequence [n, V], 64 sequences per forward."""
    core = engine.engine
    params = SamplingParams(**PARAMS)
    out = []
    for start in range(0, len(sequences), 64):
        chunk = sequences[start:start + 64]
        slots = [core.pool.extend_slots([], len(s)) for s in chunk]
        specs = [ExtendSpec(row=i, prefix_len=0, token_ids=s, new_slots=sl) for i, (s, sl) in
                 enumerate(zip(chunk, slots))]
        logits = core.runner.forward(specs)
        for sl in slots:
            core.pool.release_slots(sl)
        out.append(processed_probs(logits, SamplingBatch.from_params([params] * len(chunk), "cpu", VOCAB)))
    return torch.cat(out).double()


def _exact_marginals(engine: Engine) -> tuple[torch.Tensor, torch.Tensor]:
    """P(2nd token), P(3rd token) [V] each."""
    p1 = _next_probs(engine, [PROMPT])[0]                                            # [V]
    p2 = _next_probs(engine, [PROMPT + [a] for a in range(VOCAB)])                    # [V, V]
    p3 = _next_probs(engine, [PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
    joint12 = p1[:, None] * p2                                                       # [V, V]
    return joint12.sum(0), (joint12.reshape(-1, 1) * p3).sum(0)


def _chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Cells expecting < 5 are pooled into one."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor(float(obs.numel() - 1))
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def _sample_tokens(engine: Engine, num: int) -> tuple[torch.Tensor, torch.Tensor]:
    params = [dict(PARAMS, seed=1000 + i) for i in range(num)]
    outs = engine.generate(input_ids=[PROMPT] * num, sampling_params=params)
    second = torch.tensor([o["output_ids"][1] for o in outs])
    third = torch.tensor([o["output_ids"][2] for o in outs])
    return (torch.bincount(second, minlength=VOCAB).double(), torch.bincount(third, minlength=VOCAB).double())


@pytest.fixture(scope="module")
def exact(tiny_dirs):
    engine = _engine(tiny_dirs[0])
    return _exact_marginals(engine)


@pytest.mark.parametrize("kind", ["chain", "tree", "ngram", "assisted"])
def test_sampling_matches_target_distribution(tiny_dirs, exact, kind):
    engine = _engine(tiny_dirs[0], **_spec_kwargs(kind, tiny_dirs[1]))
    second, third = _sample_tokens(engine, NUM_SAMPLES)
    info = engine.engine.get_server_info()
    histogram = info["spec_accept_histogram"]
    if kind == "assisted":                   # both kinds of tree were verified
        assert 0 < info["spec_policy"]["request_steps_drafted_by_ngram"] < sum(histogram)
        assert set(info["spec_policy"]["by_kind"]) == {"ngram", "draft"}     # each kind's global figures
    assert sum(histogram) > NUM_SAMPLES // 2, "speculation did not run"
    assert sum(histogram[1:]) > 0.1 * sum(histogram), f"too few acceptances to test anything: {histogram}"
    p2, p3 = _chi_square_pvalue(second, exact[0]), _chi_square_pvalue(third, exact[1])
    assert p2 > P_MIN and p3 > P_MIN, (p2, p3, histogram)
    usage = engine.engine.kv_usage()
    assert usage["free"] + usage["evictable"] == usage["total"]


def test_relaxed_thresholds_are_detected(tiny_dirs, exact):
    """The harness has power: accepting drafts too easily skews the distribution."""
    engine = _engine(tiny_dirs[0], speculative_accept_threshold_single=0.05,
                     speculative_accept_threshold_acc=0.2, **_spec_kwargs("tree", tiny_dirs[1]))
    second, third = _sample_tokens(engine, NUM_SAMPLES)
    assert min(_chi_square_pvalue(second, exact[0]), _chi_square_pvalue(third, exact[1])) < P_MIN


# ---- greedy under paging, chunking, radix reuse, joins and leaves ------------------------

def _random_prompts(num: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 70, (num,), generator=g).tolist()
    shared = torch.randint(0, VOCAB - 1, (20,), generator=g).tolist()      # a common prefix for radix hits
    return [(shared if i % 2 else []) + torch.randint(0, VOCAB - 1, (n,), generator=g).tolist()
            for i, n in enumerate(lengths)]


def _staggered(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Requests arrive one per step (two at first) with different lengths, so the batch changes;
    some stop at EOS (t31) or a stop token, some only after min_new_tokens."""
    core = engine.engine
    pending = list(enumerate(prompts))
    rids, outputs = {}, {}
    while pending or core.has_unfinished():
        for _ in range(2 if not rids else 1):
            if pending:
                i, ids = pending.pop(0)
                params = SamplingParams(temperature=0, max_new_tokens=1 + (7 * i) % 13, ignore_eos=i % 3 == 0,
                                        min_new_tokens=4 if i % 2 else 0, stop_token_ids=[7] if i % 4 == 1 else [])
                rids[core.add_request(None, ids, params)] = i
        for out in core.step():
            outputs.setdefault(rids[out.rid], []).extend(out.new_token_ids)
    usage = core.kv_usage()
    assert usage["free"] + usage["evictable"] == usage["total"], usage
    return [outputs[i] for i in range(len(prompts))]


@pytest.mark.parametrize("page_size, chunk", [(1, None), (4, None), (4, 16)])
@pytest.mark.parametrize("kind", ["tree", "ngram"])
def test_greedy_equals_plain_under_batching(tiny_dirs, kind, page_size, chunk):
    settings = {"page_size": page_size, "chunked_prefill_size": chunk}
    prompts = _random_prompts(10, seed=page_size)
    plain = _staggered(_engine(tiny_dirs[0], **settings), prompts)
    spec_engine = _engine(tiny_dirs[0], **settings, **_spec_kwargs(kind, tiny_dirs[1]))
    spec = _staggered(spec_engine, prompts)
    again = _staggered(spec_engine, prompts)        # radix hits on every prompt
    assert spec == plain
    assert again == plain
    assert spec_engine.engine.stats.spec_verify_ct > 0


def _with_preemption(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """All requests at once; one is aborted, and three decoding requests are retracted
    (preempted: KV freed, recomputed later): at the first step from 9, 15 and 23 on where the
    last running request is decoding (how prefill chunks interleave moves that step)."""
    core = engine.engine
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    rids = [core.add_request(None, ids, params) for ids in prompts]
    outputs: dict[str, list[int]] = {rid: [] for rid in rids}
    step = num_retracted = 0
    retract_from = [9, 15, 23]
    while core.has_unfinished():
        for out in core.step():
            outputs[out.rid].extend(out.new_token_ids)
        step += 1
        if step == 5:
            core.abort_request(rids[3])
        victim = core.scheduler.running[-1] if len(core.scheduler.running) > 1 else None
        if (retract_from and step >= retract_from[0] and victim is not None
                and victim.num_computed == victim.seq_len - 1):
            core.scheduler.retract(victim)
            retract_from.pop(0)
            num_retracted += 1
    assert num_retracted == 3
    usage = core.kv_usage()
    assert usage["free"] + usage["evictable"] == usage["total"], usage
    return [outputs[rid] for i, rid in enumerate(rids) if i != 3]


@pytest.mark.parametrize("kind", ["tree", "ngram", "assisted"])
def test_greedy_equals_plain_with_aborts_and_retractions(tiny_dirs, kind):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB - 1, (int(n),), generator=g).tolist()
               for n in torch.randint(40, 70, (12,), generator=g)]
    settings = {"max_total_tokens": 600, "context_length": 160}
    plain = _with_preemption(_engine(tiny_dirs[0], **settings), prompts)
    spec = _with_preemption(_engine(tiny_dirs[0], **settings, **_spec_kwargs(kind, tiny_dirs[1])), prompts)
    assert spec == plain
