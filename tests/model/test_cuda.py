"""The same engine on CUDA (skipped without a GPU; CI is CPU-only)."""
from __future__ import annotations

import pytest
import torch

from specserve.engine import Engine

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT = "List three facts about the Moon."


def _greedy(device: str, model_path: str) -> list[int]:
    engine = Engine(model_path=model_path, device=device, dtype="float32", max_total_tokens=4096,
                    context_length=2048)
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]))
    out = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 16})
    engine.shutdown()
    return out["output_ids"]


def test_cuda_greedy_matches_cpu(default_gguf_path):
    cuda, cpu = _greedy("cuda", default_gguf_path), _greedy("cpu", default_gguf_path)
    assert cuda[:8] == cpu[:8]   # float32 on both; later tokens may flip on near-ties


def test_cuda_batch_runs_and_frees_kv(default_gguf_path):
    engine = Engine(model_path=default_gguf_path, device="cuda", max_total_tokens=4096, context_length=2048)
    outs = engine.generate(prompt=[PROMPT] * 4, sampling_params={"temperature": 0, "max_new_tokens": 8})
    assert len({tuple(o["output_ids"]) for o in outs}) == 1
    core = engine.engine
    assert core.pool.num_free_tokens + core.radix.evictable_size() == core.pool.capacity_tokens
