"""``specserve bench plain``: batch-1 plain decoding, our engine vs HF transformers' eager
``generate`` on the same weights (our HF export of the model) and the same dtype.

Per prompt: time to first token (prefill) and decode tokens/s over ``--max-new-tokens``
(ignore_eos, so every run has the same length). Ours and HF alternate which goes first from
prompt to prompt so both see the same noise. Reports medians, the ratio ours/HF per dtype and
how many greedy outputs are identical.
"""
from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

from specserve.bench import prompts as prompt_data
from specserve.bench import report
from specserve.bench import serving

DEFAULT_DTYPES = "bfloat16,float32"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtypes", default=DEFAULT_DTYPES, help="comma-separated; default %(default)s")
    parser.add_argument("--num-prompts", type=int, default=5,
                        help="prompts, round-robin over the eval files (default %(default)s)")
    parser.add_argument("--prompts", default=None, help="prompt files, comma-separated (default: all eval files)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--hf-dir", default=None,
                        help="an existing HF export of the model (default: export into a temp dir)")
    serving.add_quantization_argument(parser)
    parser.add_argument("--profile", action="store_true",
                        help="also split one request's decode steps into their parts (native layer ops, "
                             "LM head, Python, scheduling) and print that")
    parser.add_argument("--profile-batch", type=int, default=1,
                        help="requests decoded together in the --profile run (default %(default)s)")


def parse_dtypes(text: str) -> list[str]:
    allowed = ("bfloat16", "float32", "float16")
    dtypes = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in allowed]
    if not dtypes or bad:
        raise ValueError(f"--dtypes: expected a comma-separated subset of {', '.join(allowed)}, got {text!r}")
    return dtypes


def run(args: argparse.Namespace) -> dict[str, Any]:
    dtypes = parse_dtypes(args.dtypes)
    if args.profile_batch < 1:
        raise ValueError(f"--profile-batch: expected at least 1, got {args.profile_batch}")
    prompt_list = prompt_data.load_mixed_prompts(args.num_prompts, prompt_data.resolve_prompt_files(args.prompts))
    id_lists = serving.tokenize_prompts(args, prompt_list, args.max_new_tokens)
    from specserve.kernels import skinny

    result: dict[str, Any] = {"benchmark": "plain", "model_path": args.model_path,
                              "quantization": args.quantization, "kernel_variant": skinny.kernel_variant(),
                              "max_new_tokens": args.max_new_tokens, "num_prompts": len(id_lists),
                              "prompts": [{"category": p.category, "question_id": p.question_id,
                                           "prompt_tokens": len(ids)} for p, ids in zip(prompt_list, id_lists)],
                              "dtypes": {}}
    with _hf_dir(args) as hf_dir:
        for dtype in dtypes:
            result["dtypes"][dtype] = _run_dtype(args, dtype, hf_dir, id_lists)
    _print(result)
    return result


@contextlib.contextmanager
def _hf_dir(args: argparse.Namespace):
    """The HF directory transformers loads: given, the model itself, or a fresh export."""
    if args.hf_dir:
        yield args.hf_dir
        return
    model = Path(args.model_path)
    if model.is_dir() and (model / "config.json").is_file():
        yield str(model)
        return
    import torch

    from specserve.loading.export import export_hf_dir

    with tempfile.TemporaryDirectory(prefix="specserve-bench-hf-") as tmp:
        print(f"exporting {model.name} to an HF directory for transformers ...", flush=True)
        yield str(export_hf_dir(model, tmp, dtype=torch.float32))


def _run_dtype(args, dtype: str, hf_dir: str, id_lists: list[list[int]]) -> dict[str, Any]:
    engine = hf = None
    try:
        kv_tokens = serving.kv_tokens_needed(args, id_lists, args.profile_batch, args.max_new_tokens)
        engine = serving.make_engine(serving.engine_kwargs(args, dtype, disable_radix_cache=True,
                                                           max_total_tokens=kv_tokens, quantization=args.quantization))
        hf = _load_hf(hf_dir, dtype, engine.engine.device)
        ours_fn = lambda ids: _time_ours(engine.engine, ids, args.max_new_tokens)  # noqa: E731
        hf_fn = lambda ids: _time_hf(hf, ids, args.max_new_tokens)  # noqa: E731
        warmup_ids = prompt_data.chat_ids(engine.tokenizer, serving.WARMUP_TEXT)
        _time_ours(engine.engine, warmup_ids, 8)   # untimed
        _time_hf(hf, warmup_ids, 8)
        rows = []
        from tqdm import tqdm

        for i, ids in enumerate(tqdm(id_lists, desc=f"plain {dtype}", unit="prompt", leave=False)):
            first, second = (ours_fn, hf_fn) if i % 2 == 0 else (hf_fn, ours_fn)
            a, b = first(ids), second(ids)
            ours, ref = (a, b) if i % 2 == 0 else (b, a)
            rows.append({"prompt_tokens": len(ids), "ours": ours, "hf": ref,
                         "identical": ours["output_ids"] == ref["output_ids"],
                         "common_prefix": report.common_prefix_len(ours["output_ids"], ref["output_ids"])})
        summary = _summarize(rows)
        if args.profile:
            from specserve.bench.step_profile import print_breakdown, profile_decode

            batch = [id_lists[i % len(id_lists)] for i in range(args.profile_batch)]
            summary["profile"] = profile_decode(engine.engine, batch, args.max_new_tokens)
            print_breakdown(dtype, summary["profile"])
        return summary
    finally:
        del hf
        serving.close_engine(engine)


def _summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def med(side: str, key: str) -> float:
        return report.median(r[side][key] for r in rows)

    summary = {side: {"median_ttft_ms": med(side, "ttft_s") * 1000, "median_decode_tok_s": med(side, "decode_tok_s")}
               for side in ("ours", "hf")}
    summary["ttft_ratio_ours_over_hf"] = report.ratio(summary["ours"]["median_ttft_ms"],
                                                      summary["hf"]["median_ttft_ms"])
    summary["decode_ratio_ours_over_hf"] = report.ratio(summary["ours"]["median_decode_tok_s"],
                                                        summary["hf"]["median_decode_tok_s"])
    summary["paired_decode_ratio_median"] = report.median(
        report.ratio(r["ours"]["decode_tok_s"], r["hf"]["decode_tok_s"]) for r in rows)
    summary["identical_outputs"] = sum(r["identical"] for r in rows)
    summary["num_prompts"] = len(rows)
    summary["mean_common_prefix_tokens"] = sum(r["common_prefix"] for r in rows) / max(len(rows), 1)
    summary["per_prompt"] = [{"prompt_tokens": r["prompt_tokens"], "identical": r["identical"],
                              "common_prefix": r["common_prefix"],
                              **{f"{side}_{k}": r[side][k] for side in ("ours", "hf")
                                 for k in ("ttft_s", "decode_tok_s", "num_tokens")}} for r in rows]
    return summary


# ---- one timed generation each ---------------------------------------------------------------------

def _time_ours(core, ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    """Step the engine for one request; TTFT = first token out, decode rate over the rest."""
    records, _ = serving.run_requests(core, [ids], lambda: serving.sampling_params(max_new_tokens, True), 1)
    rec = records[0]
    return {"ttft_s": rec.ttft, "decode_tok_s": rec.decode_rate, "num_tokens": len(rec.output_ids),
            "output_ids": rec.output_ids}


def _load_hf(hf_dir: str, dtype: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype)).to(device).eval()
    eos = model.generation_config.eos_token_id
    model.generation_config.pad_token_id = (eos[0] if isinstance(eos, list) else eos) or 0
    model.generation_config.eos_token_id = None   # ignore_eos: always max_new_tokens
    return model


class _TimingStreamer:
    """A transformers streamer that records when the first new token and the end arrive."""

    def __init__(self, sync) -> None:
        self.sync = sync
        self.num_puts = 0
        self.t_first: float | None = None
        self.t_end: float | None = None

    def put(self, value) -> None:
        self.num_puts += 1
        if self.num_puts == 2:          # the first put is the prompt
            self.sync()
            self.t_first = time.perf_counter()

    def end(self) -> None:
        self.sync()
        self.t_end = time.perf_counter()


def _time_hf(model, ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    import torch

    device = model.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    streamer = _TimingStreamer(sync)
    input_ids = torch.tensor([ids], device=device)
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=0, do_sample=False, streamer=streamer)
    new = out[0, len(ids):].tolist()
    decode_s = (streamer.t_end or start) - (streamer.t_first or start)
    return {"ttft_s": (streamer.t_first or float("nan")) - start,
            "decode_tok_s": (len(new) - 1) / decode_s if len(new) > 1 and decode_s > 0 else float("nan"),
            "num_tokens": len(new), "output_ids": new}


def _print(result: dict[str, Any]) -> None:
    rows = []
    for dtype, s in result["dtypes"].items():
        rows.append([dtype, s["ours"]["median_ttft_ms"], s["hf"]["median_ttft_ms"], s["ttft_ratio_ours_over_hf"],
                     s["ours"]["median_decode_tok_s"], s["hf"]["median_decode_tok_s"], s["decode_ratio_ours_over_hf"],
                     f"{s['identical_outputs']}/{s['num_prompts']}", s["mean_common_prefix_tokens"]])
    report.print_table(["dtype", "ttft ours ms", "ttft hf ms", "ttft ours/hf", "tok/s ours", "tok/s hf",
                        "tok/s ours/hf", "identical", "common prefix"], rows,
                       title=f"plain decoding, batch 1, {result['num_prompts']} prompts x "
                             f"{result['max_new_tokens']} new tokens (medians; ttft ratio < 1 and tok/s ratio > 1 "
                             f"favour ours)")
