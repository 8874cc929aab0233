"""The integer kernel alone, per kernel build: a model's linears (default SmolLM2-135M's 30 layers
of qkv, o, gate_up and down, random Q4_1 blocks) at each row count, the builds taking turns in
one process; each call one native call, as a decoder layer's linear is.

    python -m specserve.bench.int_linears --variants avx2,avx_vnni_evex --rows 1,4,8,16 --threads 2

Prints per row count: ms per pass over the linears (median) for each build, and each build's speed
against the first. ``--variants`` takes ``build.VARIANT_NAMES`` and the test builds
(``build.TEST_BUILDS``: e.g. ``avx_vnni_evex``, the avx_vnni tile through AVX-512's encoding).
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch
from tqdm import tqdm

from specserve.bench import serving
from specserve.kernels import build, int_codes, skinny
from specserve.kernels.coded import CODE_BLOCK, BlockCodes

SMOLLM2_135M = ((960, 576), (576, 576), (3072, 576), (576, 1536))     # [N, K] of qkv, o, gate_up, down


def random_q4_1(num_rows: int, num_in: int, generator: torch.Generator) -> BlockCodes:
    """Q4_1 blocks of random codes, float16 scales and mins."""
    codes = torch.randint(0, 16, (num_rows, num_in), dtype=torch.uint8, generator=generator)
    scales = (torch.rand(num_rows, num_in // CODE_BLOCK, generator=generator) * 0.02).half().float()
    mins = (-torch.rand(num_rows, num_in // CODE_BLOCK, generator=generator) * 0.1).half().float()
    return BlockCodes(codes, scales, mins, 4)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="the integer kernel's linears per kernel build, in turns, one process")
    names = [*build.VARIANT_NAMES, *build.TEST_BUILDS]
    p.add_argument("--variants", default="avx2,avx_vnni_evex", help=f"of {', '.join(names)} (default %(default)s)")
    p.add_argument("--rows", default="1,4,8,16", help="input rows per call, comma-separated (default %(default)s)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in names]
    if unknown or not args.variants:
        p.error(f"--variants: unknown {', '.join(unknown) or '(none)'} (known: {', '.join(names)})")
    try:
        args.rows = serving.parse_int_list(args.rows)
    except ValueError as e:
        p.error(f"--rows: {e}")
    for name in ("layers", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    args.libraries = {v: build.load_variant(v) for v in args.variants}
    missing = [v for v, lib in args.libraries.items() if lib is None]
    if missing:
        p.error(f"--variants: {', '.join(missing)} cannot be built or run on this CPU")
    return args


def main() -> None:
    args = _args()
    generator = torch.Generator().manual_seed(0)
    fmt = int_codes.INT_Q4_1
    weights = []
    for _ in range(args.layers):
        for num_out, num_in in SMOLLM2_135M:
            panels = int_codes.panels(random_q4_1(num_out, num_in, generator), fmt)
            weights.append((panels, skinny.LinearWeights(0, None, 0, 0, panels.data_ptr(), fmt, 0), num_out, num_in))
    functions = {v: build.function_of(lib, "linear_forward", skinny._ARGTYPES) for v, lib in args.libraries.items()}
    print(f"integer linears: {args.layers} layers of SmolLM2-135M's shapes (Q4_1), {args.threads} threads, "
          f"ms per pass (median of {args.repeats}), the builds in turns")
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k, generator=generator) for _, k in SMOLLM2_135M}
        outputs = [torch.empty(rows, n) for _, _, n, _ in weights]
        seconds = {v: [] for v in functions}
        for rep in tqdm(range(args.repeats), desc=f"{rows} rows", leave=False):
            for v in (list(functions) if rep % 2 == 0 else list(functions)[::-1]):
                start = time.perf_counter()
                for (_, w, n, k), out in zip(weights, outputs):
                    functions[v](ctypes.byref(w), inputs[k].data_ptr(), None, out.data_ptr(), rows, n, k, 0, args.threads)
                seconds[v].append(time.perf_counter() - start)
        ms = {v: statistics.median(s) * 1e3 for v, s in seconds.items()}
        first = args.variants[0]
        print(f"{rows:3d} rows  " + "  ".join(f"{v} {ms[v]:.2f} ms ({ms[first] / ms[v]:.2f}x)" for v in ms))


if __name__ == "__main__":
    main()
