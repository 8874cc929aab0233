"""``specserve bench load-memory``: what loading a GGUF on the integer path costs in memory.

Each run loads the model in a process of its own (``--quantization gguf``, float32, CPU, a
KV cache of 512 tokens in bfloat16), then times plain decode steps on a 64-token context;
printed per variant: seconds to load, the peak and final resident memory, ms per step.
Variants: ``lean`` (what the engine does: the decoder layers' linears held as their blocks
alone) and ``dense`` (every weight first written as float32, the layers' copies dropped after:
the loading before 2026-11-29). ``--synthetic llama-1b|llama-7b`` loads a Q4_0 GGUF of that
shape with random blocks (``bench/synthetic_gguf.py``), written once into
``~/.cache/specserve/synthetic``.

    specserve bench load-memory --variants lean,dense
    specserve bench load-memory --synthetic llama-7b --variants lean
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from specserve.bench.synthetic_gguf import SHAPES, write_random_gguf

VARIANTS = ("lean", "dense")
SYNTHETIC_DIR = Path.home() / ".cache" / "specserve" / "synthetic"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--variants", default="lean,dense", help="of %s, in turns (default %%(default)s)" % (VARIANTS,))
    parser.add_argument("--runs", type=int, default=1, help="rounds of every variant, taking turns (default 1)")
    parser.add_argument("--synthetic", choices=sorted(SHAPES), default=None,
                        help="a random-block Q4_0 GGUF of this shape instead of --model-path")
    parser.add_argument("--decode-steps", type=int, default=16, help="plain decode steps timed (default 16)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or any(v not in VARIANTS for v in variants):
        raise ValueError(f"--variants takes {', '.join(VARIANTS)} (got {args.variants!r})")
    if args.runs < 1:
        raise ValueError(f"--runs must be at least 1 (got {args.runs})")
    path = str(args.model_path)
    if args.synthetic:
        path = str(write_random_gguf(SYNTHETIC_DIR / f"{args.synthetic}-q4_0.gguf", SHAPES[args.synthetic]))
    runs = [_child(path, variant, args.threads, args.decode_steps) for _ in range(args.runs) for variant in variants]
    result = {"model_path": path, "gguf_mib": os.path.getsize(path) / 2**20, "runs": runs}
    _print(result, variants)
    return result


def _child(path: str, variant: str, threads: int | None, steps: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "specserve.bench.load_memory", "--child", path, variant, str(threads or 0),
               str(steps)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        return {"variant": variant, "error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _print(result: dict[str, Any], variants: list[str]) -> None:
    print(f"loading {result['model_path']} ({result['gguf_mib']:.0f} MiB), --quantization gguf, float32:")
    for variant in variants:
        runs = [r for r in result["runs"] if r["variant"] == variant]
        errors = [r["error"] for r in runs if "error" in r]
        good = [r for r in runs if "error" not in r]
        if errors:
            print(f"  {variant}: failed: {errors[0]}")
        if good:
            med = lambda key: statistics.median(r[key] for r in good)   # noqa: E731
            print(f"  {variant}: load {med('load_s'):.1f} s, peak {med('peak_mib'):.0f} MiB, resident after "
                  f"{med('rss_mib'):.0f} MiB, decode {med('step_ms'):.1f} ms a step ({len(good)} run(s))")


def measure(path: str, variant: str, steps: int) -> dict[str, Any]:
    """Load ``path`` as the engine does (``variant`` dense: every dense weight written first) and
    time ``steps`` plain decode steps after a 64-token context."""
    import psutil
    import torch

    from specserve.cache.block_pool import BlockPool
    from specserve.loading.loader import read_checkpoint
    from specserve.runner import model_runner

    if variant == "dense":
        model_runner.codes_only_weights = lambda *args: []
    start = time.perf_counter()
    cfg, weights = read_checkpoint(path, dense_from_blocks=variant == "lean")   # as the engine reads it
    runner = model_runner.ModelRunner(cfg, weights, dtype=torch.float32, device="cpu", max_position=512,
                                      num_kv_slots=512, page_size=1, max_rows=2, max_row_len=512,
                                      quantization="gguf", kv_dtype=torch.bfloat16)
    load_s = time.perf_counter() - start
    rss_mib = psutil.Process().memory_info().rss / 2**20
    times = []
    with torch.inference_mode(), model_runner.forwards_after_context(runner, BlockPool(512), [1] * 64, 1) as forward:
        for _ in range(steps + 2):
            t = time.perf_counter()
            forward(1)
            times.append(time.perf_counter() - t)
    return {"variant": variant, "load_s": load_s, "rss_mib": rss_mib, "step_ms": 1000 * statistics.median(times[2:]),
            "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _, _, child_path, child_variant, child_threads, child_steps = sys.argv
    if int(child_threads):
        import torch

        torch.set_num_threads(int(child_threads))
    print(json.dumps(measure(child_path, child_variant, int(child_steps))))
