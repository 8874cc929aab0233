"""EAGLE-family speculative decoding (EAGLE, EAGLE3, NEXTN) through the whole engine, on a
tiny random Llama with tiny random heads in the published checkpoint layouts.

Greedy speculation must equal plain decoding under page_size 4, chunked prefill, radix
reuse, requests joining and leaving, aborts and retractions, and leak no KV: this
exercises the per-request feature bookkeeping (prefill chunks, verified paths, lazy
catch-up, radix-shared draft entries) whatever the head's quality.
"""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from specserve.core import SamplingParams
from test_spec_sampling import _engine, _random_prompts, _staggered, _with_preemption
from tiny_draft_heads import deepseek_mtp_tensors, eagle3_checkpoint, eagle_checkpoint, write_checkpoint
from tiny_llama import VOCAB, random_weights, tiny_config, write_tiny_model

SHAPES = {"chain": (3, 1, 4), "tree": (3, 2, 5)}


@pytest.fixture(scope="module", autouse=True)
def always_speculate():
    old = os.environ.get("SPECSERVE_SPEC_POLICY")
    os.environ["SPECSERVE_SPEC_POLICY"] = "always"
    yield
    if old is None:
        os.environ.pop("SPECSERVE_SPEC_POLICY")
    else:
        os.environ["SPECSERVE_SPEC_POLICY"] = old


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_eagle")
    cfg = tiny_config()
    weights = random_weights(cfg, seed=0)
    target = write_tiny_model(root / "target", weights)
    mtp_target = write_tiny_model(root / "mtp_target", dict(weights, **deepseek_mtp_tensors(cfg)))
    config = json.loads((mtp_target / "config.json").read_text())
    (mtp_target / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=1)))
    deep = tiny_config(num_layers=4)                       # EAGLE3 reads three distinct layers
    deep_target = write_tiny_model(root / "deep_target", random_weights(deep, seed=0), deep)
    eagle3 = eagle3_checkpoint(deep, draft_vocab=VOCAB // 2, aux_layer_ids=[0, 1, 2])
    return {"target": str(target), "mtp_target": str(mtp_target), "deep_target": str(deep_target),
            "EAGLE": str(write_checkpoint(root / "eagle", *eagle_checkpoint(cfg))),
            "EAGLE3": str(write_checkpoint(root / "eagle3", *eagle3))}


def _spec(tiny: dict[str, str], algo: str, shape: str) -> tuple[str, dict]:
    steps, topk, n = SHAPES[shape]
    kwargs = {"speculative_algorithm": algo, "speculative_num_steps": steps, "speculative_eagle_topk": topk,
              "speculative_num_draft_tokens": n}
    if algo == "NEXTN":
        return tiny["mtp_target"], kwargs
    target = tiny["deep_target"] if algo == "EAGLE3" else tiny["target"]
    return target, dict(kwargs, speculative_draft_model_path=tiny[algo])


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3", "NEXTN"])
@pytest.mark.parametrize("page_size, chunk", [(1, None), (4, 16)])
def test_greedy_equals_plain_under_batching(tiny, algo, shape, page_size, chunk):
    settings = {"page_size": page_size, "chunked_prefill_size": chunk}
    prompts = _random_prompts(10, seed=page_size)
    model, kwargs = _spec(tiny, algo, shape)
    plain = _staggered(_engine(model, **settings), prompts)
    spec_engine = _engine(model, **settings, **kwargs)
    assert spec_engine.engine.spec_worker is not None, "the draft did not load"
    spec = _staggered(spec_engine, prompts)
    again = _staggered(spec_engine, prompts)        # radix hits on every prompt
    assert spec == plain
    assert again == plain
    assert spec_engine.engine.stats.spec_verify_ct > 0


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3", "NEXTN"])
def test_greedy_equals_plain_with_aborts_and_retractions(tiny, algo):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB - 1, (int(n),), generator=g).tolist()
               for n in torch.randint(40, 70, (12,), generator=g)]
    settings = {"max_total_tokens": 600, "context_length": 160}
    model, kwargs = _spec(tiny, algo, "tree")
    plain = _with_preemption(_engine(model, **settings), prompts)
    spec = _with_preemption(_engine(model, **settings, **kwargs), prompts)
    assert spec == plain


def test_unloadable_draft_falls_back_to_plain_decoding(tiny, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    engine = _engine(tiny["target"], speculative_algorithm="EAGLE3", speculative_draft_model_path=str(broken))
    assert engine.engine.runner.capture_features is None
    assert engine.engine.spec_worker is None
    prompts = _random_prompts(3, seed=5)
    assert _staggered(engine, prompts) == _staggered(_engine(tiny["target"]), prompts)


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3", "NEXTN"])
def test_greedy_equals_plain_when_every_other_step_decodes_plainly(tiny, algo):
    """Steps where nobody drafts run as the engine's plain decode step; the head still gets
    their target features (``on_plain_step``), so later drafts continue from
    the right entries and greedy output equals plain decoding."""
    prompts = _random_prompts(6, seed=3)
    model, kwargs = _spec(tiny, algo, "tree")
    plain = _staggered(_engine(model), prompts)
    spec_engine = _engine(model, **kwargs)
    worker = spec_engine.engine.spec_worker
    select, calls = worker.policy.select, [0]

    def every_other_step(states, caps, depth_caps, *hint):
        calls[0] += 1
        return [1] * len(caps) if calls[0] % 2 else select(states, caps, depth_caps, *hint)

    worker.policy.select = every_other_step
    assert _staggered(spec_engine, prompts) == plain
    assert worker.num_plain_steps > 0 and worker.num_drafted_steps > 0
    assert spec_engine.engine.stats.spec_verify_ct > 0


def test_plain_steps_leave_each_request_its_own_target_features(tiny):
    """A plain step hands row i of its target features to item i (``on_plain_step``): the features
    each request keeps for its next catch-up, prompt and decoded positions, are those it keeps
    decoding alone (greedy output would not show a mix-up, only worse drafts)."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (9, 23, 14)]
    model, kwargs = _spec(tiny, "EAGLE3", "chain")
    batched = _pending_after_plain_steps(_engine(model, **kwargs), prompts)
    for prompt, features in zip(prompts, batched):
        assert features.shape[0] == len(prompt) + 4          # the prompt and four plain steps' roots
        torch.testing.assert_close(features, _pending_after_plain_steps(_engine(model, **kwargs), [prompt])[0])


def _pending_after_plain_steps(engine, prompts: list[list[int]], decode_steps: int = 4) -> list[torch.Tensor]:
    """Each request's pending target features after a prefill and ``decode_steps`` plain steps."""
    core = engine.engine
    core.spec_worker.policy.select = lambda states, caps, depth_caps, *hint: [1] * len(caps)
    rids = [core.add_request(None, ids, SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True))
            for ids in prompts]
    for _ in range(1 + decode_steps):
        core.step()
    running = {req.rid: req for req in core.scheduler.running}
    pending = [running[rid].spec_state.proposer.take_pending() for rid in rids]
    for rid in rids:
        core.abort_request(rid)
    return pending


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_short_chains_draft_only_the_tokens_they_keep(tiny, algo):
    """Chains sized down to 2 or 3 nodes (as the policy sizes them for requests that accept
    little) run 1 or 2 head forwards of the 3 steps, not all 3, and greedy output still equals
    plain decoding."""
    prompts = _random_prompts(6, seed=5)
    model, kwargs = _spec(tiny, algo, "chain")
    plain = _staggered(_engine(model), prompts)
    spec_engine = _engine(model, **kwargs)
    worker = spec_engine.engine.spec_worker
    proposer, select = worker.proposer, worker.policy.select
    sizes, forwards, drafted = iter([2, 3] * 10_000), [0], []

    def short_chains(states, caps, depth_caps, *hint):
        return [min(n, next(sizes)) if n > 1 else 1 for n in select(states, caps, depth_caps, *hint)]

    def counting(forward):
        def run(*args, **kwargs):
            forwards[0] += 1
            return forward(*args, **kwargs)
        return run

    def recording(propose):
        def run(engine, items, max_nodes):
            before = forwards[0]
            trees = propose(engine, items, max_nodes)
            drafted.append((max(max_nodes), forwards[0] - before, max(t.num_nodes for t in trees)))
            return trees
        return run

    worker.policy.select = short_chains
    proposer.runner.forward = counting(proposer.runner.forward)
    proposer.propose = recording(proposer.propose)
    assert _staggered(spec_engine, prompts) == plain
    assert {cap for cap, _, _ in drafted} == {2, 3}
    assert all(num_forwards == cap - 1 and nodes <= cap for cap, num_forwards, nodes in drafted)


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_a_catch_up_over_plain_steps_is_not_learned_as_step_overhead(tiny, algo):
    """A head drafting again after plain steps first catches up on their positions: a one-off cost
    of switching the request on. The policy's step-cost model (whose learned overhead every later
    drafting step is charged) gets each drafting step's time without that share of the catch-up;
    a step right after a verify catches up on no more than the verify left and gives up nothing."""
    prompts = _random_prompts(4, seed=7)
    model, kwargs = _spec(tiny, algo, "chain")
    spec_engine = _engine(model, **kwargs)
    worker = spec_engine.engine.spec_worker
    select, calls, observed, wall = worker.policy.select, [0], [], []

    def long_plain_stretches(states, caps, depth_caps, *hint):
        calls[0] += 1
        return [1] * len(caps) if calls[0] % 10 < 7 else select(states, caps, depth_caps, *hint)

    observe, decode_step = worker.policy.observe_step, worker.decode_step

    def recording(sizes, seconds, forward_seconds=None):
        observed.append((max(sizes), seconds, worker.proposer.last_switch_seconds))
        return observe(sizes, seconds, forward_seconds)

    def timed(*args):
        began = time.perf_counter()
        out = decode_step(*args)
        wall.append(time.perf_counter() - began)
        return out

    worker.policy.select, worker.policy.observe_step, worker.decode_step = long_plain_stretches, recording, timed
    _staggered(spec_engine, prompts)
    drafted = [(seconds, switch, step) for (size, seconds, switch), step in zip(observed, wall) if size > 1]
    assert any(switch > 0 for _, switch, _ in drafted) and any(switch == 0 for _, switch, _ in drafted)
    assert all(seconds <= step - switch for seconds, switch, step in drafted)


def test_the_switch_share_of_a_catch_up_is_its_rows_beyond_a_verify():
    from specserve.speculative.base import catch_up_share

    assert catch_up_share([39], 4, 3.9) == pytest.approx(3.5)
    assert catch_up_share([2, 4, 10], 4, 1.6) == pytest.approx(0.6)
    assert catch_up_share([1, 3], 4, 2.0) == 0.0
    assert catch_up_share([], 4, 1.0) == 0.0
