"""``specserve bench kv-cache`` on the default GGUF: the perplexity it reports comes from logits
that agree with decoding, and a bfloat16 cache leaves the model's perplexity where it was."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from specserve.bench import cli, kv_cache, serving
from specserve.runner.model_runner import forward_on_free_slots

PROMPTS = ",".join(str(p) for p in sorted((Path(__file__).parents[1] / "data" / "eval").glob("*.jsonl")))


def _args(default_gguf_path: str, *extra: str):
    args = cli.parse_args(["kv-cache", "--model-path", default_gguf_path, "--threads", "2", "--prompts", PROMPTS,
                           *extra])
    args.model_path = default_gguf_path
    return args


def test_prompt_logits_end_with_the_token_decoding_picks(default_gguf_path):
    args = _args(default_gguf_path)
    engine = serving.make_engine(serving.engine_kwargs(args, "float32", disable_radix_cache=True,
                                                       quantization="gguf"))
    try:
        text = kv_cache._long_texts(1, [Path(p) for p in PROMPTS.split(",")])[0]
        ids = kv_cache._prompt_ids(engine.tokenizer, text, 96)
        assert 92 <= len(ids) <= 96
        free_before = engine.engine.pool.num_free_tokens
        logits = forward_on_free_slots(engine.engine.runner, engine.engine.pool, ids, is_prefill=True)
        assert engine.engine.pool.num_free_tokens == free_before        # its slots went back
        first = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
        assert logits.shape[0] == len(ids)
        assert int(logits[-1].argmax()) == first["output_ids"][0]
    finally:
        serving.close_engine(engine)


def test_a_bfloat16_cache_keeps_the_perplexity(default_gguf_path):
    result = kv_cache.run(_args(default_gguf_path, "--prompt-tokens", "64,160", "--num-prompts", "2",
                                "--max-new-tokens", "4"))
    assert [row["prompt_tokens"] for row in result["rows"]] == [64, 160]
    for row in result["rows"]:
        assert set(row["decode_tok_s"]) == {"auto", "bf16"} and min(row["decode_tok_s"].values()) > 0
        assert 0 <= row["identical"] <= row["compared"] == 2
    ppl = result["perplexity"]
    assert all(math.isfinite(v) and 1.0 < v < 200.0 for v in ppl.values())
    assert ppl["bf16"] == pytest.approx(ppl["auto"], rel=0.02)


def test_prompt_lengths_are_checked_before_any_engine_is_built(default_gguf_path):
    with pytest.raises(ValueError, match="--prompt-tokens"):
        kv_cache.run(_args(default_gguf_path, "--prompt-tokens", "4000"))
