"""EAGLE-2 style dynamic draft trees, as pure tensor functions (batched over requests).

A drafter that produces a next-token distribution for any tree node grows the
tree in S steps:

* step 0 (``first_step``): the K most likely tokens after the root become the
  first K pool nodes and the frontier;
* every later step (``expand_step``): each of the K frontier nodes is expanded
  by its K most likely children; all K * K candidates join the pool, scored by
  their cumulative draft log-prob (parent score + log q(child)); the K best
  candidates become the next frontier;
* ``rerank``: the N - 1 best pool nodes by score form the tree (plus the root).
  Pool order is step order, so a parent's pool index is below its children's;
  a child's score is <= its parent's (log-probs are <= 0) and ties are broken
  towards the lower pool index, so the best N - 1 nodes are closed under
  parents. Selected nodes are emitted in pool order: parents before children,
  preferred (higher-scored) siblings first within a step.

The pool holds K + (S - 1) * K * K nodes; N - 1 must not exceed that. With
K == 1 the tree is a chain of S tokens. The tree is a deterministic function of
the draft distributions, so it is verified with point-mass rules
(``DraftTree.draft_probs = None``), which are lossless for any such tree.

Shapes: bs = requests, K = topk, V = vocabulary, P = pool size so far.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class TreePool:
    tokens: Tensor    # [bs, P] int64
    scores: Tensor    # [bs, P] float32, cumulative draft log-prob
    parents: Tensor   # [bs, P] int64 pool index of the parent, -1 for children of the root

    @property
    def size(self) -> int:
        return int(self.tokens.shape[1])


@dataclass
class Frontier:
    tokens: Tensor       # [bs, K] int64, the nodes to expand next
    scores: Tensor       # [bs, K] float32
    pool_index: Tensor   # [bs, K] int64, their pool indices
    parent_slot: Tensor  # [bs, K] int64, frontier slot of the parent in the previous step (-1: root)


def first_step(root_logprobs: Tensor, topk: int, token_map: Tensor | None = None) -> tuple[TreePool, Frontier]:
    """root_logprobs: [bs, V] draft log-probs after the root. ``token_map`` [V]: the
    target id of each draft-vocabulary index (a draft with its own vocabulary)."""
    scores, tokens = root_logprobs.float().topk(topk, dim=-1)           # [bs, K]
    if token_map is not None:
        tokens = token_map[tokens]
    bs = tokens.shape[0]
    index = torch.arange(topk, device=tokens.device).expand(bs, topk)   # [bs, K]
    parents = torch.full_like(tokens, -1)
    return TreePool(tokens, scores, parents), Frontier(tokens, scores, index.clone(), parents.clone())


def expand_step(pool: TreePool, frontier: Frontier, child_logprobs: Tensor,
                topk: int, token_map: Tensor | None = None) -> tuple[TreePool, Frontier]:
    """child_logprobs: [bs, K, V] draft log-probs after each frontier node."""
    bs, width = frontier.tokens.shape
    child_lp, child_tokens = child_logprobs.float().topk(topk, dim=-1)          # [bs, K, K]
    if token_map is not None:
        child_tokens = token_map[child_tokens]
    cum = (frontier.scores.unsqueeze(2) + child_lp).reshape(bs, width * topk)   # [bs, K*K]
    tokens = child_tokens.reshape(bs, width * topk)
    parents = frontier.pool_index.unsqueeze(2).expand(bs, width, topk).reshape(bs, width * topk)
    best = _best(cum, topk)                                                     # [bs, K]
    new_pool = TreePool(torch.cat([pool.tokens, tokens], dim=1), torch.cat([pool.scores, cum], dim=1),
                        torch.cat([pool.parents, parents], dim=1))
    new_frontier = Frontier(tokens.gather(1, best), cum.gather(1, best), best + pool.size,
                            torch.div(best, topk, rounding_mode="floor"))
    return new_pool, new_frontier


def rerank(pool: TreePool, root_tokens: Tensor, num_nodes: int) -> tuple[Tensor, Tensor]:
    """The best ``num_nodes - 1`` pool nodes plus the root, parents first.

    root_tokens: [bs]. Returns (draft_tokens [bs, n], parents [bs, n]) in tree
    numbering (root = node 0, ``parents[:, 0] == -1``), n = min(num_nodes, 1 + P).
    """
    bs = pool.tokens.shape[0]
    m = min(num_nodes - 1, pool.size)
    selected = _best(pool.scores, m).sort(dim=1).values                   # [bs, m] pool order
    node_of = torch.full_like(pool.tokens, -1)                            # [bs, P] pool -> tree node
    node_of.scatter_(1, selected, torch.arange(1, m + 1, device=selected.device).expand(bs, m))
    pool_parent = pool.parents.gather(1, selected)                        # [bs, m]
    tree_parent = torch.where(pool_parent < 0, 0, node_of.gather(1, pool_parent.clamp(min=0)))
    root = root_tokens.reshape(bs, 1).to(pool.tokens)
    minus_one = torch.full((bs, 1), -1, dtype=torch.int64, device=selected.device)
    return (torch.cat([root, pool.tokens.gather(1, selected)], dim=1),
            torch.cat([minus_one, tree_parent], dim=1))


def _best(scores: Tensor, k: int) -> Tensor:
    """[bs, k] indices of the k highest scores; ties go to the lower index."""
    return scores.sort(dim=1, descending=True, stable=True).indices[:, :k]
