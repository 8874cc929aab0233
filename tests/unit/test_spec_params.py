"""Speculative flags: auto-choice of S/K/N, partial settings, impossible shapes, thresholds."""
from __future__ import annotations

import json

import pytest

from specserve.config import ConfigError, ModelConfig, ServerArgs
from specserve.speculative.params import resolve_spec_params

LLAMA = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
QWEN = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=32, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def _resolve(cfg=LLAMA, **kwargs):
    return resolve_spec_params(ServerArgs(**kwargs), cfg)


def _shape(p):
    return p.num_steps, p.topk, p.num_draft_tokens


def test_off_without_algorithm():
    assert _resolve() is None


@pytest.mark.parametrize("flag", ["speculative_num_steps", "speculative_eagle_topk",
                                  "speculative_num_draft_tokens"])
def test_shape_flag_without_algorithm_is_an_error(flag):
    with pytest.raises(ConfigError, match="without --speculative-algorithm"):
        _resolve(**{flag: 2})


def test_auto_choice_standalone_and_ngram():
    p = _resolve(speculative_algorithm="STANDALONE", speculative_draft_model_path="d")
    assert (p.algorithm, _shape(p)) == ("STANDALONE", (3, 1, 4))
    p = _resolve(speculative_algorithm="NGRAM")
    assert p.num_draft_tokens == 12


def test_ngram_uses_only_n():
    assert _resolve(speculative_algorithm="NGRAM", speculative_num_draft_tokens=8).num_draft_tokens == 8
    p = _resolve(speculative_algorithm="NGRAM", speculative_num_steps=3, speculative_eagle_topk=2)
    assert p.num_draft_tokens == 12          # S and K ignored (warning)
    with pytest.raises(ConfigError, match="--speculative-num-draft-tokens must be >= 2"):
        _resolve(speculative_algorithm="NGRAM", speculative_num_draft_tokens=1)
    with pytest.raises(ConfigError, match="--speculative-ngram-min-match-window-size"):
        _resolve(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=13)


@pytest.mark.parametrize("given, shape", [
    ({"speculative_num_steps": 2}, (2, 1, 3)),             # STANDALONE auto (3, 1, 4): K=1 makes N = S + 1
    ({"speculative_eagle_topk": 2}, (3, 2, 4)),
    ({"speculative_num_draft_tokens": 3}, (3, 1, 4)),      # K=1 chain: N follows S (logged)
    ({"speculative_num_steps": 5, "speculative_eagle_topk": 1}, (5, 1, 6)),
])
def test_partial_shape_is_filled_from_the_auto_choice(given, shape):
    p = _resolve(speculative_algorithm="STANDALONE", speculative_draft_model_path="d", **given)
    assert _shape(p) == shape


def test_partial_shape_fills_an_auto_n_that_fits_the_tree():
    """EAGLE on Llama auto-chooses (5, 4, 8); S=1, K=2 can only build 2 drafts, so the auto N is 3."""
    p = _resolve(speculative_algorithm="EAGLE", speculative_num_steps=1, speculative_eagle_topk=2)
    assert _shape(p) == (1, 2, 3)
    with pytest.raises(ConfigError, match="too large"):        # a given N is checked, not fitted
        _resolve(speculative_algorithm="EAGLE", speculative_num_steps=1, speculative_eagle_topk=2,
                 speculative_num_draft_tokens=8)


def test_ngram_default_n_follows_the_window_flag():
    assert _resolve(speculative_algorithm="NGRAM").num_draft_tokens == 12
    p = _resolve(speculative_algorithm="NGRAM", speculative_ngram_max_match_window_size=7)
    assert p.num_draft_tokens == 7


def test_policy_flag_and_its_environment_spelling(monkeypatch):
    monkeypatch.delenv("SPECSERVE_SPEC_POLICY", raising=False)
    assert _resolve(speculative_algorithm="NGRAM").policy == "auto"
    assert _resolve(speculative_algorithm="NGRAM", speculative_policy="always").policy == "always"
    monkeypatch.setenv("SPECSERVE_SPEC_POLICY", "always")
    assert _resolve(speculative_algorithm="NGRAM").policy == "always"
    monkeypatch.setenv("SPECSERVE_SPEC_POLICY", "sometimes")
    with pytest.raises(ConfigError, match="SPECSERVE_SPEC_POLICY"):
        _resolve(speculative_algorithm="NGRAM")
    with pytest.raises(ConfigError, match="--speculative-policy"):
        ServerArgs(speculative_policy="never")


def _standalone(s, k, n):
    return _resolve(speculative_algorithm="STANDALONE", speculative_draft_model_path="d",
                    speculative_num_steps=s, speculative_eagle_topk=k, speculative_num_draft_tokens=n)


def test_topk_one_forces_chain():
    assert _shape(_standalone(4, 1, 9)) == (4, 1, 5)
    assert _shape(_standalone(4, 1, 5)) == (4, 1, 5)


def test_tree_shapes():
    assert _shape(_standalone(3, 2, 3)) == (3, 2, 3)       # K > 1 with N == S + 1 is fine
    assert _shape(_standalone(2, 2, 7)) == (2, 2, 7)       # pool: 2 + 1*4 = 6 candidates
    with pytest.raises(ConfigError, match="at most 6 candidates"):
        _standalone(2, 2, 8)
    assert _shape(_standalone(1, 3, 4)) == (1, 3, 4)
    with pytest.raises(ConfigError, match="--speculative-num-draft-tokens 5 is too large"):
        _standalone(1, 3, 5)


@pytest.mark.parametrize("s, k, n, flag", [(0, 1, 2, "--speculative-num-steps"),
                                           (2, 0, 3, "--speculative-eagle-topk"),
                                           (2, 2, 1, "--speculative-num-draft-tokens")])
def test_bad_values_name_their_flag(s, k, n, flag):
    with pytest.raises(ConfigError, match=flag):
        _standalone(s, k, n)


def test_standalone_requires_draft_path():
    with pytest.raises(ConfigError, match="requires --speculative-draft-model-path"):
        _resolve(speculative_algorithm="STANDALONE")


def test_eagle_family_auto_choice():
    for algo in ("EAGLE", "NEXTN", "EAGLE3"):
        params = _resolve(speculative_algorithm=algo)
        assert (params.num_steps, params.topk, params.num_draft_tokens) == (5, 4, 8)
        assert params.algorithm == ("EAGLE3" if algo == "EAGLE3" else "EAGLE")
    from specserve.speculative.params import auto_choose
    assert auto_choose("EAGLE", LLAMA.architecture) == (5, 4, 8)
    assert auto_choose("EAGLE3", QWEN.architecture) == (3, 1, 4)
    with pytest.raises(ConfigError, match="too large"):
        _resolve(speculative_algorithm="EAGLE", speculative_num_steps=1, speculative_eagle_topk=2,
                 speculative_num_draft_tokens=9)


def test_thresholds():
    p = _resolve(speculative_algorithm="NGRAM", speculative_accept_threshold_single=0.5,
                 speculative_accept_threshold_acc=0.0)
    assert p.threshold_single == 0.5 and 0.0 < p.threshold_acc < 1e-6
    for flag in ("speculative_accept_threshold_single", "speculative_accept_threshold_acc"):
        with pytest.raises(ConfigError, match="--" + flag.replace("_", "-")):
            _resolve(speculative_algorithm="NGRAM", **{flag: 1.5})


def test_lowercase_algorithm_is_accepted():
    assert _resolve(speculative_algorithm="ngram").algorithm == "NGRAM"


def test_measured_shapes_of_the_shipped_drafts_are_valid():
    import torch

    from specserve.drafts import MEASURED_SHAPES, measured_shape
    from specserve.speculative.params import _check_shape

    assert MEASURED_SHAPES
    for (algorithm, dtype, quantization), shape in MEASURED_SHAPES.items():
        assert measured_shape(algorithm.lower(), "cpu", dtype, quantization) == shape
        assert measured_shape(algorithm, "cuda:0", dtype, quantization) is None
        assert _check_shape(*shape) == shape
    assert measured_shape("NGRAM", "cpu", torch.float32) is None


def test_recorded_shapes_replace_their_key_only(tmp_path, monkeypatch):
    import torch

    from specserve import drafts

    monkeypatch.setattr(drafts, "MEASURED_SHAPES_FILE", tmp_path / "shapes.json")
    monkeypatch.setattr(drafts, "MEASURED_SHAPES", {})
    old = {"algorithm": "EAGLE3", "dtype": "float32", "quantization": "unquant", "shape": [3, 1, 4]}
    drafts.record_measured_shapes([old, dict(old, quantization="gguf", shape=[5, 4, 8])], source="a")
    drafts.record_measured_shapes([dict(old, quantization="gguf", shape=[4, 4, 8])], source="b")
    assert drafts.measured_shape("EAGLE3", "cpu", torch.float32, "gguf") == (4, 4, 8)
    assert drafts.measured_shape("eagle3", "cpu", torch.float32) == (3, 1, 4)
    assert drafts.measured_shape("EAGLE3", "cpu", torch.float32, "w8a8_int8") == (3, 1, 4)   # falls back
    assert len(json.loads((tmp_path / "shapes.json").read_text())["shapes"]) == 2


def test_ngram_assist_widens_the_tree_cap_not_the_drafters_shape():
    p = _resolve(speculative_algorithm="EAGLE3", speculative_num_steps=1, speculative_eagle_topk=1,
                 speculative_num_draft_tokens=2, speculative_ngram_assist=6)
    assert _shape(p) == (1, 1, 2) and p.assist_nodes == 6 and p.tree_cap == 6
    p = _resolve(speculative_algorithm="EAGLE3", speculative_num_steps=5, speculative_eagle_topk=4,
                 speculative_num_draft_tokens=8, speculative_ngram_assist=4)
    assert p.tree_cap == 8
    assert _resolve(speculative_algorithm="EAGLE3").tree_cap == _resolve(speculative_algorithm="EAGLE3").num_draft_tokens


@pytest.mark.parametrize("kwargs", [{"speculative_algorithm": "NGRAM", "speculative_ngram_assist": 4},
                                    {"speculative_ngram_assist": 4},
                                    {"speculative_algorithm": "EAGLE3", "speculative_ngram_assist": 1},
                                    {"speculative_algorithm": "EAGLE3", "speculative_ngram_assist": -2}])
def test_ngram_assist_needs_a_draft_model_and_two_nodes(kwargs):
    with pytest.raises(ConfigError, match="--speculative-ngram-assist"):
        ServerArgs(**kwargs)
