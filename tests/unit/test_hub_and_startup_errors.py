"""Hub ids resolve through huggingface_hub (its cache, revisions); every startup problem is
a one-line ConfigError naming the flag, which launch_server prints as ``error:`` (exit 2)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from specserve.config import ConfigError, ModelConfig
from specserve.loading import hub
from specserve.loading.loader import check_architecture, check_load_format


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty HF cache with the Hub unreachable (what a machine without network sees)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    return tmp_path / "hf" / "hub"


def test_local_paths_are_used_as_they_are(tmp_path):
    assert hub.resolve_checkpoint(str(tmp_path), "--model-path") == str(tmp_path)
    token_map = tmp_path / "map.pt"
    token_map.write_bytes(b"x")
    assert hub.resolve_file(str(token_map), "--speculative-token-map") == str(token_map)


def test_hub_id_offline_is_one_line_naming_the_id(offline_hub):
    with pytest.raises(ConfigError) as err:
        hub.resolve_checkpoint("meta-llama/Llama-3.1-8B-Instruct", "--model-path")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("--model-path meta-llama/Llama-3.1-8B-Instruct: ")
    assert "local path" in message


def test_hub_file_offline_names_the_file(offline_hub):
    with pytest.raises(ConfigError, match="--speculative-token-map thunlp/LLaMA3-Instruct-8B-FR-Spec/freq_32768.pt"):
        hub.resolve_file("thunlp/LLaMA3-Instruct-8B-FR-Spec/freq_32768.pt", "--speculative-token-map")


def test_hub_snapshot_in_the_cache_resolves_offline(offline_hub):
    """A repository already in the HF cache (as `hf download` leaves it) resolves without network,
    at the revision asked for."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = offline_hub / "models--org--tiny" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors").write_bytes(b"")
    (snapshot / "freq.pt").write_bytes(b"")
    refs = offline_hub / "models--org--tiny" / "refs"
    refs.mkdir()
    (refs / "main").write_text(commit)
    assert Path(hub.resolve_checkpoint("org/tiny", "--model-path")) == snapshot
    assert Path(hub.resolve_checkpoint("org/tiny", "--model-path", revision=commit)) == snapshot
    assert Path(hub.resolve_file("org/tiny/freq.pt", "--speculative-token-map")) == snapshot / "freq.pt"
    with pytest.raises(ConfigError, match="--model-path org/tiny"):
        hub.resolve_checkpoint("org/tiny", "--model-path", revision="v2")


def test_missing_local_path_is_a_config_error():
    with pytest.raises(ConfigError, match="--model-path ./no/such/dir: no such file or directory"):
        hub.resolve_checkpoint("./no/such/dir", "--model-path")


def test_load_format_must_match_the_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    check_load_format(tmp_path, "safetensors")
    check_load_format(tmp_path, "auto")
    with pytest.raises(ConfigError, match="--load-format gguf: .* is a safetensors checkpoint"):
        check_load_format(tmp_path, "gguf")
    with pytest.raises(ConfigError, match="--load-format dummy: not supported"):
        check_load_format(tmp_path, "dummy")


def test_unsupported_architecture_names_it():
    with pytest.raises(ConfigError, match="architecture GPT2LMHeadModel is not supported"):
        check_architecture(ModelConfig(architecture="GPT2LMHeadModel"), "/m")


def _launch(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "specserve.launch_server", "--port", "1", *argv],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def _assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-2000:]
    for needle in needles:
        assert needle in errors[0]


def test_launch_with_a_hub_id_offline_exits_2_with_one_line(tmp_path):
    proc = _launch("--model-path", "org/name", env={"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    _assert_one_line_error(proc, "--model-path org/name", "local path")


def test_launch_with_a_missing_path_exits_2(tmp_path):
    _assert_one_line_error(_launch("--model-path", str(tmp_path / "nothing")), "no such file or directory")


def test_launch_with_a_memory_budget_that_does_not_fit_names_the_flags(default_gguf_path):
    proc = _launch("--model-path", default_gguf_path, "--mem-fraction-static", "0.0001")
    _assert_one_line_error(proc, "not enough memory", "--mem-fraction-static")


def test_launch_with_a_model_dir_without_tokenizer_exits_2(tmp_path, hf_export_dir):
    """A checkpoint directory whose tokenizer files are missing: one error line naming the flags."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(hf_export_dir, model)
    for file in model.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens")):
            file.unlink()
    _assert_one_line_error(_launch("--model-path", str(model)), "--model-path", "--tokenizer-path")
