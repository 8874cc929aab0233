"""Speculative decoding on the JAX backend, through the whole engine, on a tiny random Llama
with tiny random draft heads (the published EAGLE / EAGLE-3 layouts, as tests/model uses):
greedy speculative output equals the JAX backend's own plain decoding, token for token,
with requests joining and leaving (the batch changes every step) and radix hits. A draft
that cannot load leaves the server decoding plainly, with a warning."""
from __future__ import annotations

import json
import logging

import pytest

from tests.jax.helpers import random_prompts, staggered, tiny_engine
from tests.model.tiny_draft_heads import eagle3_checkpoint, eagle_checkpoint, write_checkpoint
from tests.model.tiny_llama import VOCAB, perturbed, random_weights, tiny_config, write_tiny_model

SPECS = {
    "NGRAM": {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4},
    "EAGLE": {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3, "speculative_eagle_topk": 2,
              "speculative_num_draft_tokens": 5},
    "EAGLE3": {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
               "speculative_num_draft_tokens": 4},
    "STANDALONE": {"speculative_algorithm": "STANDALONE", "speculative_num_steps": 3, "speculative_eagle_topk": 2,
                   "speculative_num_draft_tokens": 5},
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("jax_tiny")
    cfg = tiny_config()
    deep = tiny_config(num_layers=4)                       # EAGLE3 reads three distinct layers
    weights = random_weights(cfg, seed=0)
    return {"target": str(write_tiny_model(root / "target", weights)),
            "STANDALONE": str(write_tiny_model(root / "draft", perturbed(weights, seed=1, noise=0.3))),
            "deep_target": str(write_tiny_model(root / "deep", random_weights(deep, seed=0), deep)),
            "EAGLE": str(write_checkpoint(root / "eagle", *eagle_checkpoint(cfg))),
            "EAGLE3": str(write_checkpoint(root / "eagle3", *eagle3_checkpoint(deep, draft_vocab=VOCAB // 2,
                                                                                aux_layer_ids=[0, 1, 2])))}


def _target_and_kwargs(tiny: dict[str, str], algo: str) -> tuple[str, dict]:
    kwargs = dict(SPECS[algo])
    if algo == "NGRAM":
        return tiny["target"], kwargs
    kwargs["speculative_draft_model_path"] = tiny[algo]
    return (tiny["deep_target"] if algo == "EAGLE3" else tiny["target"]), kwargs


@pytest.mark.parametrize("algo", ["NGRAM", "EAGLE", "EAGLE3", pytest.param("STANDALONE", marks=pytest.mark.slow)])
def test_greedy_speculation_equals_plain_decoding(tiny, algo):
    model, kwargs = _target_and_kwargs(tiny, algo)
    prompts = random_prompts(6, seed=1)
    plain = staggered(tiny_engine(model), prompts)
    engine = tiny_engine(model, **kwargs)
    assert engine.engine.spec_worker is not None, "the draft did not load"
    spec = staggered(engine, prompts)
    again = staggered(engine, prompts)                     # radix hits on every prompt
    assert spec == plain
    assert again == plain
    assert engine.engine.stats.spec_verify_ct > 0


def test_unloadable_draft_falls_back_to_plain_decoding(tiny, tmp_path, caplog):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    with caplog.at_level(logging.WARNING):
        engine = tiny_engine(tiny["target"], speculative_algorithm="EAGLE3",
                             speculative_draft_model_path=str(broken))
    assert engine.engine.spec_worker is None
    assert engine.engine.runner.capture_features is None
    assert any("plain decoding" in r.getMessage() and r.levelno >= logging.WARNING for r in caplog.records)
    prompts = random_prompts(3, seed=5)
    assert staggered(engine, prompts) == staggered(tiny_engine(tiny["target"]), prompts)
