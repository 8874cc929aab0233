"""Batched decode attention alone, over a whole model's bfloat16 KV cache: ``--batch`` requests of
one row each, every request ``--prompt`` prompt tokens then ``--decoded`` decoded ones, their
slots laid out as the KV pool (``cache/block_pool.py``) hands them out at each ``--page-sizes``
(the prompts one request after another, then one slot per request and step): with pages of one
slot, a request's slots in runs; ``--free-list`` adds the free list's order alone, the pool's
before it kept runs (a request's rows a batch apart). The layouts (and ``--variants``, kernel
builds) take turns in one process, each running attention layer after layer over a cache too
large for the caches, as a decode step does.

    python -m specserve.bench.decode_attention --batch 16 --prompt 100 --decoded 256 --threads 2

Prints per layout: ms per step (median), the K/V bytes read a step and their rate.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch
from tqdm import tqdm

from specserve.bench import serving
from specserve.cache.block_pool import RUN_GAP, BlockPool
from specserve.kernels import attention, build, huge_pages


def decode_slots(batch: int, prompt: int, decoded: int, page_size: int, runs: bool = True) -> list[list[int]]:
    """Each request's slots in token order as the KV pool (``BlockPool``) hands them out: the
    prompts one request after another, then ``decoded`` steps of one token per request. ``runs``
    False: with pages of one slot, the free list's order alone (the pool's before it kept runs)."""
    tokens = batch * (prompt + decoded + 2 * RUN_GAP + 2 * page_size)
    pool = BlockPool(-(-tokens // page_size), page_size, RUN_GAP if runs else 0)
    slots = [pool.extend_slots([], prompt) for _ in range(batch)]
    for _ in range(decoded):
        for request in slots:
            request += pool.extend_slots(request, 1)
    return slots


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="batched decode attention by KV page size, in turns, one process")
    p.add_argument("--batch", type=int, default=16, help="requests, one row each (default %(default)s)")
    p.add_argument("--prompt", type=int, default=100, help="prompt tokens per request (default %(default)s)")
    p.add_argument("--decoded", type=int, default=256, help="decoded tokens per request (default %(default)s)")
    p.add_argument("--page-sizes", default="1,16", help="comma-separated (default %(default)s)")
    p.add_argument("--free-list", action="store_true",
                   help="also page size 1 in the free list's order alone (the pool's before it kept runs)")
    p.add_argument("--variants", default=None, help="kernel builds to take turns too, comma-separated: "
                   f"{', '.join(build.VARIANT_NAMES)} or the path of a built library (.so; default: the "
                   "variant this CPU loads)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    for name in ("batch", "prompt", "decoded", "layers", "heads", "kv_heads", "head_dim", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    unknown = [n for n in (args.variants or "").split(",")
               if n and n not in build.VARIANT_NAMES and not n.endswith(".so")]
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(build.VARIANT_NAMES)})")
    if args.heads % args.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    try:
        args.page_sizes = serving.parse_int_list(args.page_sizes)
    except ValueError as e:
        p.error(f"--page-sizes: {e}")
    args.functions = _kernel_functions(p, args.variants)
    return args


def _calls(args, names: list[str], layouts: dict[str, torch.Tensor]) -> tuple[dict, tuple]:
    """Per (layout, variant name): the arguments of each layer's call, all over one cache; and
    the tensors they point into (to keep alive while the calls run)."""
    num_slots = max(int(kv.max()) for kv in layouts.values()) + 1
    shape = (args.layers, args.kv_heads, num_slots, args.head_dim)          # head-major, as the pool's
    k, v = huge_pages.empty(shape, torch.bfloat16), huge_pages.empty(shape, torch.bfloat16)
    k.normal_(), v.normal_()
    length = args.prompt + args.decoded
    q = torch.randn(args.batch, args.heads, args.head_dim)
    out = torch.empty(args.batch, args.heads * args.head_dim)
    mask = torch.ones(args.batch, 1, length, dtype=torch.bool)
    rows = torch.arange(args.batch, dtype=torch.int32)
    queries = torch.zeros(args.batch, dtype=torch.int32)
    layers = [(k[i].transpose(0, 1), v[i].transpose(0, 1)) for i in range(args.layers)]   # [slots, heads, dim]
    calls = {(layout, name): [(q.data_ptr(), k_layer.data_ptr(), v_layer.data_ptr(),
                             *attention.kv_strides(k_layer, v_layer), out.data_ptr(), kv.data_ptr(),
                             mask.data_ptr(), rows.data_ptr(), queries.data_ptr(), args.batch, length, 1,
                             args.heads, args.kv_heads, args.head_dim, 0, 1, args.threads)
                            for k_layer, v_layer in layers]
             for layout, kv in layouts.items() for name in names}
    return calls, (k, v, q, out, mask, rows, queries, layouts)


def _kernel_functions(p: argparse.ArgumentParser, variants: str | None) -> dict:
    """``paged_attention`` of each build ``--variants`` names (default: the one this CPU loads),
    by a short label; a build that cannot be loaded is a usage error."""
    function = {}
    for name in variants.split(",") if variants else [None]:
        try:
            library = (build.load() if name is None else ctypes.CDLL(name) if name.endswith(".so")
                       else build.load_variant(name))
        except OSError as e:
            p.error(f"--variants: {e}")
        if library is None:
            p.error(f"--variants: kernel variant {name} cannot be loaded here" if name else
                    "the CPU kernels cannot be loaded here (SPECSERVE_KERNELS=0, no C compiler, or no AVX2: "
                    "see specserve/kernels/build.py)")
        function[(name or build.variant_name()).rsplit("/", 1)[-1][-24:]] = build.function_of(
            library, "paged_attention", attention._ARGTYPES)
    return function


def main() -> None:
    args = _args()
    function = args.functions
    cases = [(str(page), page, True) for page in args.page_sizes]
    if args.free_list:
        cases.append(("1, free list", 1, False))
    layouts = {label: torch.tensor(decode_slots(args.batch, args.prompt, args.decoded, page, runs), dtype=torch.int64)
               for label, page, runs in cases}
    calls, _alive = _calls(args, list(function), layouts)
    seconds = {key: [] for key in calls}
    for rep in tqdm(range(args.repeats), desc="decode attention", leave=False):
        for key in (list(calls) if rep % 2 == 0 else list(calls)[::-1]):
            fn, start = function[key[1]], time.perf_counter()
            for call in calls[key]:
                fn(*call)
            seconds[key].append(time.perf_counter() - start)
    kv_bytes = args.batch * (args.prompt + args.decoded) * args.kv_heads * args.head_dim * 2 * 2 * args.layers
    print(f"batched decode attention: {args.batch} requests x ({args.prompt} prompt + {args.decoded} decoded) "
          f"tokens, {args.layers} layers, {args.threads} threads; K/V read a step {kv_bytes / 1e6:.1f} MB")
    for (layout, name), times in seconds.items():
        ms = statistics.median(times) * 1e3
        print(f"page size {layout:>13}  {name:>12}  {ms:8.2f} ms a step  {kv_bytes / ms / 1e6:6.1f} GB/s")


if __name__ == "__main__":
    main()
