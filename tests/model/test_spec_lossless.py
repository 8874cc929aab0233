"""Greedy speculative decoding == plain greedy decoding, token for token, on the default
model (SmolLM2-135M-Instruct, float32), for NGRAM, STANDALONE, the shipped drafts, and draft
models assisted by NGRAM (``--speculative-ngram-assist``).

Every speculative engine runs with ``SPECSERVE_SPEC_POLICY=always`` so each decode step
really speculates (on a CPU the cost model would often choose plain decoding).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from specserve.core import SamplingParams
from specserve.engine import Engine

EVAL_DIR = Path(__file__).resolve().parents[1] / "data" / "eval"      # vendored: tests/data/README.md
EVAL_FILES = ("vicuna_bench.jsonl", "eagle_humaneval.jsonl", "eagle_gsm8k.jsonl", "specserve_instructions.jsonl")
COPY_TEXT = ("Repeat this text exactly: The quick brown fox jumps over the lazy dog. Pack my box with "
             "five dozen liquor jugs. How vexingly quick daft zebras jump.")
NEW_TOKENS = 24
SHIPPED = ("EAGLE3", "EAGLE", "STANDALONE")
ASSISTED = ("STANDALONE + NGRAM assist", "shipped EAGLE3 + NGRAM assist")
ALGOS = ["NGRAM", "STANDALONE"] + [f"shipped {a}" for a in SHIPPED] + list(ASSISTED)
ENGINE_KW = {"dtype": "float32", "max_total_tokens": 8192, "context_length": 2048}


def _dev_prompts() -> list[str]:
    prompts = []
    for name in EVAL_FILES:
        with open(EVAL_DIR / name) as f:
            prompts += [json.loads(line)["turns"][0] for line, _ in zip(f, range(2))]
    return prompts                     # 8 prompts: 2 per file


def _always(build):
    old = os.environ.get("SPECSERVE_SPEC_POLICY")
    os.environ["SPECSERVE_SPEC_POLICY"] = "always"
    try:
        return build()
    finally:
        if old is None:
            os.environ.pop("SPECSERVE_SPEC_POLICY")
        else:
            os.environ["SPECSERVE_SPEC_POLICY"] = old


@pytest.fixture(scope="module")
def truncated_draft(default_gguf_path, tmp_path_factory) -> str:
    import torch

    from specserve.speculative.truncated_draft import write_truncated_draft

    out = tmp_path_factory.mktemp("draft8")
    return str(write_truncated_draft(default_gguf_path, out, num_layers=8, dtype=torch.bfloat16))


@pytest.fixture(scope="module")
def engines(default_gguf_path, truncated_draft) -> dict[str, Engine]:
    built = {"plain": Engine(model_path=default_gguf_path, **ENGINE_KW)}
    specs = {
        "NGRAM": {"speculative_algorithm": "NGRAM"},
        "STANDALONE": {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": truncated_draft},
        "SELF": {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": default_gguf_path,
                 "speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4},
    }
    specs["STANDALONE + NGRAM assist"] = {**specs["STANDALONE"], "speculative_ngram_assist": 4}
    from specserve.drafts import shipped_draft

    for algo in SHIPPED:                       # the drafts trained for the default model
        if shipped_draft(algo) is not None:
            specs["shipped " + algo] = {"speculative_algorithm": algo}
    if shipped_draft("EAGLE3") is not None:
        specs["shipped EAGLE3 + NGRAM assist"] = {"speculative_algorithm": "EAGLE3", "speculative_ngram_assist": 6}
    for name, kw in specs.items():
        built[name] = _always(lambda kw=kw: Engine(model_path=default_gguf_path, **ENGINE_KW, **kw))
    return built


def _engine_for(engines, algo):
    if algo not in engines:
        pytest.skip(f"no {algo} engine: its shipped draft is not in specserve/drafts")
    return engines[algo]


@pytest.fixture(scope="module")
def prompt_ids(engines) -> list[list[int]]:
    tok = engines["plain"].tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in _dev_prompts()]


_plain_cache: dict = {}


def _generate(engine: Engine, ids, params):
    return engine.generate(input_ids=ids, sampling_params=params)


def _plain(engines, ids, params):
    key = (json.dumps(ids), json.dumps(params))
    if key not in _plain_cache:
        _plain_cache[key] = _generate(engines["plain"], ids, params)
    return _plain_cache[key]


def _assert_no_kv_leak(engine: Engine):
    usage = engine.engine.kv_usage()
    assert usage["free"] + usage["evictable"] == usage["total"], usage


@pytest.mark.parametrize("algo", ALGOS)
def test_greedy_lossless_one_at_a_time(engines, prompt_ids, algo):
    engine = _engine_for(engines, algo)
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS}
    for ids in prompt_ids[::3]:                     # 3 prompts from different files
        ours = _generate(engine, ids, params)
        assert ours["output_ids"] == _plain(engines, ids, params)["output_ids"]
        assert ours["meta_info"]["spec_verify_ct"] > 0
    _assert_no_kv_leak(engine)


@pytest.mark.parametrize("algo", ALGOS)
def test_greedy_lossless_eight_concurrent(engines, prompt_ids, algo):
    engine = _engine_for(engines, algo)
    params = [{"temperature": 0, "max_new_tokens": 8 + 2 * i} for i in range(len(prompt_ids))]
    ours = _generate(engine, prompt_ids, params)
    plain = _plain(engines, prompt_ids, params)
    assert [o["output_ids"] for o in ours] == [o["output_ids"] for o in plain]
    _assert_no_kv_leak(engine)


def test_server_info_names_the_shipped_draft_and_map_in_use(engines):
    """Left unset, the draft and the FR-Spec map are the engine's choice: /get_server_info says
    which (the server's own arguments would show None)."""
    from specserve.drafts import FRSPEC_TOKEN_MAP, shipped_draft

    info = _engine_for(engines, "shipped EAGLE").engine.get_server_info()
    assert info["speculative_draft_model_path"] == str(shipped_draft("EAGLE"))
    assert info["speculative_token_map"] == str(FRSPEC_TOKEN_MAP)
    assert engines["NGRAM"].engine.get_server_info()["speculative_token_map"] is None
    from specserve.drafts import SHIPPED_NGRAM_CORPUS

    assert engines["NGRAM"].engine.get_server_info()["speculative_ngram_corpus"] == str(SHIPPED_NGRAM_CORPUS)


def test_ngram_drafts_an_answer_its_corpus_holds(engines, default_gguf_path, tmp_path):
    """A corpus holding the answer to a chat prompt drafts it from the first decode step (the
    cache alone has nothing to match there), and the output is still plain decoding's."""
    from specserve.speculative.ngram_corpus import write_corpus

    tok = engines["plain"].tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three primary colors."}]))
    params = {"temperature": 0, "max_new_tokens": 40}
    reference = _plain(engines, ids, params)["output_ids"]
    corpus = write_corpus([reference], tmp_path / "corpus", {"target": "test"})
    for path, least in ((corpus, 3.0), ("none", None)):
        engine = _always(lambda path=path: Engine(model_path=default_gguf_path, **ENGINE_KW,
                                                  speculative_algorithm="NGRAM", speculative_ngram_corpus=str(path)))
        out = _generate(engine, ids, params)
        assert out["output_ids"] == reference
        if least is not None:
            assert out["meta_info"]["spec_accept_length"] > least, out["meta_info"]
        else:
            assert out["meta_info"].get("spec_accept_length", 1.0) < 3.0, out["meta_info"]
        _assert_no_kv_leak(engine)


def test_ngram_copy_heavy_accepts_a_lot(engines):
    tok = engines["plain"].tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": COPY_TEXT}]))
    params = {"temperature": 0, "max_new_tokens": 40}
    ours = _generate(engines["NGRAM"], ids, params)
    assert ours["output_ids"] == _plain(engines, ids, params)["output_ids"]
    meta = ours["meta_info"]
    assert meta["spec_accept_length"] > 2.0, meta
    assert meta["spec_policy"] == "always"   # SPECSERVE_SPEC_POLICY, as every engine here
    assert meta["spec_drafted_steps"] == meta["spec_verify_ct"] > 0
    assert meta["spec_drafted_steps"] + meta["spec_plain_steps"] >= 1


@pytest.mark.parametrize("algo", ASSISTED)
def test_ngram_assist_drafts_the_copy_and_the_draft_model_the_rest(engines, algo):
    """Where the prompt holds what the answer copies, NGRAM's trees come first; the steps it
    has no match for, the draft model drafts (every step drafts under ``always``)."""
    engine = _engine_for(engines, algo)
    tok = engines["plain"].tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": COPY_TEXT}]))
    params = {"temperature": 0, "max_new_tokens": 40}

    def counts():
        policy = engine.engine.get_server_info()["spec_policy"]
        return policy["request_steps_drafted_by_ngram"], policy["request_steps_drafted"]

    ngram_before, drafted_before = counts()
    ours = _generate(engine, ids, params)
    assert ours["output_ids"] == _plain(engines, ids, params)["output_ids"]
    ngram, drafted = (after - before for after, before in zip(counts(), (ngram_before, drafted_before)))
    assert 0 < ngram < drafted, (ngram, drafted)
    assert ours["meta_info"]["spec_accept_length"] > 2.0, ours["meta_info"]
    assert engine.engine.get_server_info()["speculative_ngram_assist"] > 0
    _assert_no_kv_leak(engine)


def test_target_as_draft_accepts_every_drafted_token(engines, prompt_ids):
    engine = engines["SELF"]
    before = dict(engine.engine.get_server_info())
    params = [{"temperature": 0, "max_new_tokens": 17} for _ in prompt_ids[:4]]
    ours = _generate(engine, prompt_ids[:4], params)
    assert [o["output_ids"] for o in ours] == [o["output_ids"] for o in _plain(engines, prompt_ids[:4], params)]
    after = engine.engine.get_server_info()
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = sum(o["meta_info"]["spec_verify_ct"] * (o["meta_info"]["spec_accept_length"] - 1) for o in ours)
    assert drafted > 0 and round(accepted) == drafted
    assert min(o["meta_info"]["spec_accept_length"] for o in ours) > 3.0


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5])
def test_max_tokens_and_stop_strings_inside_accepted_runs(engines, max_new_tokens):
    tok = engines["plain"].tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": COPY_TEXT}]))
    for params in ({"temperature": 0, "max_new_tokens": max_new_tokens},
                   {"temperature": 0, "max_new_tokens": 40, "stop": ["lazy", "jugs"]},
                   {"temperature": 0, "max_new_tokens": 40, "stop_token_ids": [957]}):
        plain = _plain(engines, ids, params)
        for algo in ("NGRAM", "SELF"):
            ours = _generate(engines[algo], ids, params)
            assert ours["output_ids"] == plain["output_ids"], (algo, params)
            assert ours["text"] == plain["text"]
            assert ours["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
            _assert_no_kv_leak(engines[algo])


def test_logprobs_match_plain(engines, prompt_ids):
    params = {"temperature": 0, "max_new_tokens": 12, "return_logprob": True, "top_logprobs_num": 2}
    core_plain, core_spec = engines["plain"].engine, engines["SELF"].engine
    results = []
    for core in (core_plain, core_spec):
        rid = core.add_request(None, prompt_ids[1], SamplingParams(**params))
        logprobs, tops = [], []
        while core.has_unfinished():
            for out in core.step():
                if out.rid == rid:
                    logprobs += out.new_logprobs
                    tops += out.new_top_logprobs
        results.append((logprobs, tops))
    (lp_plain, top_plain), (lp_spec, top_spec) = results
    assert len(lp_spec) == len(lp_plain) == 12
    assert max(abs(a - b) for a, b in zip(lp_plain, lp_spec)) < 1e-3
    assert [[t for t, _ in row] for row in top_spec] == [[t for t, _ in row] for row in top_plain]


def test_steps_where_nobody_speculates_are_plain_decode_steps(engines, prompt_ids, monkeypatch):
    """NGRAM catches up lazily, so a step where the policy picks nobody runs the engine's plain
    decode forward; the KV slots reserved for the trees must go back to the pool."""
    engine = engines["NGRAM"]
    worker = engine.engine.spec_worker
    monkeypatch.setattr(worker.policy, "select", lambda states, nodes, depths, *hint: [1] * len(states))
    calls = []
    plain_step = worker._plain_step
    monkeypatch.setattr(worker, "_plain_step", lambda *a: calls.append(1) or plain_step(*a))
    params = [{"temperature": 0, "max_new_tokens": 8 + 2 * i} for i in range(len(prompt_ids))]
    ours = _generate(engine, prompt_ids, params)
    assert [o["output_ids"] for o in ours] == [o["output_ids"] for o in _plain(engines, prompt_ids, params)]
    assert calls and all(o["meta_info"]["spec_verify_ct"] == 0 for o in ours)
    _assert_no_kv_leak(engine)


def test_standalone_catches_up_after_plain_steps(engines, prompt_ids, monkeypatch):
    """STANDALONE catches up lazily too: a step where the policy picks nobody is the engine's
    plain decode step, and the next draft first extends the draft model over the tokens it
    missed. With the target as its own draft every drafted token is then still accepted; a
    draft KV left stale by the plain steps would lose acceptance."""
    engine = engines["SELF"]
    worker = engine.engine.spec_worker
    select, calls, plain_calls = worker.policy.select, [0], []

    def every_other_step(states, nodes, depths, *hint):
        calls[0] += 1
        return [1] * len(states) if calls[0] % 2 else select(states, nodes, depths, *hint)

    monkeypatch.setattr(worker.policy, "select", every_other_step)
    plain_step = worker._plain_step
    monkeypatch.setattr(worker, "_plain_step", lambda *a: plain_calls.append(1) or plain_step(*a))
    before = dict(engine.engine.get_server_info())
    params = [{"temperature": 0, "max_new_tokens": 20} for _ in prompt_ids[:3]]
    ours = _generate(engine, prompt_ids[:3], params)
    assert [o["output_ids"] for o in ours] == [o["output_ids"] for o in _plain(engines, prompt_ids[:3], params)]
    drafted = engine.engine.get_server_info()["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = sum(o["meta_info"]["spec_verify_ct"] * (o["meta_info"]["spec_accept_length"] - 1) for o in ours)
    assert plain_calls and drafted > 0 and round(accepted) == drafted
    _assert_no_kv_leak(engine)
