"""Draft heads (EAGLE, EAGLE3, NEXTN/MTP) in the published checkpoint layouts: strict loading, forward
against a plain-torch reference computed from the raw tensors, vocabulary maps, aux layers, NEXTN discovery."""
from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
import torch.nn.functional as F

from specserve.models.attention import KVCache, build_metadata
from specserve.models.eagle3 import eagle3_aux_layer_ids
from specserve.models.weights import WeightLoadError
from specserve.runner.model_runner import build_model
from tests.model import tiny_draft_heads as tdh
from tests.model.tiny_draft_heads import (MAX_POS, NUM_TARGET_LAYERS, inputs, load, run_head,  # noqa: F401
                                          target, target_cfg, target_dir, target_weights)
from tests.model.tiny_llama import random_weights, tiny_config, write_tiny_model


# ---- plain-torch reference --------------------------------------------------------------------

def ref_rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def ref_rope(x, positions, theta):
    hd = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    angles = positions.float()[:, None] * inv_freq[None, :]                   # [T, hd/2]
    cos, sin = angles.cos().repeat(1, 2)[:, None], angles.sin().repeat(1, 2)[:, None]
    rotated = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], dim=-1)
    return x * cos + rotated * sin


def ref_attention(x, w, p, cfg, positions, theta):
    """Causal self-attention over all T tokens (positions increasing)."""
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    proj = {}
    for name in "qkv":
        out = x @ w[f"{p}self_attn.{name}_proj.weight"].T
        bias = w.get(f"{p}self_attn.{name}_proj.bias")
        proj[name] = out if bias is None else out + bias
    t = x.shape[0]
    q = ref_rope(proj["q"].view(t, nh, hd), positions, theta)
    k = ref_rope(proj["k"].view(t, nkv, hd), positions, theta).repeat_interleave(nh // nkv, dim=1)
    v = proj["v"].view(t, nkv, hd).repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    out = torch.einsum("hqk,khd->qhd", probs, v).reshape(t, nh * hd)
    return out @ w[f"{p}self_attn.o_proj.weight"].T


def ref_mlp(x, w, p):
    gate, up = x @ w[f"{p}mlp.gate_proj.weight"].T, x @ w[f"{p}mlp.up_proj.weight"].T
    return (F.silu(gate) * up) @ w[f"{p}mlp.down_proj.weight"].T


def ref_decoder(x, w, p, cfg, positions, theta):
    h = x + ref_attention(ref_rms(x, w[f"{p}input_layernorm.weight"]), w, p, cfg, positions, theta)
    return h + ref_mlp(ref_rms(h, w[f"{p}post_attention_layernorm.weight"]), w, p)


# ---- fixtures and helpers ---------------------------------------------------------------------

def write(tmp_path, name, config, tensors):
    return tdh.write_checkpoint(tmp_path / name, config, tensors)


# ---- EAGLE ------------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix, own_parts", [("", False), ("model.", True)])
def test_eagle_forward_matches_reference(tmp_path, target, target_dir, target_cfg, target_weights,
                                         prefix, own_parts):
    config, w = tdh.eagle_checkpoint(target_cfg, embed=own_parts, lm_head=own_parts, input_norm=own_parts,
                                     prefix=prefix)
    head = load("EAGLE", write(tmp_path, "eagle", config, w), target, target_dir)
    assert (head.feature_kind, head.feature_size, head.aux_layer_ids) == ("final", 64, ())
    assert head.draft_vocab_size == 32 and head.config.num_hidden_layers == 1
    w = {k.removeprefix("model."): v for k, v in w.items()}
    embed = w["embed_tokens.weight"] if own_parts else target_weights["model.embed_tokens.weight"]
    lm_head = w["lm_head.weight"] if own_parts else target_weights["lm_head.weight"]
    ids, hidden = inputs(5, 64)
    positions = torch.arange(5)

    x = torch.cat([embed[ids], hidden], -1) @ w["fc.weight"].T + w["fc.bias"]
    h = x + ref_attention(x, w, "layers.0.", target_cfg, positions, 5000.0)      # no input norm in layer 0
    ref = h + ref_mlp(ref_rms(h, w["layers.0.post_attention_layernorm.weight"]), w, "layers.0.")

    out = run_head(head, ids, hidden)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(head.compute_logits(out), ref @ lm_head.T, atol=1e-4, rtol=1e-4)
    assert torch.equal(head.draft_to_target(torch.arange(4)), torch.arange(4))


def test_eagle_without_fc_bias(tmp_path, target, target_dir, target_cfg):
    config, w = tdh.eagle_checkpoint(target_cfg, bias=False)
    head = load("EAGLE", write(tmp_path, "eagle", config, w), target, target_dir)
    assert head.fc.bias is None


def test_eagle_fr_spec_token_map(tmp_path, target, target_dir, target_cfg):
    draft = write(tmp_path, "eagle", *tdh.eagle_checkpoint(target_cfg))
    token_map = [3, 0, 17, 30, 8, 21]
    torch.save(token_map, tmp_path / "map.pt")
    full = load("EAGLE", draft, target, target_dir)
    restricted = load("EAGLE", draft, target, target_dir, token_map_path=str(tmp_path / "map.pt"))
    assert restricted.draft_vocab_size == len(token_map)
    ids, hidden = inputs(5, 64)
    out_full, out_restricted = run_head(full, ids, hidden), run_head(restricted, ids, hidden)
    torch.testing.assert_close(out_restricted, out_full)
    logits = restricted.compute_logits(out_restricted)
    assert logits.shape == (5, len(token_map))
    torch.testing.assert_close(logits, full.compute_logits(out_full)[:, token_map])
    assert restricted.draft_to_target(torch.tensor([0, 2, 5])).tolist() == [3, 17, 21]


def test_eagle_strict_loading(tmp_path, target, target_dir, target_cfg):
    config, w = tdh.eagle_checkpoint(target_cfg)
    cases = {"missing": ("fc.bias", {k: v for k, v in w.items() if k != "fc.bias"}),
             "extra": ("layers.0.self_attn.extra_proj.weight",
                       dict(w, **{"layers.0.self_attn.extra_proj.weight": torch.zeros(4, 4)})),
             "misshaped": ("layers.0.self_attn.q_proj.weight",
                           dict(w, **{"layers.0.self_attn.q_proj.weight": torch.zeros(64, 63)}))}
    for case, (name, tensors) in cases.items():
        with pytest.raises(WeightLoadError, match=name.replace(".", r"\.")):
            load("EAGLE", write(tmp_path, case, config, tensors), target, target_dir)


# ---- EAGLE3 -----------------------------------------------------------------------------------

@pytest.mark.parametrize("own_embed", [False, True])
def test_eagle3_forward_matches_reference(tmp_path, target, target_dir, target_cfg, target_weights, own_embed):
    config, w = tdh.eagle3_checkpoint(target_cfg, embed=own_embed)
    head = load("EAGLE3", write(tmp_path, "eagle3", config, w), target, target_dir)
    assert (head.feature_kind, head.feature_size, head.draft_vocab_size) == ("aux", 192, 16)
    embed = w["embed_tokens.weight"] if own_embed else target_weights["model.embed_tokens.weight"]
    ids, features = inputs(5, 3 * 64)
    positions = torch.arange(5)

    def ref_step(ids, hidden, positions):
        attn_in = torch.cat([ref_rms(embed[ids], w["midlayer.input_layernorm.weight"]),
                             ref_rms(hidden, w["midlayer.hidden_norm.weight"])], -1)
        h = hidden + ref_attention(attn_in, w, "midlayer.", target_cfg, positions, 5000.0)
        return h + ref_mlp(ref_rms(h, w["midlayer.post_attention_layernorm.weight"]), w, "midlayer.")

    ref = ref_step(ids, features @ w["fc.weight"].T, positions)
    out = run_head(head, ids, features)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    ref_logits = ref_rms(ref, w["norm.weight"]) @ w["lm_head.weight"].T
    torch.testing.assert_close(head.compute_logits(out), ref_logits, atol=1e-4, rtol=1e-4)

    # a draft step feeds its own output back (width H: no fc)
    again = run_head(head, ids, out)
    torch.testing.assert_close(again, ref_step(ids, out, positions), atol=1e-4, rtol=1e-4)


def test_eagle3_d2t_mapping(tmp_path, target, target_dir, target_cfg):
    config, w = tdh.eagle3_checkpoint(target_cfg, draft_vocab=16)
    head = load("EAGLE3", write(tmp_path, "eagle3", config, w), target, target_dir)
    selected = torch.arange(16) + w["d2t"]
    assert torch.equal(head.draft_to_target(torch.arange(16)), selected)
    assert torch.equal(head.draft_to_target(torch.tensor([[5, 0]])), selected[torch.tensor([[5, 0]])])
    exported = head.checkpoint_tensors()
    assert torch.equal(exported["d2t"], w["d2t"]) and torch.equal(exported["t2d"], w["t2d"])
    assert torch.equal(exported["midlayer.self_attn.k_proj.weight"], w["midlayer.self_attn.k_proj.weight"])


def test_eagle3_full_vocab_needs_no_d2t(tmp_path, target, target_dir, target_cfg):
    config, w = tdh.eagle3_checkpoint(target_cfg, draft_vocab=None)
    head = load("EAGLE3", write(tmp_path, "eagle3", config, w), target, target_dir)
    assert head.draft_vocab_size == 32 and head.d2t is None
    assert torch.equal(head.draft_to_target(torch.arange(32)), torch.arange(32))


def test_eagle3_ignores_token_map_with_warning(tmp_path, target, target_dir, target_cfg, caplog):
    draft = write(tmp_path, "eagle3", *tdh.eagle3_checkpoint(target_cfg))
    torch.save(torch.tensor([1, 2, 3]), tmp_path / "map.pt")
    with caplog.at_level(logging.WARNING, logger="specserve.models.draft_head"):
        head = load("EAGLE3", draft, target, target_dir, token_map_path=str(tmp_path / "map.pt"))
    assert "token-map" in caplog.text and "ignored" in caplog.text
    assert head.draft_vocab_size == 16 and head.token_map is None


def test_eagle3_strict_loading(tmp_path, target, target_dir, target_cfg):
    config, w = tdh.eagle3_checkpoint(target_cfg)
    cases = {"missing": ("midlayer.hidden_norm.weight",
                         {k: v for k, v in w.items() if k != "midlayer.hidden_norm.weight"}),
             "no_d2t": ("d2t", {k: v for k, v in w.items() if k != "d2t"}),
             "extra": ("midlayer.extra.weight", dict(w, **{"midlayer.extra.weight": torch.ones(3)})),
             "misshaped": ("midlayer.self_attn.q_proj.weight",   # a [q, H] projection: EAGLE3 needs 2H inputs
                           dict(w, **{"midlayer.self_attn.q_proj.weight": torch.zeros(64, 64)})),
             "bad_lm_head": ("lm_head.weight", dict(w, **{"lm_head.weight": torch.zeros(32, 64)}))}
    for case, (name, tensors) in cases.items():
        with pytest.raises(WeightLoadError, match=name.replace(".", r"\.")):
            load("EAGLE3", write(tmp_path, case, config, tensors), target, target_dir)


def test_eagle3_aux_layer_ids(tmp_path, target, target_dir, target_cfg):
    assert eagle3_aux_layer_ids(32) == (2, 16, 29)
    assert eagle3_aux_layer_ids(32, {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}) == (2, 16, 29)
    head = load("EAGLE3", write(tmp_path, "default", *tdh.eagle3_checkpoint(target_cfg)), target, target_dir)
    assert head.aux_layer_ids == (2, 4, 5)
    configured = tdh.eagle3_checkpoint(target_cfg, aux_layer_ids=[0, 3, 6])
    head = load("EAGLE3", write(tmp_path, "configured", *configured), target, target_dir)
    assert head.aux_layer_ids == (1, 4, 7)


def test_eagle3_aux_layer_ids_must_fit_the_target(tmp_path, target_dir):
    small_cfg = tiny_config(2)
    small = build_model(small_cfg, random_weights(small_cfg, seed=0).items(), torch.float32, "cpu", MAX_POS)
    draft = write(tmp_path, "eagle3", *tdh.eagle3_checkpoint(small_cfg))
    with pytest.raises(ValueError, match="aux layer ids"):
        load("EAGLE3", draft, small, target_dir)


def test_algorithm_and_checkpoint_must_agree(tmp_path, target, target_dir, target_cfg):
    eagle3_dir = write(tmp_path, "eagle3", *tdh.eagle3_checkpoint(target_cfg))
    eagle_dir = write(tmp_path, "eagle", *tdh.eagle_checkpoint(target_cfg))
    with pytest.raises(ValueError, match="EAGLE3 head"):
        load("EAGLE", eagle3_dir, target, target_dir)
    with pytest.raises(ValueError, match="EAGLE head"):
        load("EAGLE3", eagle_dir, target, target_dir)
    with pytest.raises(ValueError, match="--speculative-draft-model-path"):
        load("EAGLE3", None, target, target_dir)
    with pytest.raises(ValueError, match="--speculative-draft-model-path"):
        load("EAGLE", None, target, target_dir)   # the target carries no MTP layers


# ---- NEXTN / MTP ------------------------------------------------------------------------------

def _write_mtp_target(tmp_path, cfg, weights, mtp, num_mtp_layers=1):
    out = write_tiny_model(tmp_path / "mtp_target", dict(weights, **mtp), cfg)
    config = json.loads((out / "config.json").read_text())
    config.update(num_nextn_predict_layers=num_mtp_layers)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _load_target(path):
    from specserve.loading.loader import read_checkpoint

    cfg, weights = read_checkpoint(path)
    return build_model(cfg, weights, torch.float32, "cpu", MAX_POS)


def _target_logits(model, ids):
    cfg = model.config
    cache = KVCache(cfg.num_hidden_layers, len(ids) + 1, cfg.num_key_value_heads, cfg.head_dim,
                    torch.float32, "cpu")
    meta = build_metadata([0], [len(ids)], torch.arange(len(ids))[None], torch.arange(len(ids)),
                          num_kv_groups=cfg.num_attention_heads // cfg.num_key_value_heads)
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)), cache, meta))


@pytest.mark.parametrize("own_parts", [False, True])
def test_nextn_deepseek_layout(tmp_path, target, target_dir, target_cfg, target_weights, own_parts):
    mtp = tdh.deepseek_mtp_tensors(target_cfg, embed=own_parts, head=own_parts)
    path = _write_mtp_target(tmp_path, target_cfg, target_weights, mtp)
    mtp_target = _load_target(path)
    ids, hidden = inputs(5, 64)
    torch.testing.assert_close(_target_logits(mtp_target, ids), _target_logits(target, ids))

    for algorithm, draft in (("NEXTN", path), ("NEXTN", None), ("EAGLE", None)):   # the model as its own draft
        head = load(algorithm, draft, mtp_target, path)
        assert (head.feature_kind, head.feature_size, head.config.num_hidden_layers) == ("final", 64, 1)
        assert head.draft_vocab_size == 32
    p = f"model.layers.{NUM_TARGET_LAYERS}."
    w = {k.removeprefix(p): v for k, v in mtp.items()}
    embed = w["embed_tokens.weight"] if own_parts else target_weights["model.embed_tokens.weight"]
    lm_head = w["shared_head.head.weight"] if own_parts else target_weights["lm_head.weight"]
    positions = torch.arange(5)
    x = torch.cat([ref_rms(embed[ids], w["enorm.weight"]), ref_rms(hidden, w["hnorm.weight"])], -1)
    ref = ref_decoder(x @ w["eh_proj.weight"].T, w, "", target_cfg, positions, target_cfg.rope_theta)
    out = run_head(head, ids, hidden)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    ref_logits = ref_rms(ref, w["shared_head.norm.weight"]) @ lm_head.T
    torch.testing.assert_close(head.compute_logits(out), ref_logits, atol=1e-4, rtol=1e-4)


def test_nextn_mimo_layout(tmp_path, target_cfg, target_weights):
    cfg = dataclasses.replace(target_cfg, architecture="MiMoForCausalLM", attention_bias=True,
                              extra={"model_type": "mimo"})
    weights = dict(target_weights, **tdh.qkv_biases(cfg))
    mtp = tdh.mimo_mtp_tensors(cfg, num_layers=2)         # only layer 0 is used
    plain_dir = write_tiny_model(tmp_path / "plain", weights, cfg)
    path = _write_mtp_target(tmp_path, cfg, weights, mtp, num_mtp_layers=2)
    config = json.loads((path / "config.json").read_text())
    del config["attention_bias"]                          # as MiMo ships it: implied by the architecture
    (path / "config.json").write_text(json.dumps(config))
    mtp_target, plain_target = _load_target(path), _load_target(plain_dir)
    assert mtp_target.config.attention_bias and mtp_target.config.num_nextn_predict_layers == 2
    ids, hidden = inputs(5, 64)
    torch.testing.assert_close(_target_logits(mtp_target, ids), _target_logits(plain_target, ids))

    head = load("EAGLE", None, mtp_target, path)
    w = {k.removeprefix("model.mtp_layers.0."): v for k, v in mtp.items()}
    positions = torch.arange(5)
    x = torch.cat([ref_rms(hidden, w["hidden_layernorm.weight"]),
                   ref_rms(weights["model.embed_tokens.weight"][ids], w["token_layernorm.weight"])], -1)
    ref = ref_decoder(x @ w["input_proj.weight"].T, w, "", cfg, positions, cfg.rope_theta)
    out = run_head(head, ids, hidden)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    ref_logits = ref_rms(ref, w["final_layernorm.weight"]) @ weights["lm_head.weight"].T
    torch.testing.assert_close(head.compute_logits(out), ref_logits, atol=1e-4, rtol=1e-4)


def test_target_skips_exactly_the_mtp_keys(tmp_path, target_cfg, target_weights):
    mtp = tdh.deepseek_mtp_tensors(target_cfg)
    stray = {f"model.layers.{NUM_TARGET_LAYERS + 1}.enorm.weight": torch.ones(64)}   # not an MTP layer (n = 1)
    path = _write_mtp_target(tmp_path, target_cfg, target_weights, dict(mtp, **stray))
    with pytest.raises(WeightLoadError, match=rf"model\.layers\.{NUM_TARGET_LAYERS + 1}\.enorm"):
        _load_target(path)
    no_flag = write_tiny_model(tmp_path / "no_flag", dict(target_weights, **mtp), target_cfg)
    with pytest.raises(WeightLoadError, match=rf"model\.layers\.{NUM_TARGET_LAYERS}\."):
        _load_target(no_flag)     # without num_nextn_predict_layers the keys are not MTP layers


def test_nextn_strict_loading(tmp_path, target_cfg, target_weights):
    mtp = tdh.deepseek_mtp_tensors(target_cfg)
    p = f"model.layers.{NUM_TARGET_LAYERS}."
    broken = {k: v for k, v in mtp.items() if k != p + "hnorm.weight"}
    path = _write_mtp_target(tmp_path, target_cfg, target_weights, broken)
    with pytest.raises(WeightLoadError, match=rf"model\.layers\.{NUM_TARGET_LAYERS}\.hnorm\.weight"):
        load("EAGLE", None, _load_target(path), path)


# ---- export and training mode -----------------------------------------------------------------

def test_checkpoint_tensors_round_trip(tmp_path, target_cfg, target_weights, target, target_dir):
    eagle_config, eagle_w = tdh.eagle_checkpoint(target_cfg, embed=True, prefix="model.")
    eagle3_config, eagle3_w = tdh.eagle3_checkpoint(target_cfg)
    mtp = tdh.deepseek_mtp_tensors(target_cfg, head=True)
    mtp_dir = _write_mtp_target(tmp_path, target_cfg, target_weights, mtp)
    cases = [("EAGLE", write(tmp_path, "eagle", eagle_config, eagle_w), target, target_dir,
              {k.removeprefix("model."): v for k, v in eagle_w.items()}),
             ("EAGLE3", write(tmp_path, "eagle3", eagle3_config, eagle3_w), target, target_dir, eagle3_w),
             ("EAGLE", None, _load_target(mtp_dir), mtp_dir, mtp)]
    for algorithm, draft, model, model_dir, expected in cases:
        exported = load(algorithm, draft, model, model_dir).checkpoint_tensors()
        assert exported.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(exported[name], tensor), name


def test_pytorch_bin_eagle_checkpoint(tmp_path, target, target_dir, target_cfg):
    config, w = tdh.eagle_checkpoint(target_cfg)
    out = tmp_path / "eagle_bin"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    torch.save(w, out / "pytorch_model.bin")
    reference = load("EAGLE", write(tmp_path, "eagle", config, w), target, target_dir)
    head = load("EAGLE", out, target, target_dir)
    ids, hidden = inputs(5, 64)
    torch.testing.assert_close(run_head(head, ids, hidden), run_head(reference, ids, hidden))


def test_train_mode_drops_packed_weights(tmp_path, target, target_dir, target_cfg):
    head = load("EAGLE3", write(tmp_path, "eagle3", *tdh.eagle3_checkpoint(target_cfg)), target, target_dir)
    assert not head.training
    head.train()
    assert all(getattr(m, "packed_weight", None) is None for m in head.modules())
    ids, features = inputs(5, 3 * 64)
    cfg = head.config
    cache = KVCache(1, 6, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
    meta = build_metadata([0], [5], torch.arange(5)[None], torch.arange(5), num_kv_groups=2)
    head.compute_logits(head(ids, features, torch.arange(5), cache, meta)).logsumexp(-1).sum().backward()
    assert head.fc.weight.grad is not None and head.midlayer.self_attn.qkv_proj.weight.grad.abs().sum() > 0


def test_token_map_out_of_range(tmp_path, target, target_dir, target_cfg):
    torch.save([0, 32], tmp_path / "map.pt")
    with pytest.raises(ValueError, match="token map"):
        load("EAGLE", write(tmp_path, "eagle", *tdh.eagle_checkpoint(target_cfg)), target, target_dir,
             token_map_path=str(tmp_path / "map.pt"))
