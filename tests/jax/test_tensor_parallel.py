"""--tp-size 2 over two forced host devices gives the greedy output of --tp-size 1 (the
weights split by heads and MLP columns, jit inserting the all-reduces). The device count
must be set before jax is imported, so the engines run in a subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specserve.config import ConfigError
from tests.jax.helpers import tiny_engine
from tests.model.tiny_llama import random_weights, tiny_config, write_tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    cfg = tiny_config()                          # 4 query / 2 KV heads: attention splits over 2
    return str(write_tiny_model(tmp_path_factory.mktemp("tp") / "model", random_weights(cfg, seed=3)))


def test_tp2_on_two_host_devices_equals_tp1(tiny_model):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "tests.jax.tp_worker", tiny_model, "1,2"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert result["2"]["devices"] == 2
    assert result["2"]["wq_shard_shape"][-1] * 2 == result["1"]["wq_shard_shape"][-1]   # heads split in two
    assert result["2"]["tokens"] == result["1"]["tokens"]
    assert all(len(t) == 24 for t in result["1"]["tokens"])


def test_tp_larger_than_the_devices_is_a_config_error(tiny_model):
    import jax

    with pytest.raises(ConfigError, match="xla_force_host_platform_device_count"):
        tiny_engine(tiny_model, tp_size=len(jax.devices()) + 1)


def test_tp_with_the_torch_backend_is_refused():
    with pytest.raises(ConfigError, match="--backend jax"):
        from specserve.config import ServerArgs

        ServerArgs(tp_size=2)
