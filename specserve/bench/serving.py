"""``specserve bench serving``: N concurrent requests through LLMEngine (offline, no HTTP).

For each concurrency, every prompt is sent through a closed loop that keeps N requests in
flight (a new one is added as soon as one finishes). Reports aggregate decode throughput
(generated tokens / wall time), its ratio vs concurrency 1, and whether each request's greedy
output equals the one-at-a-time output. ``--speculative-algorithm`` runs the same load with
speculation; ``--compare-plain`` runs plain decoding too, in the same invocation.

Also home of the request driver shared by the other benchmarks (``run_requests``).
"""
from __future__ import annotations

import argparse
import gc
import itertools
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from specserve.bench import prompts as prompt_data
from specserve.bench import report

DEFAULT_CONCURRENCY = "1,8,16"
SPEC_FLAGS = ("speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps",
              "speculative_eagle_topk", "speculative_num_draft_tokens")


# ---- shared by every benchmark: building engines and driving requests --------------------------

@dataclass
class RequestRecord:
    """One request's timings (seconds, relative to the start of its run) and output."""

    index: int
    prompt_len: int
    t_add: float = 0.0
    t_first: float | None = None
    t_end: float | None = None
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    finish_reason: dict[str, Any] | None = None

    @property
    def ttft(self) -> float:
        return (self.t_first - self.t_add) if self.t_first is not None else float("nan")

    @property
    def decode_rate(self) -> float:
        """Tokens per second after the first one (NaN with fewer than 2 tokens)."""
        if self.t_first is None or self.t_end is None or len(self.output_ids) < 2:
            return float("nan")
        return (len(self.output_ids) - 1) / max(self.t_end - self.t_first, 1e-9)


QUANTIZATION_CHOICES = ("unquant", "gguf", "w8a8_int8")


def add_quantization_argument(parser: argparse.ArgumentParser, what: str = "the engine's") -> None:
    """``--quantization`` and ``--kv-cache-dtype``, as launch_server takes them, for a benchmark's
    engines (``engine_kwargs`` passes the second; the first is passed by each caller)."""
    parser.add_argument("--quantization", default=None, choices=QUANTIZATION_CHOICES,
                        help=f"{what} linear path: gguf = integer kernels on the GGUF blocks (what `make serve` "
                             "runs), unquant = exact float, w8a8_int8 = float weights rounded to Q8_0 blocks "
                             "(default: the engine's default)")
    parser.add_argument("--kv-cache-dtype", default=None, choices=("auto", "bf16", "bfloat16"),
                        help=f"{what} KV cache: auto = the model's dtype, bf16 = half the bytes to read per "
                             "key (default: the engine's default)")


def engine_kwargs(args: argparse.Namespace, dtype: str, *, disable_radix_cache: bool = False,
                  max_total_tokens: int | None = None, **extra: Any) -> dict[str, Any]:
    """Engine(**kwargs) for the common flags; ``extra`` entries that are None are left out."""
    kwargs: dict[str, Any] = {"model_path": args.model_path, "dtype": dtype, "device": args.device,
                              "context_length": args.context_length,
                              "max_total_tokens": args.max_total_tokens or max_total_tokens,
                              "disable_radix_cache": disable_radix_cache,
                              "kv_cache_dtype": getattr(args, "kv_cache_dtype", None)}
    kwargs.update({k: v for k, v in extra.items() if v is not None})
    return {k: v for k, v in kwargs.items() if v is not None}


def make_engine(kwargs: dict[str, Any]):
    from specserve.engine import Engine

    return Engine(**kwargs)


def close_engine(engine) -> None:
    if engine is not None:
        engine.shutdown()
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def max_prompt_len(args: argparse.Namespace, max_new_tokens: int) -> int:
    """Longest prompt (tokens) that still leaves room for ``max_new_tokens`` in the context."""
    return max(16, args.context_length - max_new_tokens - 8)


def load_tokenizer(model_path: str):
    from specserve.tokenizer import Tokenizer

    return Tokenizer.load(model_path)


def tokenize_prompts(args: argparse.Namespace, prompt_list, max_new_tokens: int, tokenizer=None) -> list[list[int]]:
    """Chat-templated token ids of each prompt, shortened to fit the context if needed."""
    tokenizer = tokenizer or load_tokenizer(args.model_path)
    max_len = max_prompt_len(args, max_new_tokens)
    return [prompt_data.chat_ids(tokenizer, p.text, max_len) for p in prompt_list]


def kv_tokens_needed(args: argparse.Namespace, id_lists: list[list[int]], concurrency: int,
                     max_new_tokens: int, slack_per_request: int = 64) -> int:
    """A KV pool that holds ``concurrency`` of the longest requests at once (and one full context)."""
    longest = max((len(ids) for ids in id_lists), default=0) + max_new_tokens + slack_per_request
    return max(args.context_length + slack_per_request, concurrency * longest)


def sampling_params(max_new_tokens: int, ignore_eos: bool):
    from specserve.core import SamplingParams

    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)


_run_counter = itertools.count()


def run_requests(core, id_lists: list[list[int]], make_sampling: Callable[[], Any], concurrency: int,
                 on_finish: Callable[[RequestRecord], None] | None = None,
                 ) -> tuple[list[RequestRecord], float]:
    """Send every prompt through ``core`` (an LLMEngine), keeping ``concurrency`` requests in
    flight. Returns the records (in prompt order) and the wall time in seconds."""
    run_id = next(_run_counter)
    pending = deque(enumerate(id_lists))
    active: dict[str, RequestRecord] = {}
    records: list[RequestRecord | None] = [None] * len(id_lists)
    start = time.perf_counter()

    def admit() -> None:
        while pending and len(active) < concurrency:
            index, ids = pending.popleft()
            rid = f"bench-{run_id}-{index}"
            record = RequestRecord(index=index, prompt_len=len(ids), t_add=time.perf_counter() - start)
            core.add_request(rid, ids, make_sampling())
            active[rid] = records[index] = record

    admit()
    while active:
        outputs = core.step()
        now = time.perf_counter() - start
        for out in outputs:
            record = active.get(out.rid)
            if record is None:
                continue
            if out.new_token_ids and record.t_first is None:
                record.t_first = now
            record.output_ids.extend(out.new_token_ids)
            record.text += out.text_delta
            if out.finished:
                record.t_end, record.meta, record.finish_reason = now, dict(out.meta_info), out.finish_reason
                del active[out.rid]
                if on_finish is not None:
                    on_finish(record)
        if not outputs and active and not core.has_unfinished():
            raise RuntimeError(f"engine went idle with {len(active)} request(s) unfinished")
        admit()
    return [r for r in records if r is not None], time.perf_counter() - start


WARMUP_TEXT = "Count from one to twenty, in words."


def warm_up(core, tokenizer, concurrency: int = 1, max_new_tokens: int = 8) -> None:
    """A short untimed run on a prompt outside the eval sets (first-call allocations, kernel
    selection), then drop any cached prefix."""
    ids = prompt_data.chat_ids(tokenizer, WARMUP_TEXT)
    run_requests(core, [ids] * max(1, concurrency), lambda: sampling_params(max_new_tokens, True), concurrency)
    core.flush_cache()


def progress_bar(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=False, dynamic_ncols=True)


def mismatches(records: list[RequestRecord], reference: list[RequestRecord]) -> list[dict[str, Any]]:
    """Requests whose output differs from the reference run's, with where they diverge."""
    out = []
    for rec, ref in zip(records, reference):
        if rec.output_ids != ref.output_ids or rec.text != ref.text:
            out.append({"index": rec.index, "first_diff_token": report.common_prefix_len(rec.output_ids,
                                                                                          ref.output_ids),
                        "len": len(rec.output_ids), "ref_len": len(ref.output_ids)})
    return out


def spec_kwargs(algorithm: str | None, draft_model_path: str | None = None, num_steps: int | None = None,
                topk: int | None = None, num_draft_tokens: int | None = None) -> dict[str, Any]:
    """Engine kwargs for one speculative configuration ({} for plain decoding)."""
    if not algorithm:
        return {}
    values = (algorithm.upper(), draft_model_path, num_steps, topk, num_draft_tokens)
    return {k: v for k, v in zip(SPEC_FLAGS, values) if v is not None}


# ---- the serving benchmark ---------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", default=DEFAULT_CONCURRENCY,
                        help="comma-separated numbers of requests in flight (1 is always run: it is "
                             "the one-at-a-time reference); default %(default)s")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="prompts per concurrency, round-robin over the eval files "
                             "(default: the largest concurrency)")
    parser.add_argument("--prompts", default=None, help="prompt files, comma-separated (default: all eval files)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="generate exactly --max-new-tokens per request (default on)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-running-requests", type=int, default=None)
    parser.add_argument("--disable-radix-cache", action="store_true")
    parser.add_argument("--speculative-algorithm", default=None)
    parser.add_argument("--speculative-draft-model-path", default=None)
    parser.add_argument("--speculative-num-steps", type=int, default=None)
    parser.add_argument("--speculative-eagle-topk", type=int, default=None)
    parser.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    parser.add_argument("--compare-plain", action="store_true",
                        help="with --speculative-algorithm: also run plain decoding and compare")
    parser.add_argument("--speculative-policy", default=None, choices=("auto", "always"),
                        help="auto (the server's default: the policy may decline to speculate, e.g. in "
                             "large batches) or always")
    add_quantization_argument(parser)


def parse_int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise ValueError(f"expected positive integers separated by commas, got {text!r}")
    return values


def concurrency_levels(text: str) -> list[int]:
    """Sorted, distinct, always including 1 (the one-at-a-time reference)."""
    return sorted(set(parse_int_list(text)) | {1})


def modes_to_run(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """[(label, speculative kwargs)]: plain, the speculative configuration, or both."""
    spec = spec_kwargs(args.speculative_algorithm, args.speculative_draft_model_path,
                       args.speculative_num_steps, args.speculative_eagle_topk,
                       args.speculative_num_draft_tokens)
    if not spec:
        return [("plain", {})]
    label = spec["speculative_algorithm"]
    return ([("plain", {})] if args.compare_plain else []) + [(label, spec)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    levels = concurrency_levels(args.concurrency)
    num_prompts = args.num_prompts or max(levels)
    prompt_list = prompt_data.load_mixed_prompts(num_prompts, prompt_data.resolve_prompt_files(args.prompts))
    result: dict[str, Any] = {"benchmark": "serving", "model_path": args.model_path, "dtype": args.dtype,
                              "max_new_tokens": args.max_new_tokens, "ignore_eos": args.ignore_eos,
                              "num_prompts": len(prompt_list), "concurrency": levels, "modes": {},
                              "prompts": [{"category": p.category, "question_id": p.question_id}
                                          for p in prompt_list]}
    outputs: dict[str, list[RequestRecord]] = {}
    for label, spec in modes_to_run(args):
        result["modes"][label], outputs[label] = _run_mode(args, label, spec, prompt_list, levels)
    if "plain" in outputs and len(outputs) > 1:
        other = next(k for k in outputs if k != "plain")
        result["spec_vs_plain_mismatches"] = mismatches(outputs[other], outputs["plain"])
    _print(result)
    return result


def _run_mode(args, label, spec, prompt_list, levels) -> tuple[list[dict[str, Any]], list[RequestRecord]]:
    """Every concurrency level for one mode. A speculative mode gets a fresh engine per level:
    drafter state (the n-gram cache) would otherwise already hold the outputs of the previous
    level's identical prompts and inflate acceptance."""
    id_lists = tokenize_prompts(args, prompt_list, args.max_new_tokens)
    kwargs = engine_kwargs(args, args.dtype, disable_radix_cache=args.disable_radix_cache,
                           max_total_tokens=kv_tokens_needed(args, id_lists, max(levels), args.max_new_tokens),
                           max_running_requests=args.max_running_requests or max(levels),
                           quantization=args.quantization,
                           speculative_policy=args.speculative_policy if spec else None, **spec)
    engine = None
    runs, reference = [], None
    try:
        for level in levels:
            if engine is None or spec:
                close_engine(engine)
                engine = None
                engine = make_engine(kwargs)
                warm_up(engine.engine, engine.tokenizer, concurrency=min(4, max(levels)))
            runs.append(_run_level(engine.engine, label, level, id_lists, args))
            records = runs[-1].pop("_records")
            reference = reference or records
            runs[-1]["mismatches_vs_c1"] = mismatches(records, reference)
    finally:
        close_engine(engine)
    if spec and not any(r["accept_length"] for r in runs):
        print(f"warning [{label}]: no speculative verify pass was recorded (spec_verify_ct = 0): "
              f"the engine ran plain decoding", flush=True)
    for entry in runs:
        entry["ratio_vs_c1"] = report.ratio(entry["throughput"], runs[0]["throughput"])
        entry["decode_ratio_vs_c1"] = report.ratio(entry["decode_throughput"], runs[0]["decode_throughput"])
    return runs, reference


def _run_level(core, label: str, level: int, id_lists, args) -> dict[str, Any]:
    core.flush_cache()
    before = replace(core.stats)
    with progress_bar(len(id_lists), f"serving {label} c={level}") as bar:
        records, wall = run_requests(core, id_lists, lambda: sampling_params(args.max_new_tokens, args.ignore_eos),
                                     level, on_finish=lambda _r: bar.update(1))
    generated = sum(len(r.output_ids) for r in records)
    verify = [r.meta.get("spec_verify_ct", 0) for r in records]
    accept = [r.meta.get("spec_accept_length", 1.0) for r in records]
    return {"concurrency": level, "num_requests": len(records), "generated_tokens": generated,
            "wall_s": wall, "throughput": generated / wall if wall > 0 else float("nan"),
            **_decode_figures(before, core.stats),
            "median_ttft_s": report.median(r.ttft for r in records),
            "median_decode_rate": report.median(r.decode_rate for r in records),
            "accept_length": report.weighted_mean(accept, verify) if sum(verify) else None,
            "_records": records}


def _decode_figures(before, after) -> dict[str, Any]:
    """Decode steps alone (prefill steps left out): their time, tokens and tokens/s."""
    seconds = after.decode_seconds - before.decode_seconds
    tokens = after.decode_tokens - before.decode_tokens
    return {"decode_s": seconds, "decode_tokens": tokens, "prefill_s": after.prefill_seconds - before.prefill_seconds,
            "decode_throughput": tokens / seconds if seconds > 0 else float("nan")}


def _print(result: dict[str, Any]) -> None:
    rows = []
    plain = {r["concurrency"]: r["throughput"] for r in result["modes"].get("plain", [])}
    for label, runs in result["modes"].items():
        for entry in runs:
            rows.append([label, entry["concurrency"], entry["num_requests"], entry["generated_tokens"],
                         entry["wall_s"], entry["throughput"], entry["ratio_vs_c1"],
                         entry["decode_throughput"], entry["decode_ratio_vs_c1"],
                         report.ratio(entry["throughput"], plain.get(entry["concurrency"])) if label != "plain"
                         else None,
                         entry["median_ttft_s"] * 1000, entry["accept_length"],
                         f"{len(entry['mismatches_vs_c1'])}/{entry['num_requests']}"])
    report.print_table(["mode", "conc", "reqs", "tokens", "wall s", "tok/s", "x vs c1", "decode tok/s",
                        "decode x vs c1", "x vs plain",
                        "ttft ms", "accept", "mismatch"], rows,
                       title=f"serving: {result['dtype']}, max_new_tokens={result['max_new_tokens']}, "
                             f"ignore_eos={result['ignore_eos']} (tok/s: all tokens over the wall time; decode "
                             f"tok/s: tokens of decode steps over their time, prefill steps left out; mismatch: "
                             f"greedy output != one-at-a-time)")
    if "spec_vs_plain_mismatches" in result:
        print(f"speculative vs plain outputs (c=1): {len(result['spec_vs_plain_mismatches'])} of "
              f"{result['num_prompts']} differ\n", flush=True)
