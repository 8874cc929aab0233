"""Engine behaviour on the default model (SmolLM2-135M-Instruct, float32, CPU or CUDA):
stop strings and stop tokens, length limits, min_new_tokens, seeded sampling,
logprobs, chunked prefill, page size, prefix cache, retraction, abort, request
validation, and that the KV pool is whole again after every test.

Generations are short (8-16 tokens) and engines are built once per module.
"""
from __future__ import annotations

import pytest
import torch

from specserve.core import SamplingParams
from specserve.engine import Engine

CONTEXT = 160
GREEDY = {"temperature": 0.0}
CHAT_PROMPTS = ["Say only the word yes.", "What is the capital of France?",
                "List three facts about the Moon.", "Write a haiku about autumn leaves."]
RAW_PROMPTS = ["Once upon a time", "The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):"]

_ENGINES: list[Engine] = []


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The model is tiny: one intra-op thread is faster on a small, shared CPU."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def make_engine(default_gguf_path, _one_thread):
    def make(**kwargs) -> Engine:
        args = {"model_path": default_gguf_path, "dtype": "float32", "max_total_tokens": 1024,
                "context_length": CONTEXT, **kwargs}
        engine = Engine(**args)
        _ENGINES.append(engine)
        return engine
    yield make
    _ENGINES.clear()


@pytest.fixture(autouse=True)
def _kv_pool_whole_after_each_test():
    yield
    for engine in _ENGINES:
        core = engine.engine
        leftover = list(core.requests)
        for rid in leftover:          # so that one failure does not spill into later tests
            core.abort_request(rid)
        while core.has_unfinished():
            core.step()
        assert not leftover, f"requests left unfinished: {leftover}"
        assert not core.requests and not core.streamers
        assert core.radix.protected_size() == 0
        assert core.pool.num_free_tokens + core.radix.evictable_size() == core.pool.capacity_tokens
        assert len(core.scheduler.free_rows) == core.scheduler.max_running


@pytest.fixture(scope="module")
def engine(make_engine) -> Engine:
    return make_engine()


def chat_ids(engine: Engine, text: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def raw_ids(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def gen(engine: Engine, ids: list[int], **params) -> dict:
    return engine.generate(input_ids=ids, sampling_params=params)


def run_core(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[dict]:
    """Drive LLMEngine directly, collecting everything its StepOutputs carry."""
    core = engine.engine
    rids = [core.add_request(None, ids, sp) for ids, sp in requests]
    results = {rid: {"ids": [], "text": "", "logprobs": [], "top": [], "finish": None, "meta": {}}
               for rid in rids}
    pending = set(rids)
    for _ in range(10_000):
        if not pending:
            break
        for out in core.step():
            res = results[out.rid]
            assert res["finish"] is None, "output after the final one"
            res["ids"] += out.new_token_ids
            res["text"] += out.text_delta
            res["logprobs"] += out.new_logprobs
            res["top"] += out.new_top_logprobs
            if out.finished:
                res["finish"], res["meta"] = out.finish_reason, out.meta_info
                pending.discard(out.rid)
    assert not pending
    return [results[r] for r in rids]


# ---------------------------------------------------------------- stops
def test_stop_strings_cut_exactly(engine):
    ids = raw_ids(engine, "Once upon a time")
    full = gen(engine, ids, max_new_tokens=16, **GREEDY)
    text = full["text"]
    words = text.split()
    assert len(words) >= 6, text
    # a word, a piece that ends inside a token, and a run spanning several tokens
    stops = [words[3], words[4][:3], " ".join(words[2:5])]
    for stop in stops:
        assert stop in text
        out = gen(engine, ids, max_new_tokens=16, stop=[stop], **GREEDY)
        assert stop not in out["text"]
        assert out["text"] == text[:text.index(stop)], stop
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert out["output_ids"] == full["output_ids"][:len(out["output_ids"])]
        assert out["meta_info"]["completion_tokens"] == len(out["output_ids"])


def test_stop_string_first_of_several_and_absent(engine):
    ids = raw_ids(engine, "Once upon a time")
    text = gen(engine, ids, max_new_tokens=16, **GREEDY)["text"]
    words = text.split()
    late, early = words[5], words[2]
    out = gen(engine, ids, max_new_tokens=16, stop=[late, early], **GREEDY)
    assert out["text"] == text[:min(text.index(early), text.index(late))]
    absent = gen(engine, ids, max_new_tokens=16, stop=["ZZZ-not-there"], **GREEDY)
    assert absent["text"] == text and absent["meta_info"]["finish_reason"] == {"type": "length"}
    in_prompt_only = gen(engine, ids, max_new_tokens=16, stop=["upon"], **GREEDY)   # "upon" is in the prompt
    if "upon" not in text:
        assert in_prompt_only["text"] == text


def test_stop_token_ids(engine):
    ids = raw_ids(engine, "1, 2, 3, 4,")
    full = gen(engine, ids, max_new_tokens=12, **GREEDY)["output_ids"]
    stop_id = full[2]
    first = full.index(stop_id)
    out = gen(engine, ids, max_new_tokens=12, stop_token_ids=[stop_id], **GREEDY)
    assert out["output_ids"] == full[:first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}


def test_eos_stops_unless_ignored(engine):
    ids = chat_ids(engine, CHAT_PROMPTS[0])
    out = gen(engine, ids, max_new_tokens=16, **GREEDY)
    eos = set(engine.engine.eos_token_ids)
    assert out["output_ids"][-1] in eos and len(out["output_ids"]) < 16
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": out["output_ids"][-1]}
    ignored = gen(engine, ids, max_new_tokens=8, ignore_eos=True, **GREEDY)
    assert len(ignored["output_ids"]) == 8
    assert ignored["meta_info"]["finish_reason"] == {"type": "length"}


# ---------------------------------------------------------------- lengths
@pytest.mark.parametrize("max_new", [0, 1, 2, 9])
def test_max_new_tokens_exact(engine, max_new):
    ids = raw_ids(engine, RAW_PROMPTS[0])
    out = gen(engine, ids, max_new_tokens=max_new, ignore_eos=True, **GREEDY)
    assert len(out["output_ids"]) == max_new
    assert out["meta_info"]["completion_tokens"] == max_new
    assert out["meta_info"]["finish_reason"] == {"type": "length"}
    if max_new:
        longer = gen(engine, ids, max_new_tokens=12, ignore_eos=True, **GREEDY)["output_ids"]
        assert out["output_ids"] == longer[:max_new]


def test_min_new_tokens_suppresses_eos_and_stop_tokens(engine):
    ids = chat_ids(engine, CHAT_PROMPTS[0])
    plain = gen(engine, ids, max_new_tokens=16, **GREEDY)["output_ids"]
    eos = set(engine.engine.eos_token_ids)
    assert len(plain) < 6 and plain[-1] in eos           # "Yes." then EOS
    out = gen(engine, ids, max_new_tokens=16, min_new_tokens=6, **GREEDY)
    assert len(out["output_ids"]) >= 6
    assert not eos & set(out["output_ids"][:6]), out["output_ids"]
    assert out["output_ids"][:len(plain) - 1] == plain[:-1]
    stop_id = plain[0]
    out = gen(engine, ids, max_new_tokens=10, min_new_tokens=3, stop_token_ids=[stop_id], **GREEDY)
    assert len(out["output_ids"]) >= 3
    assert stop_id not in out["output_ids"][:3]


# ---------------------------------------------------------------- sampling
def test_seeded_sampling_reproducible_and_seeds_differ(engine):
    ids = raw_ids(engine, RAW_PROMPTS[0])
    params = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True}
    a = gen(engine, ids, seed=1234, **params)["output_ids"]
    b = gen(engine, ids, seed=1234, **params)["output_ids"]
    c = gen(engine, ids, seed=4321, **params)["output_ids"]
    assert a == b
    assert a != c
    # the seed fixes the request's draws whatever else runs in the batch
    batch = engine.generate(input_ids=[raw_ids(engine, RAW_PROMPTS[1]), ids],
                            sampling_params=[dict(params, seed=7), dict(params, seed=1234)])
    assert batch[1]["output_ids"] == a


def test_temperature_with_top_k_top_p_min_p(engine):
    ids = raw_ids(engine, RAW_PROMPTS[1])
    greedy = gen(engine, ids, max_new_tokens=10, ignore_eos=True, **GREEDY)["output_ids"]
    for params in ({"top_k": 5}, {"top_p": 0.8}, {"top_k": 20, "top_p": 0.9, "min_p": 0.05}):
        out = gen(engine, ids, max_new_tokens=10, ignore_eos=True, temperature=0.7, seed=3, **params)
        assert len(out["output_ids"]) == 10
        assert all(0 <= t < engine.engine.model_config.vocab_size for t in out["output_ids"])
    top1 = gen(engine, ids, max_new_tokens=10, ignore_eos=True, temperature=1.5, top_k=1, seed=3)
    assert top1["output_ids"] == greedy


def test_logprobs_present_and_consistent(engine):
    ids = raw_ids(engine, RAW_PROMPTS[2])
    greedy, sampled = run_core(engine, [
        (ids, SamplingParams(max_new_tokens=8, temperature=0.0, return_logprob=True, top_logprobs_num=5)),
        (ids, SamplingParams(max_new_tokens=8, temperature=1.0, seed=5, return_logprob=True,
                             top_logprobs_num=3)),
    ])
    for res, num_top in ((greedy, 5), (sampled, 3)):
        assert len(res["logprobs"]) == len(res["ids"]) == len(res["top"]) == 8
        for token, lp, top in zip(res["ids"], res["logprobs"], res["top"]):
            assert lp <= 0.0
            assert len(top) == num_top
            values = [v for _, v in top]
            assert values == sorted(values, reverse=True)
            assert all(v <= 0.0 for v in values)
            assert lp <= values[0] + 1e-5
            for top_id, top_lp in top:
                if top_id == token:
                    assert top_lp == pytest.approx(lp, abs=1e-4)
    for token, lp, top in zip(greedy["ids"], greedy["logprobs"], greedy["top"]):
        assert top[0][0] == token and top[0][1] == pytest.approx(lp, abs=1e-4)
    plain = run_core(engine, [(ids, SamplingParams(max_new_tokens=8, temperature=0.0))])[0]
    assert plain["ids"] == greedy["ids"] and plain["logprobs"] == [] and plain["top"] == []


# ---------------------------------------------------------------- KV layouts
@pytest.fixture(scope="module")
def reference_outputs(engine):
    """Greedy outputs of the default engine, one request at a time."""
    prompts = [chat_ids(engine, p) for p in CHAT_PROMPTS[1:]] + [raw_ids(engine, p) for p in RAW_PROMPTS]
    return [(ids, gen(engine, ids, max_new_tokens=12, **GREEDY)["output_ids"]) for ids in prompts]


def _batched(engine, reference_outputs):
    return [r["output_ids"] for r in engine.generate(
        input_ids=[ids for ids, _ in reference_outputs],
        sampling_params=[dict(max_new_tokens=12, **GREEDY)] * len(reference_outputs))]


def test_batched_equals_one_at_a_time(engine, reference_outputs):
    assert _batched(engine, reference_outputs) == [out for _, out in reference_outputs]


def test_decode_step_accounting(engine, reference_outputs):
    """Each request's first token comes from its prefill step, every later one from a decode
    step: the decode counters (which `bench serving` divides) see exactly those."""
    stats = engine.engine.stats
    before = (stats.decode_tokens, stats.decode_seconds, stats.prefill_seconds)
    outputs = _batched(engine, reference_outputs)
    assert stats.decode_tokens - before[0] == sum(len(out) - 1 for out in outputs)
    assert stats.decode_seconds > before[1] and stats.prefill_seconds > before[2]


def test_chunked_prefill_same_greedy_output(make_engine, reference_outputs):
    chunked = make_engine(chunked_prefill_size=16)
    assert max(len(ids) for ids, _ in reference_outputs) > 2 * 16
    for ids, want in reference_outputs[:3]:
        assert gen(chunked, ids, max_new_tokens=12, **GREEDY)["output_ids"] == want
    assert _batched(chunked, reference_outputs) == [out for _, out in reference_outputs]


def test_page_size_4_same_greedy_output(make_engine, reference_outputs):
    paged = make_engine(page_size=4)
    assert _batched(paged, reference_outputs) == [out for _, out in reference_outputs]
    ids, want = reference_outputs[0]
    again = gen(paged, ids, max_new_tokens=12, **GREEDY)     # prefix cache, page-aligned
    assert again["output_ids"] == want
    cached = again["meta_info"]["cached_tokens"]
    assert cached > 0 and cached % 4 == 0 and cached <= len(ids) - 1


def test_prefix_cache_hit_same_output(engine):
    ids = chat_ids(engine, "Name a color of the sky.")
    first = gen(engine, ids, max_new_tokens=10, **GREEDY)
    second = gen(engine, ids, max_new_tokens=10, **GREEDY)
    assert first["meta_info"]["cached_tokens"] < len(ids) - 1
    assert second["meta_info"]["cached_tokens"] == len(ids) - 1
    assert second["output_ids"] == first["output_ids"] and second["text"] == first["text"]
    assert engine.engine.kv_usage()["cached"] > 0
    # a longer prompt sharing the chat preamble reuses it too
    other = gen(engine, chat_ids(engine, "Name a color of grass."), max_new_tokens=4, **GREEDY)
    assert other["meta_info"]["cached_tokens"] > 0


def test_radix_disabled(make_engine, reference_outputs):
    plain = make_engine(disable_radix_cache=True)
    ids, want = reference_outputs[0]
    for _ in range(2):
        out = gen(plain, ids, max_new_tokens=12, **GREEDY)
        assert out["output_ids"] == want
        assert out["meta_info"]["cached_tokens"] == 0
    assert plain.engine.kv_usage()["cached"] == 0
    assert plain.engine.pool.num_free_tokens == plain.engine.pool.capacity_tokens


def test_retraction_under_tiny_kv_pool(make_engine, engine):
    """A pool just above one context: concurrent generations longer than the decode reserve
    (which admission keeps free) outgrow it, get retracted and recomputed, and still give
    the greedy output they have without retraction (batched and solo outputs are equal:
    test_batched_equals_one_at_a_time)."""
    tiny = make_engine(context_length=100, max_total_tokens=144)
    assert tiny.engine.context_len == 100
    prompts = [raw_ids(engine, p) for p in RAW_PROMPTS[:3]]
    params = [dict(max_new_tokens=70, ignore_eos=True, **GREEDY)] * len(prompts)
    retractions = engine.engine.scheduler.num_retractions
    want = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    assert engine.engine.scheduler.num_retractions == retractions
    outs = tiny.generate(input_ids=prompts, sampling_params=params)
    assert tiny.engine.scheduler.num_retractions > 0
    assert [o["output_ids"] for o in outs] == want
    assert [len(o["output_ids"]) for o in outs] == [70] * 3


# ---------------------------------------------------------------- abort
def test_abort_running_and_waiting_frees_kv(engine):
    core = engine.engine
    ids = raw_ids(engine, RAW_PROMPTS[3])
    total = core.pool.capacity_tokens
    running = core.add_request("abort-running", ids, SamplingParams(max_new_tokens=50, ignore_eos=True))
    core.step()
    core.step()
    waiting = core.add_request("abort-waiting", ids + [11], SamplingParams(max_new_tokens=50))
    assert core.kv_usage()["free"] + core.radix.evictable_size() < total
    core.abort_request(running)
    core.abort_request(waiting)
    core.abort_request("no-such-request")               # ignored
    outs = core.step()
    finals = {o.rid: o for o in outs if o.finished}
    assert set(finals) == {running, waiting}
    for out in finals.values():
        assert out.finish_reason == {"type": "abort"}
    assert finals[running].meta_info["completion_tokens"] >= 1
    assert not core.has_unfinished() and core.step() == []
    assert core.pool.num_free_tokens + core.radix.evictable_size() == total


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("ids_len,params,message", [
    (0, {}, "empty"),
    (CONTEXT, {"max_new_tokens": 1}, "context length"),
    (CONTEXT - 10, {"max_new_tokens": 11}, "context length"),
    (5, {"temperature": -1.0}, "temperature"),
    (5, {"top_p": 0.0}, "top_p"),
    (5, {"top_k": 0}, "top_k"),
    (5, {"min_p": 1.5}, "min_p"),
    (5, {"max_new_tokens": -1}, "max_new_tokens"),
    (5, {"min_new_tokens": -2}, "min_new_tokens"),
    (5, {"repetition_penalty": 0.0}, "repetition_penalty"),
    (5, {"frequency_penalty": 3.0}, "frequency_penalty"),
    (5, {"top_logprobs_num": 50}, "top_logprobs"),
    (5, {"stop_token_ids": [10 ** 9]}, "stop_token_ids"),
    (5, {"n": 2}, "n"),
])
def test_validation_errors(engine, ids_len, params, message):
    core = engine.engine
    with pytest.raises(ValueError, match=message):
        core.add_request(None, [1] * ids_len, SamplingParams(**params))
    assert not core.has_unfinished() and not core.requests


def test_validation_token_ids_and_duplicates(engine):
    core = engine.engine
    vocab = core.model_config.vocab_size
    for bad in ([1, vocab], [-1, 2]):
        with pytest.raises(ValueError, match="token ids"):
            core.add_request(None, bad, SamplingParams())
    core.validate_request([1] * (CONTEXT - 10), SamplingParams(max_new_tokens=10))   # exactly fits
    rid = core.add_request("dup", [1, 2, 3], SamplingParams(max_new_tokens=1))
    with pytest.raises(ValueError, match="duplicate"):
        core.add_request("dup", [1, 2, 3], SamplingParams(max_new_tokens=1))
    while core.has_unfinished():
        core.step()
    assert rid not in core.requests
