"""train-draft on a tiny random Llama: capture == direct target features (and resumes),
training lowers the loss and resumes exactly, export -> load_draft_head gives the trained
head's logits, the CLI runs every stage and names flags in its errors."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open

from specserve.models.attention import KVCache, TorchSDPABackend, build_metadata
from specserve.models.draft_heads import load_draft_head
from specserve.runner.model_runner import build_model
from specserve.train import cli
from specserve.train.capture import CaptureConfig, capture, from_storage, list_shards
from specserve.train.export import export_head
from specserve.train.train_head import HeadTrainer, TrainConfig, best_checkpoint, latest_checkpoint, target_parts_from
from tests.model.tiny_llama import random_weights, tiny_config, write_tiny_model

NUM_LAYERS = 8
AUX = (2, 4, 5)
VOCAB_IDS = list(range(0, 32, 2))        # a 16-token draft vocabulary of the 32-token target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = tiny_config(NUM_LAYERS)
    weights = random_weights(cfg, seed=0)
    path = write_tiny_model(tmp_path_factory.mktemp("tiny_target"), weights, cfg)
    return cfg, weights, path


@pytest.fixture(scope="module")
def answers(tiny, tmp_path_factory):
    """Records like regenerate's: prompts of 3..9 tokens, answers of 5..39 tokens."""
    g = torch.Generator().manual_seed(0)
    path = tmp_path_factory.mktemp("answers") / "answers.jsonl"
    with open(path, "w") as f:
        for i in range(48):
            prompt = torch.randint(0, 32, (int(torch.randint(3, 10, (1,), generator=g)),), generator=g).tolist()
            answer = torch.randint(0, 32, (int(torch.randint(5, 40, (1,), generator=g)),), generator=g).tolist()
            f.write(json.dumps({"index": 100 + i, "source": "t", "input_ids": prompt, "output_ids": answer}) + "\n")
    return path


def capture_cfg(tiny, answers, out, **kw) -> CaptureConfig:
    base = dict(model_path=str(tiny[2]), answers_path=str(answers), out_dir=str(out), aux_layer_ids=AUX, top_k=8,
                batch_tokens=160, shard_tokens=400)
    return CaptureConfig(**(base | kw))


@pytest.fixture(scope="module")
def captured(tiny, answers, tmp_path_factory):
    out = tmp_path_factory.mktemp("capture")
    capture(capture_cfg(tiny, answers, out))
    return out


def read_capture(folder) -> dict[int, dict[str, np.ndarray]]:
    """record index -> its arrays (and prompt_len)."""
    out = {}
    for shard in list_shards(folder):
        arrays = {p.stem: np.load(p) for p in shard.glob("*.npy") if p.stem != "records"}
        for index, offset, length, prompt_len in np.load(shard / "records.npy"):
            out[int(index)] = {k: v[offset:offset + length] for k, v in arrays.items()} | {"prompt_len": prompt_len}
    return out


# ---- capture -----------------------------------------------------------------------------------

def test_capture_equals_direct_target_features(tiny, answers, captured):
    cfg, weights, _ = tiny
    model = build_model(cfg, weights.items(), torch.float32, "cpu", 128)
    model.aux_layer_ids = AUX
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    stored = read_capture(captured)
    records = [json.loads(line) for line in open(answers)]
    assert sorted(stored) == sorted(r["index"] for r in records)
    assert len(list_shards(captured)) > 1
    for record in records[:12]:
        ids = record["input_ids"] + record["output_ids"]
        n = len(ids)
        cache = KVCache(NUM_LAYERS, n + 1, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
        slots = torch.arange(n)
        with torch.no_grad():
            final, aux = model(torch.tensor(ids), torch.arange(n), cache,
                               build_metadata([0], [n], slots[None], slots, num_kv_groups=groups))
            logp = torch.log_softmax(model.compute_logits(final), -1)
        got = stored[record["index"]]
        assert got["prompt_len"] == len(record["input_ids"])
        assert got["tokens"].tolist() == ids
        torch.testing.assert_close(from_storage(got["aux"]).float(), torch.cat(aux, -1), rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(from_storage(got["final"]).float(), final, rtol=2e-3, atol=2e-3)
        values, indices = logp.topk(8, -1)
        assert torch.equal(torch.from_numpy(got["topk_ids"]).long(), indices)
        torch.testing.assert_close(torch.from_numpy(got["topk_logp"]).float(), values, rtol=2e-3, atol=2e-3)


def test_capture_resumes_after_interruption(tiny, answers, captured, tmp_path):
    out = tmp_path / "cap"
    capture(capture_cfg(tiny, answers, out, max_records=7))
    assert len(read_capture(out)) == 7
    (out / "shard_00099.tmp").mkdir()                   # a shard being written when the run died
    capture(capture_cfg(tiny, answers, out))
    assert not list(out.glob("*.tmp"))
    resumed, whole = read_capture(out), read_capture(captured)
    assert sorted(resumed) == sorted(whole)
    for index, arrays in whole.items():
        for name, value in arrays.items():
            np.testing.assert_array_equal(resumed[index][name], value, err_msg=f"{index} {name}")


def test_capture_reads_several_answer_files(tiny, answers, captured, tmp_path):
    lines = answers.read_text().splitlines(keepends=True)
    (tmp_path / "a.jsonl").write_text("".join(lines[:20]))
    (tmp_path / "b.jsonl").write_text("".join(lines[20:]))
    capture(capture_cfg(tiny, answers, tmp_path / "cap", answers_path=f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}"))
    split, whole = read_capture(tmp_path / "cap"), read_capture(captured)
    assert sorted(split) == sorted(whole)
    np.testing.assert_array_equal(split[100]["aux"], whole[100]["aux"])


def test_capture_refuses_a_different_setup(tiny, answers, captured, tmp_path):
    out = tmp_path / "cap"
    shutil.copytree(captured, out)
    with pytest.raises(ValueError, match="top_k"):
        capture(capture_cfg(tiny, answers, out, top_k=4))


def test_bfloat16_features_round_trip(tiny, answers, captured, tmp_path):
    capture(capture_cfg(tiny, answers, tmp_path / "bf", feature_dtype="bfloat16", max_records=3))
    bf, fp = read_capture(tmp_path / "bf"), read_capture(captured)
    for index, arrays in bf.items():
        assert arrays["aux"].dtype == np.uint16
        torch.testing.assert_close(from_storage(arrays["aux"]).float(), from_storage(fp[index]["aux"]).float(),
                                   rtol=1e-2, atol=1e-2)


# ---- training ----------------------------------------------------------------------------------

def trainer(tiny, captured, out, algorithm="EAGLE3", **kw) -> HeadTrainer:
    cfg, weights, path = tiny
    base = dict(algorithm=algorithm, capture_dir=str(captured), out_dir=str(out), model_path=str(path),
                seq_len=64, batch_size=2, max_steps=40, lr=3e-3, warmup_steps=5, save_every=1000, val_records=6)
    return HeadTrainer(TrainConfig(**(base | kw)), VOCAB_IDS, target=target_parts_from(cfg, weights.items()))


@pytest.mark.parametrize("algorithm", ["EAGLE3", "EAGLE"])
def test_training_reduces_loss(tiny, captured, tmp_path, algorithm):
    t = trainer(tiny, captured, tmp_path, algorithm)
    before = t.evaluate()
    t.train()
    after = t.evaluate()
    assert after["val_loss"] < 0.8 * before["val_loss"], (before, after)
    assert (tmp_path / "train_log.jsonl").is_file()


def test_resume_continues_exactly(tiny, captured, tmp_path):
    """Interrupted after step 11 of 14 (past the first epoch), resumed: the same weights."""
    whole = trainer(tiny, captured, tmp_path / "a", max_steps=14)
    assert whole.steps_per_epoch < 11
    whole.train()
    part = trainer(tiny, captured, tmp_path / "b", max_steps=14)
    batches = part.batches_from(0)
    for _ in range(11):
        part.train_step(next(batches))
    part.save_checkpoint()
    resumed = trainer(tiny, captured, tmp_path / "b", max_steps=14, resume=True)
    assert resumed.step == 11
    resumed.train()
    for (name, a), b in zip(whole.head.state_dict().items(), resumed.head.state_dict().values()):
        assert torch.equal(a, b), name


def test_warm_start_takes_head_weights_only(tiny, captured, tmp_path):
    first = trainer(tiny, captured, tmp_path / "a", max_steps=6)
    first.train()
    checkpoint = first.save_checkpoint()
    warm = trainer(tiny, captured, tmp_path / "b", max_steps=3, init_from=str(checkpoint))
    assert warm.step == 0 and warm.scheduler.last_epoch == 0
    for (name, a), b in zip(first.head.state_dict().items(), warm.head.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="--init-from"):
        trainer(tiny, captured, tmp_path / "c", algorithm="EAGLE", init_from=str(checkpoint))


def test_best_head_is_kept_and_patience_stops(tiny, captured, tmp_path):
    t = trainer(tiny, captured, tmp_path, max_steps=6, early_stop_patience=2)
    stops = []
    for step, val_loss in enumerate([1.0, 0.9, 0.95, 0.97], start=1):
        t.step = step
        stops.append(t.note_evaluation({"val_loss": val_loss}))
    assert stops == [False, False, False, True]
    best = torch.load(best_checkpoint(tmp_path), weights_only=False)
    assert best["step"] == 2 and best["val_metrics"] == {"val_loss": 0.9}
    resumed_state = t.checkpoint_state()
    assert resumed_state["best_val_loss"] == 0.9 and resumed_state["bad_evals"] == 2


def test_warm_start_from_an_exported_head(tiny, captured, tmp_path):
    first = trainer(tiny, captured, tmp_path / "a", max_steps=6)
    first.train()
    folder = export_head(first.head, "EAGLE3", tmp_path / "exported", torch.float32)
    warm = trainer(tiny, captured, tmp_path / "b", max_steps=3, init_from=str(folder))
    assert warm.step == 0
    for (name, a), b in zip(first.head.state_dict().items(), warm.head.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="--init-from"):
        trainer(tiny, captured, tmp_path / "c", init_from=str(tmp_path / "a"))     # no model.safetensors


# ---- export ------------------------------------------------------------------------------------

def head_logits(head, ids, features):
    """Prefill logits of ``head`` over a sequence through the serving attention path."""
    cfg = head.config
    backend, head.backend = head.backend, TorchSDPABackend()
    n = len(ids)
    cache = KVCache(1, n + 1, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
    slots = torch.arange(n)
    meta = build_metadata([0], [n], slots[None], slots, num_kv_groups=cfg.num_attention_heads // cfg.num_key_value_heads)
    with torch.no_grad():
        out = head(ids, features, torch.arange(n), cache, meta)
        logits = head.compute_logits(out)
    head.backend = backend
    return logits, head.draft_to_target(torch.arange(logits.shape[-1]))


EAGLE3_KEYS = {"fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
               "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
               "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
               "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
               "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
EAGLE_KEYS = {"fc.weight", "fc.bias", "layers.0.post_attention_layernorm.weight", "layers.0.self_attn.q_proj.weight",
              "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
              "layers.0.self_attn.o_proj.weight", "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
              "layers.0.mlp.down_proj.weight"}


@pytest.mark.parametrize("algorithm", ["EAGLE3", "EAGLE"])
def test_export_round_trip(tiny, captured, tmp_path, algorithm):
    cfg, weights, path = tiny
    t = trainer(tiny, captured, tmp_path / "train", algorithm, max_steps=5)
    t.train()
    head = t.head.eval()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 32, (9,), generator=g)
    features = torch.randn(9, head.feature_size if algorithm == "EAGLE3" else cfg.hidden_size, generator=g)
    target = target_parts_from(cfg, weights.items())
    for dtype in (torch.float32, torch.bfloat16):
        out = export_head(head, algorithm, tmp_path / str(dtype), dtype)
        config = json.loads((out / "config.json").read_text())
        with safe_open(str(out / "model.safetensors"), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        assert set(tensors) == (EAGLE3_KEYS if algorithm == "EAGLE3" else EAGLE_KEYS)
        assert {t.dtype for k, t in tensors.items() if k not in ("d2t", "t2d")} == {dtype}
        assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
        loaded = load_draft_head(algorithm, str(out), target, str(path), dtype=torch.float32, device="cpu",
                                 max_position=64)
        want, want_ids = head_logits(head if dtype == torch.float32 else _rounded(head), ids, features)
        got, got_ids = head_logits(loaded, ids, features)
        if algorithm == "EAGLE3":
            assert config["architectures"] == ["LlamaForCausalLMEagle3"]
            assert config["draft_vocab_size"] == len(VOCAB_IDS)
            assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [a - 1 for a in AUX]
            assert tuple(loaded.aux_layer_ids) == AUX
            assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
            assert sorted(got_ids.tolist()) == VOCAB_IDS and torch.equal(got_ids, want_ids)
        else:
            assert config["architectures"] == ["LlamaForCausalLMEagle"]
            got = got[:, VOCAB_IDS]      # trained over the draft vocabulary; served with the full lm_head
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _rounded(head):
    """A copy of ``head`` whose weights went through bfloat16."""
    import copy

    clone = copy.deepcopy(head)
    with torch.no_grad():
        for p in clone.parameters():
            if p.requires_grad:
                p.copy_(p.to(torch.bfloat16).float())
    return clone


# ---- CLI ---------------------------------------------------------------------------------------

def test_cli_runs_every_stage(tiny, answers, tmp_path, capsys):
    _, _, path = tiny
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    shutil.copy(answers, work / "answers.jsonl")
    common = ["--work-dir", str(work), "--model-path", str(path), "--algorithm", "EAGLE3"]
    assert cli.main(common + ["--stage", "capture", "--aux-layer-ids", "2,4,5", "--top-k", "8"]) == 0
    assert cli.main(common + ["--stage", "frspec", "--token-map-size", "8", "--out", str(out)]) == 0
    assert cli.main(common + ["--stage", "train", "--draft-vocab-size", "16", "--seq-len", "64",
                              "--max-steps", "3", "--save-every", "2", "--val-records", "4"]) == 0
    assert cli.main(common + ["--stage", "train", "--draft-vocab-size", "16", "--seq-len", "64",
                              "--max-steps", "4", "--save-every", "2", "--val-records", "4", "--resume"]) == 0
    assert cli.main(common + ["--stage", "export", "--out", str(out)]) == 0
    assert "from step 3" in capsys.readouterr().out
    token_map = torch.load(out / "frspec_token_map.pt", weights_only=True)
    assert len(token_map) == 8
    info = json.loads((out / "training_info.json").read_text())
    assert info["step"] == 4
    card = (out / "README.md").read_text()             # the model card: steps and held-out agreement
    assert "4 optimizer steps" in card and "per unrolled step: 0." in card
    warm = tmp_path / "warm"          # a new run warm-started from the exported folder takes its vocabulary
    warm.mkdir()
    (warm / "capture").symlink_to(work / "capture")
    assert cli.main(["--work-dir", str(warm), "--model-path", str(path), "--algorithm", "EAGLE3", "--stage", "train",
                     "--draft-vocab-size", "16", "--seq-len", "64", "--max-steps", "1", "--val-records", "4",
                     "--init-from", str(out)]) == 0
    vocab = torch.load(work / "train_EAGLE3" / "draft_vocab.pt", weights_only=True)
    assert sorted(torch.load(warm / "train_EAGLE3" / "draft_vocab.pt", weights_only=True)) == sorted(vocab)
    # without --lr, a fresh head trains at FRESH_LR and a warm start at the smaller WARM_START_LR
    configs = [torch.load(latest_checkpoint(run / "train_EAGLE3"), weights_only=False)["config"]
               for run in (work, warm)]
    assert [c["lr"] for c in configs] == [cli.FRESH_LR, cli.WARM_START_LR] and cli.WARM_START_LR < cli.FRESH_LR


@pytest.mark.parametrize("argv, flag", [
    (["--stage", "train"], "--algorithm"),
    (["--stage", "all"], "--algorithm"),
    (["--stage", "export", "--algorithm", "EAGLE"], "--out"),
    (["--stage", "capture", "--answers", "missing.jsonl"], "--answers"),
    (["--stage", "capture", "--aux-layer-ids", "a,b"], "--aux-layer-ids"),
])
def test_cli_errors_name_the_flag(tmp_path, capsys, argv, flag):
    (tmp_path / "answers.jsonl").write_text("")
    assert cli.main(["--work-dir", str(tmp_path)] + argv) == 2
    assert flag in capsys.readouterr().err
