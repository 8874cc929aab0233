"""A STANDALONE draft for any target: a subset of its decoder layers (plus
embeddings, final norm and head), written as an HF directory with the target's
tokenizer.

    python -m specserve.speculative.truncated_draft --layers 8 --out /tmp/draft8 [--last 4] [--model-path X.gguf]

``--layers L`` keeps L layers: the first ``L - last`` and the last ``last`` ones
(``--last 0``: a plain early-exit copy of the first L layers). Keeping the last
layers (layer skipping) drafts far better than early exit, whose hidden states
never reach the head's space. Not a trained draft: cheap to make, same
vocabulary. Used by tests and benchmarks until trained drafts ship.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specserve.loading.export import export_hf_dir
from specserve.loading.loader import resolve_model_path

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def write_truncated_draft(model_path: str | None, out_dir: str | Path, num_layers: int,
                          num_last: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """Export ``model_path`` (GGUF or HF dir; None = the default model) keeping ``num_layers``
    layers: the first ``num_layers - num_last`` and the last ``num_last``."""
    out = export_hf_dir(resolve_model_path(model_path), out_dir, dtype=dtype)
    config = json.loads((out / "config.json").read_text())
    total = config["num_hidden_layers"]
    if not 1 <= num_layers <= total or not 0 <= num_last <= num_layers:
        raise ValueError(f"need 1 <= layers <= {total} and 0 <= last <= layers; got {num_layers}, {num_last}")
    keep = list(range(num_layers - num_last)) + list(range(total - num_last, total))
    new_index = {old: new for new, old in enumerate(keep)}
    weights = load_file(str(out / "model.safetensors"))
    kept = {_renamed(name, new_index): t for name, t in weights.items() if _keeps(name, new_index)}
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _keeps(name: str, new_index: dict[int, int]) -> bool:
    match = _LAYER.match(name)
    return match is None or int(match.group(1)) in new_index


def _renamed(name: str, new_index: dict[int, int]) -> str:
    match = _LAYER.match(name)
    if match is None:
        return name
    return f"model.layers.{new_index[int(match.group(1))]}." + name[match.end():]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="target checkpoint (default: the default model)")
    parser.add_argument("--layers", type=int, required=True, help="decoder layers to keep")
    parser.add_argument("--last", type=int, default=0, help="how many of them are the target's last layers")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = parser.parse_args()
    path = write_truncated_draft(args.model_path, args.out, args.layers, args.last, getattr(torch, args.dtype))
    print(path)


if __name__ == "__main__":
    main()
