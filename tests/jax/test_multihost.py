"""jax.distributed: two processes (one CPU device each, as two hosts would be) serve one
--tp-size 2 model; process 0 schedules and samples, process 1 follows its steps. The
greedy output equals one process's --tp-size 1."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jax.helpers import greedy, random_prompts, tiny_engine
from tests.model.tiny_llama import random_weights, tiny_config, write_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow            # two processes compiling side by side on two cores: ~1 minute
def test_two_processes_serve_one_sharded_model(tmp_path):
    model = str(write_tiny_model(tmp_path / "model", random_weights(tiny_config(), seed=3)))
    expected = greedy(tiny_engine(model), random_prompts(3, seed=11), 16)
    env = dict(os.environ, PYTHONPATH=str(ROOT), SPECSERVE_JAX_COORDINATOR=f"127.0.0.1:{_free_port()}",
               SPECSERVE_JAX_NUM_PROCESSES="2")
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.jax.multihost_worker", model], cwd=ROOT,
                              env=dict(env, SPECSERVE_JAX_PROCESS_ID=str(i)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    line = next(x for x in outs[0][0].splitlines() if x.startswith("RESULT "))
    assert json.loads(line[len("RESULT "):]) == expected
