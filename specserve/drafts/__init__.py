"""Drafts trained for the default model (SmolLM2-135M-Instruct) that ship with specserve.

With the default target and no ``--speculative-draft-model-path``, EAGLE3, EAGLE and
STANDALONE use these (``specserve train-draft`` made them; README: "Draft training"), and
NGRAM drafts also from a corpus of the model's own answers (``specserve.train.ngram_corpus``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

DRAFTS_DIR = Path(__file__).resolve().parent
SHIPPED = {"EAGLE3": "smollm2-135m-eagle3", "EAGLE": "smollm2-135m-eagle",
           "STANDALONE": "smollm2-135m-standalone"}
FRSPEC_TOKEN_MAP = DRAFTS_DIR / "smollm2-135m-frspec-8k.pt"
SHIPPED_NGRAM_CORPUS = DRAFTS_DIR / "smollm2-135m-ngram-corpus"     # NGRAM: the model's own answers


def shipped_draft(algorithm: str | None) -> Path | None:
    """The shipped draft directory for ``--speculative-algorithm`` (as typed; NEXTN has none)."""
    name = SHIPPED.get((algorithm or "").upper())
    if name is None:
        return None
    path = DRAFTS_DIR / name
    return path if (path / "config.json").exists() else None


MEASURED_SHAPES_FILE = DRAFTS_DIR / "measured_shapes.json"   # written by `specserve bench shapes --write`


def _read_measured_shapes() -> dict[tuple[str, torch.dtype, str], tuple[int, int, int]]:
    entries = json.loads(MEASURED_SHAPES_FILE.read_text())["shapes"] if MEASURED_SHAPES_FILE.is_file() else []
    return {(e["algorithm"], getattr(torch, e["dtype"]), e["quantization"]): tuple(e["shape"]) for e in entries}


# (algorithm, dtype, quantization) -> (S, K, N) measured fastest for each shipped draft with the
# default target on a CPU; used when --speculative-num-steps/-eagle-topk/-num-draft-tokens are
# all left unset.
MEASURED_SHAPES = _read_measured_shapes()


def measured_shape(algorithm: str | None, device: str, dtype: torch.dtype,
                   quantization: str | None = None) -> tuple[int, int, int] | None:
    """The measured (S, K, N) of the shipped ``algorithm`` draft on ``device`` in ``dtype`` with
    ``quantization`` (None: unquant); a quantization never measured falls back to unquant's."""
    if not str(device).startswith("cpu"):
        return None
    algorithm = (algorithm or "").upper()
    return MEASURED_SHAPES.get((algorithm, dtype, quantization or "unquant"),
                               MEASURED_SHAPES.get((algorithm, dtype, "unquant")))


def record_measured_shapes(entries: list[dict], source: str) -> Path:
    """Replace the entries of the same (algorithm, dtype, quantization) in the shapes file."""
    data = json.loads(MEASURED_SHAPES_FILE.read_text()) if MEASURED_SHAPES_FILE.is_file() else {"shapes": []}
    keys = {(e["algorithm"], e["dtype"], e["quantization"]) for e in entries}
    kept = [e for e in data["shapes"] if (e["algorithm"], e["dtype"], e["quantization"]) not in keys]
    data["about"] = "written by `specserve bench shapes --write`; do not edit by hand"
    data["shapes"] = kept + [dict(e, source=source) for e in entries]
    MEASURED_SHAPES_FILE.write_text(json.dumps(data, indent=1) + "\n")
    MEASURED_SHAPES.clear()
    MEASURED_SHAPES.update(_read_measured_shapes())
    return MEASURED_SHAPES_FILE
