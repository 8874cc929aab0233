"""STANDALONE draft training (specserve/train/standalone.py) on tiny synthetic cases."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specserve.config import ModelConfig
from specserve.loading.loader import read_checkpoint
from specserve.runner.model_runner import ExtendSpec, ModelRunner
from specserve.train import standalone as sa

VOCAB = 64
TARGET = ModelConfig(architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
                     tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,), extra={"model_type": "llama"})
SHAPE = sa.DraftShape(hidden_size=16, num_layers=1, intermediate_size=32, num_heads=2, num_kv_heads=1, head_dim=8)


def _write_target(folder: Path) -> Path:
    """A 'target' checkpoint: the draft reads only its config, embedding and final norm."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TARGET.to_hf()))
    gen = torch.Generator().manual_seed(0)
    save_file({"model.embed_tokens.weight": torch.randn(VOCAB, TARGET.hidden_size, generator=gen),
               "model.norm.weight": torch.ones(TARGET.hidden_size)}, str(folder / "model.safetensors"))
    return folder


def _write_answers(path: Path, num_records: int = 48) -> Path:
    """Prompt [1, 5, a, step]; answer a + step, a + 2 step, ... (mod 50, offset 10): learnable."""
    gen = torch.Generator().manual_seed(1)
    with open(path, "w") as f:
        for index in range(num_records):
            start, step = (int(x) for x in torch.randint(0, 50, (2,), generator=gen))
            step = step % 4 + 1
            answer = [10 + (start + i * step) % 50 for i in range(1, 20)] + [2]
            f.write(json.dumps({"index": index, "source": "synthetic", "input_ids": [1, 5, 10 + start, 59 + step],
                                "output_ids": answer}) + "\n")
    return path


def _args(tmp_path: Path, **overrides) -> sa.StandaloneTrainArgs:
    kw = dict(data=str(_write_answers(tmp_path / "answers.jsonl")), out=str(tmp_path / "draft"),
              work_dir=str(tmp_path / "work"), target=str(_write_target(tmp_path / "target")), shape=SHAPE,
              max_steps=60, lr=1e-2, warmup_steps=5, tokens_per_batch=256, heldout_frac=0.2, eval_every=1000,
              num_negatives=-1, quiet=True)
    kw.update(overrides)
    return sa.StandaloneTrainArgs(**kw)


def _tiny_draft(seed: int = 0) -> sa.DraftLM:
    model = sa.DraftLM(sa.draft_config(TARGET, SHAPE), max_len=64)
    model.init_random(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():     # non-trivial norms and a spread-out head
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape))
            else:
                p.mul_(20.0 if "embed" in name else 5.0)
    return model


# ---- loss ------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 3])
def test_tied_head_ce_matches_autograd(k):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(50, dtype=torch.float64, generator=gen)
    ids = torch.randint(0, 50, (37, k), generator=gen)
    probs = torch.rand(37, k, dtype=torch.float64, generator=gen)
    probs = probs / probs.sum(1, keepdim=True)
    ce, top = sa._TiedHeadCE.apply(hidden, weight, bias, ids, probs, torch.float64, 8)
    logp = torch.log_softmax(hidden @ weight.T + bias, -1)
    ref = -(logp.gather(1, ids) * probs).sum(1)
    assert torch.allclose(ce.double(), ref, atol=1e-4)          # softmax arithmetic is float32
    assert torch.equal(top, logp.argmax(-1))
    grad = torch.randn(37, dtype=torch.float64, generator=gen)
    got = torch.autograd.grad((ce * grad).sum(), (hidden, weight))
    want = torch.autograd.grad((ref * grad).sum(), (hidden, weight))
    for g, w in zip(got, want):
        assert torch.allclose(g.double(), w, atol=1e-4)


def test_candidate_vocab_covers_labels_and_corrects_negatives():
    vocab = sa.CandidateVocab(torch.tensor([3, 5, 7]), vocab_size=100, num_negatives=10, seed=0)
    tokens, bias, index = vocab.sample(torch.tensor([5, 42]))
    positives = {3, 5, 7, 42}
    assert positives <= set(tokens.tolist()) and len(set(tokens.tolist())) == len(tokens) == 14
    assert torch.equal(tokens[index[tokens]], tokens)
    is_negative = torch.tensor([t not in positives for t in tokens.tolist()])
    assert torch.allclose(bias[is_negative], torch.full((10,), float(torch.log(torch.tensor(96 / 10)))))
    assert torch.all(bias[~is_negative] == 0)


# ---- init ------------------------------------------------------------------------------------

def test_logit_preserving_maps_are_exact_at_full_rank_and_rank_well_below_it():
    gen = torch.Generator().manual_seed(0)
    embedding = torch.randn(300, 24, generator=gen)
    # states concentrated on a few directions, as a trained model's final states are
    states = torch.randn(2000, 6, generator=gen) @ torch.randn(6, 24, generator=gen) + 0.05 * torch.randn(
        2000, 24, generator=gen)
    target = states @ embedding.T
    a, b = sa.logit_preserving_maps(embedding, states, 24)
    assert torch.allclose((states @ a) @ (embedding @ b).T, target, atol=1e-2, rtol=1e-3)
    a, b = sa.logit_preserving_maps(embedding, states, 8)
    approx = (states @ a) @ (embedding @ b).T
    assert (approx.argmax(-1) == target.argmax(-1)).float().mean() > 0.9
    pca = sa.principal_directions(embedding, 8)           # ignores where the states lie
    assert (approx.argmax(-1) == target.argmax(-1)).float().mean() > (
        ((states @ pca) @ (embedding @ pca).T).argmax(-1) == target.argmax(-1)).float().mean()


def test_init_head_ranks_the_targets_next_token_far_above_chance():
    """The draft's tied head fed the target's (mapped) final states ranks the target's next
    token near the top before any training."""
    gen = torch.Generator().manual_seed(2)
    weights = {"model.embed_tokens.weight": torch.randn(VOCAB, TARGET.hidden_size, generator=gen),
               "model.norm.weight": torch.ones(TARGET.hidden_size)}
    states = torch.randn(512, 4, generator=gen) @ torch.randn(4, TARGET.hidden_size, generator=gen)
    next_token = (states @ weights["model.embed_tokens.weight"].T).argmax(-1)
    model = sa.DraftLM(sa.draft_config(TARGET, SHAPE), max_len=16)
    state_map = sa.init_head(model, TARGET, weights, states)
    logits = model.logits(states @ state_map)
    rank = (logits > logits.gather(1, next_token[:, None])).sum(1).float()
    assert rank.mean() < VOCAB / 20                        # chance: (VOCAB - 1) / 2
    assert sa.init_head(model, TARGET, weights) is None    # PCA init without states


# ---- data ------------------------------------------------------------------------------------

def test_collate_marks_answer_positions(tmp_path):
    examples, lines = sa.load_examples(_write_answers(tmp_path / "a.jsonl", 3), max_len=10)
    assert lines == 3 and all(len(e.ids) == 10 for e in examples)
    batch = sa.collate(examples[:2], prompt_weight=0.25)
    e = examples[0]                                  # 4 prompt + 20 answer tokens, cut to the last 10
    assert e.answer_start == 1 and e.cut == 14
    assert torch.equal(batch["labels"][0, :9], torch.tensor(e.ids[1:]))
    assert batch["is_answer"][0].tolist() == [True] * 9 + [False]
    assert batch["weights"][0].tolist() == [1.0] * 9 + [0.0]
    assert sa.is_heldout(7, 0.0) is False and sa.is_heldout(7, 1.0) is True


# ---- training --------------------------------------------------------------------------------

@pytest.mark.parametrize("num_negatives", [-1, 8])
def test_training_reduces_heldout_loss(tmp_path, num_negatives):
    metrics = sa.train_standalone(_args(tmp_path, num_negatives=num_negatives, max_steps=200))
    before, after = metrics["initial_heldout"], metrics["heldout"]
    assert metrics["steps"] == 200
    assert after["loss"] < before["loss"] - 1.0
    assert after["top1"] > before["top1"] + 0.2
    assert (Path(metrics["args"]["out"]) / "model.safetensors").is_file()


def test_resume_continues_and_refuses_another_shape(tmp_path):
    sa.train_standalone(_args(tmp_path, max_steps=4))
    metrics = sa.train_standalone(_args(tmp_path, max_steps=8, resume=True))
    assert metrics["steps"] == 8 and len(metrics["history"]) == 8
    wider = sa.DraftShape(hidden_size=24, num_layers=1, intermediate_size=32, num_heads=2, num_kv_heads=1,
                          head_dim=8)
    with pytest.raises(ValueError, match="shape"):
        sa.train_standalone(_args(tmp_path, max_steps=8, resume=True, shape=wider))


# ---- export ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_loads_through_specserve_with_the_same_logits(tmp_path, dtype):
    model = _tiny_draft()
    with torch.no_grad():                  # the weights as stored, so both sides compute on equal values
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    out = sa.export_draft(model, tmp_path / "draft", dtype=dtype)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == str(dtype).removeprefix("torch.")
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (VOCAB, 1, 2)
    assert (config["rope_theta"], config["max_position_embeddings"]) == (10000.0, 256)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names and "model.layers.0.self_attn.q_proj.weight" in names

    cfg, weights = read_checkpoint(out)
    runner = ModelRunner(cfg, weights, dtype=torch.float32, device="cpu", max_position=64, num_kv_slots=64,
                         page_size=1, max_rows=1, max_row_len=64)
    ids = [1, 7, 9, 30, 2, 44, 12, 5, 60, 3]
    got = runner.forward([ExtendSpec(row=0, prefix_len=0, token_ids=ids, new_slots=list(range(len(ids))),
                                     num_logits=len(ids))])
    with torch.no_grad():
        want = model.logits(model(torch.tensor([ids]))[0])
    assert want.std() > 1.0
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
