"""Training-time test == inference: the unrolled training forward of a draft head (TTT
backend, whole packed batch at once) gives, at every step j and index i, exactly what the
same head computes at inference when it prefills entries 0..i into a paged KV cache and
then drafts a chain of j steps after position i (TorchSDPABackend, build_metadata)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from specserve.models.attention import KVCache, TorchSDPABackend, build_metadata
from specserve.train.dataset import Batch, step_view
from specserve.train.train_head import build_head, target_parts_from
from specserve.train.ttt import TTTBackend, TTTCache, TTTMeta
from tests.model.tiny_llama import random_weights, tiny_config

NUM_TARGET_LAYERS = 8
AUX = (2, 4, 5)
NUM_STEPS = 3


def target_parts():
    cfg = tiny_config(NUM_TARGET_LAYERS)
    return target_parts_from(cfg, random_weights(cfg, seed=0).items())


def randomized(head, seed: int):
    """Weights with spread (the training init is nearly zero, which would hide bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if not p.requires_grad:
                continue
            if p.dim() == 1 and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return head


def packed_batch(feature_size: int, hidden: int, seed: int = 1):
    """Row 0: records of 5 and 7 tokens; row 1: one record of 10 tokens and 2 of padding."""
    g = torch.Generator().manual_seed(seed)
    seg_lens = [[5, 7], [10]]
    bsz, seq_len = 2, 12
    tokens = torch.randint(0, 32, (bsz, seq_len), generator=g)
    segment = torch.full((bsz, seq_len), -1)
    positions = torch.zeros(bsz, seq_len, dtype=torch.int64)
    for b, lens in enumerate(seg_lens):
        col = 0
        for s, n in enumerate(lens):
            segment[b, col:col + n] = s
            positions[b, col:col + n] = torch.arange(n)
            col += n
    batch = Batch(tokens=tokens, positions=positions, segment=segment,
                  is_answer=torch.ones(bsz, seq_len, dtype=torch.bool),
                  feature=torch.randn(bsz, seq_len, feature_size, generator=g), final=None,
                  topk_ids=torch.zeros(bsz, seq_len, 4, dtype=torch.int64), topk_logp=torch.zeros(bsz, seq_len, 4))
    return batch, seg_lens


@torch.no_grad()
def ttt_outputs(head, batch: Batch, num_steps: int) -> list[torch.Tensor]:
    head.backend = TTTBackend()
    bsz, seq_len = batch.tokens.shape
    meta, cache = TTTMeta.from_segments(batch.segment), TTTCache()
    hidden = batch.feature.reshape(bsz * seq_len, -1)
    outs = []
    for j in range(num_steps):
        ids, _, positions = step_view(batch, j)
        hidden = head(ids.reshape(-1), hidden, positions.reshape(-1), cache, meta)
        outs.append(hidden.view(bsz, seq_len, -1))
    return outs


@torch.no_grad()
def inference_chain(head, tokens: torch.Tensor, features: torch.Tensor, i: int, num_steps: int):
    """Prefill draft entries 0..i (entry k: token k+1, feature k, position k) into a paged cache,
    then draft ``num_steps - 1`` chain steps after position i feeding back the head's output."""
    head.backend = TorchSDPABackend()
    cfg = head.config
    cache = KVCache(cfg.num_hidden_layers, 64, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
    slots = torch.randperm(60)[:i + num_steps]        # any slots: the cache is paged
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    n = i + 1
    meta = build_metadata([0], [n], slots[:n].unsqueeze(0), slots[:n], num_kv_groups=groups)
    out = head(tokens[1:n + 1], features[:n], torch.arange(n), cache, meta)
    outs = [out[-1]]
    hidden = out[-1:]
    for j in range(1, num_steps):
        length = n + j
        meta = build_metadata([length - 1], [1], slots[:length].unsqueeze(0), slots[length - 1:length],
                              num_kv_groups=groups)
        hidden = head(tokens[i + 1 + j:i + 2 + j], hidden, torch.tensor([i + j]), cache, meta)
        outs.append(hidden[0])
    return outs, out


@pytest.mark.parametrize("algorithm", ["EAGLE3", "EAGLE"])
def test_ttt_steps_equal_inference_chains(algorithm):
    target = target_parts()
    head = build_head(algorithm, target, list(range(0, 32, 2)), aux_layer_ids=AUX, max_position=64)
    head = randomized(head, seed=3).eval()
    h = target.config.hidden_size
    batch, seg_lens = packed_batch(3 * h if algorithm == "EAGLE3" else h, h)
    train_outs = ttt_outputs(head, batch, NUM_STEPS)
    checked = 0
    for b, lens in enumerate(seg_lens):
        col = 0
        for n in lens:
            tokens, features = batch.tokens[b, col:col + n], batch.feature[b, col:col + n]
            for i in range(n - 1):
                steps = min(NUM_STEPS, n - 1 - i)        # step j needs token i + 1 + j
                chain, prefill = inference_chain(head, tokens, features, i, steps)
                torch.testing.assert_close(prefill, train_outs[0][b, col:col + i + 1], atol=2e-5, rtol=1e-5)
                for j in range(steps):
                    torch.testing.assert_close(chain[j], train_outs[j][b, col + i], atol=2e-5, rtol=1e-5,
                                               msg=lambda m: f"row {b} index {i} step {j}: {m}")
                    checked += 1
            col += n
    assert checked > 40


def test_ttt_gradients_reach_earlier_steps():
    target = target_parts()
    head = randomized(build_head("EAGLE3", target, list(range(16)), aux_layer_ids=AUX, max_position=64), seed=4)
    batch, _ = packed_batch(3 * target.config.hidden_size, target.config.hidden_size)
    batch = dataclasses.replace(batch, feature=batch.feature.requires_grad_(True))
    head.backend = TTTBackend()
    bsz, seq_len = batch.tokens.shape
    meta, cache = TTTMeta.from_segments(batch.segment), TTTCache()
    hidden = batch.feature.reshape(bsz * seq_len, -1)
    for j in range(2):
        ids, _, positions = step_view(batch, j)
        hidden = head(ids.reshape(-1), hidden, positions.reshape(-1), cache, meta)
    hidden[3].sum().backward()            # step-1 output at index 3 of row 0 (record of 5 tokens)
    grad = batch.feature.grad.abs().sum(-1)[0]
    assert (grad[:4] > 0).all()           # its own entry and the step-0 keys it attends to
    assert (grad[4:] == 0).all()          # nothing from later indices or the next record
