"""On the integer path (``--quantization gguf``), greedy speculative decoding == plain greedy
decoding, token for token, on the default model (float32): verify widths 2..16 and batches of
1..8 rows give each row the bits plain decoding gives it. The target serving as its own draft
(SELF) must accept every drafted token: any row-dependence of the kernels breaks that.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from specserve.engine import Engine
from specserve.kernels import int_codes
from specserve.runner.model_runner import forward_on_free_slots

pytestmark = pytest.mark.skipif(not int_codes.is_available(), reason="CPU kernels not built here")

EVAL_DIR = Path(__file__).resolve().parents[1] / "data" / "eval"
EVAL_FILES = ("vicuna_bench.jsonl", "eagle_humaneval.jsonl", "eagle_gsm8k.jsonl", "specserve_instructions.jsonl")
ENGINE_KW = {"dtype": "float32", "max_total_tokens": 8192, "context_length": 2048, "quantization": "gguf"}
SPECS = {
    "NGRAM": {"speculative_algorithm": "NGRAM"},
    "SELF4": {"speculative_algorithm": "STANDALONE", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
              "speculative_num_draft_tokens": 4},
    "SELF16": {"speculative_algorithm": "STANDALONE", "speculative_num_steps": 15, "speculative_eagle_topk": 1,
               "speculative_num_draft_tokens": 16},
    "EAGLE3": {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 4, "speculative_eagle_topk": 4,
               "speculative_num_draft_tokens": 8},     # the shipped head, its linears in Q8_0 blocks
}


def _prompts() -> list[str]:
    prompts = []
    for name in EVAL_FILES:
        with open(EVAL_DIR / name) as f:
            prompts += [json.loads(line)["turns"][0] for line, _ in zip(f, range(2))]
    return prompts                     # 8 prompts: 2 per file


@pytest.fixture(scope="module")
def engines(default_gguf_path) -> dict[str, Engine]:
    old = os.environ.get("SPECSERVE_SPEC_POLICY")
    os.environ["SPECSERVE_SPEC_POLICY"] = "always"      # every decode step speculates
    try:
        built = {"plain": Engine(model_path=default_gguf_path, **ENGINE_KW)}
        for name, kw in SPECS.items():
            if name.startswith("SELF"):
                kw = {**kw, "speculative_draft_model_path": default_gguf_path}
            built[name] = Engine(model_path=default_gguf_path, **ENGINE_KW, **kw)
    finally:
        if old is None:
            os.environ.pop("SPECSERVE_SPEC_POLICY")
        else:
            os.environ["SPECSERVE_SPEC_POLICY"] = old
    return built


@pytest.fixture(scope="module")
def prompt_ids(engines) -> list[list[int]]:
    tok = engines["plain"].tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in _prompts()]


def test_the_integer_path_is_in_use(engines):
    model = engines["plain"].engine.runner.model
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.int_panels is not None and model.lm_head.int_panels is not None


def test_the_draft_head_runs_the_integer_kernel_too(engines):
    head = engines["EAGLE3"].engine.spec_worker.proposer.head
    assert head.lm_head.int_panels is not None and head.midlayer.mlp.down_proj.int_panels is not None


@pytest.mark.parametrize("algo", list(SPECS))
def test_greedy_lossless_one_at_a_time(engines, prompt_ids, algo):
    params = {"temperature": 0, "max_new_tokens": 24}
    for ids in prompt_ids[::3]:
        ours = engines[algo].generate(input_ids=ids, sampling_params=params)
        plain = engines["plain"].generate(input_ids=ids, sampling_params=params)
        assert ours["output_ids"] == plain["output_ids"]
        assert ours["meta_info"]["spec_verify_ct"] > 0


@pytest.mark.parametrize("algo", list(SPECS))
def test_greedy_lossless_eight_concurrent(engines, prompt_ids, algo):
    params = [{"temperature": 0, "max_new_tokens": 8 + 2 * i} for i in range(len(prompt_ids))]
    ours = engines[algo].generate(input_ids=prompt_ids, sampling_params=params)
    plain = engines["plain"].generate(input_ids=prompt_ids, sampling_params=params)
    assert [o["output_ids"] for o in ours] == [o["output_ids"] for o in plain]


@pytest.mark.parametrize("algo", ["SELF4", "SELF16"])
def test_target_as_draft_accepts_every_drafted_token(engines, prompt_ids, algo):
    """Draft rows (one at a time) and verify rows (W at once, several requests) get the same bits."""
    engine = engines[algo]
    width = SPECS[algo]["speculative_num_draft_tokens"]
    before = dict(engine.engine.get_server_info())
    params = [{"temperature": 0, "max_new_tokens": 2 * width + 1} for _ in prompt_ids[:4]]
    ours = engine.generate(input_ids=prompt_ids[:4], sampling_params=params)
    drafted = engine.engine.get_server_info()["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = sum(o["meta_info"]["spec_verify_ct"] * (o["meta_info"]["spec_accept_length"] - 1) for o in ours)
    assert drafted > 0 and round(accepted) == drafted


@pytest.mark.parametrize("num_tokens", [1, 3, 9])
def test_thread_count_does_not_change_the_logits(engines, prompt_ids, num_tokens):
    """A forward of 1 or 3 rows on 2 threads (each thread quantizing its own copy of the linears'
    inputs) or of 9 (row-wise steps split by rows) gives one thread's logits, bit for bit."""
    core = engines["plain"].engine
    tokens = prompt_ids[0][:num_tokens]
    threads = torch.get_num_threads()
    logits = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            logits.append(forward_on_free_slots(core.runner, core.pool, tokens))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(logits[0], logits[1])


def test_greedy_lossless_with_a_bfloat16_kv_cache(default_gguf_path, prompt_ids):
    """``--kv-cache-dtype bf16``: the cache holds bfloat16, and speculation (every step) still
    gives plain decoding's tokens on the same cache dtype."""
    kw = {**ENGINE_KW, "kv_cache_dtype": "bf16"}
    plain = Engine(model_path=default_gguf_path, **kw)
    old = os.environ.get("SPECSERVE_SPEC_POLICY")
    os.environ["SPECSERVE_SPEC_POLICY"] = "always"
    try:
        ngram = Engine(model_path=default_gguf_path, **kw, **SPECS["NGRAM"])
    finally:
        if old is None:
            os.environ.pop("SPECSERVE_SPEC_POLICY")
        else:
            os.environ["SPECSERVE_SPEC_POLICY"] = old
    assert plain.engine.runner.kv_cache.k.dtype == torch.bfloat16
    params = [{"temperature": 0, "max_new_tokens": 24} for _ in prompt_ids]
    ours = ngram.generate(input_ids=prompt_ids, sampling_params=params)
    reference = plain.generate(input_ids=prompt_ids, sampling_params=params)
    assert [o["output_ids"] for o in ours] == [o["output_ids"] for o in reference]
    assert sum(o["meta_info"]["spec_verify_ct"] for o in ours) > 0
