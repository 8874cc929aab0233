"""Token frequencies of the regenerated answers: the FR-Spec token map (the most frequent
target ids, ``torch.save``d as a list) and the EAGLE3 draft vocabulary (``d2t``/``t2d``)."""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import torch


def count_tokens(answers, include_prompt: bool = False) -> Counter:
    """Occurrences of every token id in the answers (and prompts if asked) of regenerate
    JSONL file(s): a path, a comma-separated string of paths, or a list (``read_records``,
    which skips a last line still being written)."""
    from specserve.train.capture import read_records

    counts: Counter = Counter()
    for record in read_records(answers):
        counts.update(record["output_ids"])
        if include_prompt:
            counts.update(record["input_ids"])
    return counts


def top_frequent_ids(counts: Counter, size: int, vocab_size: int,
                     always: tuple[int, ...] = ()) -> list[int]:
    """The ``size`` most frequent ids, most frequent first (ties: smaller id first).

    ``always`` ids (e.g. EOS) are included whatever their count; when fewer than ``size``
    ids occur, unseen ids fill the list in id order.
    """
    if not 1 <= size <= vocab_size:
        raise ValueError(f"token map size must be in [1, {vocab_size}] (the target vocabulary); got {size}")
    bad = [t for t in list(counts) + list(always) if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the target vocabulary of {vocab_size}")
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    chosen = list(dict.fromkeys(list(always) + ranked))[:size]
    if len(chosen) < size:
        seen = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in seen][:size - len(chosen)]
    return sorted(chosen, key=lambda t: (-counts[t], t))


def write_token_map(ids: list[int], path: str | os.PathLike) -> Path:
    """The FR-Spec token map file (``--speculative-token-map``): a list of target ids."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save([int(t) for t in ids], path)
    return path


def draft_vocab_maps(ids: list[int], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE3 ``d2t`` [draft_vocab] int64 (target id = i + d2t[i]) and ``t2d`` [vocab] bool,
    for the draft vocabulary ``ids`` (kept in target id order)."""
    used = torch.tensor(sorted(set(ids)), dtype=torch.int64)
    if len(used) != len(ids):
        raise ValueError("draft vocabulary ids must be distinct")
    d2t = used - torch.arange(len(used))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d

