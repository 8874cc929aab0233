"""Verification of a draft tree against the target: greedy and lossless sampling.

Both rules walk the tree from the root. At each accepted node they try its
children in index order; the walk stops at a node where no child is accepted
(or at a leaf), and one more "bonus" token is produced from the target's
distribution at that node. Emitted tokens = draft tokens of the accepted
non-root nodes + the bonus token, so ``accept_len + 1`` tokens per step.

Sampling (``sample_accept``) -- exact semantics
------------------------------------------------
Let p = target distribution at the current node, siblings x_1..x_k its children.

* Deterministic drafter (``tree.draft_probs is None``; each child is a point
  mass, e.g. greedy top-k EAGLE-2 trees, NGRAM). One coin u ~ U[0, 1) per node;
  ``prob_acc`` accumulates the (original) target probabilities of the siblings
  tried so far; sibling x_j is accepted iff

      u < prob_acc / threshold_acc     or     (p(x_j) >= threshold_single and p(x_j) > 0)

  A sibling whose token was already rejected at this node is skipped. If all
  siblings are rejected the bonus is drawn from p with the rejected tokens
  zeroed and renormalized. With both thresholds at 1.0 this is exactly the
  sequential one-hot rule "accept x_j with prob p'(x_j), else p' <- p' without
  x_j, renormalized", hence lossless for any choice of children. This matches
  SGLang's ``tree_speculative_sampling_target_only`` (its coin/prob_acc test).

* Sampling drafter (``tree.draft_probs`` given: q = draft_probs[node]).
  Multi-draft recursive rejection sampling, one fresh coin per sibling:

      accept x_j  iff  u_j < p(x_j) / (q(x_j) * threshold_acc)
                  or   (p0(x_j) >= threshold_single and p0(x_j) > 0)

  where p0 is the node's original target distribution. On rejection
  ``p <- normalize(max(p - q, 0))`` and, for draws without replacement (the
  default, see ``DraftTree``), ``q <- normalize(q with x_j removed)``; with
  replacement q stays. If all siblings are rejected the bonus is drawn from the
  current residual p. With thresholds 1.0 this is lossless (each step is a
  single-draft rejection step whose "rejected" branch is itself lossless for
  the residual, given any earlier draws).

* Accepted down to a leaf: the bonus is drawn from the leaf's p.

Thresholds < 1.0 relax acceptance (faster, NOT lossless), following SGLang's
``--speculative-accept-threshold-single`` / ``--speculative-accept-threshold-acc``.
They do not apply to greedy verification.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from specserve.runner.sampler import argmax_rows
from specserve.speculative.tree import DraftTree, children_lists

GREEDY_TEMPERATURE = 1e-5  # at or below this a request is verified greedily


class AcceptResult(NamedTuple):
    accepted_indices: list[int]  # tree node indices of the accepted path, root first
    bonus_token: int  # the extra token sampled at the last accepted node

    @property
    def accept_len(self) -> int:
        """Number of accepted draft tokens (root excluded)."""
        return len(self.accepted_indices) - 1


def emitted_tokens(tree: DraftTree, result: AcceptResult) -> list[int]:
    """Tokens this step appends to the request: accepted draft tokens + bonus."""
    tokens = tree.token_list()
    return [tokens[i] for i in result.accepted_indices[1:]] + [result.bonus_token]


# ---- greedy ---------------------------------------------------------------------

def greedy_accept(tree: DraftTree, target_tokens: Tensor | Sequence[int]) -> AcceptResult:
    """target_tokens: [n] int, argmax of the target after each node.

    From the current node, accept the first child whose token equals the
    target's choice; stop when none does. Bonus = target choice at the last node.
    """
    tokens = tree.token_list()
    targets = target_tokens.tolist() if isinstance(target_tokens, Tensor) else list(target_tokens)
    if tree.is_chain:               # node i's only child is i + 1
        node = 0
        while node + 1 < len(tokens) and tokens[node + 1] == targets[node]:
            node += 1
        return AcceptResult(list(range(node + 1)), int(targets[node]))
    children = children_lists(tree.parents)
    accepted = [0]
    node = 0
    while True:
        want = targets[node]
        nxt = next((c for c in children[node] if tokens[c] == want), -1)
        if nxt < 0:
            return AcceptResult(accepted, int(want))
        accepted.append(nxt)
        node = nxt


# ---- sampling -------------------------------------------------------------------

def sample_accept(tree: DraftTree, target_probs: Tensor, generator: torch.Generator | None = None,
                  threshold_single: float = 1.0, threshold_acc: float = 1.0) -> AcceptResult:
    """target_probs: [n, V] target distribution after each node (temperature etc. applied).

    See the module docstring for the exact acceptance rule.
    """
    _check_thresholds(threshold_single, threshold_acc)
    tokens = tree.draft_tokens.tolist()
    children = children_lists(tree.parents)
    coins = torch.rand(tree.num_nodes + 1, generator=generator, dtype=torch.float64).tolist()  # [n + 1]
    accepted = [0]
    node = 0
    while children[node]:
        kids = children[node]
        kid_tokens = [tokens[c] for c in kids]
        if tree.draft_probs is None:
            pick, residual = _point_mass_step(target_probs[node], kids, kid_tokens, coins[node],
                                              threshold_single, threshold_acc)
        else:
            pick, residual = _sampled_step(target_probs[node], tree.draft_probs[node], kids, kid_tokens,
                                           coins, threshold_single, threshold_acc,
                                           tree.is_sampled_with_replacement)
        if pick < 0:
            return AcceptResult(accepted, _sample_from(residual, coins[-1]))
        accepted.append(pick)
        node = pick
    return AcceptResult(accepted, _sample_from(target_probs[node].to(torch.float64), coins[-1]))


def _check_thresholds(threshold_single: float, threshold_acc: float) -> None:
    if not 0.0 <= threshold_single <= 1.0:
        raise ValueError(f"threshold_single must be in [0, 1]; got {threshold_single}")
    if not 0.0 < threshold_acc <= 1.0:
        raise ValueError(f"threshold_acc must be in (0, 1]; got {threshold_acc}")


def _point_mass_step(p_row: Tensor, kids: list[int], kid_tokens: list[int], coin: float,
                     threshold_single: float, threshold_acc: float) -> tuple[int, Tensor | None]:
    """One node, deterministic children. Returns (accepted child or -1, residual [V] or None)."""
    kid_probs = p_row[kid_tokens].tolist()  # [k]
    prob_acc = 0.0
    rejected: list[int] = []
    for child, x, px in zip(kids, kid_tokens, kid_probs):
        if x in rejected:
            continue
        prob_acc += px
        if coin < prob_acc / threshold_acc or (px >= threshold_single and px > 0.0):
            return child, None
        rejected.append(x)
    residual = p_row.to(torch.float64)  # [V]
    residual = residual.index_fill(0, torch.tensor(rejected, device=residual.device), 0.0)
    return -1, residual


def _sampled_step(p_row: Tensor, q_row: Tensor, kids: list[int], kid_tokens: list[int],
                  coins: list[float], threshold_single: float, threshold_acc: float,
                  is_with_replacement: bool) -> tuple[int, Tensor | None]:
    """One node, children drawn from q_row. Returns (accepted child or -1, residual [V] or None)."""
    p0_kids = p_row[kid_tokens].tolist()  # [k] original target probs, for threshold_single
    p = p_row.to(torch.float64)  # [V] current residual target
    q = _normalized(q_row.to(device=p.device, dtype=torch.float64))  # [V] current proposal
    for child, x, p0 in zip(kids, kid_tokens, p0_kids):
        if p0 >= threshold_single and p0 > 0.0:
            return child, None
        px, qx = float(p[x]), float(q[x])
        if px > 0.0 and coins[child] * qx * threshold_acc < px:
            return child, None
        p = _residual(p, q)
        if not is_with_replacement:
            q = q.clone()
            q[x] = 0.0
            q = _normalized(q)
    return -1, p


def _residual(p: Tensor, q: Tensor) -> Tensor:
    """normalize(max(p - q, 0)); p itself if that has no mass (then rejection had prob ~0)."""
    r = (p - q).clamp_(min=0.0)
    mass = float(r.sum())
    return r / mass if mass > 1e-12 else p


def _normalized(q: Tensor) -> Tensor:
    mass = float(q.sum())
    return q / mass if mass > 0.0 else q


def _sample_from(weights: Tensor, coin: float) -> int:
    """Inverse-CDF sample from unnormalized non-negative weights [V] with a U[0,1) coin."""
    cdf = torch.cumsum(weights, dim=0)  # [V]
    total = float(cdf[-1])
    if total <= 0.0:
        raise ValueError("cannot sample from an all-zero distribution")
    idx = int(torch.searchsorted(cdf, torch.tensor([coin * total], dtype=cdf.dtype, device=cdf.device),
                                 right=True))
    idx = min(idx, cdf.shape[0] - 1)
    if float(weights[idx]) <= 0.0:  # float round-off at the top end
        idx = int(torch.argmax(weights))
    return idx


# ---- batch ----------------------------------------------------------------------

def verify_batch(trees: Sequence[DraftTree], target: Tensor, *, is_probs: bool = False,
                 temperatures: Sequence[float] | None = None,
                 generator: torch.Generator | None = None,
                 threshold_single: float = 1.0, threshold_acc: float = 1.0) -> list[AcceptResult]:
    """Verify several requests' trees from one packed target pass.

    target: [total_nodes, V] rows in ``pack_trees`` order; logits (softmax with
        the request's temperature is applied here) or, with ``is_probs``, final
        probabilities (temperature, top-k/top-p already applied by the caller).
    temperatures: per request; None = all greedy. A request with temperature
        <= GREEDY_TEMPERATURE is verified greedily (argmax, no thresholds).
    """
    num_nodes = [t.num_nodes for t in trees]
    if target.shape[0] != sum(num_nodes):
        raise ValueError(f"target has {target.shape[0]} rows for {sum(num_nodes)} tree nodes")
    temps = [0.0] * len(trees) if temperatures is None else list(temperatures)
    is_greedy = [t <= GREEDY_TEMPERATURE for t in temps]
    rows = torch.split(target, num_nodes, dim=0)
    argmax = torch.split(argmax_rows(target).cpu(), num_nodes) if any(is_greedy) else None
    results = []
    for r, tree in enumerate(trees):
        if is_greedy[r]:
            results.append(greedy_accept(tree, argmax[r]))
            continue
        probs = rows[r] if is_probs else torch.softmax(rows[r].float() / temps[r], dim=-1)
        results.append(sample_accept(tree, probs, generator, threshold_single, threshold_acc))
    return results
