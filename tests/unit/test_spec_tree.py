"""DraftTree invariants and structure helpers, checked against brute force."""
from __future__ import annotations

import random

import pytest
import torch

from specserve.speculative.tree import (DraftTree, chain, children_lists, depths, is_leaf, pack_trees, positions,
                                 retrieve_indices, root_only, subtree, tree_mask, truncate_tree)

#        0
#      /   \
#     1     2
#    / \    |
#   3   4   5
#           |
#           6
EXAMPLE = DraftTree.from_lists([50, 51, 52, 53, 54, 55, 56], [-1, 0, 0, 1, 1, 2, 5])


def _random_parents(rng: random.Random, n: int) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def _ancestors(parents: list[int], i: int) -> list[int]:
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]  # root first


def test_validation_rejects_bad_trees():
    with pytest.raises(ValueError):
        DraftTree.from_lists([1, 2], [0, 0])  # root must have parent -1
    with pytest.raises(ValueError):
        DraftTree.from_lists([1, 2, 3], [-1, 2, 0])  # parent after child
    with pytest.raises(ValueError):
        DraftTree.from_lists([1, 2], [-1])
    with pytest.raises(ValueError):
        DraftTree.from_lists([], [])
    with pytest.raises(ValueError):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 0]), draft_probs=torch.ones(3, 4))


def test_example_structure():
    par = EXAMPLE.parents
    assert depths(par).tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert positions(par, 10).tolist() == [10, 11, 11, 12, 12, 12, 13]
    assert children_lists(par) == [[1, 2], [3, 4], [5], [], [], [6], []]
    assert is_leaf(par).tolist() == [False, False, False, True, True, False, True]
    assert retrieve_indices(par).tolist() == [[0, 1, 3, -1], [0, 1, 4, -1], [0, 2, 5, 6]]
    mask = tree_mask(par)
    assert mask[6].tolist() == [True, False, True, False, False, True, True]
    assert mask[3].tolist() == [True, True, False, True, False, False, False]
    assert EXAMPLE.root_token == 50 and not EXAMPLE.is_chain and EXAMPLE.num_nodes == 7


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 64])
def test_structure_matches_brute_force(n):
    rng = random.Random(n)
    for _ in range(5):
        par = _random_parents(rng, n)
        par_t = torch.tensor(par)
        mask = tree_mask(par_t)
        for i in range(n):
            anc = set(_ancestors(par, i))
            assert [j for j in range(n) if mask[i, j]] == sorted(anc)
        assert depths(par_t).tolist() == [len(_ancestors(par, i)) - 1 for i in range(n)]
        assert DraftTree(torch.arange(n), par_t).depth == max(len(_ancestors(par, i)) - 1 for i in range(n))
        leaves = [i for i in range(n) if i not in par]
        max_len = max(len(_ancestors(par, i)) for i in leaves)
        expected = [_ancestors(par, i) + [-1] * (max_len - len(_ancestors(par, i))) for i in leaves]
        assert retrieve_indices(par_t).tolist() == expected


def test_chain_is_the_trivial_case():
    tree = chain([4, 5, 6, 7])
    assert tree.is_chain and tree.parents.tolist() == [-1, 0, 1, 2] and tree.depth == 3
    assert tree_mask(tree.parents).equal(torch.ones(4, 4, dtype=torch.bool).tril())
    assert positions(tree.parents, 3).tolist() == [3, 4, 5, 6]
    assert retrieve_indices(tree.parents).tolist() == [[0, 1, 2, 3]]
    assert children_lists(tree.parents) == [[1], [2], [3], []]


def test_root_only_tree_is_plain_decoding():
    tree = root_only(9)
    assert tree.is_root_only and tree.is_chain and tree.root_token == 9 and tree.depth == 0
    assert tree_mask(tree.parents).tolist() == [[True]]
    assert depths(tree.parents).tolist() == [0]
    assert positions(tree.parents, 5).tolist() == [5]
    assert retrieve_indices(tree.parents).tolist() == [[0]]
    assert children_lists(tree.parents) == [[]]


def test_truncate_and_subtree():
    probs = torch.rand(7, 3)
    tree = DraftTree(EXAMPLE.draft_tokens, EXAMPLE.parents, probs)
    cut = truncate_tree(tree, 4)
    assert cut.draft_tokens.tolist() == [50, 51, 52, 53] and cut.parents.tolist() == [-1, 0, 0, 1]
    assert cut.draft_probs.equal(probs[:4])
    assert truncate_tree(tree, 100) is tree
    assert truncate_tree(tree, 1).is_root_only
    sub = subtree(tree, [0, 2, 5, 6])
    assert sub.draft_tokens.tolist() == [50, 52, 55, 56] and sub.parents.tolist() == [-1, 0, 1, 2]
    assert sub.draft_probs.equal(probs[[0, 2, 5, 6]])
    with pytest.raises(ValueError):
        subtree(tree, [0, 5])  # 5's parent 2 missing
    with pytest.raises(ValueError):
        subtree(tree, [1, 3])  # no root
    with pytest.raises(ValueError):
        truncate_tree(tree, 0)


def test_pack_trees():
    trees = [EXAMPLE, root_only(3), chain([7, 8])]
    packed = pack_trees(trees)
    assert packed.batch_size == 3 and packed.total_nodes == 10
    assert packed.offsets.tolist() == [0, 7, 8, 10]
    assert packed.draft_tokens.tolist() == [50, 51, 52, 53, 54, 55, 56, 3, 7, 8]
    assert packed.parents.tolist() == [-1, 0, 0, 1, 1, 2, 5, -1, -1, 8]
    assert packed.depths.tolist() == [0, 1, 1, 2, 2, 2, 3, 0, 0, 1]
    assert packed.positions([100, 20, 30]).tolist() == [100, 101, 101, 102, 102, 102, 103, 20, 30, 31]
    assert packed.request_index().tolist() == [0] * 7 + [1, 2, 2]
    block = packed.block_mask()
    assert block.shape == (10, 10)
    assert block[:7, :7].equal(tree_mask(EXAMPLE.parents)) and not block[7:, :7].any()
    assert block[9].tolist() == [False] * 8 + [True, True]
    assert [m.shape[0] for m in packed.tree_masks] == [7, 1, 2]
    assert [x.tolist() for x in packed.split(torch.arange(10))] == [list(range(7)), [7], [8, 9]]
