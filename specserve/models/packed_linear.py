"""Linear layers with a CPU fast path: weights prepacked once for oneDNN.

On CPU, ``torch.ops.mkldnn._linear_pointwise`` over a prepacked weight runs
bfloat16 matmuls about 1.6x faster than ``F.linear`` (the same result bits)
and float32 matmuls over many rows about 1.5x faster. For float32 inputs of up
to 3 rows plain ``F.linear`` (MKL) costs about what one row costs, while the
packed kernel costs 1.6x more from 2 rows on, so those keep ``F.linear``: a
speculative verify over 2-3 tokens then costs about one decode step. Packing copies the
weight: call ``pack_linears_for_cpu`` after the weights are final.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

FLOAT32_PLAIN_MAX_ROWS = 3


class Linear(nn.Linear):
    """``nn.Linear`` that uses a oneDNN-prepacked copy of its weight once packed."""

    packed_weight: torch.Tensor | None = None
    plain_max_rows: int = 0            # inputs of up to this many rows use F.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed_weight
        if packed is None or x.shape[0] <= self.plain_max_rows:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")


def can_pack() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_linears_for_cpu(model: nn.Module) -> int:
    """Prepack every CPU float32/bfloat16 ``Linear`` of ``model``; returns how many."""
    if not can_pack():
        return 0
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, Linear) or weight.device.type != "cpu":
            continue
        if weight.dtype not in (torch.float32, torch.bfloat16):
            continue
        module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        module.plain_max_rows = FLOAT32_PLAIN_MAX_ROWS if weight.dtype == torch.float32 else 0
        count += 1
    logger.debug("prepacked %d linear layers for oneDNN", count)
    return count
