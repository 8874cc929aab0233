"""Benchmark output: small statistics helpers, JSON result files, plain-text tables and
matplotlib PNG plots. Nothing here runs a model."""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

DEFAULT_OUT_DIR = "bench_results"


# ---- statistics -------------------------------------------------------------------------------

def median(values: Iterable[float]) -> float:
    """Median of the finite values; NaN when there are none."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``; NaN when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or not denominator or math.isnan(denominator):
        return math.nan
    return numerator / denominator


def weighted_mean(values: Sequence[float], weights: Sequence[float]) -> float:
    total = sum(weights)
    if not total:
        return math.nan
    return sum(v * w for v, w in zip(values, weights)) / total


def common_prefix_len(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---- JSON ---------------------------------------------------------------------------------------

def environment() -> dict[str, Any]:
    """Where a result came from: versions, threads, host, git commit (best effort)."""
    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                            "cpu_count": os.cpu_count(), "argv": sys.argv}
    try:
        import torch

        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads(),
                    cuda=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    except ImportError:
        pass
    info["git_commit"] = _git_commit()
    info["cpu"] = cpu_class()
    return info


def cpu_class() -> str:
    """The CPU's model name and the ISA extensions that pick kernel variants here."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    pairs = (line.split(":", 1) for line in text.split("\n\n")[0].splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in pairs}
    name, flags = fields.get("model name", "unknown CPU"), set(fields.get("flags", "").split())
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return f"{name} ({', '.join(isa) or 'no AVX2'})"


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def result_path(out_dir: str | os.PathLike, name: str, suffix: str = ".json",
                stamp: str | None = None) -> Path:
    """``<out_dir>/<name>-<YYYYmmdd-HHMMSS><suffix>``."""
    stamp = stamp or _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(out_dir) / f"{name}-{stamp}{suffix}"


def write_json(path: str | os.PathLike, data: dict[str, Any]) -> Path:
    """Write ``data`` (NaN/inf become null) with an ``environment`` block; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = dict(data)
    payload.setdefault("environment", environment())
    payload.setdefault("created", _dt.datetime.now().isoformat(timespec="seconds"))
    path.write_text(json.dumps(_json_safe(payload), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def _json_safe(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return str(value)


# ---- tables -------------------------------------------------------------------------------------

def fmt(value: Any, digits: int = 2) -> str:
    """A table cell: floats with ``digits`` decimals, NaN/None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return "-" if not math.isfinite(value) else f"{value:.{digits}f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """A fixed-width text table; the first column left-aligned, the others right-aligned."""
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells if i < len(r)]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths)))

    out = [title] if title else []
    out += [line(headers), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    return "\n".join(out)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> None:
    print(format_table(headers, rows, title), flush=True)
    print(flush=True)


# ---- plots --------------------------------------------------------------------------------------

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speculative(result: dict[str, Any], path: str | os.PathLike) -> Path | None:
    """Two panels: speedup vs plain and accept length, one bar group per config, one bar per
    category (and overall). ``result["configs"]`` as written by bench.speculative."""
    configs = [c for c in result.get("configs", []) if not c.get("is_plain")]
    if not configs:
        return None
    plt = _pyplot()
    groups = list(configs[0]["per_category"]) + ["overall"]
    labels = [c["label"] for c in configs]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(labels) * 2), 4.5))
    for ax, key, ylabel in ((axes[0], "speedup", "speedup vs plain (x)"),
                            (axes[1], "accept_length", "accept length (tokens / verify)")):
        _grouped_bars(ax, labels, groups, lambda c, g: _cell(c, g, key), configs)
        ax.set_ylabel(ylabel)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    axes[0].legend(fontsize="small")
    fig.suptitle(f"{result.get('algorithm')} on {Path(str(result.get('model_path'))).name} "
                 f"({result.get('dtype')}, max_new_tokens={result.get('max_new_tokens')})")
    return _save(fig, path, plt)


def _cell(config: dict[str, Any], group: str, key: str) -> float:
    stats = config["overall"] if group == "overall" else config["per_category"].get(group, {})
    value = stats.get(key)
    return math.nan if value is None else float(value)


def _grouped_bars(ax, labels, groups, value_of, items) -> None:
    width = 0.8 / max(len(groups), 1)
    for j, group in enumerate(groups):
        xs = [i + (j - (len(groups) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, [value_of(item, group) for item in items], width, label=group)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize="small")


def plot_verify_cost(result: dict[str, Any], path: str | os.PathLike) -> Path | None:
    """Forward time (ms) and ratio vs W=1 against the verify width, one line per dtype (and
    llama.cpp's, when run beside)."""
    curves = result.get("curves", {})
    if not curves:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for dtype, rows in curves.items():
        widths = [r["width"] for r in rows]
        axes[0].plot(widths, [r["median_ms"] for r in rows], marker="o", label=dtype)
        axes[1].plot(widths, [r["ratio_vs_w1"] for r in rows], marker="o", label=dtype)
    for ax, ylabel in ((axes[0], "forward time (ms, median)"), (axes[1], "time / time(W=1)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("new tokens per forward (W)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"verify-width cost, context {result.get('context')} tokens, batch 1")
    return _save(fig, path, plt)


def plot_serving(result: dict[str, Any], path: str | os.PathLike) -> Path | None:
    """Throughput against concurrency, per mode (plain / spec): all tokens over the wall time
    (solid) and decode steps alone (dashed, where recorded)."""
    modes = result.get("modes", {})
    if not modes:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, runs in modes.items():
        levels = [r["concurrency"] for r in runs]
        line, = ax.plot(levels, [r["throughput"] for r in runs], marker="o", label=f"{mode}: wall time")
        if all("decode_throughput" in r for r in runs):
            ax.plot(levels, [r["decode_throughput"] for r in runs], marker="s", linestyle="--",
                    color=line.get_color(), label=f"{mode}: decode steps")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("generated tokens / s")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path, plt)


def plot_http(result: dict[str, Any], path: str | os.PathLike) -> Path | None:
    """Left: streamed output tokens/s against clients, ours and vLLM's where it ran (batch-1 offline
    Engine and llama.cpp as horizontal lines). Right: median and p99 of TTFT and inter-token latency (ms)."""
    levels = [lv for lv in result.get("http", []) if lv["stream"]]
    if not levels:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    clients = [lv["concurrency"] for lv in levels]
    axes[0].plot(clients, [lv["output_tokens_per_s"] for lv in levels], marker="o", label="HTTP server")
    vllm = (result.get("vllm") or {}).get("http") or []
    if vllm:
        axes[0].plot([lv["concurrency"] for lv in vllm], [lv["output_tokens_per_s"] for lv in vllm], marker="^",
                     label=f"vLLM {result['vllm'].get('dtype')}, HTTP", color="C2")
    for name, key in (("offline Engine, batch 1", "offline"), ("llama.cpp, batch 1", "llama_cpp")):
        rate = (result.get(key) or {}).get("request_tokens_per_s_median")
        if rate:
            axes[0].axhline(rate, linestyle="--", linewidth=1, label=name, color="grey" if key == "offline" else "C3")
    axes[0].set(xscale="log", xlabel="concurrent streaming clients", ylabel="output tokens / s")
    for key, marker in (("ttft", "o"), ("itl", "s")):
        for stat, style in (("median", "-"), ("p99", ":")):
            axes[1].plot(clients, [1e3 * lv[f"{key}_{stat}_s"] for lv in levels], marker=marker,
                         linestyle=style, label=f"{key.upper()} {stat}")
    axes[1].set(xscale="log", yscale="log", xlabel="concurrent streaming clients", ylabel="ms")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"HTTP serving, {result.get('max_new_tokens')} new tokens, threads {result.get('threads')}")
    return _save(fig, path, plt)


def _save(fig, path: str | os.PathLike, plt) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
