"""Tiny random draft-head checkpoints in the published key layouts (EAGLE, EAGLE3, NEXTN/MTP in a
DeepSeek-V3 or MiMo target), for tests. Sizes follow tests/model/tiny_llama.py (hidden 64, vocab 32)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specserve.config import ModelConfig
from specserve.models.attention import KVCache, build_metadata
from specserve.models.draft_heads import load_draft_head
from specserve.runner.model_runner import build_model
from tests.model.tiny_llama import random_weights, tiny_config, write_tiny_model


class _Rand:
    def __init__(self, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)

    def mat(self, rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=self.g) * cols ** -0.5

    def norm(self, dim: int) -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(dim, generator=self.g)

    def vec(self, dim: int) -> torch.Tensor:
        return 0.1 * torch.randn(dim, generator=self.g)

    def embed(self, vocab: int, dim: int) -> torch.Tensor:
        return torch.randn(vocab, dim, generator=self.g)


def decoder_layer(cfg: ModelConfig, rand: _Rand, prefix: str, *, attn_input: int | None = None,
                  qkv_bias: bool = False, input_norm: bool = True) -> dict[str, torch.Tensor]:
    """One Llama decoder layer's HF tensors (separate q/k/v, gate/up)."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    width = attn_input or h
    w = {prefix + "self_attn.q_proj.weight": rand.mat(q, width),
         prefix + "self_attn.k_proj.weight": rand.mat(kv, width),
         prefix + "self_attn.v_proj.weight": rand.mat(kv, width),
         prefix + "self_attn.o_proj.weight": rand.mat(h, q),
         prefix + "post_attention_layernorm.weight": rand.norm(h),
         prefix + "mlp.gate_proj.weight": rand.mat(inter, h),
         prefix + "mlp.up_proj.weight": rand.mat(inter, h),
         prefix + "mlp.down_proj.weight": rand.mat(h, inter)}
    if qkv_bias:
        w.update({prefix + "self_attn.q_proj.bias": rand.vec(q), prefix + "self_attn.k_proj.bias": rand.vec(kv),
                  prefix + "self_attn.v_proj.bias": rand.vec(kv)})
    if input_norm:
        w[prefix + "input_layernorm.weight"] = rand.norm(h)
    return w


def draft_config(target: ModelConfig, architecture: str, **extra) -> dict:
    """A one-layer draft config.json with the target's shapes."""
    cfg = {"architectures": [architecture], "model_type": "llama", "vocab_size": target.vocab_size,
           "hidden_size": target.hidden_size, "intermediate_size": target.intermediate_size,
           "num_hidden_layers": 1, "num_attention_heads": target.num_attention_heads,
           "num_key_value_heads": target.num_key_value_heads, "head_dim": target.head_dim,
           "rms_norm_eps": target.rms_norm_eps, "rope_theta": 5000.0,
           "max_position_embeddings": target.max_position_embeddings, "tie_word_embeddings": False}
    cfg.update(extra)
    return cfg


def eagle_checkpoint(target: ModelConfig, seed: int = 1, *, bias: bool = True, embed: bool = False,
                     lm_head: bool = False, input_norm: bool = False,
                     prefix: str = "") -> tuple[dict, dict[str, torch.Tensor]]:
    rand, h = _Rand(seed), target.hidden_size
    config = draft_config(target, "LlamaForCausalLMEagle", bias=bias)
    w = {"fc.weight": rand.mat(h, 2 * h)}
    if bias:
        w["fc.bias"] = rand.vec(h)
    w.update(decoder_layer(target, rand, "layers.0.", input_norm=input_norm))
    if embed:
        w["embed_tokens.weight"] = rand.embed(target.vocab_size, h)
    if lm_head:
        w["lm_head.weight"] = rand.mat(target.vocab_size, h)
    return config, {(prefix + k if k != "lm_head.weight" else k): v for k, v in w.items()}


def eagle3_checkpoint(target: ModelConfig, seed: int = 2, *, draft_vocab: int | None = 16, embed: bool = False,
                      aux_layer_ids: list[int] | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    rand, h, vocab = _Rand(seed), target.hidden_size, target.vocab_size
    extra: dict = {}
    if draft_vocab is not None:
        extra["draft_vocab_size"] = draft_vocab
    if aux_layer_ids is not None:
        extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}
    config = draft_config(target, "LlamaForCausalLMEagle3", **extra)
    w = {"fc.weight": rand.mat(h, 3 * h), "midlayer.hidden_norm.weight": rand.norm(h),
         "norm.weight": rand.norm(h), "lm_head.weight": rand.mat(draft_vocab or vocab, h)}
    w.update(decoder_layer(target, rand, "midlayer.", attn_input=2 * h))
    if draft_vocab is not None and draft_vocab != vocab:
        selected = torch.randperm(vocab, generator=rand.g)[:draft_vocab].sort().values
        w["d2t"] = selected - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[selected] = True
        w["t2d"] = t2d
    if embed:
        w["embed_tokens.weight"] = rand.embed(vocab, h)
    return config, w


def deepseek_mtp_tensors(target: ModelConfig, seed: int = 3, *, embed: bool = False,
                         head: bool = False) -> dict[str, torch.Tensor]:
    rand, h = _Rand(seed), target.hidden_size
    p = f"model.layers.{target.num_hidden_layers}."
    w = {p + "enorm.weight": rand.norm(h), p + "hnorm.weight": rand.norm(h),
         p + "eh_proj.weight": rand.mat(h, 2 * h),
         p + "shared_head.norm.weight": rand.norm(h)}
    w.update(decoder_layer(target, rand, p, qkv_bias=target.attention_bias))
    if embed:
        w[p + "embed_tokens.weight"] = rand.embed(target.vocab_size, h)
    if head:
        w[p + "shared_head.head.weight"] = rand.mat(target.vocab_size, h)
    return w


def mimo_mtp_tensors(target: ModelConfig, seed: int = 4, num_layers: int = 1) -> dict[str, torch.Tensor]:
    rand, h = _Rand(seed), target.hidden_size
    w: dict[str, torch.Tensor] = {}
    for i in range(num_layers):
        p = f"model.mtp_layers.{i}."
        w.update({p + "token_layernorm.weight": rand.norm(h), p + "hidden_layernorm.weight": rand.norm(h),
                  p + "input_proj.weight": rand.mat(h, 2 * h), p + "final_layernorm.weight": rand.norm(h)})
        w.update(decoder_layer(target, rand, p, qkv_bias=True))
    return w


def qkv_biases(target: ModelConfig, seed: int = 5) -> dict[str, torch.Tensor]:
    """q/k/v biases for every target layer (Qwen2-like targets such as MiMo)."""
    rand = _Rand(seed)
    q, kv = target.num_attention_heads * target.head_dim, target.num_key_value_heads * target.head_dim
    w: dict[str, torch.Tensor] = {}
    for i in range(target.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        w.update({p + "q_proj.bias": rand.vec(q), p + "k_proj.bias": rand.vec(kv),
                  p + "v_proj.bias": rand.vec(kv)})
    return w


def write_checkpoint(out: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


# ---- a tiny target and helpers to run heads beside it (pytest fixtures: import them by name) -----

NUM_TARGET_LAYERS = 8
MAX_POS = 64


@pytest.fixture(scope="module")
def target_cfg() -> ModelConfig:
    return tiny_config(NUM_TARGET_LAYERS)


@pytest.fixture(scope="module")
def target_weights(target_cfg):
    return random_weights(target_cfg, seed=0)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, target_cfg, target_weights):
    return write_tiny_model(tmp_path_factory.mktemp("target"), target_weights, target_cfg)


@pytest.fixture(scope="module")
def target(target_cfg, target_weights):
    return build_model(target_cfg, target_weights.items(), torch.float32, "cpu", MAX_POS)


def run_head(head, ids, hidden, split: int = 3):
    """Forward ``ids`` at positions 0..T-1 in two calls (prefill, then extend) through a KV cache."""
    cfg = head.config
    num_tokens = len(ids)
    cache = KVCache(cfg.num_hidden_layers, num_tokens + 1, cfg.num_key_value_heads, cfg.head_dim,
                    torch.float32, "cpu")
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    kv_indices = torch.arange(num_tokens)[None]
    outs = []
    with torch.no_grad():
        for start, end in ((0, split), (split, num_tokens)):
            meta = build_metadata([start], [end - start], kv_indices, torch.arange(start, end),
                                  num_kv_groups=groups)
            outs.append(head(ids[start:end], hidden[start:end], torch.arange(start, end), cache, meta))
    return torch.cat(outs)


def inputs(num_tokens: int, width: int, vocab: int = 32, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num_tokens,), generator=g), torch.randn(num_tokens, width, generator=g)


def load(algorithm, draft_dir, target, target_dir, **kw):
    return load_draft_head(algorithm, None if draft_dir is None else str(draft_dir), target, str(target_dir),
                           dtype=torch.float32, device="cpu", max_position=MAX_POS, **kw)
