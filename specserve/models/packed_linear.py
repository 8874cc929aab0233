"""Linear layers with a CPU fast path: weights prepacked once for oneDNN.

On CPU, ``torch.ops.mkldnn._linear_pointwise`` over a prepacked weight runs
bfloat16 matmuls about 1.6x faster than ``F.linear`` (the same result bits)
and float32 matmuls over many rows about 1.5x faster. For float32 inputs of up
to 3 rows plain ``F.linear`` (MKL) costs about what one row costs, while the
packed kernel costs 1.6x more from 2 rows on, so those keep ``F.linear``: a
speculative verify over 2-3 tokens then costs about one decode step. Packing copies the
weight: call ``pack_linears_for_cpu`` after the weights are final.

Row invariance: a bfloat16 row's result must not depend on how many rows share the
call (greedy speculative output == plain decoding). oneDNN's one-row kernel can round
differently from its many-row kernel (seen on AMD EPYC for the 1536-wide down
projection; the many-row kernel agrees with itself from 2 rows on). Packing probes
bfloat16 layers shape by shape and, where one row disagrees for any layer of a
shape, runs single rows of that shape as two (the same cost there). float32 keeps
its fast paths: its rounding differences are far below what flips a greedy choice
in practice.
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
    pads_single_row: bool = False      # one row runs as two (the many-row kernel's rounding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed_weight
        if packed is None or x.shape[0] <= self.plain_max_rows:
            return F.linear(x, self.weight, self.bias)
        if self.pads_single_row and x.shape[0] == 1:
            return torch.ops.mkldnn._linear_pointwise(torch.cat([x, x]), packed, self.bias, "none", [], "")[:1]
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
    _pad_single_rows_per_shape(model)
    logger.debug("prepacked %d linear layers for oneDNN", count)
    return count


def _shape_key(module: Linear) -> tuple:
    return module.in_features, module.out_features, module.weight.dtype, module.bias is not None


def _pad_single_rows_per_shape(model: nn.Module) -> None:
    """The one-row rounding difference belongs to oneDNN's kernel for a shape, while each
    layer's probe sees it only with some probability: one flagged layer flags its shape."""
    packed = [m for m in model.modules() if isinstance(m, Linear) and m.packed_weight is not None
              and m.weight.dtype == torch.bfloat16]
    flagged: set[tuple] = set()
    for module in packed:                  # a shape already flagged needs no more probes
        if _shape_key(module) not in flagged and not _is_one_row_invariant(module):
            flagged.add(_shape_key(module))
    for module in packed:
        module.pads_single_row = _shape_key(module) in flagged


@torch.inference_mode()
def _is_one_row_invariant(module: Linear, num_rows: int = 16, num_trials: int = 6) -> bool:
    """Whether a row computed alone gets the same bits as inside a call of ``num_rows``."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(num_trials):
        x = torch.randn(num_rows, module.in_features, generator=generator).to(module.weight.dtype)
        together = module(x)
        if any(not torch.equal(module(x[i:i + 1]), together[i:i + 1]) for i in range(num_rows)):
            return False
    return True


@torch.inference_mode()
def warm_up_packed_linears(model: nn.Module, max_rows: int) -> int:
    """Run every packed layer shape once at each row count up to ``max_rows``. oneDNN builds
    a kernel per input shape on first use (about 0.5 ms on this CPU), which would otherwise
    land on serving steps whenever a batch or a verify tree reaches a new width.
    Returns the number of distinct layer shapes warmed."""
    seen: set[tuple] = set()
    for module in model.modules():
        if not isinstance(module, Linear) or module.packed_weight is None:
            continue
        key = _shape_key(module)
        if key in seen:
            continue
        seen.add(key)
        x = torch.zeros(max_rows, module.in_features, dtype=module.weight.dtype)
        for num_rows in range(1, max_rows + 1):
            module(x[:num_rows])
    return len(seen)
