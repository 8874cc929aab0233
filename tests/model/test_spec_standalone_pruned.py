"""STANDALONE with a pruned vocabulary (``train/prune_vocab.py``): a full-vocabulary draft (the
target's first 4 and last 4 layers) cut to the 512 ids plain decoding of the test prompts uses most loads
with its ``d2t``, drafts only those ids, and greedy output equals plain decoding token for token
on both linear paths."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from specserve.config import ConfigError
from specserve.drafts import FRSPEC_TOKEN_MAP
from specserve.engine import Engine
from specserve.speculative.truncated_draft import write_truncated_draft
from specserve.train.prune_vocab import prune_draft_vocab

ENGINE_KW = {"dtype": "float32", "max_total_tokens": 4096, "context_length": 1024}
PROMPTS = ("Write a haiku about the sea.", "What is 17 times 23? Explain step by step.",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"")
PARAMS = {"temperature": 0, "max_new_tokens": 40}
SIZE = 512


@pytest.fixture(scope="module")
def setup(default_gguf_path, tmp_path_factory):
    draft = write_truncated_draft(default_gguf_path, tmp_path_factory.mktemp("draft8"), num_layers=8,
                                  num_last=4, dtype=torch.bfloat16)
    plain = Engine(model_path=default_gguf_path, **ENGINE_KW)
    tok = plain.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    outputs = [o["output_ids"] for o in plain.generate(input_ids=ids, sampling_params=[PARAMS] * len(ids))]
    pruned = prune_draft_vocab(draft, Counter(t for out in outputs for t in out), SIZE,
                               tmp_path_factory.mktemp("pruned"))
    return plain, ids, outputs, pruned, draft


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_pruned_draft_is_lossless_and_drafts_its_own_ids(setup, default_gguf_path, quantization, monkeypatch):
    plain, ids, outputs, pruned, _ = setup
    if quantization:
        plain = Engine(model_path=default_gguf_path, quantization=quantization, **ENGINE_KW)
        outputs = [o["output_ids"] for o in plain.generate(input_ids=ids, sampling_params=[PARAMS] * len(ids))]
    engine = Engine(model_path=default_gguf_path, speculative_algorithm="STANDALONE",
                    speculative_draft_model_path=str(pruned), speculative_policy="always",
                    speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6,
                    quantization=quantization, **ENGINE_KW)
    proposer = engine.engine.spec_worker.proposer
    assert proposer.token_map.numel() == SIZE and proposer.runner.model.config.vocab_size == SIZE
    kept = set(proposer.token_map.tolist())
    drafted: list[int] = []
    propose = proposer.propose

    def recording(eng, items, max_nodes):
        trees = propose(eng, items, max_nodes)
        drafted.extend(t for tree in trees for t in tree.draft_tokens[1:].tolist())
        return trees

    monkeypatch.setattr(proposer, "propose", recording)
    got = engine.generate(input_ids=ids, sampling_params=[PARAMS] * len(ids))
    assert [o["output_ids"] for o in got] == outputs
    assert drafted and set(drafted) <= kept
    assert sum(o["meta_info"]["spec_verify_ct"] * (o["meta_info"]["spec_accept_length"] - 1) for o in got) > 0


def test_pruned_draft_keeps_its_rows_only_and_refuses_a_token_map(setup, default_gguf_path):
    from safetensors import safe_open

    _, _, outputs, pruned, _ = setup
    with safe_open(str(pruned / "model.safetensors"), framework="pt") as f:
        embedding, d2t = f.get_tensor("model.embed_tokens.weight"), f.get_tensor("d2t")
    assert embedding.shape[0] == d2t.numel() == SIZE
    vocab = (d2t + torch.arange(SIZE)).tolist()
    most_frequent = Counter(t for out in outputs for t in out).most_common(1)[0][0]
    assert vocab[0] == most_frequent and len(set(vocab)) == SIZE
    with pytest.raises(ConfigError, match="--speculative-token-map"):
        Engine(model_path=default_gguf_path, speculative_algorithm="STANDALONE",
               speculative_draft_model_path=str(pruned), speculative_token_map=str(FRSPEC_TOKEN_MAP), **ENGINE_KW)
