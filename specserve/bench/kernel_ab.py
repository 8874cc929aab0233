"""``specserve bench kernel-ab``: builds of the kernels taking turns in one process, on forwards of
W new tokens (``verify-cost``'s: batch 1, a ``--context``-token context, causal mask).

    git worktree add /tmp/before HEAD~1
    specserve bench kernel-ab --kernels /tmp/before/specserve/kernels,specserve/kernels --widths 1,4,8

Each ``--kernels`` entry: a folder of kernel sources (another checkout's ``specserve/kernels``, built
as the variant this CPU loads), a built library (``.so``) or a variant name (``build.VARIANT_NAMES``).
Separate processes on a shared VM differ by 5-30% within the hour; here every round runs each
build in turn on one engine, so a slow phase falls on all of them, and each build is judged by
its ratio to the first build within each round. The model is loaded once and its weights packed
by the variant this CPU loads: builds that pack weights differently (``int_pack_codes``) cannot be
compared this way.

Prints per build and width: the median ms; against the first build, the median over rounds of
the round's ratio, with its quartiles; and whether the logits equal the first build's bit for bit.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path
from typing import Any

from specserve.bench import report, serving

DEFAULT_WIDTHS = "1,4,8"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kernels", default="",
                        help="two or more builds, comma-separated: folders of kernel sources, .so files or "
                             "variant names; the first is the baseline")
    parser.add_argument("--widths", default=DEFAULT_WIDTHS, help="new tokens per forward (default %(default)s)")
    parser.add_argument("--context", type=int, default=256, help="tokens already in the KV cache")
    parser.add_argument("--dtype", default="float32")
    serving.add_quantization_argument(parser)
    parser.add_argument("--rounds", type=int, default=30, help="turns of every build (default %(default)s)")
    parser.add_argument("--forwards", type=int, default=5,
                        help="timed forwards per build, width and round, after one untimed (default %(default)s)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    widths = sorted(set(serving.parse_int_list(args.widths)))
    for name in ("context", "rounds", "forwards"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1")
    names = [n.strip() for n in args.kernels.split(",") if n.strip()]
    if len(names) < 2:
        raise ValueError("--kernels needs two or more builds to compare")
    libraries = [_library(name) for name in names]
    engine = serving.make_engine(serving.engine_kwargs(args, args.dtype, disable_radix_cache=True,
                                                       max_total_tokens=args.context + max(widths) + 64,
                                                       quantization=args.quantization))
    try:
        times, same = _take_turns(engine, libraries, widths, args)
    finally:
        serving.close_engine(engine)
    result = {"benchmark": "kernel_ab", "model_path": args.model_path, "context": args.context,
              "quantization": args.quantization, "widths": widths, "rounds": args.rounds,
              "forwards": args.forwards, "builds": [_entry(n, times, i, widths, same[i]) for i, n in enumerate(names)]}
    _print(result)
    return result


def _library(name: str) -> ctypes.CDLL:
    """The build ``name`` stands for (see the module doc); ValueError where it cannot be had."""
    from specserve.kernels import build

    try:
        if name.endswith(".so"):
            return ctypes.CDLL(name)
        if Path(name).is_dir():
            return build.load_sources(name)
        if name not in build.VARIANT_NAMES:
            raise ValueError(f"--kernels: {name} is no folder, .so file or variant ({', '.join(build.VARIANT_NAMES)})")
        library = build.load_variant(name)
    except OSError as exc:
        raise ValueError(f"--kernels: {name}: {exc}") from None
    if library is None:
        raise ValueError(f"--kernels: variant {name} cannot be built or run on this CPU")
    return library


def _take_turns(engine, libraries: list, widths: list[int], args) -> tuple[dict, list[bool]]:
    """Each round, each build in turn: per width one untimed forward, then ``args.forwards`` timed.
    Returns {(build, width, round): [seconds]} and whether each build's logits equal the first's."""
    from tqdm import tqdm

    from specserve.bench.verify_cost import context_ids
    from specserve.kernels import build
    from specserve.runner.model_runner import forwards_after_context

    core = engine.engine
    times: dict[tuple[int, int, int], list[float]] = {}
    logits: dict[tuple[int, int], Any] = {}
    ctx = context_ids(engine.tokenizer, args.context)
    with forwards_after_context(core.runner, core.pool, ctx, max(widths)) as forward, \
            tqdm(total=args.rounds * len(libraries), desc="kernel-ab", leave=False) as bar:
        for rnd in range(args.rounds):
            for i, library in enumerate(libraries):
                with build.use_library(library):
                    for width in widths:
                        logits.setdefault((i, width), forward(width).clone())
                        times[(i, width, rnd)] = [_timed(forward, width) for _ in range(args.forwards)]
                bar.update(1)
    same = [all(logits[(i, w)].equal(logits[(0, w)]) for w in widths) for i in range(len(libraries))]
    return times, same


def _timed(forward, width: int) -> float:
    start = time.perf_counter()
    forward(width)
    return time.perf_counter() - start


def _entry(name: str, times: dict, i: int, widths: list[int], same: bool) -> dict[str, Any]:
    rounds = sorted({r for (_, _, r) in times})
    entry: dict[str, Any] = {"kernels": name, "logits_equal_first": same, "widths": {}}
    for width in widths:
        medians = [statistics.median(times[(i, width, r)]) for r in rounds]
        ratios = sorted(statistics.median(times[(i, width, r)]) / statistics.median(times[(0, width, r)])
                        for r in rounds)
        entry["widths"][width] = {"median_ms": statistics.median(medians) * 1000,
                                  "ratio_vs_first": statistics.median(ratios),
                                  "ratio_quartiles": [ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]]}
    return entry


def _print(result: dict[str, Any]) -> None:
    rows = []
    for entry in result["builds"]:
        cells = [f"{w['median_ms']:.3f} ms, {w['ratio_vs_first']:.3f}x ({w['ratio_quartiles'][0]:.3f}-"
                 f"{w['ratio_quartiles'][1]:.3f})" for w in entry["widths"].values()]
        rows.append([entry["kernels"][-40:], *cells, "yes" if entry["logits_equal_first"] else "NO"])
    report.print_table(["kernels", *[f"W={w}" for w in result["widths"]], "same logits"], rows,
                       f"kernel builds in turns: forwards of W tokens on a {result['context']}-token context, "
                       f"{result['rounds']} rounds x {result['forwards']} forwards; ms, and time against the "
                       "first build (median of the rounds' ratios, quartiles)")
