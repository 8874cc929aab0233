"""Attention whose result for one query row is the same bits whatever else is in the batch.

Plain decoding computes token t as one query over the t keys before it, in order.
Speculative verification computes the same token as one row of a wider forward: beside
other rows, other requests padded to a longer key length and, for a draft tree, with
the masked keys of sibling branches between its ancestors. torch SDPA's CPU kernel
reduces over the key axis in vectorized blocks whose lanes and tails move with all of
that, so the two disagree in the last bits; in bfloat16 that flips greedy choices.

Here the two reductions (over the head dimension for the scores, over the keys for
the softmax numerator and denominator) run in float64 on float32-exact inputs. A BLAS
kernel's summation order does change with the shapes around a row (measured on MKL,
AMD EPYC: from one row to two, with the batch count, with a longer key axis), but in
float64 those orders agree to ~1e-16, and rounding to float32 then erases the
difference unless a sum lands within that distance of a float32 rounding boundary
(roughly one sum in 10^8). So:

* scores: one float64 matmul over the head dimension, rounded to float32;
* the caller pads the key axis to a multiple of ``KEY_BLOCK``, so the elementwise
  ``exp`` runs fully vectorized (no scalar tail with different rounding);
* numerator and denominator of the softmax come from one float64 matmul of the
  weights against ``[V, 1]``; a masked key adds an exact zero.

The extra cost over float32 is small at decode shapes (the matmuls are tiny); it buys
greedy speculative output identical to plain decoding in bfloat16, trees included,
whatever order the BLAS sums in.
"""
from __future__ import annotations

import torch

KEY_BLOCK = 64            # the caller pads the key axis (kv slots and mask) to a multiple of this


def row_invariant_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                            mask: torch.Tensor) -> torch.Tensor:
    """q [B, H, R, D]; keys/values [B, H, L, D], L a multiple of KEY_BLOCK; mask
    [B, 1, R, L] bool (True = attend; every row attends to at least one key).
    Returns [B, H, R, D] in q's dtype."""
    head_dim = q.shape[-1]
    scores = torch.matmul(q.double() * head_dim ** -0.5, keys.double().transpose(-1, -2)).float()
    scores.masked_fill_(~mask, float("-inf"))
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    values_one = torch.empty(values.shape[:-1] + (head_dim + 1,), dtype=torch.float64, device=values.device)
    values_one[..., :head_dim].copy_(values)
    values_one[..., head_dim] = 1.0
    acc = torch.matmul(weights.double(), values_one).float()                # [B, H, R, D + 1]
    return (acc[..., :head_dim] / acc[..., head_dim:]).to(q.dtype)
