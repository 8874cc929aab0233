"""``launch_server --backend jax`` serves the default model over the OpenAI API (the server
process, its scheduler and front unchanged): an OpenAI client gets a sensible answer."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("the server did not become healthy")


@pytest.mark.slow           # a server start with the default model and its compiles: ~1 minute
def test_openai_client_gets_an_answer_from_the_jax_backend(default_gguf_path, tmp_path):
    openai = pytest.importorskip("openai")
    port = _free_port()
    cmd = [sys.executable, "-m", "specserve.launch_server", "--model-path", default_gguf_path, "--backend", "jax",
           "--port", str(port), "--max-total-tokens", "4096", "--context-length", "1024",
           "--max-running-requests", "4", "--precompile-bs-paddings", "1,2,4", "--precompile-token-paddings", "64"]
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", proc, 600)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        reply = client.chat.completions.create(model="default", temperature=0, max_tokens=32, messages=[
            {"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
        assert "Paris" in reply.choices[0].message.content
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
