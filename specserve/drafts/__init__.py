"""Drafts trained for the default model (SmolLM2-135M-Instruct) that ship with specserve.

With the default target and no ``--speculative-draft-model-path``, EAGLE3, EAGLE and
STANDALONE use these (``specserve train-draft`` made them; README: "Draft training").
"""
from __future__ import annotations

from pathlib import Path

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
