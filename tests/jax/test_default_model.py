"""The JAX backend on the default model (SmolLM2-135M-Instruct, float32).

* Greedy output equals the torch backend's exact float32 path on at least 9 of 10 prompts
  over 64 tokens (the two backends' matmuls round differently, so a near-tie may flip).
* Greedy speculative output with the shipped EAGLE3 and EAGLE heads (the same folders the
  torch backend loads) and NGRAM equals the JAX backend's own plain decoding.
"""
from __future__ import annotations

import pytest

from specserve.engine import Engine
from tests.jax.helpers import SMALL_BUCKETS
from tests.jax.prompts import PROMPTS

ENGINE_KW = {"dtype": "float32", "max_total_tokens": 4096, "context_length": 512, "max_running_requests": 16}
NEW_TOKENS = 64


def _chat_ids(engine: Engine, prompt: str) -> list[int]:
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return engine.tokenizer.encode(text)


def _greedy(engine: Engine, prompts: list[str], new_tokens: int) -> list[list[int]]:
    ids = [_chat_ids(engine, p) for p in prompts]
    params = [{"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True} for _ in ids]
    return [o["output_ids"] for o in engine.generate(input_ids=ids, sampling_params=params)]


@pytest.fixture(scope="module")
def jax_plain(default_gguf_path) -> Engine:
    return Engine(model_path=default_gguf_path, backend="jax", **SMALL_BUCKETS, **ENGINE_KW)


def test_greedy_matches_the_torch_backend(default_gguf_path, jax_plain):
    torch_engine = Engine(model_path=default_gguf_path, backend="torch", **ENGINE_KW)
    expected = _greedy(torch_engine, list(PROMPTS), NEW_TOKENS)
    got = _greedy(jax_plain, list(PROMPTS), NEW_TOKENS)
    assert all(len(g) == NEW_TOKENS for g in got)
    same = sum(g == e for g, e in zip(got, expected))
    assert same >= 9, f"only {same} of {len(PROMPTS)} prompts give the torch backend's greedy output"


@pytest.mark.slow            # ~45 s each on two cores, mostly compiling (tests/jax/test_spec_tiny.py: fast)
@pytest.mark.parametrize("algo", ["EAGLE3", "EAGLE", "NGRAM"])
def test_shipped_speculation_equals_plain_decoding(default_gguf_path, jax_plain, algo):
    from specserve.drafts import shipped_draft

    if algo != "NGRAM" and shipped_draft(algo) is None:
        pytest.skip(f"no shipped {algo} draft")
    engine = Engine(model_path=default_gguf_path, backend="jax", speculative_algorithm=algo, **SMALL_BUCKETS,
                    **ENGINE_KW)
    assert engine.engine.spec_worker is not None, "the shipped draft did not load"
    prompts = list(PROMPTS[:4])
    assert _greedy(engine, prompts, 48) == _greedy(jax_plain, prompts, 48)
    assert engine.engine.stats.spec_verify_ct > 0
