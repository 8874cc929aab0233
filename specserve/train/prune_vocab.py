"""A STANDALONE draft with a pruned vocabulary: keep the embedding (tied LM head) rows of the
target tokens the answers use most, so the draft's file and its per-step LM head shrink by the
vocabulary's share (the SmolLM2 draft as distilled: 18.9 of its 21.2 MB were the 49152-row embedding;
pruned to 8192 ids it ships at 5.6 MB).

The pruned draft keeps the rows of the ``size - 1`` most frequent ids, most frequent first, plus
one last row, the mean of every other row: each other id reads it as input, and it proposes the
``size``-th most frequent id. Its ``model.safetensors`` carries ``d2t`` (draft id i <-> target id
i + d2t[i], EAGLE-3's rule); the STANDALONE proposer maps ids both ways
(``speculative/token_map.py``).

    python -m specserve.train.prune_vocab --draft specserve/drafts/smollm2-135m-standalone \\
        --answers WORK/answers.jsonl --size 8192 --out my-pruned-draft
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from specserve.loading.safetensors import read_safetensors_dir
from specserve.models.draft_head import DRAFT_VOCAB_TENSOR
from specserve.train.frspec import count_tokens, top_frequent_ids

EMBEDDING = "model.embed_tokens.weight"
UNTIED_HEAD = "lm_head.weight"


def prune_draft_vocab(draft_dir: str | Path, counts, size: int, out_dir: str | Path) -> Path:
    """Write the pruned copy of the draft in ``draft_dir`` to ``out_dir``."""
    config = json.loads((Path(draft_dir) / "config.json").read_text())
    vocab_size = int(config["vocab_size"])
    if not 2 <= size < vocab_size:
        raise ValueError(f"--size must be in [2, {vocab_size}) (the draft's vocabulary); got {size}")
    tensors = dict(read_safetensors_dir(draft_dir)[1])
    if DRAFT_VOCAB_TENSOR in tensors:
        raise ValueError(f"--draft {draft_dir}: its vocabulary is pruned already")
    eos = config.get("eos_token_id")
    always = tuple(eos if isinstance(eos, list) else [eos] if eos is not None else [])   # it must be able to stop
    ids = torch.tensor(top_frequent_ids(counts, size, vocab_size, always))   # most frequent first
    out = {name: t for name, t in tensors.items() if name not in (EMBEDDING, UNTIED_HEAD)}
    out.update({name: _pruned_rows(tensors[name], ids) for name in (EMBEDDING, UNTIED_HEAD) if name in tensors})
    out[DRAFT_VOCAB_TENSOR] = ids - torch.arange(size)
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.update(vocab_size=size)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def _pruned_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids[:-1]`` of ``table``, then the mean of every row not among them (computed in
    float32) as the shared row of the dropped ids."""
    kept = torch.zeros(table.shape[0], dtype=torch.bool)
    kept[ids[:-1]] = True
    shared = table[~kept].float().mean(0, keepdim=True).to(table.dtype)
    return torch.cat([table[ids[:-1]], shared])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specserve.train.prune_vocab", description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", required=True, help="STANDALONE draft folder (HF safetensors, target's vocabulary)")
    p.add_argument("--answers", required=True, help="regenerated answers JSONL file(s), comma-separated")
    p.add_argument("--size", type=int, default=8192, help="draft vocabulary size (default %(default)s)")
    p.add_argument("--out", required=True, help="folder for the pruned draft")
    args = p.parse_args(argv)
    try:
        out = prune_draft_vocab(args.draft, count_tokens(args.answers), args.size, args.out)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"pruned draft: {args.size} ids -> {out} ({size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
