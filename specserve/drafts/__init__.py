"""Drafts trained for the default model (SmolLM2-135M-Instruct) that ship with specserve.

With the default target and no ``--speculative-draft-model-path``, EAGLE3, EAGLE and
STANDALONE use these (``specserve train-draft`` made them; README: "Draft training").
"""
from __future__ import annotations

from pathlib import Path

import torch

DRAFTS_DIR = Path(__file__).resolve().parent
SHIPPED = {"EAGLE3": "smollm2-135m-eagle3", "EAGLE": "smollm2-135m-eagle",
           "STANDALONE": "smollm2-135m-standalone"}
FRSPEC_TOKEN_MAP = DRAFTS_DIR / "smollm2-135m-frspec-8k.pt"


def shipped_draft(algorithm: str | None) -> Path | None:
    """The shipped draft directory for ``--speculative-algorithm`` (as typed; NEXTN has none)."""
    name = SHIPPED.get((algorithm or "").upper())
    if name is None:
        return None
    path = DRAFTS_DIR / name
    return path if (path / "config.json").exists() else None


# (S, K, N) measured fastest for each shipped draft with the default target on a CPU
# (README, "Measured figures": one bench_speculative run per dtype, 2026-11-22); used
# when --speculative-num-steps/-eagle-topk/-num-draft-tokens are all left unset.
MEASURED_SHAPES = {
    ("EAGLE3", torch.bfloat16): (4, 4, 6),      # 1.18x, accept length 1.77 (2026-11-22)
    ("EAGLE3", torch.float32): (3, 1, 4),       # 1.01x: verify of 4+ tokens costs too much in fp32
    ("EAGLE", torch.bfloat16): (5, 4, 8),       # 1.21x with the FR-Spec map, accept length 1.98
    ("EAGLE", torch.float32): (3, 1, 4),        # 1.04x with the FR-Spec map
    ("STANDALONE", torch.bfloat16): (1, 1, 2),  # 1.12x
    ("STANDALONE", torch.float32): (1, 1, 2),   # 1.16x
}


def measured_shape(algorithm: str | None, device: str, dtype: torch.dtype) -> tuple[int, int, int] | None:
    """The measured (S, K, N) of the shipped ``algorithm`` draft on ``device`` in ``dtype``."""
    if not str(device).startswith("cpu"):
        return None
    return MEASURED_SHAPES.get(((algorithm or "").upper(), dtype))
