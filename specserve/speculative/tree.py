"""Draft trees: the one shape every proposer returns (a chain is a tree of width 1).

A ``DraftTree`` describes the speculative tokens of ONE request for one step.
Node 0 is the ROOT: the last accepted token, which is not yet in the KV cache,
so the target's verify pass computes its KV and its next-token distribution
together with those of the draft nodes. Nodes are stored parents-before-children
(``parents[i] < i``), so any prefix ``0..k`` of the nodes is itself a valid tree
and a single forward sweep over the indices visits parents first.

A tree with only the root is plain decoding: the verify pass then emits exactly
one token (the "bonus" token sampled at the root).

The structure tensors (``draft_tokens``, ``parents``) are small (<= a few dozen
nodes) and live on the CPU; the helpers below are pure functions of them with
shape comments (they read ``parents`` with one ``tolist()``, cheaper than many
tiny tensor ops for trees this small). ``draft_probs`` may live on any device.

Shapes: ``n = num_nodes`` (root included), ``V = vocab size`` (the TARGET's
vocabulary; FR-Spec drafters map their reduced vocabulary back before filling
``draft_probs``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor


@dataclass
class DraftTree:
    """Speculative tokens of one request, as a tree rooted at the last accepted token.

    draft_tokens: [n] int64. ``draft_tokens[0]`` is the root (last accepted token).
    parents:      [n] int64. ``parents[0] == -1``; ``0 <= parents[i] < i`` for i >= 1.
        Siblings are ordered by index; the verifier tries them in that order, so
        put the drafter's preferred child first.
    draft_probs:  [n, V] float or None. Row ``i`` is the draft distribution q_i
        that the CHILDREN of node ``i`` were sampled from (rows of leaves are
        ignored). Needed for lossless rejection sampling with a sampling drafter.
        Contract when it is given:
          * the children of node i, in index order, are the FIRST k draws from
            q_i, with k fixed independently of what was drawn (a data-independent
            tree shape, or a prefix cut such as ``truncate_tree``);
          * by default draws are WITHOUT replacement: draw j is sampled from q_i
            with draws 1..j-1 removed and renormalized. This is exactly what the
            Gumbel-top-k trick gives (children ordered by perturbed score,
            best first), i.e. a "sampled top-k" EAGLE-style tree.
          * ``is_sampled_with_replacement=True`` instead means iid draws from q_i
            (duplicates allowed and must be kept).
        Pruning or re-ranking siblings by their sampled values breaks this
        contract: such drafters (and every deterministic drafter: greedy
        top-k EAGLE-2 trees, NGRAM) pass ``draft_probs=None``; the verifier then
        treats each child as a point mass, which is lossless for ANY choice of
        children that does not look at the target's randomness.
    """

    draft_tokens: Tensor
    parents: Tensor
    draft_probs: Tensor | None = None
    is_sampled_with_replacement: bool = False

    def __post_init__(self) -> None:
        self._depth = max(_depth_list(_validate(self)))

    @property
    def num_nodes(self) -> int:
        return int(self.draft_tokens.shape[0])

    @property
    def depth(self) -> int:
        """The deepest node's distance from the root (0: the root-only tree)."""
        return self._depth

    @property
    def root_token(self) -> int:
        return int(self.draft_tokens[0])

    @property
    def is_root_only(self) -> bool:
        return self.num_nodes == 1

    @property
    def is_chain(self) -> bool:
        """True for a width-1 tree (node i's parent is i - 1); the root-only tree is a chain."""
        return self.parents.tolist() == list(range(-1, self.num_nodes - 1))

    def token_list(self) -> list[int]:
        """``draft_tokens`` as a list of ints."""
        return self.draft_tokens.tolist()

    @classmethod
    def from_lists(cls, draft_tokens: Sequence[int], parents: Sequence[int],
                   draft_probs: Tensor | None = None,
                   is_sampled_with_replacement: bool = False) -> "DraftTree":
        return cls(torch.tensor(list(draft_tokens), dtype=torch.int64),
                   torch.tensor(list(parents), dtype=torch.int64),
                   draft_probs, is_sampled_with_replacement)

    def to(self, device: torch.device | str) -> "DraftTree":
        probs = None if self.draft_probs is None else self.draft_probs.to(device)
        return DraftTree(self.draft_tokens.to(device), self.parents.to(device), probs,
                         self.is_sampled_with_replacement)


def _validate(tree: DraftTree) -> list[int]:
    """Raises ValueError for a malformed tree; returns its parents as a list."""
    tokens, parents = tree.draft_tokens, tree.parents
    if tokens.dim() != 1 or parents.dim() != 1 or tokens.shape != parents.shape:
        raise ValueError(f"draft_tokens and parents must be 1-D of equal length; got "
                         f"{tuple(tokens.shape)} and {tuple(parents.shape)}")
    if tokens.shape[0] < 1:
        raise ValueError("a DraftTree needs at least the root node")
    if tokens.dtype != torch.int64 or parents.dtype != torch.int64:
        raise ValueError("draft_tokens and parents must be int64")
    par = parents.tolist()
    if par[0] != -1 or any(not 0 <= p < i for i, p in enumerate(par) if i):
        raise ValueError(f"parents must satisfy parents[0] == -1 and 0 <= parents[i] < i; got {par}")
    probs = tree.draft_probs
    if probs is not None and (probs.dim() != 2 or probs.shape[0] != tokens.shape[0]):
        raise ValueError(f"draft_probs must be [num_nodes, vocab]; got {tuple(probs.shape)}")
    return par


# ---- constructors ---------------------------------------------------------------

def chain(tokens: Sequence[int] | Tensor, draft_probs: Tensor | None = None) -> DraftTree:
    """Width-1 tree: ``tokens[0]`` is the root, ``tokens[i]`` the i-th drafted token."""
    if isinstance(tokens, list) and tokens and draft_probs is None:
        return _ChainTree(tokens)
    draft_tokens = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)  # [n]
    parents = torch.arange(-1, draft_tokens.shape[0] - 1, dtype=torch.int64)  # [n]
    return DraftTree(draft_tokens, parents, draft_probs)


def root_only(root_token: int) -> DraftTree:
    """The "empty" tree: no speculation, plain decoding of one token. Built on every step of
    every request the policy skips, so it skips ``_validate`` (valid by construction) and makes
    its tensors only when something reads them: a plain step reads only ``is_root_only`` and
    ``root_token`` (making the tensor took ~20 us a step in a decode step, after the weights went
    through the caches; 11 us hot with validation). A chain of the one id."""
    return _ChainTree([root_token])


class _ChainTree(DraftTree):
    """``chain``'s tree of a list of ids without draft probabilities (an EAGLE chain, every step
    of every drafting request) and ``root_only``'s: valid by construction, its tensors made on
    first read. The verifier and the engine read its tokens as a list (``token_list``); building
    and validating the tensors took ~30 us a step."""

    def __init__(self, tokens: list[int]) -> None:       # no dataclass __init__: nothing to validate
        self._ids, self._tokens, self._parents = [int(t) for t in tokens], None, None
        self._depth = len(self._ids) - 1
        self.draft_probs, self.is_sampled_with_replacement = None, False

    @property
    def draft_tokens(self) -> Tensor:
        if self._tokens is None:
            self._tokens = torch.from_numpy(np.array(self._ids, dtype=np.int64))
        return self._tokens

    @property
    def parents(self) -> Tensor:
        if self._parents is None:
            self._parents = torch.arange(-1, len(self._ids) - 1, dtype=torch.int64)
        return self._parents

    @property
    def num_nodes(self) -> int:
        return len(self._ids)

    @property
    def root_token(self) -> int:
        return self._ids[0]

    @property
    def is_chain(self) -> bool:
        return True

    def token_list(self) -> list[int]:
        return list(self._ids)


# ---- structure ------------------------------------------------------------------

def tree_mask(parents: Tensor) -> Tensor:
    """[n, n] bool: ``mask[i, j]`` iff node j is an ancestor of node i or i itself."""
    n = parents.shape[0]
    if n > _MAX_BITSET_NODES:
        return _tree_mask_doubling(parents)
    bits = torch.tensor(_ancestor_bits(parents.tolist()), dtype=torch.int64)  # [n] row i as a bitset
    shifts = torch.arange(n, dtype=torch.int64)
    return ((bits[:, None] >> shifts) & 1).bool().to(parents.device)  # [n, n]


_MAX_BITSET_NODES = 63  # a row fits a non-negative int64


def _ancestor_bits(par: list[int]) -> list[int]:
    """bits[i] has bit j set iff j is an ancestor-or-self of i (parents come first)."""
    bits = [1] * len(par)
    for i in range(1, len(par)):
        bits[i] = bits[par[i]] | (1 << i)
    return bits


def _tree_mask_doubling(parents: Tensor) -> Tensor:
    """Same as tree_mask for any size, on any device: after step k row i holds the
    ancestors at distance < 2**k."""
    n = parents.shape[0]
    idx = torch.arange(n, device=parents.device)
    jump = torch.where(parents < 0, idx, parents)  # [n] root points to itself
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)  # [n, n]
    for _ in range((n - 1).bit_length()):
        mask = mask | mask[jump]
        jump = jump[jump]
    return mask


def depths(parents: Tensor) -> Tensor:
    """[n] int64: distance from the root (root = 0)."""
    return torch.tensor(_depth_list(parents.tolist()), dtype=torch.int64, device=parents.device)


def _depth_list(par: list[int]) -> list[int]:
    depth = [0] * len(par)
    for i in range(1, len(par)):
        depth[i] = depth[par[i]] + 1
    return depth


def positions(parents: Tensor, start_pos: int | Tensor) -> Tensor:
    """[n] int64 position ids; ``start_pos`` is the root's position (= cached length)."""
    return depths(parents) + start_pos


def is_leaf(parents: Tensor) -> Tensor:
    """[n] bool: nodes without children."""
    par = parents.tolist()
    has_child = set(par[1:])
    return torch.tensor([i not in has_child for i in range(len(par))], device=parents.device)


def children_lists(parents: Tensor | Sequence[int]) -> list[list[int]]:
    """children[i] = child node indices of node i, ascending (= the verifier's try order)."""
    par = parents.tolist() if isinstance(parents, Tensor) else list(parents)
    children: list[list[int]] = [[] for _ in par]
    for i, p in enumerate(par):
        if p >= 0:
            children[p].append(i)
    return children


def retrieve_indices(parents: Tensor) -> Tensor:
    """[num_leaves, max_depth + 1] int64: root-to-leaf node paths, padded with -1.

    Leaves are listed in ascending node index.
    """
    par = parents.tolist()
    has_child = set(par[1:])
    paths = []
    for leaf in range(len(par)):
        if leaf in has_child:
            continue
        path = [leaf]
        while par[path[-1]] >= 0:
            path.append(par[path[-1]])
        paths.append(path[::-1])
    width = max(len(p) for p in paths)
    rows = [p + [-1] * (width - len(p)) for p in paths]
    return torch.tensor(rows, dtype=torch.int64, device=parents.device)


# ---- editing --------------------------------------------------------------------

def subtree(tree: DraftTree, keep: Sequence[int] | Tensor) -> DraftTree:
    """The tree restricted to the nodes ``keep`` (must contain 0 and every kept node's parent).

    Kept nodes keep their relative order, so siblings keep their try order. For a
    sampled tree (``draft_probs`` given) keep a PREFIX of every sibling list, or
    the verifier's assumption about how siblings were drawn no longer holds.
    """
    keep_t = torch.as_tensor(keep, dtype=torch.int64).unique(sorted=True)  # [m]
    if keep_t.numel() == 0 or int(keep_t[0]) != 0:
        raise ValueError("subtree must keep the root (node 0)")
    new_index = torch.full((tree.num_nodes,), -1, dtype=torch.int64)
    new_index[keep_t] = torch.arange(keep_t.shape[0])
    old_parents = tree.parents[keep_t]  # [m]
    new_parents = torch.where(old_parents >= 0, new_index[old_parents.clamp(min=0)], -1)
    if bool((new_parents[1:] < 0).any()):
        raise ValueError("subtree: kept nodes must be closed under parents")
    probs = None if tree.draft_probs is None else tree.draft_probs[keep_t.to(tree.draft_probs.device)]
    return DraftTree(tree.draft_tokens[keep_t], new_parents, probs, tree.is_sampled_with_replacement)


def truncate_tree(tree: DraftTree, max_nodes: int) -> DraftTree:
    """The first ``max_nodes`` nodes (root included). A prefix of a parents-first
    order is always a valid tree, and it keeps a prefix of every sibling list, so a
    sampled tree stays valid for lossless verification."""
    if max_nodes < 1:
        raise ValueError("max_nodes must be >= 1 (the root)")
    if tree.num_nodes <= max_nodes:
        return tree
    if isinstance(tree, _ChainTree):
        return _ChainTree(tree.token_list()[:max_nodes])
    probs = None if tree.draft_probs is None else tree.draft_probs[:max_nodes]
    return DraftTree(tree.draft_tokens[:max_nodes], tree.parents[:max_nodes], probs,
                     tree.is_sampled_with_replacement)


# ---- batching -------------------------------------------------------------------

@dataclass
class PackedTrees:
    """Several requests' trees laid out back to back (request order).

    draft_tokens: [total_nodes] int64
    parents:      [total_nodes] int64 flat index of the parent, -1 for roots
    depths:       [total_nodes] int64
    offsets:      [bs + 1] int64, tree r occupies ``offsets[r]:offsets[r + 1]``
    tree_masks:   per request [n_r, n_r] bool (see ``tree_mask``)
    num_nodes:    per request node counts (python ints)
    """

    draft_tokens: Tensor
    parents: Tensor
    depths: Tensor
    offsets: Tensor
    tree_masks: list[Tensor]
    num_nodes: list[int]

    @property
    def batch_size(self) -> int:
        return len(self.num_nodes)

    @property
    def total_nodes(self) -> int:
        return int(self.draft_tokens.shape[0])

    def request_index(self) -> Tensor:
        """[total_nodes] int64: which request each node belongs to."""
        counts = torch.tensor(self.num_nodes, dtype=torch.int64)
        return torch.repeat_interleave(torch.arange(self.batch_size), counts)

    def positions(self, start_positions: Tensor | Sequence[int]) -> Tensor:
        """[total_nodes] position ids; ``start_positions[r]`` is request r's root position."""
        start = torch.as_tensor(start_positions, dtype=torch.int64)  # [bs]
        counts = torch.tensor(self.num_nodes, dtype=torch.int64, device=start.device)
        return self.depths.to(start.device) + torch.repeat_interleave(start, counts)

    def block_mask(self) -> Tensor:
        """[total_nodes, total_nodes] bool: block-diagonal tree mask of the whole batch."""
        return torch.block_diag(*self.tree_masks)

    def split(self, x: Tensor) -> list[Tensor]:
        """Split a [total_nodes, ...] tensor into per-request pieces."""
        return list(torch.split(x, self.num_nodes, dim=0))


def pack_trees(trees: Sequence[DraftTree]) -> PackedTrees:
    if not trees:
        raise ValueError("pack_trees needs at least one tree")
    num_nodes = [t.num_nodes for t in trees]
    starts = [0]
    for n in num_nodes:
        starts.append(starts[-1] + n)
    flat_parents: list[int] = []
    flat_depths: list[int] = []
    for start, tree in zip(starts, trees):
        par = tree.parents.tolist()
        flat_parents += [p + start if p >= 0 else -1 for p in par]
        flat_depths += _depth_list(par)
    return PackedTrees(
        draft_tokens=torch.cat([t.draft_tokens for t in trees]),
        parents=torch.tensor(flat_parents, dtype=torch.int64),
        depths=torch.tensor(flat_depths, dtype=torch.int64),
        offsets=torch.tensor(starts, dtype=torch.int64),
        tree_masks=[tree_mask(t.parents) for t in trees],
        num_nodes=num_nodes,
    )
