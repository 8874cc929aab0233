"""``python -m specserve.bench.backends``: the torch and JAX backends side by side on the same
prompts, offline engine, float32: batch 1 (prompts one after another) and N concurrent,
plain and with a speculative algorithm (default EAGLE3, shipped head). Prints startup time
(the JAX backend's precompile included and given apart), output tokens/s, accept length and
whether the greedy outputs of the two backends agree. Figures, never assertions."""
from __future__ import annotations

import argparse
import json
import os
import time

from specserve.bench import prompts as prompt_data
from specserve.engine import Engine


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backends", default="torch,jax")
    parser.add_argument("--speculative-algorithm", default="EAGLE3", help="'none' for plain only")
    parser.add_argument("--speculative-policy", default="always",
                        help="always (measure the drafts) or auto (speculate where the cost model says it pays)")
    parser.add_argument("--no-plain", action="store_true", help="only the speculative runs")
    parser.add_argument("--num-prompts", type=int, default=4, help="batch-1 prompts (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--precompile-bs-paddings", default="1,2,4,8")
    parser.add_argument("--precompile-token-paddings", default="64,128,256")
    return parser.parse_args()


def _engine(args: argparse.Namespace, backend: str, algo: str | None) -> tuple[Engine, float]:
    kwargs = {"backend": backend, "dtype": "float32", "context_length": 2048, "max_total_tokens": 32768,
              "max_running_requests": max(8, args.concurrency)}
    if backend == "jax":
        kwargs.update(precompile_bs_paddings=args.precompile_bs_paddings,
                      precompile_token_paddings=args.precompile_token_paddings)
    if algo:
        kwargs.update(speculative_algorithm=algo, speculative_policy=args.speculative_policy)
    start = time.perf_counter()
    engine = Engine(**kwargs)
    return engine, time.perf_counter() - start


def _generate(engine: Engine, id_lists: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], float]:
    params = [{"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True} for _ in id_lists]
    start = time.perf_counter()
    outs = engine.generate(input_ids=id_lists, sampling_params=params)
    return [o["output_ids"] for o in outs], time.perf_counter() - start


def _measure(args, engine: Engine, prompts: list[list[int]]) -> dict:
    _generate(engine, prompts[:1], 8)                                        # warm-up
    outputs, seconds = [], 0.0
    for ids in prompts[:args.num_prompts]:                                   # batch 1
        out, sec = _generate(engine, [ids], args.max_new_tokens)
        outputs += out
        seconds += sec
    batch1 = sum(map(len, outputs)) / seconds
    many, sec = _generate(engine, prompts[:args.concurrency], args.max_new_tokens)
    stats = engine.engine.stats
    return {"batch1_tok_s": round(batch1, 2), f"concurrent{args.concurrency}_tok_s": round(sum(map(len, many)) / sec, 2),
            "accept_len": round(stats.avg_spec_accept_length, 2), "verifies": stats.spec_verify_ct,
            "outputs": outputs + many}


def main() -> None:
    args = _parse()
    algos = ([] if args.no_plain else [None]) + ([] if args.speculative_algorithm.lower() == "none" else [args.speculative_algorithm.upper()])
    texts = prompt_data.load_mixed_prompts(max(args.num_prompts, args.concurrency))
    rows, outputs = [], {}
    for backend in args.backends.split(","):
        for algo in algos:
            engine, startup = _engine(args, backend, algo)
            prompts = [prompt_data.chat_ids(engine.tokenizer, p.text, 1024) for p in texts]
            result = _measure(args, engine, prompts)
            outputs[(backend, algo)] = result.pop("outputs")
            precompile = getattr(engine.engine.runner, "precompile_seconds", 0.0)
            rows.append({"backend": backend, "spec": algo or "plain", "startup_s": round(startup, 1),
                         "precompile_s": round(precompile, 1), **result})
            print(json.dumps(rows[-1]), flush=True)
            engine.shutdown() if hasattr(engine, "shutdown") else None
    _print_agreement(outputs)
    print(f"CPU: {_cpu_name()}, {os.cpu_count()} logical cores, load average {os.getloadavg()[0]:.1f}")


def _print_agreement(outputs: dict) -> None:
    keys = list(outputs)
    for key in keys[1:]:
        same = sum(a == b for a, b in zip(outputs[keys[0]], outputs[key]))
        print(f"greedy outputs equal to {keys[0]}: {key}: {same}/{len(outputs[key])}")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
