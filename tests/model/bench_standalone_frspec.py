"""Prints (never asserts) what the FR-Spec token map saves a STANDALONE draft step: the shipped
SmolLM2 draft (3 layers, hidden 192, vocab 49152) with and without the shipped 8k map.

    .venv/bin/python tests/model/bench_standalone_frspec.py [--threads N] [--repeats R]

Per configuration: the draft's LM head alone and one whole draft forward (layers + head) of
``rows`` one-token rows after a 256-token context (rows = 1: a chain step / catch-up of one
request; 4: a K = 4 frontier step), median of R runs; then end-to-end greedy decoding with
the shipped shape and ``--speculative-policy always`` on a few prompts.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from specserve.drafts import FRSPEC_TOKEN_MAP
from specserve.engine import Engine
from specserve.kernels import skinny
from specserve.loading.default_model import ensure_default_model
from specserve.runner.model_runner import ExtendSpec

CONTEXT = 256
ENGINE_KW = {"dtype": "float32", "max_total_tokens": 4096, "context_length": 1024}
PROMPTS = ("Write a haiku about the sea.", "Explain what a hash table is in two sentences.",
           "List three prime numbers and say why they are prime.")


def _median_ms(fn, repeats: int) -> float:
    """Median ms of ``fn``: this thread's CPU time at one thread (steady on a shared machine:
    all work runs on the calling thread), else wall time."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def draft_step_ms(engine: Engine, rows: int, repeats: int) -> tuple[float, float]:
    """(LM head ms, whole draft forward ms) for ``rows`` one-token rows after CONTEXT tokens."""
    runner = engine.engine.spec_worker.proposer.runner
    runner.forward([ExtendSpec(row=0, prefix_len=0, token_ids=[5] * CONTEXT, new_slots=list(range(CONTEXT)))])
    for row in range(1, rows):
        runner.req_to_token[row, :CONTEXT] = runner.req_to_token[0, :CONTEXT]
    specs = [ExtendSpec(row=r, prefix_len=CONTEXT, token_ids=[7], new_slots=[CONTEXT + r]) for r in range(rows)]
    hidden = torch.randn(rows, runner.config.hidden_size, dtype=runner.dtype)
    head_ms = _median_ms(lambda: runner.model.lm_head(hidden), repeats)
    return head_ms, _median_ms(lambda: runner.forward(specs), repeats)


def decode_tokens_per_s(engine: Engine, prompt_ids: list[list[int]]) -> tuple[float, float]:
    """(tokens/s, mean accept length) of greedy decoding, prompts one at a time."""
    params = {"temperature": 0, "max_new_tokens": 96}
    engine.generate(input_ids=prompt_ids[0], sampling_params=dict(params, max_new_tokens=8))   # warm
    t0, tokens, accept = time.perf_counter(), 0, []
    for ids in prompt_ids:
        out = engine.generate(input_ids=ids, sampling_params=params)
        tokens += len(out["output_ids"])
        accept.append(out["meta_info"].get("spec_accept_length") or 1.0)
    return tokens / (time.perf_counter() - t0), statistics.mean(accept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="1: CPU-time clock (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = ensure_default_model()
    configs = {"full vocab": {}, "FR-Spec 8k": {"speculative_token_map": str(FRSPEC_TOKEN_MAP)}}
    engines = {name: Engine(model_path=model, speculative_algorithm="STANDALONE", speculative_policy="always",
                            **ENGINE_KW, **extra) for name, extra in configs.items()}
    plain = Engine(model_path=model, **ENGINE_KW)
    tok = plain.tokenizer
    prompt_ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    print(f"CPU: {platform.processor() or platform.machine()}, kernels {skinny.kernel_variant()}, "
          f"{args.threads} thread(s) ({'thread CPU time' if args.threads == 1 else 'wall time'}), float32, "
          f"draft context {CONTEXT}, median of {args.repeats}")
    for rows in (1, 4):
        for name, engine in engines.items():
            head_ms, step_ms = draft_step_ms(engine, rows, args.repeats)
            print(f"  {name:11s} rows={rows}: LM head {head_ms:6.3f} ms, draft forward {step_ms:6.3f} ms")
    print("end to end (shipped shape, policy always, 96 new tokens x 3 prompts):")
    for name, engine in {"plain": plain, **engines}.items():
        tps, accept = decode_tokens_per_s(engine, prompt_ids)
        print(f"  {name:11s}: {tps:6.1f} tokens/s, accept length {accept:.2f}")


if __name__ == "__main__":
    main()
