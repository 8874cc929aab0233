"""``specserve bench <plain|serving|speculative|verify-cost|kernel-ab|kv-cache|shapes|http|startup|load-memory> [args]``
(also ``python -m specserve.bench.cli ...``).

Every subcommand prints a table, shows a progress bar and writes a JSON result file (and a PNG
plot where one helps) into ``--out`` (default ``bench_results/``). Figures are whatever the
machine gives: benchmarks print, they never assert timings.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any, Callable

from specserve.bench import report

# subcommand -> (module, one-line help); modules are imported only when run
SUBCOMMANDS = {
    "plain": ("specserve.bench.plain", "batch-1 plain decoding: our engine vs HF transformers generate"),
    "serving": ("specserve.bench.serving", "N concurrent requests through LLMEngine: throughput, consistency"),
    "speculative": ("specserve.bench.speculative", "speculative parameter sweep vs plain (bench_speculative)"),
    "verify-cost": ("specserve.bench.verify_cost", "forward time over W new tokens on a C-token context"),
    "kernel-ab": ("specserve.bench.kernel_ab", "builds of the kernels taking turns in one process on verify-cost's "
                                               "forwards: time against the first, same logits"),
    "kv-cache": ("specserve.bench.kv_cache", "plain decoding after long prompts, float32 vs bfloat16 KV cache "
                                             "taking turns: tokens/s, agreement, perplexity"),
    "shapes": ("specserve.bench.shapes", "the fastest steps/topk/draft tokens per shipped draft here "
                                         "(--write records them for the engine)"),
    "http": ("specserve.bench.http", "the HTTP server under concurrent streaming load, beside the offline "
                                     "Engine, llama.cpp and vLLM (bench_serving)"),
    "startup": ("specserve.bench.startup", "seconds from launching the server to its first /health 200"),
    "load-memory": ("specserve.bench.load_memory", "peak and resident memory of loading a GGUF on the integer "
                                                   "path (--synthetic: a 1B or 7B shape)"),
}
PLOTS: dict[str, Callable[[dict[str, Any], Any], Any]] = {
    "speculative": report.plot_speculative,
    "shapes": report.plot_speculative,
    "verify-cost": report.plot_verify_cost,
    "serving": report.plot_serving,
    "http": report.plot_http,
}


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("common")
    group.add_argument("--model-path", default=None,
                       help="GGUF file or HF directory (default: SmolLM2-135M-Instruct Q4_1, fetched if needed)")
    group.add_argument("--device", default="auto", help="auto, cpu or cuda")
    group.add_argument("--context-length", type=int, default=2048,
                       help="engine context length; longer prompts are shortened (default %(default)s)")
    group.add_argument("--max-total-tokens", type=int, default=None,
                       help="KV pool size in tokens (default: what the benchmark needs)")
    group.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    group.add_argument("--out", default=report.DEFAULT_OUT_DIR, help="result folder (default %(default)s)")
    group.add_argument("--tag", default=None, help="added to the result file names")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve bench", description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        child = sub.add_parser(name, help=help_text, description=help_text)
        _module(module_name).add_arguments(child)
        add_common_arguments(child)
    return parser


def _module(name: str):
    return importlib.import_module(name)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def _prepare(args: argparse.Namespace) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from specserve.loading.loader import resolve_model_path

    args.model_path = resolve_model_path(args.model_path)


def save(args: argparse.Namespace, result: dict[str, Any]) -> list[str]:
    """Write the JSON result (and its plot) into ``args.out``; returns the paths written."""
    name = args.command.replace("-", "_") + (f"-{args.tag}" if args.tag else "")
    json_path = report.result_path(args.out, name)
    result = dict(result, args={k: v for k, v in vars(args).items() if k != "func"})
    paths = [str(report.write_json(json_path, result))]
    plot = PLOTS.get(args.command)
    if plot is not None:
        try:
            png = plot(result, json_path.with_suffix(".png"))
        except Exception as exc:  # a plot is a convenience: never lose the JSON for it
            print(f"warning: could not draw the plot: {exc}", file=sys.stderr)
            png = None
        if png is not None:
            paths.append(str(png))
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    module = _module(SUBCOMMANDS[args.command][0])
    try:
        _prepare(args)
        result = module.run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in save(args, result):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
