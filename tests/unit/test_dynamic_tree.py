"""EAGLE-2 style dynamic trees on hand-made draft probabilities."""
from __future__ import annotations

import math

import torch

from specserve.speculative import dynamic_tree as dt
from specserve.speculative.tree import DraftTree, tree_mask

V = 6


def _logprobs(*rows: dict[int, float]) -> torch.Tensor:
    """One row per dict {token: prob}; the rest of the mass spread evenly."""
    out = []
    for row in rows:
        rest = (1.0 - sum(row.values())) / (V - len(row))
        out.append([math.log(row.get(t, rest)) for t in range(V)])
    return torch.tensor(out)


def test_first_step_takes_topk_of_root():
    pool, frontier = dt.first_step(_logprobs({3: 0.5, 1: 0.3}), topk=2)
    assert pool.tokens.tolist() == [[3, 1]]
    assert pool.parents.tolist() == [[-1, -1]]
    assert frontier.pool_index.tolist() == [[0, 1]]
    assert torch.allclose(pool.scores.exp(), torch.tensor([[0.5, 0.3]]))


def test_expand_keeps_best_cumulative_and_grows_pool():
    pool, frontier = dt.first_step(_logprobs({3: 0.5, 1: 0.3}), topk=2)
    # after 3: 4 (0.9), 5 (0.05); after 1: 2 (0.6), 0 (0.3)
    child = _logprobs({4: 0.9, 5: 0.05}, {2: 0.6, 0: 0.3}).view(1, 2, V)
    pool, frontier = dt.expand_step(pool, frontier, child, topk=2)
    # candidates: 3-4 .45, 3-5 .025 (or a 0.0125 rest token), 1-2 .18, 1-0 .09
    assert pool.size == 6
    assert pool.tokens[0, 2:].tolist()[0] == 4 and pool.tokens[0, 4:].tolist() == [2, 0]
    assert frontier.tokens.tolist() == [[4, 2]]
    assert frontier.parent_slot.tolist() == [[0, 1]]
    assert frontier.pool_index.tolist() == [[2, 4]]
    assert torch.allclose(frontier.scores.exp(), torch.tensor([[0.45, 0.18]]))


def test_rerank_picks_best_nodes_parents_first():
    pool, frontier = dt.first_step(_logprobs({3: 0.5, 1: 0.3}), topk=2)
    child = _logprobs({4: 0.9, 5: 0.05}, {2: 0.6, 0: 0.3}).view(1, 2, V)
    pool, _ = dt.expand_step(pool, frontier, child, topk=2)
    tokens, parents = dt.rerank(pool, torch.tensor([7]), num_nodes=5)
    # best 4 of the pool: 3 (.5), 4 (.45), 1 (.3), 2 (.18); pool order: 3, 1, 4, 2
    assert tokens.tolist() == [[7, 3, 1, 4, 2]]
    assert parents.tolist() == [[-1, 0, 0, 1, 2]]
    DraftTree(tokens[0], parents[0])          # valid tree
    assert tree_mask(parents[0])[3].tolist() == [True, True, False, True, False]


def test_rerank_drops_child_before_parent_on_ties():
    # equal probabilities everywhere: ties must not select a child without its parent
    flat = torch.full((1, V), -math.log(V))
    pool, frontier = dt.first_step(flat, topk=3)
    pool, frontier = dt.expand_step(pool, frontier, torch.full((1, 3, V), 0.0), topk=3)  # p = 1 children
    for n in range(2, 1 + pool.size + 1):
        tokens, parents = dt.rerank(pool, torch.tensor([0]), num_nodes=n)
        DraftTree(tokens[0], parents[0])       # raises unless parents come first and are kept


def test_topk_one_is_a_chain():
    pool, frontier = dt.first_step(_logprobs({2: 0.7}), topk=1)
    for best in (4, 1):
        pool, frontier = dt.expand_step(pool, frontier, _logprobs({best: 0.8}).view(1, 1, V), topk=1)
    tokens, parents = dt.rerank(pool, torch.tensor([5]), num_nodes=4)
    assert tokens.tolist() == [[5, 2, 4, 1]] and parents.tolist() == [[-1, 0, 1, 2]]
    assert DraftTree(tokens[0], parents[0]).is_chain


def test_batched_requests_are_independent():
    root = torch.cat([_logprobs({1: 0.6, 2: 0.3}), _logprobs({5: 0.5, 4: 0.4})])
    pool, frontier = dt.first_step(root, topk=2)
    child = torch.stack([_logprobs({3: 0.9}, {0: 0.9}), _logprobs({2: 0.5}, {1: 0.99})])  # [2, 2, V]
    pool, frontier = dt.expand_step(pool, frontier, child, topk=2)
    tokens, parents = dt.rerank(pool, torch.tensor([9, 8]), num_nodes=4)
    # request 0: 1 (.6), 3 (.54), 2 (.3) ; request 1: 5 (.5), 4 (.4), 4-1 (.396)
    assert tokens.tolist() == [[9, 1, 2, 3], [8, 5, 4, 1]]
    assert parents.tolist() == [[-1, 0, 0, 1], [-1, 0, 0, 2]]


def test_rerank_with_fewer_pool_nodes_than_requested():
    pool, _ = dt.first_step(_logprobs({1: 0.6, 2: 0.3}), topk=2)
    tokens, parents = dt.rerank(pool, torch.tensor([0]), num_nodes=8)
    assert tokens.shape == (1, 3) and parents.tolist() == [[-1, 0, 0]]


def test_token_map_turns_draft_vocab_ids_into_target_ids():
    """A draft with its own vocabulary (EAGLE3 d2t, FR-Spec): trees hold target ids, scores unchanged."""
    token_map = torch.tensor([40, 41, 42, 43, 44, 45])
    root = _logprobs({3: 0.5, 1: 0.3})
    pool, frontier = dt.first_step(root, topk=2, token_map=token_map)
    assert pool.tokens.tolist() == [[43, 41]] and frontier.tokens.tolist() == [[43, 41]]
    children = torch.stack([_logprobs({2: 0.9}), _logprobs({5: 0.6, 0: 0.3})], dim=1)   # [1, K, V]
    pool, frontier = dt.expand_step(pool, frontier, children, topk=2, token_map=token_map)
    plain_pool, plain_frontier = dt.expand_step(*dt.first_step(root, topk=2), children, topk=2)
    assert pool.tokens.tolist() == [[token_map[t].item() for t in plain_pool.tokens[0]]]
    assert torch.equal(pool.scores, plain_pool.scores) and torch.equal(pool.parents, plain_pool.parents)
    assert frontier.tokens.tolist() == [[token_map[t].item() for t in plain_frontier.tokens[0]]]
