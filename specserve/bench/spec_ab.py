"""Interleaved A/B of plain vs speculative decoding in ONE process (both engines loaded),
alternating which runs first per prompt group, so drifting machine load hits both alike.
``--spec`` and ``--base`` take any engine arguments, so it also compares two settings of plain
decoding (e.g. ``--base '{"page_size": 1}' --spec '{"page_size": 16}'``).

    python -m specserve.bench.spec_ab --spec '{"speculative_algorithm": "NGRAM"}' --copy-heavy
    python -m specserve.bench.spec_ab --spec '{"speculative_algorithm": "NGRAM"}' \\
        --prompts ../shared/data/eval/vicuna_bench.jsonl,../shared/data/eval/eagle_alpaca.jsonl \\
        --num-prompts-per-file 16 --batch-size 16 --cpu-time

Both engines are warmed up first (KV caches touched, one untimed group of a warm-up prompt).
Prints: outputs identical to plain, median and total speedup, tok/s, accept length (verifies
that carried drafts), verifies per generated token, accept histogram and the policy's state.
``--cpu-time`` times with process CPU time (meaningful with OMP_NUM_THREADS=1 on a shared
machine). SPECSERVE_SPEC_POLICY=always forces speculation.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from specserve.bench import serving
from specserve.bench.prompts import COPY_HEAVY


def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object of server args")
    return value


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="plain vs speculative, interleaved, one process")
    p.add_argument("--spec", required=True, type=_json_dict,
                   help="JSON dict of the second engine's server args (speculative ones, or any other; they "
                   "override the shared ones)")
    p.add_argument("--base", default={}, type=_json_dict,
                   help="JSON dict of the first (baseline) engine's server args (default: the shared ones)")
    p.add_argument("--prompts", default=None, help="FastChat JSONL files, comma-separated (turns[0])")
    p.add_argument("--copy-heavy", action="store_true", help="use the built-in copy-heavy prompts")
    p.add_argument("--num-prompts-per-file", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=1, help="requests in flight per group")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    serving.add_quantization_argument(p, "both engines'")
    p.add_argument("--model-path", default=None)
    p.add_argument("--cpu-time", action="store_true", help="time with process CPU time")
    return p.parse_args()


def _texts(args) -> list[str]:
    texts = list(COPY_HEAVY) if args.copy_heavy else []
    for path in (args.prompts.split(",") if args.prompts else []):
        with open(path) as f:
            texts += [json.loads(line)["turns"][0] for line, _ in zip(f, range(args.num_prompts_per_file))]
    if not texts:
        raise SystemExit("give --prompts and/or --copy-heavy")
    return texts


def main() -> None:
    from specserve.engine import Engine

    args = _args()
    kw = dict(model_path=args.model_path, dtype=args.dtype, max_total_tokens=16384, context_length=2048,
              max_running_requests=max(16, args.batch_size), quantization=args.quantization)
    if args.kv_cache_dtype:
        kw["kv_cache_dtype"] = args.kv_cache_dtype
    plain, spec = Engine(**{**kw, **args.base}), Engine(**{**kw, **args.spec})
    tok = plain.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in _texts(args)]
    groups = [ids[i:i + args.batch_size] for i in range(0, len(ids), args.batch_size)]
    params = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
    for engine in (plain, spec):
        _warm_up(engine, args.batch_size, args.max_new_tokens)
    clock = time.process_time if args.cpu_time else time.perf_counter
    ratios, total, same, metas = [], {plain: 0.0, spec: 0.0}, 0, []
    for gi, group in enumerate(groups):
        outs = {}
        for engine in ((plain, spec) if gi % 2 == 0 else (spec, plain)):
            t0 = clock()
            outs[engine] = engine.generate(input_ids=group, sampling_params=params)
            total[engine] += (elapsed := clock() - t0)
            outs[engine] = (outs[engine], elapsed)
        (po, pt), (so, st) = outs[plain], outs[spec]
        same += sum(a["output_ids"] == b["output_ids"] for a, b in zip(po, so))
        ratios.append(pt / st)
        metas += [(o["meta_info"], len(o["output_ids"])) for o in so]
    _report(args, len(ids), same, ratios, total[plain], total[spec], metas, spec.engine.get_server_info())


def _warm_up(engine, batch_size: int, max_new_tokens: int) -> None:
    """As a server starts: its KV caches touched, then ``serving.warm_up``'s untimed group of its
    warm-up prompt (none of the measured ones, whose answers an n-gram cache would then know).
    Without it the first group's cold start went into the figures: the EAGLE3 engine's first
    group of 16 took 1.72 s where the plain engine's took 1.34, and later groups ~1.3 each
    (AVX-512 Zen4)."""
    engine.engine.prefault_kv_cache()
    serving.warm_up(engine.engine, engine.tokenizer, batch_size, max_new_tokens)


def _report(args, num, same, ratios, t_plain, t_spec, metas, info) -> None:
    generated = sum(n for _, n in metas)
    verify = sum(m.get("spec_verify_ct", 0) for m, _ in metas)
    accept = sum(m.get("spec_verify_ct", 0) * m.get("spec_accept_length", 1.0) for m, _ in metas)
    print(json.dumps({
        "prompts": num, "batch_size": args.batch_size, "same_as_plain": f"{same}/{num}",
        "median_speedup": round(statistics.median(ratios), 3), "total_speedup": round(t_plain / t_spec, 3),
        "plain_tok_s": round(generated / t_plain, 1), "spec_tok_s": round(generated / t_spec, 1),
        "accept_length": round(accept / verify, 2) if verify else 1.0,
        "verifies_per_token": round(verify / generated, 3),
        "accept_histogram": info.get("spec_accept_histogram"), "policy": info.get("spec_policy"),
        "clock": "cpu" if args.cpu_time else "wall"}))


if __name__ == "__main__":
    main()
