"""SGLang's documented launch commands start the server and answer a chat request.

Each test runs ``python -m specserve.launch_server`` with the flags of one of SGLang's
speculative-decoding examples (the model and draft paths local: the default model and its
shipped drafts), waits for /health, sends one chat request and checks the startup log says
what the flags that cannot apply here do. ``--max-total-tokens`` keeps the KV cache small:
``--mem-fraction-static 0.7`` alone would reserve 70% of this machine's RAM for it.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from .conftest import free_port
from .test_api_real import REPO_ROOT, _wait_until_healthy

SHAPE = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
         "--mem-fraction-static", "0.7", "--cuda-graph-max-bs", "8", "--dtype", "float16"]
NGRAM_FLAGS = ["--speculative-ngram-min-match-window-size", "1", "--speculative-ngram-max-match-window-size", "12",
               "--speculative-ngram-min-bfs-breadth", "1", "--speculative-ngram-max-bfs-breadth", "10",
               "--speculative-ngram-match-type", "BFS", "--speculative-ngram-branch-length", "18",
               "--speculative-ngram-capacity", "10000000"]
TOKEN_MAP = str(REPO_ROOT / "specserve" / "drafts" / "smollm2-135m-frspec-8k.pt")

COMMANDS = {
    "EAGLE3": (["--speculative-algorithm", "EAGLE3", *SHAPE],
               ["--cuda-graph-max-bs 8: no effect", "--dtype float16: this CPU build"], (3, 1, 4)),
    "STANDALONE": (["--speculative-algorithm", "STANDALONE", *SHAPE,
                    "--speculative-draft-model-quantization", "unquant"],
                   ["--cuda-graph-max-bs 8: no effect"], (3, 1, 4)),
    "NGRAM": (["--speculative-algorithm", "NGRAM", *NGRAM_FLAGS, "--disable-overlap-schedule"],
              ["--disable-overlap-schedule: no effect"], (0, 0, 12)),
    "EAGLE+FR-Spec": (["--speculative-algorithm", "EAGLE", "--enable-torch-compile", "--torch-compile-max-bs", "2",
                       "--speculative-token-map", TOKEN_MAP],
                      ["--enable-torch-compile --torch-compile-max-bs 2: torch.compile is not applied",
                       "draft vocab 8192"], None),                      # the head's lm_head cut to the map
}


def _launch(argv: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "specserve.launch_server", "--host", "127.0.0.1", "--port", str(port),
               "--max-total-tokens", "8192", *argv]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    return process, f"http://127.0.0.1:{port}"


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.mark.parametrize("name", list(COMMANDS))
def test_sglang_launch_command_serves_a_chat_request(name, default_gguf_path, tmp_path):
    argv, log_lines, shape = COMMANDS[name]
    log_path = tmp_path / "server.log"
    process, base_url = _launch(["--model-path", default_gguf_path, *argv], log_path)
    try:
        _wait_until_healthy(process, base_url, log_path)
        with httpx.Client(base_url=base_url, timeout=120) as http:
            reply = http.post("/v1/chat/completions", json={
                "model": "default", "temperature": 0, "max_tokens": 16,
                "messages": [{"role": "user", "content": "List 3 countries and their capitals."}]})
            info = http.get("/get_server_info").json()
    finally:
        _stop(process)
    log = log_path.read_text()
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"].strip()
    assert "speculative decoding disabled" not in log, log[-3000:]      # the draft loaded
    for line in log_lines:
        assert line in log, log[-3000:]
    assert info["spec_policy"]["policy"] == "auto" and "--speculative-policy auto:" in log
    if shape is not None:
        got = (info["speculative_num_steps"], info["speculative_eagle_topk"], info["speculative_num_draft_tokens"])
        assert got == shape
