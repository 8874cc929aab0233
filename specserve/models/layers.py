"""Building blocks shared by every Llama-family model and draft head."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specserve.kernels import layer as native_layer
from specserve.models.packed_linear import Linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.native = False     # ``use_native_norms``: one native call where it can run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and native_layer.can_run_norm(x, self.weight):
            return native_layer.rms_norm(x, self.weight, self.eps)
        # Written out: on CPU this is several times faster than F.rms_norm for a few rows,
        # and it is HF's arithmetic (float32 statistics, scale after casting back).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def use_native_norms(model: nn.Module) -> None:
    """Every RMSNorm of ``model`` runs the native kernel where it can (~2 us a call instead of
    ~15-40 us of torch ops): for models on the integer path, whose native layers already compute
    their norms that way (the bits may differ from torch's in the last place, which the exact
    float path must not)."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.native = True


class GatedMLP(nn.Module):
    """SiLU-gated MLP with gate and up projections fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)                       # [T, 2 * inter]
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding with a precomputed cos/sin table.

    ``cos_sin(positions)`` is computed once per forward and shared by layers.
    """

    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: dict | None = None) -> None:
        super().__init__()
        inv_freq = _inv_freq(head_dim, base, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)                     # [max_pos, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)              # [max_pos, hd]
        mscale = _attention_factor(scaling)
        self.register_buffer("cos_cached", emb.cos() * mscale, persistent=False)
        self.register_buffer("sin_cached", emb.sin() * mscale, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos_cached[positions].to(dtype), self.sin_cached[positions].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, hd]; cos/sin: [T, hd]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def _inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    kind = (scaling or {}).get("rope_type")
    if kind is None:
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, base, scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3, yarn)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, base: float, s: dict) -> torch.Tensor:
    factor = s["factor"]
    old_len = s.get("original_max_position_embeddings", 4096)
    beta_fast, beta_slow = s.get("beta_fast", 32), s.get("beta_slow", 1)

    def dim_for(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_for(beta_fast)), 0)
    high = min(math.ceil(dim_for(beta_slow)), head_dim - 1)
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)
    extrapolate = 1 - ramp.clamp(0, 1)
    return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate


def _attention_factor(scaling: dict | None) -> float:
    if not scaling or scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    return 0.1 * math.log(scaling["factor"]) + 1.0
