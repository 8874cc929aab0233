"""Checkpoint tensors (HF Llama names, from ``specserve.loading``) -> the JAX model's
parameters: one array per kind, the decoder layers stacked on a leading axis (the
forward scans over them, so compile time does not grow with depth).

Strict like the torch loader: every key is used, every shape checked, and an error
names the key otherwise. Linear weights are stored transposed ([in, out]).
"""
from __future__ import annotations

import re
from typing import Iterable

import numpy as np
import torch

from specserve.config import ModelConfig

_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# HF name inside a layer -> (parameter name, transpose)
_LAYER_PARAMS = {
    "input_layernorm.weight": ("ln1", False),
    "post_attention_layernorm.weight": ("ln2", False),
    "self_attn.q_proj.weight": ("wq", True), "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True), "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False), "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "self_attn.q_norm.weight": ("q_norm", False), "self_attn.k_norm.weight": ("k_norm", False),
    "mlp.gate_proj.weight": ("wg", True), "mlp.up_proj.weight": ("wu", True), "mlp.down_proj.weight": ("wd", True),
    "mlp.gate_proj.bias": ("bg", False), "mlp.up_proj.bias": ("bu", False), "mlp.down_proj.bias": ("bd", False),
}


def expected_layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer parameter shapes (after transposition) this config needs."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes = {"ln1": (h,), "ln2": (h,), "wq": (h, q), "wk": (h, kv), "wv": (h, kv), "wo": (q, h),
              "wg": (h, i), "wu": (h, i), "wd": (i, h)}
    if cfg.attention_bias:
        shapes.update(bq=(q,), bk=(kv,), bv=(kv,))
    if cfg.qk_norm:
        shapes.update(q_norm=(cfg.head_dim,), k_norm=(cfg.head_dim,))
    if cfg.mlp_bias:
        shapes.update(bg=(i,), bu=(i,), bd=(h,))
    return shapes


def collect_params(cfg: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]],
                   skip_prefixes: tuple[str, ...] = ()) -> dict:
    """numpy float32 parameters: {"embed", "norm", "lm_head", "layers": {name: [L, ...]}}.
    ``skip_prefixes``: keys another part loads (a NEXTN draft's layers)."""
    layers: list[dict[str, np.ndarray]] = [{} for _ in range(cfg.num_hidden_layers)]
    top: dict[str, np.ndarray] = {}
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES) or (skip_prefixes and name.startswith(skip_prefixes)):
            continue
        _place(cfg, name, _to_numpy(tensor), layers, top)
    _check_complete(cfg, layers, top)
    stacked = {key: np.stack([layer[key] for layer in layers]) for key in layers[0]}
    lm_head = top["embed"].T if cfg.tie_word_embeddings else top["lm_head"]
    return {"embed": top["embed"], "norm": top["norm"], "lm_head": np.ascontiguousarray(lm_head),
            "layers": stacked}


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to(torch.float32).cpu().numpy()


def _place(cfg: ModelConfig, name: str, array: np.ndarray, layers: list[dict], top: dict) -> None:
    match = _LAYER_KEY.fullmatch(name)
    if match:
        index, rest = int(match.group(1)), match.group(2)
        if index >= cfg.num_hidden_layers or rest not in _LAYER_PARAMS:
            raise KeyError(f"checkpoint key {name!r} has no place in the JAX Llama model")
        key, transpose = _LAYER_PARAMS[rest]
        layers[index][key] = np.ascontiguousarray(array.T) if transpose else array
        return
    if name == "model.embed_tokens.weight":
        top["embed"] = array
    elif name == "model.norm.weight":
        top["norm"] = array
    elif name == "lm_head.weight":
        if not cfg.tie_word_embeddings:          # HF semantics: tied models ignore a stored head
            top["lm_head"] = np.ascontiguousarray(array.T)
    else:
        raise KeyError(f"checkpoint key {name!r} has no place in the JAX Llama model")


def _check_complete(cfg: ModelConfig, layers: list[dict], top: dict) -> None:
    h, v = cfg.hidden_size, cfg.vocab_size
    wanted_top = {"embed": (v, h), "norm": (h,)}
    if not cfg.tie_word_embeddings:
        wanted_top["lm_head"] = (h, v)
    for key, shape in wanted_top.items():
        _check(key, top.get(key), shape)
    wanted = expected_layer_shapes(cfg)
    for index, layer in enumerate(layers):
        extra = sorted(set(layer) - set(wanted))
        if extra:
            raise KeyError(f"layer {index}: unexpected parameters {extra} for this config")
        for key, shape in wanted.items():
            _check(f"model.layers.{index}.{key}", layer.get(key), shape)


def _check(name: str, array: np.ndarray | None, shape: tuple[int, ...]) -> None:
    if array is None:
        raise KeyError(f"checkpoint has no tensor for {name}")
    if tuple(array.shape) != shape:
        raise ValueError(f"{name}: shape {tuple(array.shape)} (transposed where linear), expected {shape}")
