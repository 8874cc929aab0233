"""STANDALONE with an FR-Spec token map (``--speculative-token-map``): a full-vocabulary draft
(the target's first 2 and last 2 layers) with the shipped 8k map drafts only ids of the map, its LM head holds only the map's
rows, and greedy output equals plain decoding token for token (the target verifies every
drafted token). ``--speculative-policy always`` so every decode step really speculates.
"""
from __future__ import annotations

import pytest
import torch

from specserve.config import ConfigError
from specserve.drafts import FRSPEC_TOKEN_MAP
from specserve.engine import Engine
from specserve.speculative.truncated_draft import write_truncated_draft

ENGINE_KW = {"dtype": "float32", "max_total_tokens": 4096, "context_length": 1024}
PROMPTS = ("Write a haiku about the sea.", "What is 17 times 23? Explain step by step.",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"")
SHAPES = {"auto": {}, "tree": {"speculative_num_steps": 3, "speculative_eagle_topk": 2,
                                  "speculative_num_draft_tokens": 6}}


@pytest.fixture(scope="module")
def hot_ids() -> set[int]:
    return set(torch.load(FRSPEC_TOKEN_MAP, weights_only=True))


@pytest.fixture(scope="module")
def engines(default_gguf_path, tmp_path_factory) -> dict[str, Engine]:
    draft = write_truncated_draft(default_gguf_path, tmp_path_factory.mktemp("draft4"), num_layers=4, num_last=2,
                                  dtype=torch.bfloat16)
    built = {"plain": Engine(model_path=default_gguf_path, **ENGINE_KW)}
    for name, shape in SHAPES.items():
        built[name] = Engine(model_path=default_gguf_path, speculative_algorithm="STANDALONE",
                             speculative_draft_model_path=str(draft),
                             speculative_token_map=str(FRSPEC_TOKEN_MAP), speculative_policy="always",
                             **ENGINE_KW, **shape)
    return built


@pytest.fixture(scope="module")
def prompt_ids(engines) -> list[list[int]]:
    tok = engines["plain"].tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]


def _record_drafts(engine: Engine, monkeypatch) -> list[int]:
    """Wrap the proposer's propose; returns the list every drafted token id (roots excluded) lands in."""
    proposer = engine.engine.spec_worker.proposer
    drafted: list[int] = []
    propose = proposer.propose

    def recording(eng, items, max_nodes):
        trees = propose(eng, items, max_nodes)
        for tree in trees:
            drafted.extend(tree.draft_tokens[1:].tolist())
        return trees

    monkeypatch.setattr(proposer, "propose", recording)
    return drafted


@pytest.mark.parametrize("shape", list(SHAPES))
def test_lm_head_holds_the_hot_rows_only(engines, shape):
    proposer = engines[shape].engine.spec_worker.proposer
    lm_head = proposer.runner.model.lm_head
    assert lm_head.out_features == lm_head.weight.shape[0] == 8192
    assert proposer.token_map.tolist() == torch.load(FRSPEC_TOKEN_MAP, weights_only=True)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_lossless_and_drafts_in_the_map(engines, prompt_ids, hot_ids, shape, monkeypatch):
    engine = engines[shape]
    drafted = _record_drafts(engine, monkeypatch)
    params = {"temperature": 0, "max_new_tokens": 24}
    for ids in prompt_ids:
        ours = engine.generate(input_ids=ids, sampling_params=params)
        plain = engines["plain"].generate(input_ids=ids, sampling_params=params)
        assert ours["output_ids"] == plain["output_ids"]
        assert ours["meta_info"]["spec_verify_ct"] > 0
    assert drafted and set(drafted) <= hot_ids
    assert engine.engine.get_server_info()["spec_draft_tokens"] > 0


def test_greedy_lossless_batched(engines, prompt_ids, hot_ids, monkeypatch):
    drafted = _record_drafts(engines["tree"], monkeypatch)
    params = [{"temperature": 0, "max_new_tokens": 10 + 3 * i} for i in range(len(prompt_ids))]
    ours = engines["tree"].generate(input_ids=prompt_ids, sampling_params=params)
    plain = engines["plain"].generate(input_ids=prompt_ids, sampling_params=params)
    assert [o["output_ids"] for o in ours] == [o["output_ids"] for o in plain]
    assert drafted and set(drafted) <= hot_ids


@pytest.mark.parametrize("algorithm", ["STANDALONE", "EAGLE"])
def test_out_of_range_token_map_is_a_config_error(default_gguf_path, tmp_path, algorithm):
    """A startup error naming the flag, not a draft that fails to load (speculation turned off)."""
    bad = tmp_path / "map.pt"
    torch.save([5, 49152], bad)
    with pytest.raises(ConfigError) as info:
        Engine(model_path=default_gguf_path, speculative_algorithm=algorithm,
               speculative_token_map=str(bad), **ENGINE_KW)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"--speculative-token-map {bad}:"), message
    assert "49152" in message
