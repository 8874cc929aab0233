"""FR-Spec for a draft model (STANDALONE): the draft proposes only from a hot vocabulary,
the target ids a ``--speculative-token-map`` lists (most frequent first).

Most of a small draft's arithmetic is its LM head (the shipped SmolLM2 draft: 49152 x 192
against 3 small layers), so the head keeps the hot rows only: logits come out as
``[T, V_hot]``, hot index ``i`` standing for target id ``token_map[i]``; the tree builder maps
them back (``dynamic_tree.first_step`` / ``expand_step`` take the map). The target verifies
every drafted token, so output stays lossless whatever the draft proposes.
"""
from __future__ import annotations

import pickle

import torch
from torch import nn

from specserve.config import ConfigError
from specserve.models.draft_head import DRAFT_VOCAB_TENSOR, draft_vocab_ids, load_token_map
from specserve.models.packed_linear import Linear, integer_quantization, pack_linears_for_cpu

FLAG = "--speculative-token-map"
_READ_ERRORS = (OSError, EOFError, RuntimeError, ValueError, TypeError, pickle.UnpicklingError)


def read_token_map(path: str, vocab_size: int, topk: int = 1) -> torch.Tensor:
    """The map's target ids, int64 [V_hot]. A ConfigError naming the flag when the file is no
    list of distinct ids in [0, vocab_size), or holds fewer than ``topk`` ids."""
    try:
        ids = load_token_map(path)                                             # [V_hot]
    except _READ_ERRORS as exc:
        reason = " ".join(str(exc).split())[:200]
        raise ConfigError(f"{FLAG} {path}: not a token map (a torch.save'd list of token ids): {reason}") from None
    problem = _problem(ids, vocab_size, topk)
    if problem:
        raise ConfigError(f"{FLAG} {path}: {problem}")
    return ids


def split_draft_vocab(weights) -> tuple[list, torch.Tensor | None]:
    """A draft checkpoint's tensors without its ``d2t``, and the target ids of its vocabulary
    (int64 [V_draft], in draft id order), or None for a draft with the target's vocabulary."""
    kept, d2t = [], None
    for name, tensor in weights:
        if name == DRAFT_VOCAB_TENSOR:
            d2t = tensor
        else:
            kept.append((name, tensor))
    return kept, None if d2t is None else draft_vocab_ids(d2t)


def input_id_map(vocab_ids: torch.Tensor, target_vocab_size: int) -> list[int]:
    """Target id -> draft id of a pruned-vocabulary draft; ids outside its vocabulary go to its
    last id (the pruning tool makes that row stand for every token it dropped)."""
    table = [len(vocab_ids) - 1] * target_vocab_size
    for draft_id, target_id in enumerate(vocab_ids.tolist()):
        table[target_id] = draft_id
    return table


def _problem(ids: torch.Tensor, vocab_size: int, topk: int) -> str | None:
    if ids.numel() < max(topk, 1):
        return f"holds {ids.numel()} token ids, fewer than --speculative-eagle-topk {topk} (at least 1)"
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        return f"token id {low if low < 0 else high} is outside the vocabulary [0, {vocab_size})"
    if torch.unique(ids).numel() != ids.numel():
        return "some token ids appear more than once"
    return None


@torch.no_grad()
def restricted_lm_head(full: Linear, token_map: torch.Tensor, quantization: str | None = None) -> Linear:
    """A Linear over ``full``'s rows ``token_map`` (logits [T, V_hot]), packed for the CPU like
    the model's other linears. Dense weights: a head that ran the integer kernels (``gguf``)
    keeps its rows as plain floats here."""
    rows = token_map.to(full.weight.device)
    head = Linear(full.in_features, rows.numel(), bias=full.bias is not None, device="meta")   # no init work
    weight = full.weight.detach().index_select(0, rows).contiguous()          # [V_hot, H]
    head.weight = nn.Parameter(weight, requires_grad=False)
    if full.bias is not None:
        head.bias = nn.Parameter(full.bias.detach().index_select(0, rows), requires_grad=False)   # [V_hot]
    pack_linears_for_cpu(head, integer_quantization(head, quantization))
    return head.eval()
