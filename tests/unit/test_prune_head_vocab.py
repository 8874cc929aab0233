"""An EAGLE-3 head's draft vocabulary cut smaller (``train/prune_vocab.py``): the kept ids are the
ones the ranking puts first, and the loaded head's logits at them are the full head's, so its greedy
draft is the full head's wherever that lies in the kept vocabulary."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from specserve.train.prune_vocab import main, prune_head_vocab
from tests.model import tiny_draft_heads as tdh
from tests.model.tiny_draft_heads import inputs, load, run_head, target, target_cfg, target_dir, target_weights  # noqa: F401

DRAFT_VOCAB, SIZE = 16, 6


@pytest.fixture()
def heads(tmp_path, target, target_dir, target_cfg):  # noqa: F811
    config, w = tdh.eagle3_checkpoint(target_cfg, draft_vocab=DRAFT_VOCAB)
    full_dir = tdh.write_checkpoint(tmp_path / "full", config, w)
    vocab = (torch.arange(DRAFT_VOCAB) + w["d2t"]).tolist()
    counts = Counter({t: 100 - 3 * i for i, t in enumerate(reversed(vocab))})    # the last ids rank first
    pruned_dir = prune_head_vocab(full_dir, counts, SIZE, tmp_path / "pruned")
    full, pruned = (load("EAGLE3", d, target, target_dir) for d in (full_dir, pruned_dir))
    return full, pruned, vocab


def test_pruned_head_keeps_the_top_ranked_ids_and_their_logits(heads):
    full, pruned, vocab = heads
    assert pruned.draft_vocab_size == SIZE
    kept = pruned.draft_to_target(torch.arange(SIZE)).tolist()
    assert kept == sorted(vocab[-SIZE:])
    ids, features = inputs(5, 3 * 64)
    with torch.no_grad():
        hidden = run_head(full, ids, features)
        torch.testing.assert_close(run_head(pruned, ids, features), hidden, rtol=0, atol=0)
        logits_full, logits_pruned = full.compute_logits(hidden), pruned.compute_logits(hidden)
    rows = torch.tensor([vocab.index(t) for t in kept])
    torch.testing.assert_close(logits_pruned, logits_full[:, rows], rtol=0, atol=0)
    best_full = full.draft_to_target(logits_full.argmax(-1))
    best_pruned = pruned.draft_to_target(logits_pruned.argmax(-1))
    inside = torch.tensor([t in kept for t in best_full.tolist()])
    assert torch.equal(best_pruned[inside], best_full[inside])


def test_cli_ranks_by_a_token_map_and_rejects_bad_sizes(tmp_path, target_cfg, capsys):  # noqa: F811
    config, w = tdh.eagle3_checkpoint(target_cfg, draft_vocab=DRAFT_VOCAB)
    head = tdh.write_checkpoint(tmp_path / "full", config, w)
    vocab = (torch.arange(DRAFT_VOCAB) + w["d2t"]).tolist()
    torch.save([vocab[7], vocab[2], vocab[11]], tmp_path / "map.pt")       # most frequent first
    out = tmp_path / "pruned"
    assert main(["--draft", str(head), "--ranked", str(tmp_path / "map.pt"), "--size", "2", "--out", str(out)]) == 0
    from safetensors.torch import load_file
    pruned = load_file(str(out / "model.safetensors"))
    assert (torch.arange(2) + pruned["d2t"]).tolist() == sorted([vocab[7], vocab[2]])
    assert pruned["t2d"].sum() == 2 and pruned["lm_head.weight"].shape[0] == 2
    assert main(["--draft", str(head), "--ranked", str(tmp_path / "map.pt"), "--size", str(DRAFT_VOCAB),
                 "--out", str(tmp_path / "bad")]) == 2
    assert "error: --size must be in [2, 16)" in capsys.readouterr().err
