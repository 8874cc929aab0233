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

An EAGLE-3 head (its own draft vocabulary already, ``d2t``) is cut the same way to a smaller one:
its LM head keeps the rows of the ``size`` ids of its vocabulary that rank first, so a draft step
reads fewer rows, and its logits at the kept ids do not change. The ranking comes from answers'
token counts or from a list of ids most frequent first (``--ranked``: an FR-Spec token map):

    python -m specserve.train.prune_vocab --draft specserve/drafts/smollm2-135m-eagle3 \\
        --ranked specserve/drafts/smollm2-135m-frspec-8k.pt --size 4096 --out my-head-4k
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file

from specserve.loading.safetensors import read_safetensors_dir
from specserve.models.draft_head import DRAFT_VOCAB_TENSOR, draft_vocab_ids
from specserve.train.frspec import count_tokens, draft_vocab_maps, top_frequent_ids

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
    config.update(vocab_size=size)
    return _write(out, config, out_dir)


def prune_head_vocab(head_dir: str | Path, counts, size: int, out_dir: str | Path) -> Path:
    """Write a copy of the EAGLE-3 head in ``head_dir`` whose draft vocabulary is the ``size`` ids of
    its own that ``counts`` ranks first (EOS kept; ties and unseen ids by target id), in target id
    order as EAGLE-3's ``d2t`` keeps them, to ``out_dir``."""
    config = json.loads((Path(head_dir) / "config.json").read_text())
    tensors = dict(read_safetensors_dir(head_dir)[1])
    if DRAFT_VOCAB_TENSOR not in tensors or UNTIED_HEAD not in tensors:
        raise ValueError(f"--draft {head_dir}: not an EAGLE-3 head with its own vocabulary (d2t, lm_head)")
    d2t = tensors[DRAFT_VOCAB_TENSOR]
    vocab = draft_vocab_ids(d2t).tolist()                           # draft id -> target id
    if not 2 <= size < len(vocab):
        raise ValueError(f"--size must be in [2, {len(vocab)}) (the head's vocabulary); got {size}")
    draft_of = {t: i for i, t in enumerate(vocab)}
    eos = config.get("eos_token_id")
    always = [t for t in (eos if isinstance(eos, list) else [eos]) if t in draft_of]
    ranked = sorted(vocab, key=lambda t: (t not in always, -counts.get(t, 0), t))
    targets = ranked[:size]
    d2t, t2d = draft_vocab_maps(targets, int(config["vocab_size"]))      # kept in target id order
    out = dict(tensors)
    out[UNTIED_HEAD] = tensors[UNTIED_HEAD][torch.tensor([draft_of[t] for t in sorted(targets)])]
    out[DRAFT_VOCAB_TENSOR] = d2t
    if "t2d" in tensors:
        out["t2d"] = t2d
    config.update(draft_vocab_size=size)
    return _write(out, config, out_dir)


def _write(tensors: dict, config: dict, out_dir: str | Path) -> Path:
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def _is_eagle3_head(draft_dir: str | Path) -> bool:
    config = json.loads((Path(draft_dir) / "config.json").read_text())
    return any("Eagle3" in name for name in config.get("architectures", []))


def ranked_counts(path: str | Path) -> Counter:
    """Counts that rank a token map's ids (a list of target ids, most frequent first) in its order."""
    ids = torch.load(path)
    return Counter({int(t): len(ids) - i for i, t in enumerate(ids)})


def _pruned_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids[:-1]`` of ``table``, then the mean of every row not among them (computed in
    float32) as the shared row of the dropped ids."""
    kept = torch.zeros(table.shape[0], dtype=torch.bool)
    kept[ids[:-1]] = True
    shared = table[~kept].float().mean(0, keepdim=True).to(table.dtype)
    return torch.cat([table[ids[:-1]], shared])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specserve.train.prune_vocab", description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", required=True, help="STANDALONE draft folder (HF safetensors, target's vocabulary) "
                                                  "or EAGLE-3 head folder")
    ranking = p.add_mutually_exclusive_group(required=True)
    ranking.add_argument("--answers", help="regenerated answers JSONL file(s), comma-separated")
    ranking.add_argument("--ranked", help="token map file: target ids, most frequent first (FR-Spec's)")
    p.add_argument("--size", type=int, default=8192, help="draft vocabulary size (default %(default)s)")
    p.add_argument("--out", required=True, help="folder for the pruned draft")
    args = p.parse_args(argv)
    try:
        counts = count_tokens(args.answers) if args.answers else ranked_counts(args.ranked)
        prune = prune_head_vocab if _is_eagle3_head(args.draft) else prune_draft_vocab
        out = prune(args.draft, counts, args.size, args.out)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"pruned draft: {args.size} ids -> {out} ({size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
