"""``specserve bench kernel-ab`` on the default GGUF: builds of the kernels take turns in one
process, and a lower ISA variant's whole forwards give the loaded variant's logits bit for bit."""
from __future__ import annotations

import pytest

from specserve.bench import cli, kernel_ab, verify_cost
from specserve.kernels import build

pytestmark = pytest.mark.skipif(build.load() is None, reason="CPU kernels not built here")


def _run(default_gguf_path: str, kernels: str, monkeypatch):
    monkeypatch.setattr(verify_cost, "context_ids", lambda tokenizer, n: list(range(1000, 1000 + n)))
    args = cli.parse_args(["kernel-ab", "--model-path", default_gguf_path, "--kernels", kernels, "--widths", "1,3",
                           "--context", "40", "--rounds", "2", "--forwards", "1", "--quantization", "gguf",
                           "--kv-cache-dtype", "bf16"])
    return kernel_ab.run(args)


def test_the_avx2_build_gives_the_loaded_builds_logits(default_gguf_path, monkeypatch):
    loaded = build.variant_name()
    result = _run(default_gguf_path, f"{loaded},avx2", monkeypatch)
    assert [b["kernels"] for b in result["builds"]] == [loaded, "avx2"]
    for entry in result["builds"]:
        assert entry["logits_equal_first"]
        assert set(entry["widths"]) == {1, 3}
        for width in entry["widths"].values():
            low, high = width["ratio_quartiles"]
            assert width["median_ms"] > 0 and low <= width["ratio_vs_first"] <= high
    assert build.load() is build._load_best()             # the turns left the loaded build in place


def test_a_source_folder_builds_as_the_loaded_variant(tmp_path):
    library = build.load_sources(build.SOURCE_DIR)
    assert build._level_function(library)() == build._level_function(build.load())()
    with pytest.raises(OSError, match="cpu_kernels.c"):
        build.load_sources(tmp_path)


def test_bad_builds_are_usage_errors(default_gguf_path, monkeypatch):
    for kernels in ("", "avx2"):
        with pytest.raises(ValueError, match="two or more"):
            _run(default_gguf_path, kernels, monkeypatch)
    with pytest.raises(ValueError, match="no folder, .so file or variant"):
        _run(default_gguf_path, "avx2,nowhere", monkeypatch)
