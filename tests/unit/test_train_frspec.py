"""FR-Spec token map and EAGLE3 draft vocabulary: the most frequent answer tokens."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from specserve.models.draft_head import draft_vocab_ids, load_token_map
from specserve.train.frspec import count_tokens, draft_vocab_maps, top_frequent_ids, write_token_map


def write_answers(path, records):
    with open(path, "w") as f:
        for i, (prompt, answer) in enumerate(records):
            f.write(json.dumps({"index": i, "source": "t", "input_ids": prompt, "output_ids": answer}) + "\n")
        f.write('{"index": 99, "source": "t", "input_ids": [1], "outp')     # a line still being written
    return path


def test_counts_answers_only_by_default(tmp_path):
    path = write_answers(tmp_path / "a.jsonl", [([7, 7, 7], [1, 2, 2]), ([7], [2, 3, 3, 3])])
    assert count_tokens(path) == Counter({1: 1, 2: 3, 3: 3})
    assert count_tokens(path, include_prompt=True)[7] == 4


def test_top_frequent_ids_order_ties_and_fill():
    counts = Counter({5: 10, 3: 7, 9: 7, 1: 1})
    assert top_frequent_ids(counts, 3, 16) == [5, 3, 9]            # ties: smaller id first
    assert top_frequent_ids(counts, 6, 16) == [5, 3, 9, 1, 0, 2]    # unseen ids fill in id order
    assert 15 in top_frequent_ids(counts, 3, 16, always=(15,))
    with pytest.raises(ValueError, match="token map size"):
        top_frequent_ids(counts, 17, 16)
    with pytest.raises(ValueError, match="outside"):
        top_frequent_ids(Counter({40: 1}), 2, 16)


def test_frequency_map_matches_brute_force(tmp_path):
    g = torch.Generator().manual_seed(0)
    records = [([], (torch.randint(0, 50, (30,), generator=g) ** 2 % 97).tolist()) for _ in range(20)]
    path = write_answers(tmp_path / "a.jsonl", records)
    counts = Counter(t for _, answer in records for t in answer)
    ids = top_frequent_ids(count_tokens(path), 10, 97)
    threshold = counts[ids[-1]]
    assert all(counts[t] >= threshold for t in ids)
    assert all(counts[t] <= threshold for t in range(97) if t not in ids)
    out = write_token_map(ids, tmp_path / "maps" / "token_map.pt")
    assert torch.equal(load_token_map(str(out)), torch.tensor(ids))


def test_draft_vocab_maps():
    ids = [9, 2, 30, 4]
    d2t, t2d = draft_vocab_maps(ids, 32)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert draft_vocab_ids(d2t).tolist() == [2, 4, 9, 30]         # target id = i + d2t[i], in id order
    assert t2d.nonzero().squeeze(1).tolist() == [2, 4, 9, 30]
    with pytest.raises(ValueError, match="distinct"):
        draft_vocab_maps([1, 1], 32)
