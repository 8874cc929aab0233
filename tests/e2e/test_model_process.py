"""The server's two processes on the default model: hang-ups under concurrent load leave
nothing behind, SIGTERM stops both processes, a killed model process gives clear 503s, a killed
front leaves neither the model process nor its sockets' folder, and a model that cannot start is
one ``error:`` line with exit status 2."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from specserve.bench import http_client as hc
from specserve.bench.prompts import chat_ids

from .test_api_real import REPO_ROOT, _wait_until_healthy
from .conftest import free_port, wait_until

PROMPTS = ["Name three colours.", "Write a haiku about the sea.", "What is 17 times 3?",
           "List the planets of the solar system.", "Explain what a compiler does.",
           "Give me a recipe for pancakes.", "Translate 'good morning' into French.",
           "Why is the sky blue?"]
MAX_NEW_TOKENS = 24
# uvicorn shuts down gracefully on SIGTERM, then re-raises the signal: exit status -SIGTERM
STOPPED_BY_SIGTERM = (0, -signal.SIGTERM)


class Server:
    def __init__(self, process: subprocess.Popen, base_url: str, log_path: Path) -> None:
        self.process, self.base_url, self.log_path = process, base_url, log_path

    def info(self) -> dict:
        return httpx.get(self.base_url + "/get_server_info", timeout=30).json()


@pytest.fixture()
def server(tmp_path: Path, default_gguf_path: str) -> Iterator[Server]:
    with _served(tmp_path, default_gguf_path) as running:
        yield running


@contextlib.contextmanager
def _served(tmp_path: Path, model_path: str, *extra_args: str, env: dict | None = None) -> Iterator[Server]:
    port = free_port()
    command = [sys.executable, "-m", "specserve.launch_server", "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning", "--model-path", model_path, "--context-length", "1024",
               "--speculative-algorithm", "NGRAM", *extra_args]
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   env=None if env is None else {**os.environ, **env})
    running = Server(process, f"http://127.0.0.1:{port}", log_path)
    try:
        _wait_until_healthy(process, running.base_url, log_path)
        yield running
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def prompt_ids(default_gguf_path: str) -> list[list[int]]:
    from specserve.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(default_gguf_path)
    return [chat_ids(tokenizer, text) for text in PROMPTS]


def _is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_hang_ups_under_load_leave_no_request_or_kv_behind_and_sigterm_stops_both(
        server: Server, prompt_ids: list[list[int]]) -> None:
    solo, _ = asyncio.run(hc.run_load(server.base_url, prompt_ids,
                                      hc.LoadSpec(1, True, MAX_NEW_TOKENS, len(prompt_ids))))
    solo_text = {r.prompt_index: r.text for r in solo}
    assert all(r.error is None and r.completion_tokens == MAX_NEW_TOKENS for r in solo)
    load = hc.LoadSpec(16, True, MAX_NEW_TOKENS, 0, duration_s=12, abort_fraction=0.25, seed=3)
    records, _ = asyncio.run(hc.run_load(server.base_url, prompt_ids, load))
    hung_up = [r for r in records if r.was_aborted]
    completed = [r for r in records if not r.was_aborted]
    assert hung_up and completed
    assert {r.status for r in records} == {200}, [r.error for r in records if r.status != 200][:3]
    assert all(r.error is None for r in completed)
    assert [r.prompt_index for r in completed if r.text != solo_text[r.prompt_index]] == []
    time.sleep(1.0)
    after = hc.server_state(server.base_url)
    assert after["num_running_reqs"] == 0 and after["num_waiting_reqs"] == 0
    assert after["kv_tokens_held_by_requests"] == 0

    model_pid = server.info()["model_process_pid"]
    assert model_pid != server.process.pid and not _is_gone(model_pid)
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(60) in STOPPED_BY_SIGTERM
    assert _is_gone(model_pid), "the model process outlived the front"


def test_a_killed_model_process_fails_its_request_with_503_and_health_says_so(server: Server) -> None:
    model_pid = server.info()["model_process_pid"]
    body = {"model": "default", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert "text" in first
            os.kill(model_pid, signal.SIGKILL)
            rest = "\n".join(lines)
        payloads = [line[len("data: "):] for line in [first, *rest.splitlines()] if line.startswith("data: ")]
        assert payloads[-1] == "[DONE]"
        errors = [json.loads(p) for p in payloads[:-1] if '"error"' in p]
        assert errors and errors[0]["error"]["code"] == 503
        assert "model process" in errors[0]["error"]["message"]
        health = http.get("/health")
        assert health.status_code == 503 and "model process" in health.json()["error"]["message"]
        again = http.post("/v1/completions", json=dict(body, stream=False))
        assert again.status_code == 503
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(30) in STOPPED_BY_SIGTERM


def test_a_killed_front_leaves_no_model_process_and_no_socket_files(tmp_path: Path, default_gguf_path: str) -> None:
    """SIGKILL on the front: the kernel stops the model process, which removes the sockets'
    folder the front can no longer remove."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    with _served(tmp_path, default_gguf_path, env={"TMPDIR": str(temporary)}) as running:
        assert _socket_folders(temporary)
        model_pid = running.info()["model_process_pid"]
        running.process.kill()
        running.process.wait(30)
        assert wait_until(lambda: _is_gone(model_pid), 30), "the model process outlived a killed front"
    assert _socket_folders(temporary) == []


def _socket_folders(directory: Path) -> list[str]:
    """The servers' IPC sockets' folders in directory."""
    return [p.name for p in directory.iterdir() if p.name.startswith("specserve-ipc-")]


def test_a_model_that_cannot_start_is_one_error_line_and_exit_2(tmp_path: Path) -> None:
    missing = tmp_path / "missing.gguf"
    result = subprocess.run([sys.executable, "-m", "specserve.launch_server", "--model-path", str(missing),
                             "--port", str(free_port())], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and str(missing) in error_lines[0]


def test_stream_interval_sends_tokens_in_groups_with_the_same_text(tmp_path: Path, default_gguf_path: str) -> None:
    """``--stream-interval 3``: each SSE chunk after the first carries up to 3 tokens, and the
    streamed text is the text served without streaming."""
    with _served(tmp_path, default_gguf_path, "--stream-interval", "3") as running:
        for prompt in PROMPTS[:2]:
            body = {"prompt": prompt, "max_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}
            whole = httpx.post(running.base_url + "/v1/completions", json=body, timeout=60).json()
            pieces = []
            with httpx.stream("POST", running.base_url + "/v1/completions", json={**body, "stream": True},
                              timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        pieces += [c["text"] for c in json.loads(line[6:])["choices"]]
            assert "".join(pieces) == whole["choices"][0]["text"]
            assert 2 <= len(pieces) <= 1 + -(-(MAX_NEW_TOKENS - 1) // 3)     # the first token, then groups
