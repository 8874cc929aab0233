"""Engines and prompts shared by the JAX backend's tests (tiny random models from
tests/model, small buckets so that compiling stays cheap on two cores)."""
from __future__ import annotations

import torch

from specserve.core import SamplingParams
from specserve.engine import Engine

SMALL_BUCKETS = {"precompile_bs_paddings": "4,16", "precompile_token_paddings": "64",
                 "disable_precompile": True}
TINY_BUCKETS = {"precompile_bs_paddings": "8", "precompile_token_paddings": "64", "disable_precompile": True}


def tiny_engine(model: str, backend: str = "jax", **kwargs) -> Engine:
    settings = dict({"max_total_tokens": 4096, "context_length": 256, "max_running_requests": 16}, **kwargs)
    if backend == "jax":
        settings = dict(TINY_BUCKETS, **settings)
    return Engine(model_path=model, backend=backend, dtype="float32", **settings)


def random_prompts(num: int, seed: int, vocab: int = 32) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 60, (num,), generator=g).tolist()
    shared = torch.randint(0, vocab - 1, (20,), generator=g).tolist()      # a common prefix for radix hits
    return [(shared if i % 2 else []) + torch.randint(0, vocab - 1, (n,), generator=g).tolist()
            for i, n in enumerate(lengths)]


def greedy(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """All prompts at once (continuous batching), greedy, EOS ignored."""
    params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    outs = engine.generate(input_ids=prompts, sampling_params=[dict(params) for _ in prompts])
    return [o["output_ids"] for o in outs]


def staggered(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Requests arrive one per step with different lengths and stops, so the batch changes."""
    core = engine.engine
    pending = list(enumerate(prompts))
    rids, outputs = {}, {}
    while pending or core.has_unfinished():
        if pending:
            i, ids = pending.pop(0)
            params = SamplingParams(temperature=0, max_new_tokens=4 + (7 * i) % 17, ignore_eos=i % 3 == 0)
            rids[core.add_request(None, ids, params)] = i
        for out in core.step():
            outputs.setdefault(rids[out.rid], []).extend(out.new_token_ids)
    usage = core.kv_usage()
    assert usage["free"] + usage["evictable"] == usage["total"], usage
    return [outputs[i] for i in range(len(prompts))]
