"""Attention whose result for one query row is the same bits whatever else is in the batch.

Plain decoding computes token t as one query over the t keys before it, in order.
Speculative verification computes the same token as one row of a wider forward: beside
other rows, other requests padded to a longer key length and, for a draft tree, with
the masked keys of sibling branches between its ancestors. torch SDPA's CPU kernel
reduces over the key axis in vectorized blocks whose lanes and tails move with all of
that, so the two disagree in the last bits; in bfloat16 that flips greedy choices.

Here no reduction over keys depends on where masked keys are:

* scores are matmuls over the head dimension (the same reduction for every key);
* the caller pads the key axis to a multiple of ``KEY_BLOCK``, so the elementwise
  ``exp`` runs fully vectorized (no scalar tail with different rounding);
* numerator and denominator of the softmax come from one matmul against ``[V, 1]``,
  over key blocks of ``MATMUL_KEY_BLOCK`` added in order; a BLAS kernel accumulates
  along the key axis in order there, and a masked key adds an exact zero.

It runs in float32 for every model dtype. Per layer it costs about 60 us more than
SDPA for a decode step on this CPU (a few percent of a step), which buys greedy
speculative output identical to plain decoding in bfloat16, trees included.
"""
from __future__ import annotations

import torch

KEY_BLOCK = 64            # the caller pads the key axis (kv slots and mask) to a multiple of this
MATMUL_KEY_BLOCK = 256    # keys per P @ [V, 1] matmul: within the BLAS's own K blocking


def row_invariant_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                            mask: torch.Tensor) -> torch.Tensor:
    """q [B, H, R, D]; keys/values [B, H, L, D], L a multiple of KEY_BLOCK; mask
    [B, 1, R, L] bool (True = attend; every row attends to at least one key).
    Returns [B, H, R, D] in q's dtype."""
    head_dim = q.shape[-1]
    scores = torch.matmul(q.float() * head_dim ** -0.5, keys.float().transpose(-1, -2))
    scores.masked_fill_(~mask, float("-inf"))
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    values_one = torch.empty(values.shape[:-1] + (head_dim + 1,), dtype=torch.float32, device=values.device)
    values_one[..., :head_dim].copy_(values)
    values_one[..., head_dim] = 1.0
    acc = None
    for start in range(0, values_one.shape[-2], MATMUL_KEY_BLOCK):
        part = torch.matmul(weights[..., start:start + MATMUL_KEY_BLOCK],
                            values_one[..., start:start + MATMUL_KEY_BLOCK, :])
        acc = part if acc is None else acc.add_(part)
    return (acc[..., :head_dim] / acc[..., head_dim:]).to(q.dtype)
