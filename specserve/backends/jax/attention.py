"""Paged attention in JAX: prefill, decode and tree verification in one function.

Every forward is laid out as ``[B, Q]`` (requests x new tokens, padded). Request ``b``
has ``prefix_len[b]`` tokens in the KV cache and ``extend_len[b]`` new ones whose K/V
were just written; its key slots (prefix then new) are ``kv_slots[b]``. A new token
``q`` attends to the whole prefix and to new token ``k`` where ``tree_mask[b, q, k]``
(lower-triangular for a causal extend).

Keys are visited in blocks of ``KEY_BLOCK`` slots by a loop whose trip count is a
traced value (the batch's longest row), with an online softmax: one compiled
program serves every sequence length. Scores, softmax and the weighted sum run in
float64 (as the torch backend's row-invariant attention does), so a row's result
does not depend on the other rows, on the padding or on the number of key blocks
once rounded back: verifying a tree gives the bits plain decoding gives.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

KEY_BLOCK = 128
ACCUM_DTYPE = jnp.float64


def attention_mask_fn(prefix_len, extend_len, tree_mask):
    """``mask(key_pos) -> [B, Q, KB]`` bool for key positions ``key_pos`` [KB].
    Padded query rows (and padded requests) attend to key 0 only, so they stay finite."""
    num_q = tree_mask.shape[1]
    q_idx = jnp.arange(num_q, dtype=jnp.int32)
    is_pad_query = q_idx[None, :] >= extend_len[:, None]                         # [B, Q]

    def mask(key_pos):
        rel = key_pos[None, :] - prefix_len[:, None]                              # [B, KB]
        in_prefix = rel < 0
        is_new = (rel >= 0) & (rel < extend_len[:, None])
        tree = jnp.take_along_axis(tree_mask, jnp.clip(rel, 0, num_q - 1)[:, None, :].repeat(num_q, 1), axis=2)
        real = in_prefix[:, None, :] | (is_new[:, None, :] & tree)                # [B, Q, KB]
        pad = is_pad_query[:, :, None] & (key_pos == 0)[None, None, :]
        return jnp.where(is_pad_query[:, :, None], pad, real)

    return mask


def paged_attention(q, k_cache, v_cache, layer_base, kv_slots, num_blocks, mask_fn):
    """q: [B, Q, nkv, g, hd]; caches: [layers * slots, nkv, hd] (this layer's slots start at
    ``layer_base``); kv_slots: [B, Lmax] int32 (Lmax a multiple of KEY_BLOCK); num_blocks:
    traced int32 scalar. Returns [B, Q, nkv, g, hd] in q's dtype."""
    bsz, num_q, num_kv, group, head_dim = q.shape
    scale = 1.0 / float(head_dim) ** 0.5
    q64 = q.astype(ACCUM_DTYPE) * scale
    m0 = jnp.full((bsz, num_q, num_kv, group), -jnp.inf, ACCUM_DTYPE)
    l0 = jnp.zeros((bsz, num_q, num_kv, group), ACCUM_DTYPE)
    acc0 = jnp.zeros((bsz, num_q, num_kv, group, head_dim), ACCUM_DTYPE)
    offsets = jnp.arange(KEY_BLOCK, dtype=jnp.int32)

    def block(j, state):
        m, l, acc = state
        start = j * KEY_BLOCK
        slots = jax.lax.dynamic_slice_in_dim(kv_slots, start, KEY_BLOCK, axis=1) + layer_base   # [B, KB]
        keys = k_cache[slots].astype(ACCUM_DTYPE)                                 # [B, KB, nkv, hd]
        values = v_cache[slots].astype(ACCUM_DTYPE)
        scores = jnp.einsum("bqhgd,bkhd->bqhgk", q64, keys)
        visible = mask_fn(start + offsets)[:, :, None, None, :]                   # [B, Q, 1, 1, KB]
        scores = jnp.where(visible, scores, -jnp.inf)
        m_new = jnp.maximum(m, scores.max(-1))
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        correction = jnp.exp(m - m_safe)
        probs = jnp.where(visible, jnp.exp(scores - m_safe[..., None]), 0.0)
        l = l * correction + probs.sum(-1)
        acc = acc * correction[..., None] + jnp.einsum("bqhgk,bkhd->bqhgd", probs, values)
        return m_new, l, acc

    _, l, acc = jax.lax.fori_loop(0, num_blocks, block, (m0, l0, acc0))
    return (acc / l[..., None]).astype(q.dtype)
