"""Our Llama implementation against HF transformers on the same weights (float32)."""
from __future__ import annotations

import pytest
import torch

from specserve.engine import Engine
from specserve.runner.model_runner import ExtendSpec

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "Write a haiku about autumn leaves.",
    "What is 17 times 23? Explain step by step.",
    "Translate 'good morning, my friend' into French and Spanish.",
    "def fibonacci(n):",
    "List three facts about the Moon.",
    "Summarize: The quick brown fox jumps over the lazy dog because it was bored.",
    "Who wrote Pride and Prejudice?",
    "Give me a recipe for pancakes.",
    "Explain what a hash table is to a child.",
    "Write a limerick about a cat who loves jazz.",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def hf_model(hf_export_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_export_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def engine(default_gguf_path):
    return Engine(model_path=default_gguf_path, dtype="float32", max_total_tokens=4096,
                  context_length=2048)


def _chat_ids(engine, text):
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def _our_prompt_logits(engine, ids):
    core = engine.engine
    slots = core.pool.extend_slots([], len(ids))
    try:
        spec = ExtendSpec(row=0, prefix_len=0, token_ids=ids, new_slots=slots, num_logits=len(ids))
        return core.runner.forward([spec]).float()
    finally:
        core.pool.release_slots(slots)


def test_prompt_logits_match_hf(engine, hf_model):
    for text in PROMPTS[:3]:
        ids = _chat_ids(engine, text)
        ours = _our_prompt_logits(engine, ids)
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].float()
        assert ours.shape == ref.shape
        assert torch.allclose(ours, ref, atol=2e-3, rtol=1e-3), (ours - ref).abs().max()
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_matches_hf_generate(engine, hf_model):
    matches = 0
    for text in PROMPTS:
        ids = _chat_ids(engine, text)
        with torch.no_grad():   # both stop at the model's eos (<|im_end|>), which is kept
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                    pad_token_id=0)[0, len(ids):].tolist()
        ours = engine.generate(input_ids=ids, sampling_params={"temperature": 0,
                                                              "max_new_tokens": NEW_TOKENS})["output_ids"]
        matches += ours == ref
    assert matches >= 9, f"only {matches}/10 prompts matched HF greedy output"


def test_batched_greedy_equals_one_at_a_time(engine):
    ids = [_chat_ids(engine, t) for t in PROMPTS[:8]]
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    alone = [engine.generate(input_ids=x, sampling_params=params)["output_ids"] for x in ids]
    together = [r["output_ids"] for r in engine.generate(input_ids=ids, sampling_params=params)]
    assert together == alone
    core = engine.engine
    assert core.pool.num_free_tokens + core.radix.evictable_size() == core.pool.capacity_tokens
