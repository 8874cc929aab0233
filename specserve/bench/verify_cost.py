"""``specserve bench verify-cost``: the verify-width cost curve of our engine.

Time of one target forward over W new tokens on top of a context of C tokens already in the KV
cache (batch 1), for each W in ``--widths`` and each dtype: the median over repeats, in ms and
as a ratio to W=1. This is what a speculative verify pass of W draft tokens costs compared with
one plain decode step; speculation pays off while accept length > cost ratio. ``--profile``
splits each width's forward into the native layers' linears and attention, the LM head and the
rest (medians over the repeats): which part grows with W.

Uses LLMEngine internals directly: the context is prefilled once into slots from the pool, and
each timed forward takes W fresh slots (``pool.extend_slots``) that are released right after.
"""
from __future__ import annotations

import argparse
import contextlib
import time
from typing import Any

from specserve.bench import llama_peer, report, serving
from specserve.bench import prompts as prompt_data

DEFAULT_WIDTHS = "1,2,4,8,16,32,64"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--widths", default=DEFAULT_WIDTHS, help="new tokens per forward; default %(default)s")
    parser.add_argument("--context", type=int, default=256, help="tokens already in the KV cache (C)")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    serving.add_quantization_argument(parser)
    parser.add_argument("--repeats", type=int, default=10, help="timed forwards per width (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed forwards per width first")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: elapsed time; cpu: this process's CPU time (steadier at one thread on a "
                             "machine other jobs share; meaningless with more threads, which spin)")
    parser.add_argument("--profile", action="store_true",
                        help="also split each width's forward into linears, attention, LM head and the rest "
                             "(the native layers' op clocks)")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="also time llama.cpp's forward of W tokens on the same context, GGUF and threads "
                             "(llama-cpp-python; logits of every row, as a verify needs; needs "
                             "`pip install llama-cpp-python`)")
    parser.add_argument("--mask", choices=("causal", "tree"), default="causal",
                        help="causal: no mask (a chain); tree: pass an explicit [W, W] mask, as a "
                             "tree verify does (lower-triangular, so the same tokens are seen)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from specserve.bench.plain import parse_dtypes

    widths = sorted(set(serving.parse_int_list(args.widths)))
    if args.context < 1:
        raise ValueError("--context must be >= 1")
    if args.profile:
        _check_profile(args)
    dtypes = parse_dtypes(args.dtypes)
    if args.llama_cpp:
        _check_llama_cpp(args)
    from specserve.kernels import skinny

    result: dict[str, Any] = {"benchmark": "verify_cost", "model_path": args.model_path, "context": args.context,
                              "quantization": args.quantization, "clock": args.clock, "kernel_variant": skinny.kernel_variant(),
                              "widths": widths, "repeats": args.repeats, "mask": args.mask, "curves": {}}
    for dtype in dtypes:
        result["curves"][dtype] = _run_dtype(args, dtype, widths)
    if args.llama_cpp:
        result["curves"][LLAMA_CPP], result["llama_cpp_version"] = _run_llama_cpp(args, widths), llama_peer.version()
    _print(result)
    if args.profile:
        for dtype, curve in result["curves"].items():
            _print_parts(dtype, result, curve)
    return result


def context_ids(tokenizer, num_tokens: int) -> list[int]:
    """``num_tokens`` of real text: eval prompts, chat-templated, concatenated and cut."""
    ids: list[int] = []
    for prompt in prompt_data.load_mixed_prompts(40):
        ids.extend(prompt_data.chat_ids(tokenizer, prompt.text))
        if len(ids) >= num_tokens:
            break
    while len(ids) < num_tokens:      # tiny eval sets: repeat
        ids.extend(ids or [0])
    return ids[:num_tokens]


def _run_dtype(args, dtype: str, widths: list[int]) -> list[dict[str, Any]]:
    import torch

    engine = None
    try:
        need = args.context + max(widths) + 64
        engine = serving.make_engine(serving.engine_kwargs(args, dtype, disable_radix_cache=True,
                                                           max_total_tokens=max(need, args.context_length + 64),
                                                           quantization=args.quantization))
        core = engine.engine
        if args.context + max(widths) > core.context_len:
            raise ValueError(f"--context {args.context} + width {max(widths)} exceeds the engine's "
                             f"context length {core.context_len} (raise --context-length)")
        ctx = context_ids(engine.tokenizer, args.context)
        sync = torch.cuda.synchronize if str(core.device).startswith("cuda") else (lambda: None)
        return _measure(core, ctx, widths, args, sync)
    finally:
        serving.close_engine(engine)


def _measure(core, ctx: list[int], widths: list[int], args, sync) -> list[dict[str, Any]]:
    """Prefill the context once, then time each width; widths interleave within each repeat so
    that slow phases of a noisy machine spread over all of them."""
    from specserve.runner.model_runner import ExtendSpec

    row = 0
    ctx_slots = core.pool.extend_slots([], len(ctx))
    if ctx_slots is None:
        raise RuntimeError("KV pool too small for the context")
    draft = _draft_tokens(ctx, max(widths))
    profiler = _PartClock(core) if args.profile else None

    def forward(width: int) -> tuple[float, dict[str, float] | None]:
        elapsed = _one_forward(core, row, ctx_slots, draft[:width], args.mask, sync, args.clock)
        return elapsed, profiler.take(elapsed) if profiler else None

    try:
        core.runner.forward([ExtendSpec(row=row, prefix_len=0, token_ids=ctx, new_slots=ctx_slots, num_logits=1)])
        with profiler or contextlib.nullcontext():
            times, parts = _time_widths(widths, args, f"verify-cost {core.runner.dtype}".replace("torch.", ""), forward)
    finally:
        core.pool.release_slots(ctx_slots)
    rows = _curve(times, widths)
    for entry in rows:
        if parts[entry["width"]]:
            entry["parts_ms"] = {name: report.median([p[name] for p in parts[entry["width"]]]) * 1000
                                 for name in PARTS}
    return rows


def _draft_tokens(ctx: list[int], count: int) -> list[int]:
    """``count`` tokens to forward after the context: its last ones (repeated if it is shorter)."""
    return ctx[-count:] if len(ctx) >= count else (ctx * count)[:count]


def _time_widths(widths: list[int], args, desc: str, forward) -> tuple[dict[int, list[float]], dict[int, list]]:
    """``forward(width)`` -> (seconds, parts or None) for every width in turn, ``args.warmup`` untimed
    rounds then ``args.repeats`` timed ones (widths interleave, so that slow phases of a noisy
    machine spread over all of them). Returns each width's seconds and parts."""
    from tqdm import tqdm

    times: dict[int, list[float]] = {w: [] for w in widths}
    parts: dict[int, list] = {w: [] for w in widths}
    with tqdm(total=(args.warmup + args.repeats) * len(widths), desc=desc, leave=False) as bar:
        for repeat in range(args.warmup + args.repeats):
            for width in widths:
                elapsed, split = forward(width)
                if repeat >= args.warmup:
                    times[width].append(elapsed)
                    if split is not None:
                        parts[width].append(split)
                bar.update(1)
    return times, parts


def _curve(times: dict[int, list[float]], widths: list[int]) -> list[dict[str, Any]]:
    """Each width's median (ms), ratio to W=1 and samples, from its forwards' seconds."""
    base = report.median(times[widths[0]]) if widths[0] == 1 else float("nan")
    rows = []
    for width in widths:
        ms = report.median(times[width]) * 1000
        rows.append({"width": width, "median_ms": ms, "min_ms": min(times[width]) * 1000,
                     "ratio_vs_w1": report.ratio(ms, base * 1000), "ms_per_token": ms / width,
                     "samples_ms": [t * 1000 for t in times[width]]})
    return rows


PARTS = ("linears", "attention", "lm_head", "rest")
LLAMA_CPP = "llama.cpp"


def _check_llama_cpp(args: argparse.Namespace) -> None:
    reason = llama_peer.skip_reason(args.model_path)
    if reason:
        raise ValueError(f"--llama-cpp: {reason}")


def _run_llama_cpp(args: argparse.Namespace, widths: list[int]) -> list[dict[str, Any]]:
    """The same curve for llama.cpp: the context evaluated once, then each width's forward timed on
    top of it, widths interleaved within each repeat as ours are."""
    ctx = context_ids(serving.load_tokenizer(args.model_path), args.context)
    llm = llama_peer.load(args.model_path, llama_peer.threads_for(args), args.context + max(widths) + 64,
                          logits_all=True)
    try:
        llm.eval(ctx)
        draft = _draft_tokens(ctx, max(widths))
        times, _ = _time_widths(widths, args, "verify-cost llama.cpp",
                                lambda width: (llama_peer.time_forward(llm, len(ctx), draft[:width]), None))
    finally:
        llm.close()
    return _curve(times, widths)


def _check_profile(args: argparse.Namespace) -> None:
    from specserve.kernels import layer as native_layer

    if args.clock != "wall":
        raise ValueError("--profile splits wall-clock time: use it with --clock wall")
    if not native_layer.is_available():
        raise ValueError("--profile reads the native layers' clocks, and the CPU kernels are not built here "
                         "(see specserve/kernels/build.py)")


class _PartClock(contextlib.ExitStack):
    """While entered: the native layers' op clocks on and the model's LM head timed; ``take(seconds)``
    splits the forward just timed into PARTS (seconds; "rest": norms, rotary, the model's ends,
    metadata and Python)."""

    def __init__(self, core) -> None:
        from specserve.kernels import layer as native_layer

        super().__init__()
        self.model, self.native_layer = core.runner.model, native_layer
        self._seconds: dict[str, float] = {}

    def __enter__(self) -> "_PartClock":
        from specserve.bench.step_profile import timed

        super().__enter__()
        self.enter_context(timed(self.model, "compute_logits", self._seconds))
        self.native_layer.profile(True)
        self.callback(self.native_layer.profile, False)
        return self

    def take(self, seconds: float) -> dict[str, float]:
        return split_forward(seconds, self.native_layer.profile(True), self._seconds.pop("compute_logits", 0.0))


def split_forward(seconds: float, layer_ops: dict[str, float], lm_head: float) -> dict[str, float]:
    """One forward's ``seconds`` as PARTS, from the native layers' op clocks (``layer.profile``)."""
    linears = sum(layer_ops.get(op, 0.0) for op in ("qkv", "o_proj", "gate_up", "down"))
    attention = layer_ops.get("attention", 0.0)
    return {"linears": linears, "attention": attention, "lm_head": lm_head,
            "rest": seconds - linears - attention - lm_head}


def _one_forward(core, row: int, ctx_slots: list[int], tokens: list[int], mask: str, sync,
                 clock: str = "wall") -> float:
    import torch

    from specserve.runner.model_runner import ExtendSpec

    width = len(tokens)
    slots = core.pool.extend_slots(ctx_slots, width)
    if slots is None:
        raise RuntimeError("KV pool too small for the verify width")
    tree_mask = None
    if mask == "tree":
        tree_mask = torch.tril(torch.ones(width, width, dtype=torch.bool, device=core.device))
    spec = ExtendSpec(row=row, prefix_len=len(ctx_slots), token_ids=tokens, new_slots=slots,
                      tree_mask=tree_mask, num_logits=width)
    try:
        sync()
        now = time.process_time if clock == "cpu" else time.perf_counter
        start = now()
        core.runner.forward([spec])
        sync()
        return now() - start
    finally:
        core.pool.release_slots(slots)


def _print(result: dict[str, Any]) -> None:
    widths = result["widths"]
    rows = []
    for dtype, curve in result["curves"].items():
        rows.append([f"{dtype} ms"] + [r["median_ms"] for r in curve])
        rows.append([f"{dtype} x W=1"] + [r["ratio_vs_w1"] for r in curve])
    peer = result["curves"].get(LLAMA_CPP)
    for dtype, curve in result["curves"].items():
        if peer and dtype != LLAMA_CPP:
            rows.append([f"llama.cpp / {dtype}"] + [report.ratio(p["median_ms"], r["median_ms"])
                                                     for p, r in zip(peer, curve)])
    report.print_table(["W"] + [str(w) for w in widths], rows,
                       title=f"verify-width cost: one forward of W new tokens on a {result['context']}-token "
                             f"context, batch 1, median of {result['repeats']} ({result['mask']} mask, "
                             f"--quantization {result['quantization'] or 'unquant'}, {result['kernel_variant']} "
                             f"kernels, {result['clock']} clock)")


def _print_parts(dtype: str, result: dict[str, Any], curve: list[dict[str, Any]]) -> None:
    if not all("parts_ms" in row for row in curve):
        return
    rows = [[f"{name} ms"] + [row["parts_ms"][name] for row in curve] for name in PARTS]
    rows.append(["attention %"] + [100 * row["parts_ms"]["attention"] / row["median_ms"] for row in curve])
    report.print_table(["W"] + [str(w) for w in result["widths"]], rows,
                       title=f"{dtype}: one forward by part (medians; linears: the layers' four matmuls, their "
                             f"input quantization included; rest: norms, rotary, the model's ends, metadata, Python)")
