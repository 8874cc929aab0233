"""The target side of a speculative step: one forward over every request's tree,
verification with the engine's sampler semantics, KV compaction, results.

Verification uses ``runner/sampler.py`` so penalties and the greedy rule are
exactly those of plain decoding:

* greedy requests: the target token after each node is ``sample`` of the node's
  penalized logits (argmax; penalties count the node's draft ancestors as
  generated), then ``greedy_accept``;
* sampled requests with a root-only tree (speculation off, or no draft): plain
  ``sample`` (same generator use as plain decoding);
* other sampled requests: ``processed_probs`` per node, then ``sample_accept``
  with the request's own (CPU) generator and the accept thresholds.

KV compaction keeps the accepted path's KV in token order: with page_size 1 the
accepted slots are appended in path order (row slots rewritten when the path is
not a prefix) and the rest decref'd; with larger pages the accepted rows of
every layer are copied into the first slots, then the tail is truncated.
"""
from __future__ import annotations

import torch
from torch import Tensor

from specserve.core import Request, TokenResult
from specserve.runner.model_runner import ExtendSpec
from specserve.runner.sampler import SamplingBatch, compute_logprobs, processed_probs, sample_requests
from specserve.speculative.params import SpecParams
from specserve.speculative.state import spec_state
from specserve.speculative.tree import DraftTree, depths, tree_mask
from specserve.speculative.verify import AcceptResult, greedy_accept, sample_accept


# ---- forward ----------------------------------------------------------------------

def verify_forward(engine, items: list, trees: list[DraftTree]) -> Tensor:
    """Logits [total_nodes, V], rows in item order, nodes in tree order."""
    specs = [_verify_spec(engine, item, tree) for item, tree in zip(items, trees)]
    return engine.runner.forward(specs)


def _verify_spec(engine, item, tree: DraftTree) -> ExtendSpec:
    req, n = item.req, tree.num_nodes
    prefix = req.num_computed
    positions = mask = None
    if not tree.is_chain:
        positions = (depths(tree.parents) + prefix).tolist()
        mask = tree_mask(tree.parents)
    return ExtendSpec(row=engine.scheduler.row_of[req.rid], prefix_len=prefix,
                      token_ids=tree.token_list(), new_slots=item.new_slots[:n],
                      positions=positions, tree_mask=mask, num_logits=n)


# ---- verification -----------------------------------------------------------------

def ban_stop_tokens_before_min_new_tokens(items: list, trees: list[DraftTree], logits: Tensor) -> Tensor:
    """min_new_tokens (SGLang semantics, as plain decoding): a node whose next token would be
    output number < min_new_tokens cannot emit EOS or stop_token_ids. ``logits`` itself when
    no row needs it, else a masked copy."""
    rows: list[int] = []
    cols: list[int] = []
    start = 0
    for item, tree in zip(items, trees):
        req = item.req
        num_out, min_new = len(req.output_ids), req.sampling.min_new_tokens
        if num_out < min_new:
            banned = list(req.eos_token_ids) + list(req.sampling.stop_token_ids)
            for node, depth in enumerate(depths(tree.parents).tolist()):
                if num_out + depth < min_new:
                    rows += [start + node] * len(banned)
                    cols += banned
        start += tree.num_nodes
    if not rows:
        return logits
    index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    return logits.index_put(index, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))


def accept_trees(engine, items: list, trees: list[DraftTree], logits: Tensor,
                 params: SpecParams) -> list[AcceptResult]:
    offsets = _offsets(trees)
    groups: dict[str, list[int]] = {"greedy": [], "root": [], "tree": []}
    for i, item in enumerate(items):
        kind = ("greedy" if item.req.sampling.is_greedy else
                "root" if trees[i].is_root_only else "tree")
        groups[kind].append(i)
    results: list[AcceptResult | None] = [None] * len(items)
    vocab = engine.model_config.vocab_size
    if groups["greedy"]:
        idx = groups["greedy"]
        rows, reqs, counts, drafts = _group(items, trees, idx, logits, offsets)
        targets = sample_requests(rows, vocab, reqs, counts, drafts).tolist()
        start = 0
        for i, count in zip(idx, counts):
            results[i] = greedy_accept(trees[i], targets[start:start + count])
            start += count
    if groups["root"]:
        idx = groups["root"]
        rows, reqs, counts, drafts = _group(items, trees, idx, logits, offsets)
        for i, token in zip(idx, sample_requests(rows, vocab, reqs, counts, drafts).tolist()):
            results[i] = AcceptResult([0], int(token))
    if groups["tree"]:
        idx = groups["tree"]
        rows, reqs, counts, drafts = _group(items, trees, idx, logits, offsets)
        batch = SamplingBatch.from_requests(reqs, logits.device, vocab, counts, drafts)
        probs = torch.split(processed_probs(rows, batch).cpu(), counts)
        for i, p in zip(idx, probs):
            results[i] = sample_accept(trees[i], p, _cpu_generator(items[i].req),
                                       params.threshold_single, params.threshold_acc)
    return results


def _offsets(trees: list[DraftTree]) -> list[int]:
    offsets = [0]
    for tree in trees:
        offsets.append(offsets[-1] + tree.num_nodes)
    return offsets


def _group(items, trees, idx: list[int], logits: Tensor, offsets: list[int]):
    """For the items ``idx``: their logit rows [r, V], and the requests, rows per request and
    draft ancestors per row (None without penalties) that ``SamplingBatch.from_requests`` takes."""
    reqs = [items[i].req for i in idx]
    counts = [trees[i].num_nodes for i in idx]
    if len(idx) == len(items):
        rows = logits
    else:
        row_ids = [r for i in idx for r in range(offsets[i], offsets[i + 1])]
        rows = logits.index_select(0, torch.tensor(row_ids, device=logits.device))
    drafts = None
    if any(req.sampling.has_penalties for req in reqs):
        drafts = [path for i in idx for path in _ancestor_tokens(trees[i])]
    return rows, reqs, counts, drafts


def _ancestor_tokens(tree: DraftTree) -> list[list[int]]:
    """Per node: draft tokens from node 1 down to the node itself (the root is already output)."""
    tokens, parents = tree.draft_tokens.tolist(), tree.parents.tolist()
    paths: list[list[int]] = [[]]
    for i in range(1, len(tokens)):
        paths.append(paths[parents[i]] + [tokens[i]])
    return paths


def _cpu_generator(req: Request) -> torch.Generator | None:
    """The request's generator for CPU coins (a CPU stream seeded from it when it lives on a GPU)."""
    gen = req.generator
    if gen is None or gen.device.type == "cpu":
        return gen
    state = spec_state(req)
    if state.cpu_generator is None:
        seed = int(torch.randint(0, 2**62, (1,), generator=gen, device=gen.device))
        state.cpu_generator = torch.Generator().manual_seed(seed)
    return state.cpu_generator


# ---- KV compaction ----------------------------------------------------------------

def compact_kv(engine, items: list, trees: list[DraftTree], results: list[AcceptResult]) -> None:
    if engine.pool.page_size == 1:
        for item, res in zip(items, results):
            _keep_path_slots(engine, item, res.accepted_indices)
        return
    _copy_path_rows(engine, items, results)
    for item, res in zip(items, results):
        kept = len(res.accepted_indices)
        engine.scheduler.free_uncommitted(item.new_slots, kept, item.req)
        engine.scheduler.commit(item.req, item.new_slots[:kept])


def _keep_path_slots(engine, item, path: list[int]) -> None:
    """page_size 1: the request keeps the path's slots in order; the others are freed."""
    req, slots = item.req, item.new_slots
    kept = [slots[i] for i in path]
    on_path = set(path)
    engine.pool.decref([s for i, s in enumerate(slots) if i not in on_path])
    prefix = req.num_computed
    engine.scheduler.commit(req, kept)
    if path[-1] != len(path) - 1:         # not the prefix 0..a: the row holds node order
        engine.runner.set_row_slots(engine.scheduler.row_of[req.rid], prefix, kept)


def _copy_path_rows(engine, items: list, results: list[AcceptResult]) -> None:
    """page_size > 1: K/V of accepted node i (path position j) -> slot of node j, all layers."""
    src, dst = [], []
    for item, res in zip(items, results):
        for j, node in enumerate(res.accepted_indices):
            if node != j:
                src.append(item.new_slots[node])
                dst.append(item.new_slots[j])
    if not src:
        return
    cache = engine.runner.kv_cache
    device = cache.k.device
    src_t, dst_t = torch.tensor(src, device=device), torch.tensor(dst, device=device)
    cache.k[:, dst_t] = cache.k[:, src_t]     # the right side is gathered first
    cache.v[:, dst_t] = cache.v[:, src_t]


# ---- results ----------------------------------------------------------------------

def token_results(engine, items: list, trees: list[DraftTree], results: list[AcceptResult],
                  emitted: list[list[int]], logits: Tensor) -> dict[str, TokenResult]:
    offsets = _offsets(trees)
    out = {}
    for i, item in enumerate(items):
        req = item.req
        result = TokenResult(emitted[i])
        if req.sampling.return_logprob:
            rows = [offsets[i] + node for node in results[i].accepted_indices]
            _attach_logprobs(req, result, logits, rows)
        out[req.rid] = result
    return out


def _attach_logprobs(req: Request, result: TokenResult, logits: Tensor, rows: list[int]) -> None:
    """Raw logprobs of each emitted token under the node that produced it."""
    top_n = req.sampling.top_logprobs_num
    picked = logits.index_select(0, torch.tensor(rows, device=logits.device))
    chosen, top_ids, top_lps = compute_logprobs(picked, torch.tensor(result.token_ids, device=logits.device), top_n)
    result.logprobs = chosen.tolist()
    result.top_logprobs = [list(zip(ids, lps)) for ids, lps in zip(top_ids.tolist(), top_lps.tolist())]
