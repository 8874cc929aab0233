"""``specserve bench speculative``: a speculative-decoding parameter sweep (SGLang's
bench_speculative), always against plain decoding in the same run.

One Engine per configuration (plain first), the same engine settings otherwise; each is shut
down before the next is built. Prompts run category by category (a category = a prompt file).
Per configuration, per category and overall: generated tokens/s, speedup vs plain, accept
length (per-request ``spec_accept_length`` weighted by ``spec_verify_ct``), the accept-length
histogram when the engine reports one, and how many outputs equal plain decoding's. With
``--llama-cpp``, llama.cpp runs beside them on the same GGUF, prompt ids and threads, in the same
turns: plain, and with its own speculation by prompt lookup (its outputs are compared with
llama.cpp's plain ones).
"""
from __future__ import annotations

import argparse
import time
import traceback
from dataclasses import dataclass
from typing import Any

from specserve.bench import llama_peer
from specserve.bench import prompts as prompt_data
from specserve.bench import report
from specserve.bench import serving
from specserve.loading.default_model import is_default_model

ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3", "NEXTN")
NEEDS_DRAFT_MODEL = ("STANDALONE", "EAGLE", "EAGLE3")
DEFAULT_GRID = "3,1,4;5,4,8"
INACTIVE_WARNING = ("no speculative verify pass was recorded (spec_verify_ct = 0 for every request): "
                    "the engine ran plain decoding; is speculation wired into it yet?")


@dataclass(frozen=True)
class SpecConfig:
    num_steps: int | None
    topk: int | None
    num_draft_tokens: int | None

    @property
    def label(self) -> str:
        parts = [f"{name}{value}" for name, value in (("s", self.num_steps), ("k", self.topk),
                                                     ("d", self.num_draft_tokens)) if value is not None]
        return " ".join(parts) or "default"


def parse_grid(text: str, algorithm: str | None) -> list[SpecConfig]:
    """``"steps,topk,draft_tokens;..."`` -> configs (an empty field means the engine's default).
    For NGRAM only draft_tokens matter: steps and topk are dropped and duplicates merged."""
    configs: list[SpecConfig] = []
    for item in (s.strip() for s in text.split(";")):
        if not item:
            continue
        fields = [f.strip() for f in item.split(",")]
        if len(fields) == 1:          # "8": just draft tokens
            fields = ["", "", fields[0]]
        if len(fields) != 3:
            raise ValueError(f"--grid entry {item!r}: expected steps,topk,draft_tokens")
        values = [_count_or_none(f, item) for f in fields]
        config = SpecConfig(*values)
        if (algorithm or "").upper() == "NGRAM":
            config = SpecConfig(None, None, config.num_draft_tokens)
        if config not in configs:
            configs.append(config)
    return configs


def _count_or_none(text: str, item: str) -> int | None:
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"--grid entry {item!r}: {text!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"--grid entry {item!r}: values must be >= 0")
    return value


def normalize_algorithm(text: str | None) -> str | None:
    """Upper-case name, or None for plain only ('none', 'plain', empty)."""
    if not text or text.lower() in ("none", "plain"):
        return None
    algo = text.upper()
    if algo not in ALGORITHMS:
        raise ValueError(f"--algorithm must be one of {', '.join(ALGORITHMS)} or none; got {text!r}")
    return algo


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", default=None,
                        help="prompt files (FastChat JSONL) or copy_heavy (built-in rewrite/extract prompts), "
                             "comma-separated; default: the four eval files")
    parser.add_argument("--num-prompts-per-file", type=int, default=3)
    parser.add_argument("--algorithm", default="NGRAM",
                        help=f"{'|'.join(ALGORITHMS)} (EAGLE+FR: EAGLE with --token-map; the default model's "
                             "shipped EAGLE head takes the shipped FR-Spec map already), "
                             "comma-separated to compare several in one run, or none for plain decoding "
                             "only (default %(default)s)")
    parser.add_argument("--draft-model-path", default=None,
                        help="draft model / head (STANDALONE, EAGLE, EAGLE3; default: the shipped draft "
                             "when --model-path is the default model)")
    parser.add_argument("--token-map", default=None,
                        help="FR-Spec token map for EAGLE+FR (default: the shipped one)")
    parser.add_argument("--ngram-corpus", default=None,
                        help="NGRAM's --speculative-ngram-corpus: a folder, none, or default (the engine's "
                             "default); comma-separated, one NGRAM run each in the same turns")
    parser.add_argument("--ngram-assist", default=None,
                        help="--speculative-ngram-assist values for the draft-model algorithms (0: off), "
                             "comma-separated, one run each in the same turns (e.g. 0,4)")
    parser.add_argument("--grid", default=DEFAULT_GRID,
                        help="configurations 'steps,topk,draft_tokens;...', an entry 'ALGO:s,k,d' only for "
                             "that algorithm (NGRAM: only draft_tokens matter); default %(default)s")
    parser.add_argument("--dtype", default="bfloat16")
    serving.add_quantization_argument(parser, "every engine's")
    parser.add_argument("--speculative-policy", default=None, choices=("auto", "always"),
                        help="auto (the server's default: the policy may decline to speculate) or always "
                             "(every step speculates: accept lengths of the drafts themselves)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=1, help="requests in flight (default %(default)s)")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="also run llama.cpp (llama-cpp-python) on the same GGUF, prompt ids and threads, in "
                             "the same turns: plain and with its prompt-lookup speculation (batch 1 only)")
    parser.add_argument("--llama-lookup-tokens", type=int, default=10,
                        help="tokens llama.cpp's prompt lookup drafts a step (default %(default)s, its own default)")


def plan_runs(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """[(label, engine spec kwargs)]: plain first, then every algorithm x its grid entries."""
    runs: list[tuple[str, dict[str, Any]]] = [("plain", {})]
    names = [a.strip() for a in (args.algorithm or "").split(",") if a.strip()]
    for name in names:
        use_token_map = name.upper() in ("EAGLE+FR", "EAGLE+FRSPEC")
        algorithm = normalize_algorithm("EAGLE" if use_token_map else name)
        if algorithm is None:
            continue
        if algorithm in NEEDS_DRAFT_MODEL and not args.draft_model_path and not is_default_model(args.model_path):
            raise ValueError(f"--algorithm {algorithm} needs --draft-model-path (only the default model "
                             "has shipped drafts)")
        extra = {"speculative_token_map": _token_map(args)} if use_token_map else {}
        label_prefix = "EAGLE+FR" if use_token_map else algorithm
        for config in parse_grid(_grid_for(args.grid, name, len(names) > 1), algorithm):
            spec = serving.spec_kwargs(algorithm, args.draft_model_path, config.num_steps, config.topk,
                                       config.num_draft_tokens)
            label = f"{label_prefix} {config.label}" if len(names) > 1 else config.label
            for ngram_label, ngram in _ngram_choices(args, algorithm):
                runs.append((label + ngram_label, dict(spec, **extra, **ngram)))
    return runs


def _ngram_choices(args: argparse.Namespace, algorithm: str) -> list[tuple[str, dict[str, Any]]]:
    """[(label suffix, engine kwargs)]: one run per --ngram-corpus value for NGRAM, per --ngram-assist
    value for the draft-model algorithms, else the one run."""
    if algorithm == "NGRAM" and args.ngram_corpus:
        values = [v.strip() for v in args.ngram_corpus.split(",") if v.strip()]
        return [(f" corpus={v}", {} if v == "default" else {"speculative_ngram_corpus": v}) for v in values]
    if algorithm != "NGRAM" and args.ngram_assist:
        return [(f" assist={n}" if n else "", {"speculative_ngram_assist": n} if n else {})
                for n in _assist_values(args.ngram_assist)]
    return [("", {})]


def _assist_values(text: str) -> list[int]:
    """--ngram-assist's values: 0 (off) or tree sizes of at least 2."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--ngram-assist: expected integers separated by commas, got {text!r}") from None
    if not values or any(v < 0 or v == 1 for v in values):
        raise ValueError(f"--ngram-assist: each value is 0 (off) or the n-gram trees' nodes (>= 2); got {text!r}")
    return values


def _grid_for(grid: str, name: str, is_multi: bool) -> str:
    """The grid entries for algorithm ``name``: 'ALGO:...' entries for it, plus unprefixed ones."""
    entries = []
    for item in (s.strip() for s in grid.split(";")):
        if ":" in item:
            algo, _, shape = item.partition(":")
            if algo.strip().upper() == name.upper():
                entries.append(shape)
        elif item:
            entries.append(item)
    return ";".join(entries)


def _token_map(args: argparse.Namespace) -> str:
    if args.token_map:
        return args.token_map
    from specserve.drafts import FRSPEC_TOKEN_MAP

    return str(FRSPEC_TOKEN_MAP)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """All engines are built first; then every prompt group (``--batch-size`` prompts) runs
    through each engine in turn, so plain and speculative runs see the same machine load."""
    runs = plan_runs(args)
    prompt_list = prompt_data.load_prompts(prompt_data.resolve_prompt_files(args.prompts), args.num_prompts_per_file)
    id_lists = serving.tokenize_prompts(args, prompt_list, args.max_new_tokens)
    result: dict[str, Any] = {
        "benchmark": "speculative", "model_path": args.model_path, "algorithm": args.algorithm or "none",
        "draft_model_path": args.draft_model_path, "dtype": args.dtype, "quantization": args.quantization,
        "speculative_policy": args.speculative_policy or "auto", "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size, "ignore_eos": args.ignore_eos, "interleaved": True,
        "categories": prompt_data.categories(prompt_list), "num_prompts": len(prompt_list), "configs": []}
    peers = _load_peers(args)
    entries, engines = _build_engines(args, runs, id_lists)
    peer_entries = [_new_entry(label, {}, peer=True) for label, _ in peers]
    outputs = [[None] * len(id_lists) for _ in runs]
    peer_outputs = [[None] * len(id_lists) for _ in peers]
    try:
        _run_interleaved(args, engines, entries, prompt_list, id_lists, outputs,
                         [(llm, entry, out) for (_, llm), entry, out in zip(peers, peer_entries, peer_outputs)])
    finally:
        for engine in engines:
            serving.close_engine(engine)
    for entry, out in zip(entries, outputs):
        _finish_entry(entry)
        _compare(entry, out, outputs[0], prompt_list, entries[0])
        result["configs"].append(entry)
    for entry, out in zip(peer_entries, peer_outputs):
        _finish_entry(entry)
        _compare(entry, out, peer_outputs[0], prompt_list, entries[0])   # speed vs ours, outputs vs its plain
        result["configs"].append(entry)
    if peers:
        result["llama_cpp"] = {"version": llama_peer.version(), "lookup_tokens": args.llama_lookup_tokens}
    _print(result)
    return result


def _load_peers(args) -> list[tuple[str, Any]]:
    """[(label, Llama)] for --llama-cpp: plain, then prompt lookup; [] without the flag."""
    if not args.llama_cpp:
        return []
    reason = llama_peer.skip_reason(args.model_path)
    if reason:
        raise ValueError(f"--llama-cpp: {reason}")
    if args.batch_size != 1:
        raise ValueError("--llama-cpp runs batch 1 only (drop --batch-size)")
    if args.llama_lookup_tokens < 1:
        raise ValueError("--llama-lookup-tokens must be >= 1")
    threads = llama_peer.threads_for(args)
    context = args.context_length
    peers = [("llama.cpp", llama_peer.load(args.model_path, threads, context)),
             (f"llama.cpp lookup {args.llama_lookup_tokens}",
              llama_peer.load(args.model_path, threads, context, args.llama_lookup_tokens))]
    for _, llm in peers:
        llama_peer.generate(llm, llm.tokenize(b"Hello"), 4)        # warm up
    return peers


def _new_entry(label: str, spec: dict[str, Any], peer: bool = False) -> dict[str, Any]:
    return {"label": label, "is_plain": not spec and not peer, "spec_kwargs": spec, "peer": peer,
            "per_category": {}, "histogram": {}, "error": None}


def _build_engines(args, runs, id_lists) -> tuple[list[dict[str, Any]], list[Any]]:
    entries, engines = [], []
    kv_tokens = serving.kv_tokens_needed(args, id_lists, args.batch_size, args.max_new_tokens)
    for label, spec in runs:
        entry = _new_entry(label, spec)
        engine = None
        try:
            policy = args.speculative_policy if spec else None
            engine = serving.make_engine(serving.engine_kwargs(args, args.dtype, max_total_tokens=kv_tokens,
                                                               max_running_requests=max(args.batch_size, 1),
                                                               quantization=args.quantization,
                                                               speculative_policy=policy, **spec))
            if spec and engine.engine.spec_worker is None:
                raise RuntimeError("speculation is off: the draft could not be loaded (see the log)")
            info = engine.engine.get_server_info()
            entry["engine_spec_params"] = {k: v for k, v in info.items()
                                           if k.startswith("speculative_") or k == "spec_policy"}
            serving.warm_up(engine.engine, engine.tokenizer, concurrency=args.batch_size)
        except Exception as exc:  # a configuration the engine cannot run: record it, go on
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc(limit=6)
            print(f"\n[{label}] failed: {entry['error']}", flush=True)
            serving.close_engine(engine)
            engine = None
        entries.append(entry)
        engines.append(engine)
    return entries, engines


def _run_interleaved(args, engines, entries, prompt_list, id_lists, outputs, peers) -> None:
    """peers: [(Llama, entry, outputs)], run after the engines on every group of prompts."""
    live = [i for i, engine in enumerate(engines) if engine is not None]
    step = max(args.batch_size, 1)
    with serving.progress_bar(len(id_lists) * (len(live) + len(peers)), "speculative (all configs)") as bar:
        for category in prompt_data.categories(prompt_list):
            indices = [i for i, p in enumerate(prompt_list) if p.category == category]
            for i in live:
                engines[i].engine.flush_cache()
            for chunk_start in range(0, len(indices), step):
                chunk = indices[chunk_start:chunk_start + step]
                for i in live:
                    _run_chunk(engines[i].engine, args, entries[i], category, chunk, id_lists, outputs[i], bar)
                for llm, entry, peer_outputs in peers:
                    _run_peer_chunk(llm, args, entry, category, chunk, id_lists, peer_outputs, bar)


def _run_chunk(core, args, entry, category, indices, id_lists, outputs, bar) -> None:
    """One group of prompts through one engine; adds to the entry's per-category sums."""
    before = core.get_server_info().get("spec_accept_histogram")
    records, wall = serving.run_requests(core, [id_lists[i] for i in indices],
                                         lambda: serving.sampling_params(args.max_new_tokens, args.ignore_eos),
                                         args.batch_size, on_finish=lambda _r: bar.update(1))
    after = core.get_server_info().get("spec_accept_histogram")
    if after is not None:
        delta = histogram_delta(before, after)
        old = entry["histogram"].get(category)
        entry["histogram"][category] = delta if old is None else _sum_histograms([old, delta])
    for index, rec in zip(indices, records):
        outputs[index] = rec.output_ids
    stats = _category_stats(entry, category)
    stats["num_requests"] += len(records)
    stats["tokens"] += sum(len(r.output_ids) for r in records)
    stats["wall_s"] += wall
    for rec in records:
        verify = rec.meta.get("spec_verify_ct", 0) or 0
        stats["verify_ct"] += verify
        stats["_accepted"] += verify * (rec.meta.get("spec_accept_length", 1.0) or 1.0)
        stats["_ttft"].append(rec.ttft)


def _run_peer_chunk(llm, args, entry, category, indices, id_lists, outputs, bar) -> None:
    """One group of prompts through llama.cpp, one at a time (it has no accept-length count)."""
    stats = _category_stats(entry, category)
    for index in indices:
        start = time.perf_counter()
        outputs[index] = llama_peer.generate(llm, id_lists[index], args.max_new_tokens, not args.ignore_eos)
        stats["wall_s"] += time.perf_counter() - start
        stats["num_requests"] += 1
        stats["tokens"] += len(outputs[index])
        bar.update(1)


def _category_stats(entry: dict[str, Any], category: str) -> dict[str, Any]:
    return entry["per_category"].setdefault(category, {"num_requests": 0, "tokens": 0, "wall_s": 0.0, "verify_ct": 0,
                                                       "_accepted": 0.0, "_ttft": []})


def _finish_entry(entry: dict[str, Any]) -> None:
    for stats in entry["per_category"].values():
        accepted, ttfts = stats.pop("_accepted"), stats.pop("_ttft")
        stats["tok_s"] = stats["tokens"] / stats["wall_s"] if stats["wall_s"] > 0 else float("nan")
        stats["accept_length"] = (None if entry.get("peer") else
                                  accepted / stats["verify_ct"] if stats["verify_ct"] else 1.0)
        stats["median_ttft_s"] = report.median(ttfts) if ttfts else None
    entry["overall"] = _overall(entry["per_category"])
    if entry.get("peer"):
        entry["overall"]["accept_length"] = None
    if entry["spec_kwargs"] and not entry["error"] and not entry["overall"]["verify_ct"]:
        entry["warning"] = INACTIVE_WARNING
    if entry["histogram"]:
        entry["histogram"]["overall"] = _sum_histograms(list(entry["histogram"].values()))


def _overall(per_category: dict[str, dict[str, Any]]) -> dict[str, Any]:
    stats = list(per_category.values())
    tokens, wall = sum(s["tokens"] for s in stats), sum(s["wall_s"] for s in stats)
    verify = [s["verify_ct"] for s in stats]
    return {"num_requests": sum(s["num_requests"] for s in stats), "tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall if wall > 0 else float("nan"), "verify_ct": sum(verify),
            "accept_length": report.weighted_mean([s["accept_length"] for s in stats], verify)
            if sum(verify) else (1.0 if stats else float("nan"))}


def _compare(entry, outputs, plain_outputs, prompt_list, plain_entry) -> None:
    """Speedup vs plain and identical-output counts, per category and overall."""
    groups = dict(entry["per_category"], overall=entry["overall"])
    plain_groups = dict(plain_entry["per_category"], overall=plain_entry["overall"])
    for name, stats in groups.items():
        stats["speedup"] = report.ratio(stats["tok_s"], plain_groups.get(name, {}).get("tok_s"))
        members = [i for i, p in enumerate(prompt_list) if name == "overall" or p.category == name]
        done = [i for i in members if outputs[i] is not None and plain_outputs and plain_outputs[i] is not None]
        stats["identical_to_plain"] = sum(outputs[i] == plain_outputs[i] for i in done)
        stats["compared"] = len(done)


def histogram_delta(before: Any, after: Any) -> Any:
    """What an engine-wide accept-length histogram gained between two snapshots
    (dict {accept_len: count} or list indexed by accept length); ``after`` if not comparable."""
    if isinstance(after, dict) and isinstance(before, dict):
        return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
    if isinstance(after, list) and isinstance(before, list):
        return [a - (before[i] if i < len(before) else 0) for i, a in enumerate(after)]
    return after


def _sum_histograms(hists: list[Any]) -> Any:
    if hists and all(isinstance(h, dict) for h in hists):
        total: dict[Any, Any] = {}
        for h in hists:
            for k, v in h.items():
                total[k] = total.get(k, 0) + v
        return total
    if hists and all(isinstance(h, list) for h in hists):
        width = max(len(h) for h in hists)
        return [sum(h[i] for h in hists if i < len(h)) for i in range(width)]
    return hists


def format_histogram(hist: Any) -> str:
    if isinstance(hist, dict):
        return " ".join(f"{k}:{v}" for k, v in sorted(hist.items(), key=lambda kv: float(kv[0])))
    if isinstance(hist, list):
        return " ".join(f"{i}:{v}" for i, v in enumerate(hist) if v)
    return str(hist)


def _print(result: dict[str, Any]) -> None:
    title = (f"speculative: {result['algorithm']}, {result['dtype']}, batch {result['batch_size']}, "
             f"max_new_tokens={result['max_new_tokens']}, {result['num_prompts']} prompts")
    rows = []
    for entry in result["configs"]:
        for name in list(entry["per_category"]) + ["overall"]:
            s = entry["overall"] if name == "overall" else entry["per_category"][name]
            rows.append([entry["label"], name, s.get("tokens"), s.get("tok_s"), s.get("speedup"),
                         s.get("accept_length"), f"{s.get('identical_to_plain', 0)}/{s.get('compared', 0)}"])
        if entry["error"]:
            rows.append([entry["label"], "ERROR", entry["error"][:60], None, None, None, "-"])
    report.print_table(["config", "category", "tokens", "tok/s", "speedup", "accept len", "same as plain"],
                       rows, title=title)
    if result.get("llama_cpp"):
        print("llama.cpp rows: speedup = vs specserve's plain decoding in the same run; 'same as plain' = "
              "equal to llama.cpp's own plain output")
    for entry in result["configs"]:
        if entry.get("warning"):
            print(f"warning [{entry['label']}]: {entry['warning']}")
        if entry["histogram"].get("overall"):
            print(f"accept histogram [{entry['label']}] (draft tokens accepted per verify: count): "
                  f"{format_histogram(entry['histogram']['overall'])}")
