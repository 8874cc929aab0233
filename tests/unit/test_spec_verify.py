"""Greedy acceptance on hand-made trees; statistical losslessness of sample_accept.

The statistical tests use a toy "target model" p(next | prefix) = P[last token]
and a toy drafter q(next | prefix) = Q[last token] (fixed random tables), run
the speculative process until at least two tokens are emitted, and compare the
first emitted token and the joint (first, second) against the exact target
distributions with a chi-square test. Each harness is also run with a
deliberately lossy rule (relaxed thresholds) to show that it can fail.
"""
from __future__ import annotations

import random

import pytest
import torch

from specserve.speculative.tree import DraftTree, chain, root_only, truncate_tree
from specserve.speculative.verify import (AcceptResult, emitted_tokens, greedy_accept, sample_accept,
                                   verify_batch)

# ---- greedy -----------------------------------------------------------------------


def _targets(n: int, pairs: dict[int, int], default: int = 99) -> torch.Tensor:
    out = torch.full((n,), default, dtype=torch.int64)
    for node, tok in pairs.items():
        out[node] = tok
    return out


def test_greedy_chain_accepts_prefix_and_bonus():
    tree = chain([7, 1, 2, 3])
    res = greedy_accept(tree, _targets(4, {0: 1, 1: 2, 2: 5, 3: 4}))
    assert res == ([0, 1, 2], 5) and res.accept_len == 2
    assert emitted_tokens(tree, res) == [1, 2, 5]


def test_greedy_chain_all_accepted_bonus_from_leaf():
    tree = chain([7, 1, 2, 3])
    res = greedy_accept(tree, _targets(4, {0: 1, 1: 2, 2: 3, 3: 8}))
    assert res == ([0, 1, 2, 3], 8)
    assert emitted_tokens(tree, res) == [1, 2, 3, 8]


def test_a_chain_of_ids_is_the_tree_its_tensors_describe():
    """``chain`` of a list keeps the ids as a list (an EAGLE chain, every step): its tensors, depth,
    cuts and greedy acceptance (targets as a list) are those of the same tree built from tensors."""
    ids = [7, 1, 2, 3]
    fast, general = chain(ids), DraftTree.from_lists(ids, [-1, 0, 1, 2])
    assert torch.equal(fast.draft_tokens, general.draft_tokens) and torch.equal(fast.parents, general.parents)
    assert (fast.num_nodes, fast.depth, fast.root_token, fast.is_chain) == (4, 3, 7, True)
    assert truncate_tree(fast, 2).token_list() == [7, 1] and truncate_tree(fast, 2).depth == 1
    targets = [1, 2, 5, 4]
    assert greedy_accept(fast, targets) == greedy_accept(general, torch.tensor(targets)) == ([0, 1, 2], 5)


def test_greedy_root_only_is_plain_decoding():
    res = greedy_accept(root_only(5), torch.tensor([42]))
    assert res == ([0], 42) and res.accept_len == 0


def test_greedy_branching_follows_matching_branch():
    #        0(9)
    #      /   \
    #    1(4)  2(5)
    #    |      |  \
    #   3(6)  4(7) 5(8)
    tree = DraftTree.from_lists([9, 4, 5, 6, 7, 8], [-1, 0, 0, 1, 2, 2])
    res = greedy_accept(tree, _targets(6, {0: 5, 2: 8, 5: 1}))
    assert res == ([0, 2, 5], 1)
    assert emitted_tokens(tree, res) == [5, 8, 1]
    # first level rejected: bonus from the root
    assert greedy_accept(tree, _targets(6, {0: 3})) == ([0], 3)


def test_greedy_first_match_wins_among_equal_siblings():
    tree = DraftTree.from_lists([9, 4, 4, 6, 7], [-1, 0, 0, 1, 2])
    res = greedy_accept(tree, _targets(5, {0: 4, 1: 6, 2: 7, 3: 0}))
    assert res == ([0, 1, 3], 0)


def test_verify_batch_greedy_and_sample_mix():
    trees = [chain([1, 2, 3]), root_only(4)]
    logits = torch.full((4, 6), -30.0)
    logits[0, 2] = logits[1, 3] = logits[2, 5] = logits[3, 1] = 10.0
    out = verify_batch(trees, logits, temperatures=[0.0, 1.0], generator=torch.Generator().manual_seed(0))
    assert out[0] == ([0, 1, 2], 5)
    assert out[1] == ([0], 1)  # nearly one-hot distribution
    probs = torch.softmax(logits, dim=-1)
    out2 = verify_batch(trees, probs, is_probs=True, temperatures=[1.0, 0.0],
                        generator=torch.Generator().manual_seed(0))
    assert out2[0] == ([0, 1, 2], 5) and out2[1] == ([0], 1)


def test_sample_accept_respects_zero_probability_tokens():
    tree = DraftTree.from_lists([0, 1, 2], [-1, 0, 0])
    probs = torch.tensor([[0.0, 0.0, 0.0, 1.0]] * 3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        assert sample_accept(tree, probs, gen, threshold_single=0.0) == ([0], 3)


def test_threshold_validation():
    with pytest.raises(ValueError):
        sample_accept(root_only(0), torch.ones(1, 3) / 3, threshold_acc=0.0)
    with pytest.raises(ValueError):
        sample_accept(root_only(0), torch.ones(1, 3) / 3, threshold_single=1.5)


# ---- statistical ---------------------------------------------------------------------

V = 6
ROOT = 0
NUM_TRIALS = 20_000
P_OK = 1e-3  # the correct rule must not be rejected at this level
P_BIASED = 1e-6  # a lossy rule must be detected at this level
NUM_SANITY_TRIALS = 3_000  # the lossy rules below are far off: fewer trials suffice


def _tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gamma = -torch.log(torch.rand(V, V, generator=g))  # Dirichlet(1) rows after normalizing
    target = gamma / gamma.sum(dim=1, keepdim=True) * 0.8 + 0.2 / V
    draft = torch.rand(V, V, generator=g) ** 3 + 0.01  # peaked, far from the target
    draft = draft / draft.sum(dim=1, keepdim=True)
    return target.double(), draft.double()


P_TABLE, Q_TABLE = _tables(1234)
Q_ROWS = Q_TABLE.tolist()


def _draw(rng: random.Random, weights: list[float], exclude: set[int]) -> int:
    w = [0.0 if i in exclude else x for i, x in enumerate(weights)]
    return rng.choices(range(V), weights=w)[0]


def _sampled_tree(rng: random.Random, root: int, widths: list[int], replacement: bool) -> DraftTree:
    """Level-by-level tree; each node's children are drawn from Q[node token]."""
    tokens, parents, frontier = [root], [-1], [0]
    for width in widths:
        nxt = []
        for node in frontier:
            drawn: set[int] = set()
            for _ in range(width):
                tok = _draw(rng, Q_ROWS[tokens[node]], set() if replacement else drawn)
                drawn.add(tok)
                tokens.append(tok)
                parents.append(node)
                nxt.append(len(tokens) - 1)
        frontier = nxt
    tok_t = torch.tensor(tokens)
    return DraftTree(tok_t, torch.tensor(parents), Q_TABLE[tok_t], replacement)


def _top_tree(rng: random.Random, root: int, widths: list[int], replacement: bool) -> DraftTree:
    """Deterministic tree: children = the draft's top-k tokens (ties aside), no draft_probs."""
    del rng, replacement
    tokens, parents, frontier = [root], [-1], [0]
    for width in widths:
        nxt = []
        for node in frontier:
            for tok in torch.topk(Q_TABLE[tokens[node]], width).indices.tolist():
                tokens.append(tok)
                parents.append(node)
                nxt.append(len(tokens) - 1)
        frontier = nxt
    return DraftTree.from_lists(tokens, parents)


def _simulate(make_tree, widths: list[int], replacement: bool, seed: int, num_trials: int = NUM_TRIALS,
              **thresholds) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the first emitted token [V] and of the first two emitted tokens [V, V]."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    first = torch.zeros(V, dtype=torch.int64)
    joint = torch.zeros(V, V, dtype=torch.int64)
    for _ in range(num_trials):
        out: list[int] = []
        while len(out) < 2:
            tree = make_tree(rng, out[-1] if out else ROOT, widths, replacement)
            res = sample_accept(tree, P_TABLE[tree.draft_tokens], gen, **thresholds)
            out += emitted_tokens(tree, res)
        first[out[0]] += 1
        joint[out[0], out[1]] += 1
    return first, joint


def _chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    counts, probs = counts.flatten().double(), probs.flatten().double()
    expected = probs * counts.sum()
    assert float(expected.min()) >= 5.0, "chi-square needs >= 5 expected counts per cell"
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor(counts.numel() - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))  # chi2 survival function


EXPECTED_FIRST = P_TABLE[ROOT]
EXPECTED_JOINT = P_TABLE[ROOT][:, None] * P_TABLE


def _pvalues(first: torch.Tensor, joint: torch.Tensor) -> tuple[float, float]:
    return _chi_square_pvalue(first, EXPECTED_FIRST), _chi_square_pvalue(joint, EXPECTED_JOINT)


def test_chi_square_helper_detects_bias():
    probs = torch.full((V,), 1.0 / V, dtype=torch.float64)
    fair = torch.full((V,), 1000)
    biased = fair.clone()
    biased[0] += 200
    biased[1] -= 200
    assert _chi_square_pvalue(fair, probs) > 0.99
    assert _chi_square_pvalue(biased, probs) < 1e-6


CASES = {
    # (a) chain of 3 tokens sampled from q
    "chain_sampled": (_sampled_tree, [1, 1, 1], False),
    # (b) tree with 3 then 2 sampled siblings per node, without / with replacement
    "tree_without_replacement": (_sampled_tree, [3, 2], False),
    "tree_with_replacement": (_sampled_tree, [3, 2], True),
    # (c) deterministic top-k tree (point-mass rule)
    "tree_deterministic": (_top_tree, [2, 2], False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sample_accept_is_lossless(case):
    make_tree, widths, replacement = CASES[case]
    first, joint = _simulate(make_tree, widths, replacement, seed=7)
    p_first, p_joint = _pvalues(first, joint)
    assert p_first > P_OK, f"{case}: first-token distribution differs from target (p={p_first:.2e})"
    assert p_joint > P_OK, f"{case}: joint of two tokens differs from target (p={p_joint:.2e})"


@pytest.mark.parametrize("case,thresholds", [
    ("chain_sampled", {"threshold_acc": 0.5}),
    ("tree_without_replacement", {"threshold_acc": 0.5}),
    ("tree_deterministic", {"threshold_single": 0.3}),
    ("tree_deterministic", {"threshold_acc": 0.5}),
])
def test_lossy_rule_is_detected(case, thresholds):
    """Sanity: the same harness flags relaxed (lossy) acceptance."""
    make_tree, widths, replacement = CASES[case]
    first, joint = _simulate(make_tree, widths, replacement, seed=11, num_trials=NUM_SANITY_TRIALS,
                             **thresholds)
    p_first, p_joint = _pvalues(first, joint)
    assert min(p_first, p_joint) < P_BIASED, (case, thresholds, p_first, p_joint)


def test_mismatched_replacement_scheme_is_detected():
    """Sanity: verifying with-replacement draws as if drawn without replacement is biased."""
    def mislabeled(rng, root, widths, replacement):
        tree = _sampled_tree(rng, root, widths, True)
        return DraftTree(tree.draft_tokens, tree.parents, tree.draft_probs, False)

    first, joint = _simulate(mislabeled, [3, 2], True, seed=13, num_trials=NUM_SANITY_TRIALS)
    assert min(_pvalues(first, joint)) < P_BIASED


def test_thresholds_raise_acceptance():
    gen_rng = random.Random(3)
    tree = _sampled_tree(gen_rng, ROOT, [1, 1, 1], False)
    probs = P_TABLE[tree.draft_tokens]
    lens = {}
    for thr in (1.0, 0.3):
        gen = torch.Generator().manual_seed(5)
        lens[thr] = sum(sample_accept(tree, probs, gen, threshold_acc=thr).accept_len for _ in range(300))
    assert lens[0.3] > lens[1.0]
    assert isinstance(sample_accept(tree, probs), AcceptResult)
