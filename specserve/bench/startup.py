"""``specserve bench startup``: seconds from launching the server to its first ``/health`` 200
(model loaded, KV pool prefaulted, verify cost timed, tokenizer loaded), ``--runs`` launches one
after another; each server is stopped before the next starts.

    specserve bench startup --runs 3
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specserve.bench import http_client as hc
from specserve.bench.http import MAKE_SERVE_ARGS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server-args", default=MAKE_SERVE_ARGS,
                        help="launch_server flags of the server under test (default: make serve's, %(default)r)")
    parser.add_argument("--runs", type=int, default=3, help="launches, one after another (default %(default)s)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.runs < 1:
        raise ValueError(f"--runs must be at least 1 (got {args.runs})")
    server_args = [*shlex.split(args.server_args), "--model-path", str(args.model_path)]
    seconds = []
    for i in tqdm(range(args.runs), desc="startup", unit="launch", leave=False):
        start = time.perf_counter()
        with hc.server_process(server_args, args.threads, Path(args.out) / f"bench_startup_server_{i}.log"):
            seconds.append(time.perf_counter() - start)
    result = {"server_args": server_args, "seconds": seconds, "median_s": statistics.median(seconds)}
    print(f"server ready after (launch to first /health 200, {args.runs} launches): median "
          f"{result['median_s']:.2f} s, min {min(seconds):.2f}, max {max(seconds):.2f}")
    return result
