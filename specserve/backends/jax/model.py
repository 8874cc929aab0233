"""The Llama-family forward in JAX (Llama, Mistral, Qwen2 biases, Qwen3 qk-norm, SmolLM).

``forward_step`` is one pure function of (params, KV caches, rope tables, a padded
batch); ``runner.py`` jits it per bucket with the caches donated, so K/V are written
in place. The layers run under ``lax.scan`` over the stacked parameters.

Arithmetic follows the torch model (``models/llama.py``, ``models/layers.py``):
RMSNorm statistics before the weight, rotate-half rope from the same cos/sin table,
SiLU-gated MLP, attention scale 1/sqrt(head_dim). Row invariance (a row's result does
not depend on how many rows share the forward, so verifying a tree gives the bits
plain decoding gives): norm statistics run in float64, matmuls in blocks of
``ROW_BLOCK`` rows (``matmul_rows``), attention as ``attention.py`` says.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from specserve.backends.jax.attention import attention_mask_fn, paged_attention

ROW_BLOCK = 32


@dataclass(frozen=True)
class StaticShape:
    """What a compiled step is specialized on (besides the arrays' shapes)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    num_slots: int           # KV slots per layer (the cache holds layers * num_slots)
    want_aux: bool           # also return every layer's input (EAGLE-3 features)


def rms_norm(x, weight, eps: float):
    x64 = x.astype(jnp.float64)
    normed = x64 * jax.lax.rsqrt(jnp.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rotate(x, cos, sin):
    """x: [T, heads, hd]; cos/sin: [T, hd] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def matmul_rows(x, w):
    """x @ w with rows taken ``ROW_BLOCK`` at a time: XLA's CPU matmul rounds one row, 2 to 32
    rows and more rows differently, so every forward of more than one row runs 2..32-row
    products, and a row's bits do not depend on how many rows share the forward."""
    num_rows = x.shape[0]
    if num_rows <= ROW_BLOCK:
        return x @ w
    pad = -num_rows % ROW_BLOCK
    blocks = jnp.pad(x, ((0, pad), (0, 0))).reshape(-1, ROW_BLOCK, x.shape[1])
    return jax.lax.map(lambda block: block @ w, blocks).reshape(-1, w.shape[1])[:num_rows]


def _linear(x, layer, weight: str, bias: str):
    out = matmul_rows(x, layer[weight])
    return out + layer[bias] if bias in layer else out


def _attention_block(x, layer, layer_index, caches, batch, cos, sin, s: StaticShape):
    num_tokens = x.shape[0]
    q = _linear(x, layer, "wq", "bq").reshape(num_tokens, s.num_heads, s.head_dim)
    k = _linear(x, layer, "wk", "bk").reshape(num_tokens, s.num_kv_heads, s.head_dim)
    v = _linear(x, layer, "wv", "bv").reshape(num_tokens, s.num_kv_heads, s.head_dim)
    if "q_norm" in layer:
        q, k = rms_norm(q, layer["q_norm"], s.eps), rms_norm(k, layer["k_norm"], s.eps)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    k_cache, v_cache = caches
    base = layer_index * s.num_slots
    k_cache = k_cache.at[base + batch["out_loc"]].set(k.astype(k_cache.dtype))
    v_cache = v_cache.at[base + batch["out_loc"]].set(v.astype(v_cache.dtype))
    bsz, num_q = batch["tree_mask"].shape[:2]
    group = s.num_heads // s.num_kv_heads
    q = q.reshape(bsz, num_q, s.num_kv_heads, group, s.head_dim)
    mask_fn = attention_mask_fn(batch["prefix_len"], batch["extend_len"], batch["tree_mask"])
    out = paged_attention(q, k_cache, v_cache, base, batch["kv_slots"], batch["num_blocks"], mask_fn)
    out = matmul_rows(out.reshape(num_tokens, s.num_heads * s.head_dim), layer["wo"])
    return out, (k_cache, v_cache)


def _mlp(x, layer):
    gate, up = _linear(x, layer, "wg", "bg"), _linear(x, layer, "wu", "bu")
    return _linear(jax.nn.silu(gate) * up, layer, "wd", "bd")


def forward_step(params, k_cache, v_cache, cos_table, sin_table, batch, *, shape: StaticShape):
    """batch: tokens/positions/out_loc [B*Q] int32, prefix_len/extend_len [B], tree_mask [B, Q, Q],
    kv_slots [B, Lmax], num_blocks [], logit_rows [R]. Returns (logits [R, V] float32,
    final hidden [B*Q, H], layer inputs [layers, B*Q, H] or None, k_cache, v_cache)."""
    h = params["embed"][batch["tokens"]]                                          # [T, H]
    cos = cos_table[batch["positions"]].astype(h.dtype)
    sin = sin_table[batch["positions"]].astype(h.dtype)
    num_layers = params["layers"]["ln1"].shape[0]

    def layer_step(carry, xs):
        h, caches = carry
        layer, index = xs
        attn, caches = _attention_block(rms_norm(h, layer["ln1"], shape.eps), layer, index, caches, batch,
                                        cos, sin, shape)
        h_mid = h + attn
        h_out = h_mid + _mlp(rms_norm(h_mid, layer["ln2"], shape.eps), layer)
        return (h_out, caches), (h if shape.want_aux else None)

    xs = (params["layers"], jnp.arange(num_layers, dtype=jnp.int32))
    (h, (k_cache, v_cache)), layer_inputs = jax.lax.scan(layer_step, (h, (k_cache, v_cache)), xs)
    hidden = rms_norm(h, params["norm"], shape.eps)
    logits = matmul_rows(hidden[batch["logit_rows"]], params["lm_head"])
    if layer_inputs is None:
        layer_inputs = jnp.zeros((0,), h.dtype)       # a fixed output structure (out_shardings)
    return logits.astype(jnp.float32), hidden, layer_inputs, k_cache, v_cache
