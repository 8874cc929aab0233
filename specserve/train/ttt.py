"""Training-time test (EAGLE-3): an attention backend that unrolls draft steps over a
whole packed batch at once, so a draft head trains on exactly what it sees at inference.

Layout: ``B`` rows of ``L`` tokens (several records packed per row, told apart by
``segment`` ids). Step 0 is the draft's prefill over the target's features: index
``i`` attends causally to the step-0 keys/values of its own record at indices ``<= i``.
Step ``j > 0`` (the draft chained after position ``i``, fed its own step-``j-1``
output) attends to those same step-0 keys plus the step-``1..j`` keys/values *at
index i only*: precisely the KV a chain drafted after position ``i`` holds at
inference. The backend keeps every step's K/V (with their autograd history) in a
``TTTCache`` and is driven through the head's ordinary ``backend.forward`` call.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class TTTMeta:
    """What the backend needs besides q/k/v: the batch layout and the step-0 mask."""

    batch_size: int
    seq_len: int
    mask: torch.Tensor                # [B, 1, L, L] bool: same record and key index <= query index

    @classmethod
    def from_segments(cls, segment: torch.Tensor) -> "TTTMeta":
        """``segment`` [B, L] record ids per token (padding: any id; it only sees its own record)."""
        bsz, seq_len = segment.shape
        idx = torch.arange(seq_len, device=segment.device)
        causal = idx[None, :] <= idx[:, None]                                      # [L(q), L(k)]
        same = segment[:, :, None] == segment[:, None, :]                          # [B, L, L]
        return cls(bsz, seq_len, (same & causal).unsqueeze(1))


@dataclass
class TTTCache:
    """Per layer, the K/V of every step so far ([T, nkv, hd] each)."""

    keys: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    values: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def append(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Store this step's K/V; returns the step number (0 for the first call of a layer)."""
        self.keys.setdefault(layer_id, []).append(k)
        self.values.setdefault(layer_id, []).append(v)
        return len(self.keys[layer_id]) - 1

    def reset(self) -> None:
        self.keys.clear()
        self.values.clear()


class TTTBackend:
    """``forward(q, k, v, layer_id, cache, meta) -> [T, nh * hd]`` like the serving backends;
    each call for a layer is the next unrolled step."""

    name = "ttt"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                cache: TTTCache, meta: TTTMeta) -> torch.Tensor:
        """q: [T, nh, hd]; k, v: [T, nkv, hd] with T = B * L."""
        step = cache.append(layer_id, k, v)
        bsz, seq_len = meta.batch_size, meta.seq_len
        num_tokens, num_heads, head_dim = q.shape
        num_kv = k.shape[1]
        group = num_heads // num_kv
        # [B, L, nkv, g, hd] -> [B, nkv, g, L, hd]
        qh = q.view(bsz, seq_len, num_kv, group, head_dim).permute(0, 2, 3, 1, 4)
        keys0 = _heads_first(cache.keys[layer_id][0], bsz, seq_len)                # [B, nkv, L, hd]
        values0 = _heads_first(cache.values[layer_id][0], bsz, seq_len)
        if step == 0:   # fused kernel: [B, nkv, g * L, hd] queries, the mask repeated per query head
            out = F.scaled_dot_product_attention(qh.reshape(bsz, num_kv, group * seq_len, head_dim), keys0,
                                                 values0, attn_mask=meta.mask.repeat(1, 1, group, 1))
            out = out.view(bsz, num_kv, group, seq_len, head_dim)
        else:
            out = _chain_attention(qh, keys0, values0, cache.keys[layer_id][1:], cache.values[layer_id][1:],
                                   meta.mask, bsz, seq_len)
        # [B, nkv, g, L, hd] -> [T, nh * hd]
        return out.permute(0, 3, 1, 2, 4).reshape(num_tokens, num_heads * head_dim)


def _heads_first(x: torch.Tensor, bsz: int, seq_len: int) -> torch.Tensor:
    """[T, nkv, hd] -> [B, nkv, L, hd]."""
    return x.view(bsz, seq_len, x.shape[1], x.shape[2]).transpose(1, 2)


def _chain_attention(qh: torch.Tensor, keys0: torch.Tensor, values0: torch.Tensor,
                     chain_keys: list[torch.Tensor], chain_values: list[torch.Tensor],
                     mask: torch.Tensor, bsz: int, seq_len: int) -> torch.Tensor:
    """Softmax over [step-0 keys at <= i] + [step-1..j keys at i]; qh: [B, nkv, g, L, hd]."""
    scale = qh.shape[-1] ** -0.5
    scores0 = torch.einsum("bngqd,bnkd->bngqk", qh, keys0) * scale                  # [B, nkv, g, L, L]
    scores0 = scores0.masked_fill(~mask.unsqueeze(2), float("-inf"))
    ks = [_heads_first(k, bsz, seq_len).unsqueeze(2) for k in chain_keys]          # [B, nkv, 1, L, hd]
    vs = [_heads_first(v, bsz, seq_len).unsqueeze(2) for v in chain_values]
    diag = torch.stack([(qh * k).sum(-1) * scale for k in ks], dim=-1)             # [B, nkv, g, L, j]
    probs = torch.softmax(torch.cat([scores0, diag], dim=-1).float(), dim=-1).to(qh.dtype)
    out = probs[..., :seq_len] @ values0.unsqueeze(2)                              # [B, nkv, g, L, hd]
    for m, v in enumerate(vs):
        out = out + probs[..., seq_len + m, None] * v
    return out
