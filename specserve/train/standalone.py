"""STANDALONE draft training: a small Llama with the target's vocabulary, distilled from
the target.

    python -m specserve.train.standalone --data answers.jsonl --out DIR [--capture CAPTURE_DIR]
        [--max-minutes 25] [--resume]

Model: a standard ``LlamaForCausalLM`` with a small hidden size H (192), tied embeddings and
a few layers, so its per-token cost (dominated by the 49152 x H head) is a few percent of
the target's.

Data. ``--data``: the JSONL of ``specserve.train.regenerate`` (prompts and the target's own
greedy answers): next-token cross-entropy on the answer tokens already distils the target's
greedy choices. ``--capture``: a capture folder of ``specserve.train.capture`` (the target run
over those records, and over reference answers): per token the target's top-K next-token
log-probs (soft labels) and its final hidden state, which the draft regresses on (below).

Init. The tied embedding (= head) starts as a rank-H factorization of the target's head:
with the target's final states (from the capture) the one that best keeps the target's
logits on them (``logit_preserving_maps``; the draft's final state is then trained towards
the matching projection of the target's, ``--state-weight``); without, the top-H principal
directions of the target's embedding. The layers start random.

Training: (soft) cross-entropy on answer positions (prompt positions weigh
``--prompt-weight``), a sampled softmax over the answer vocabulary plus random negatives
(``--num-negatives``; the head is most of the cost), AdamW, linear warmup then cosine decay
over progress = max(steps / max_steps, minutes / max_minutes) (a wall-clock budget ends
fully decayed), gradient clipping, bf16 autocast (AMX on CPU), fixed seed, resumable
checkpoints. Held-out agreement with the target (top-1, top-3, and the tokens per verify a
greedy chain would get under teacher forcing) is the acceptance proxy.

The result is an HF directory (config.json + model.safetensors, bfloat16) for
``--speculative-draft-model-path``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from specserve.config import ModelConfig
from specserve.models.layers import RMSNorm, RotaryEmbedding, apply_rotary

CHECKPOINT_NAME = "checkpoint.pt"
METRICS_NAME = "metrics.json"
CHAIN_DEPTHS = (1, 3, 5)
REFERENCE_INDEX_BASE = 1_000_000    # capture records at or above: reference answers, not the target's


# ---- configuration --------------------------------------------------------------------------

@dataclass
class DraftShape:
    hidden_size: int = 192
    num_layers: int = 3
    intermediate_size: int = 512
    num_heads: int = 3
    num_kv_heads: int = 1
    head_dim: int = 64


@dataclass
class StandaloneTrainArgs:
    data: str | None                            # regenerate JSONL (hard labels); unused with capture
    out: str                                    # exported HF draft directory
    capture: str | None = None                  # capture folder: soft labels + target final states
    work_dir: str | None = None                 # checkpoints + metrics (default: <cache>/train/<out name>)
    target: str | None = None                   # target checkpoint (default: the default model)
    shape: DraftShape = field(default_factory=DraftShape)
    max_steps: int = 100_000
    max_minutes: float | None = None
    max_records: int | None = None              # the first N records (a fixed snapshot of a growing file)
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 30
    weight_decay: float = 0.01
    norm_lr_mult: float = 10.0                  # norm scales set the logit scale: they move faster
    head_init_scale: float = 0.05               # the final norm starts at this fraction (see init_head)
    clip: float = 1.0
    tokens_per_batch: int = 2048                # padded tokens per step
    max_len: int = 512                          # prompt + answer, cut from the prompt's start
    prompt_weight: float = 0.0
    num_negatives: int = 4096                   # sampled softmax: answer vocabulary + N drawn; -1: full
    soft_top_k: int = 8                         # capture: soft labels over the target's top K
    state_weight: float = 0.0                   # capture: weight of the final-state regression (0: off)
    init_states: int = 16384                    # capture: target states fitting the head factorization
    heldout_frac: float = 0.03
    max_eval_examples: int = 64                 # per periodic evaluation (the final one uses all)
    eval_every: int = 200
    checkpoint_minutes: float = 5.0
    seed: int = 0
    device: str = "cpu"
    threads: int | None = None
    amp: str = "bf16"                           # bf16 | none
    resume: bool = False
    quiet: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.shape, dict):
            self.shape = DraftShape(**self.shape)
        if self.amp not in ("bf16", "none"):
            raise ValueError(f"--amp must be bf16 or none, not {self.amp!r}")
        if self.shape.num_heads % self.shape.num_kv_heads:
            raise ValueError("draft num_heads must be a multiple of num_kv_heads")
        if not self.data and not self.capture:
            raise ValueError("give --data (regenerate JSONL) or --capture (capture folder)")

    def resolved_work_dir(self) -> Path:
        if self.work_dir:
            return Path(self.work_dir)
        from specserve.loading.default_model import cache_dir

        return cache_dir() / "train" / Path(self.out).name


def draft_config(target: ModelConfig, shape: DraftShape) -> ModelConfig:
    """The draft's config: the target's vocabulary, special tokens, rope and context length."""
    return dataclasses.replace(
        target, architecture="LlamaForCausalLM", hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        tie_word_embeddings=True, attention_bias=False, mlp_bias=False, qk_norm=False,
        torch_dtype="bfloat16", extra={"model_type": "llama"})


# ---- model (HF parameter names; batched, causal) --------------------------------------------

class _Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj, self.k_proj = nn.Linear(h, q, bias=False), nn.Linear(h, kv, bias=False)
        self.v_proj, self.o_proj = nn.Linear(h, kv, bias=False), nn.Linear(q, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape                                                   # x: [B, T, H]
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)          # [B, T, heads, hd]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class _MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, inter = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(h, inter, bias=False), nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = _MLP(cfg)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class _Body(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DraftLM(nn.Module):
    """Training-side Llama with tied embeddings; its ``state_dict`` has the HF names that
    specserve's loader (and transformers) read. ``forward`` returns the final normed hidden
    states [B, T, H]; ``logits`` applies the tied head to selected rows."""

    def __init__(self, cfg: ModelConfig, max_len: int = 1024) -> None:
        super().__init__()
        if not cfg.tie_word_embeddings:
            raise ValueError("the draft ties its embeddings")
        self.config = cfg
        self.model = _Body(cfg)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_len, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)                              # [B, T, H]
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        cos, sin = self.rotary.cos_sin(positions, torch.float32)            # [T, hd]
        for layer in self.model.layers:
            h = layer(h, cos, sin)
        return self.model.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.model.embed_tokens.weight)             # [..., V]

    def init_random(self, seed: int, std: float = 0.02) -> None:
        gen = torch.Generator().manual_seed(seed)
        num_layers = len(self.model.layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0)
                    continue
                scale = std / math.sqrt(2 * num_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) \
                    else std
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


# ---- initialization from the target ---------------------------------------------------------

def principal_directions(embedding: torch.Tensor, dim: int) -> torch.Tensor:
    """[H_target, dim]: the top right singular vectors of the (uncentered) embedding."""
    gram = embedding.double().T @ embedding.double()                      # [Ht, Ht]
    _, vectors = torch.linalg.eigh(gram)                                  # ascending eigenvalues
    return vectors[:, -dim:].flip(-1).float().contiguous()


def logit_preserving_maps(embedding: torch.Tensor, states: torch.Tensor, dim: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B), both [H_target, dim], with ``(states @ A) @ (embedding @ B).T`` the best rank-``dim``
    approximation (least squares) of the target's logits ``states @ embedding.T``.

    With C = states' second moment and M = embedding's Gram matrix, the logits are
    (whitened states) K (orthonormal embedding)^T with K = C^1/2 M^1/2; keeping the top ``dim``
    singular triplets of K (U S V^T) gives A = C^-1/2 U S^1/2, B = M^-1/2 V S^1/2."""
    states, embedding = states.double(), embedding.double()
    c_half, c_inv = _sqrt_and_inverse(states.T @ states / len(states))
    m_half, m_inv = _sqrt_and_inverse(embedding.T @ embedding)
    u, s, vh = torch.linalg.svd(c_half @ m_half)
    root = s[:dim].sqrt()
    return (c_inv @ u[:, :dim] * root).float(), (m_inv @ vh[:dim].T * root).float()


def _sqrt_and_inverse(matrix: torch.Tensor, rel_eps: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    values, vectors = torch.linalg.eigh(matrix)
    values = values.clamp(min=rel_eps * float(values.max()))
    return (vectors * values.sqrt()) @ vectors.T, (vectors * values.rsqrt()) @ vectors.T


@torch.no_grad()
def init_head(model: "DraftLM", target_cfg: ModelConfig, target: dict[str, torch.Tensor],
              states: torch.Tensor | None = None, head_scale: float = 1.0) -> torch.Tensor | None:
    """Tied embedding (= head) and final norm from the target. With ``states`` (target final
    states [N, H_target]): embedding = E B from ``logit_preserving_maps``, returns A (the draft's
    final state should approach ``state @ A``). Without: E P, P the embedding's principal
    directions, and the final norm the target's restricted to them; returns None.

    The final norm is scaled by ``head_scale``: before training the draft's last state is
    mostly its input embedding, and at full scale the head would put a huge logit on
    repeating the input token (an initial loss ~90 instead of ~ln V)."""
    body, dim = model.model, model.config.hidden_size
    embedding = target["model.embed_tokens.weight"].float()
    if states is not None:
        state_map, head_map = logit_preserving_maps(embedding, states, dim)
        body.embed_tokens.weight.copy_(embedding @ head_map)
        final_scale = (states.float() @ state_map).pow(2).mean().sqrt().expand(dim)
    else:
        state_map, proj = None, principal_directions(embedding, dim)
        body.embed_tokens.weight.copy_(embedding @ proj)
        # A state x = P x_s has x / rms(x) = sqrt(Ht / H) * P (x_s / rms(x_s)): norms gain that factor.
        gain = math.sqrt(target_cfg.hidden_size / dim)
        final_scale = gain * (proj.pow(2) * target["model.norm.weight"].float()[:, None]).sum(0)
    body.norm.weight.copy_(final_scale * head_scale)
    return state_map


# ---- data -----------------------------------------------------------------------------------

@dataclass
class Example:
    ids: list[int]                  # prompt + answer, cut to max_len from the prompt's start
    answer_start: int               # index in ids of the first answer token
    index: int                      # the record's index (fixes the held-out split)
    capture: object | None = None   # its captured record (specserve.train.dataset.Record)
    cut: int = 0                    # tokens cut from the start


def _example(ids: list[int], prompt_len: int, index: int, max_len: int, capture=None) -> Example:
    cut = max(0, len(ids) - max_len)
    return Example(ids[cut:], max(1, prompt_len - cut), index, capture, cut)


def load_examples(path: str | os.PathLike, max_len: int, max_records: int | None = None
                  ) -> tuple[list[Example], int]:
    """(examples, lines read) of a regenerate JSONL, in file order: the first ``max_records``
    complete lines (a growing file's unfinished last line is left out); empty answers skipped."""
    examples, num_lines = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if (max_records is not None and num_lines >= max_records) or not line.endswith("\n"):
                break
            num_lines += 1
            rec = json.loads(line) if line.strip() else None
            if rec and rec["output_ids"]:
                ids = list(rec["input_ids"]) + list(rec["output_ids"])
                examples.append(_example(ids, len(rec["input_ids"]), int(rec["index"]), max_len))
    return examples, num_lines


def load_capture_examples(folder: str | os.PathLike, max_len: int, max_records: int | None = None):
    """(examples, records, dataset) of a capture folder (its first ``max_records`` records)."""
    from specserve.train.dataset import CaptureDataset

    dataset = CaptureDataset(folder, "final")
    records = dataset.records[:max_records] if max_records is not None else dataset.records
    examples = []
    for rec in records:
        if rec.length > rec.prompt_len:
            ids = dataset.read(rec, rec.length, ("tokens",))["tokens"].long().tolist()
            examples.append(_example(ids, rec.prompt_len, rec.index, max_len, rec))
    return examples, len(records), dataset


def is_heldout(index: int, frac: float) -> bool:
    """A fixed split by record index (Knuth's multiplicative hash): stable as the data grows."""
    return (index * 2654435761) % 2**32 < frac * 2**32


def split_examples(examples: list[Example], frac: float) -> tuple[list[Example], list[Example]]:
    """(training, held-out); held-out keeps only answers by the target (not reference answers)."""
    train = [e for e in examples if not is_heldout(e.index, frac)]
    heldout = [e for e in examples if is_heldout(e.index, frac) and e.index < REFERENCE_INDEX_BASE]
    return train, heldout


def make_batches(examples: list[Example], tokens_per_batch: int, seed: int) -> list[list[int]]:
    """Example indices grouped by similar length, each group <= tokens_per_batch padded tokens
    (a longer example goes alone); the order of groups is shuffled with ``seed``."""
    rng = random.Random(seed)
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i].ids), rng.random()))
    batches, current, width = [], [], 0
    for i in order:
        new_width = max(width, len(examples[i].ids))
        if current and new_width * (len(current) + 1) > tokens_per_batch:
            batches.append(current)
            current, new_width = [], len(examples[i].ids)
        current.append(i)
        width = new_width
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


@dataclass
class CaptureSource:
    """Where collate reads captured targets: soft labels over the top ``top_k``, and the
    target's final states mapped by ``state_map`` (None: no state targets)."""
    dataset: object
    top_k: int
    state_map: torch.Tensor | None = None


def collate(examples: list[Example], prompt_weight: float, source: CaptureSource | None = None
            ) -> dict[str, torch.Tensor]:
    """``ids`` [B, T] (right-padded); ``labels`` [B, T] the target's next token (the answer's
    own, or the captured top-1); ``weights`` [B, T] (1 on answer positions, ``prompt_weight``
    on prompt positions, 0 on padding); ``is_answer`` [B, T]; with a capture also ``soft_ids``,
    ``soft_probs`` [B, T, K] and, with a state map, ``states`` [B, T, H]."""
    width = max(len(e.ids) for e in examples)
    out = {"ids": torch.zeros(len(examples), width, dtype=torch.long),
           "weights": torch.zeros(len(examples), width),
           "is_answer": torch.zeros(len(examples), width, dtype=torch.bool)}
    out["labels"] = torch.zeros_like(out["ids"])
    for b, e in enumerate(examples):
        n = len(e.ids)
        out["ids"][b, :n] = torch.tensor(e.ids)
        out["labels"][b, :n - 1] = out["ids"][b, 1:n]
        out["is_answer"][b, e.answer_start - 1:n - 1] = True
        out["weights"][b, :n - 1] = prompt_weight
        out["weights"][b, out["is_answer"][b]] = 1.0
    if source is not None:
        _collate_capture(examples, source, out)
    return out


def _collate_capture(examples: list[Example], source: CaptureSource, out: dict[str, torch.Tensor]) -> None:
    (bs, width), k = out["ids"].shape, source.top_k
    out["soft_ids"] = torch.zeros(bs, width, k, dtype=torch.long)
    out["soft_probs"] = torch.zeros(bs, width, k)
    if source.state_map is not None:
        out["states"] = torch.zeros(bs, width, source.state_map.shape[1])
    names = ("topk_ids", "topk_logp", "final") if source.state_map is not None else ("topk_ids", "topk_logp")
    for b, e in enumerate(examples):
        rec, n = e.capture, len(e.ids)
        rows = source.dataset.read(dataclasses.replace(rec, offset=rec.offset + e.cut), n, names)
        probs = rows["topk_logp"][:, :k].float().exp()
        out["soft_ids"][b, :n] = rows["topk_ids"][:, :k].long()
        out["soft_probs"][b, :n] = probs / probs.sum(-1, keepdim=True)
        out["labels"][b, :n - 1] = out["soft_ids"][b, :n - 1, 0]
        if source.state_map is not None:
            out["states"][b, :n] = rows["final"].float() @ source.state_map


def sample_states(examples: list[Example], dataset, count: int, seed: int) -> torch.Tensor:
    """[<= count, H_target] target final states at answer positions of random examples."""
    rng, chunks, total = random.Random(seed), [], 0
    for e in rng.sample(examples, len(examples)):
        if total >= count:
            break
        rec = e.capture
        start = rec.offset + e.cut + e.answer_start - 1
        rows = dataset.read(dataclasses.replace(rec, offset=start), len(e.ids) - e.answer_start + 1, ("final",))
        chunks.append(rows["final"].float())
        total += len(chunks[-1])
    return torch.cat(chunks)[:count]


# ---- loss and evaluation --------------------------------------------------------------------

class _TiedHeadCE(torch.autograd.Function):
    """Per-row cross-entropy of the logits ``hidden @ weight.T + bias`` against target
    distributions over ``label_ids`` [M, K] with ``label_probs`` [M, K] (rows sum to 1; K = 1:
    hard labels), in row chunks: the [M, V] logits never exist at once (the backward
    recomputes each chunk), and the softmax arithmetic is float32 whatever the matmul dtype.
    Also returns each row's argmax."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, label_ids, label_probs, dtype, chunk):
        h, w = hidden.to(dtype), weight.to(dtype)
        lse, top = torch.empty(len(h), device=h.device), torch.empty(len(h), dtype=torch.long, device=h.device)
        picked = torch.empty(len(h), device=h.device)
        for r in range(0, len(h), chunk):
            rows = slice(r, r + chunk)
            logits = (h[rows] @ w.T).float().add_(bias)                                 # [c, V]
            picked[rows] = (logits.gather(1, label_ids[rows]) * label_probs[rows]).sum(1)
            best, top[rows] = logits.max(-1)                  # cheaper than logsumexp + argmax
            lse[rows] = best + logits.sub_(best[:, None]).exp_().sum(-1).log_()
        ctx.save_for_backward(h, w, bias, label_ids, label_probs, lse)
        ctx.hidden_dtype, ctx.weight_dtype, ctx.chunk = hidden.dtype, weight.dtype, chunk
        ctx.mark_non_differentiable(top)
        return lse - picked, top

    @staticmethod
    def backward(ctx, grad_ce, _grad_top):
        h, w, bias, label_ids, label_probs, lse = ctx.saved_tensors
        grad_h = torch.empty(h.shape, dtype=ctx.hidden_dtype, device=h.device)
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        for r in range(0, len(h), ctx.chunk):
            rows = slice(r, r + ctx.chunk)
            probs = (h[rows] @ w.T).float().add_(bias).sub_(lse[rows, None]).exp_()      # softmax [c, V]
            probs.scatter_add_(1, label_ids[rows], -label_probs[rows].float())
            grad = probs.mul_(grad_ce[rows, None]).to(h.dtype)
            grad_h[rows] = grad @ w
            grad_w += (grad.T @ h[rows]).float()
        return grad_h, grad_w.to(ctx.weight_dtype), None, None, None, None, None


def tied_head_ce(model: "DraftLM", hidden: torch.Tensor, label_ids: torch.Tensor, label_probs: torch.Tensor,
                 amp: bool, vocab: "CandidateVocab | None" = None, chunk: int = 1024
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row CE [M], argmax token [M]) of the tied head over ``hidden`` [M, H] against
    ``label_ids``/``label_probs`` [M, K]: a full softmax, or with ``vocab`` a sampled one."""
    dtype = torch.bfloat16 if amp else torch.float32
    weight = model.model.embed_tokens.weight
    if vocab is None:
        bias = torch.zeros(weight.shape[0], device=weight.device)
        return _TiedHeadCE.apply(hidden, weight, bias, label_ids, label_probs, dtype, chunk)
    tokens, bias, index = vocab.sample(label_ids.flatten())
    ce, top = _TiedHeadCE.apply(hidden, weight.index_select(0, tokens), bias, index[label_ids], label_probs,
                                dtype, chunk)
    return ce, tokens[top]


class CandidateVocab:
    """Sampled softmax for training: the softmax runs over the tokens of the training answers
    (plus the step's labels) and ``num_negatives`` tokens drawn uniformly, without replacement,
    from the rest of the vocabulary, whose logits get log(rest / drawn) so that they stand for
    the whole rest in the partition function. Every other token is still pushed down now and
    then; the head costs (answers + negatives) / V of a full softmax."""

    def __init__(self, answer_tokens: torch.Tensor, vocab_size: int, num_negatives: int, seed: int) -> None:
        self.vocab_size, self.num_negatives = vocab_size, num_negatives
        self.answer_tokens = torch.unique(answer_tokens)
        self.gen = torch.Generator().manual_seed(seed)

    def sample(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(candidate tokens [C], logit correction [C], token -> candidate index [V])."""
        device = labels.device
        positive = torch.unique(torch.cat([self.answer_tokens.to(device), labels]))
        is_rest = torch.ones(self.vocab_size, dtype=torch.bool, device=device)
        is_rest[positive] = False
        rest = is_rest.nonzero().squeeze(1)
        drawn = min(self.num_negatives, len(rest))
        negatives = rest[torch.randperm(len(rest), generator=self.gen)[:drawn].to(device)]
        tokens = torch.cat([positive, negatives])
        bias = torch.zeros(len(tokens), device=device)
        if drawn:
            bias[len(positive):] = math.log(len(rest) / drawn)
        index = torch.full((self.vocab_size,), -1, dtype=torch.long, device=device)
        index[tokens] = torch.arange(len(tokens), device=device)
        return tokens, bias, index

    @classmethod
    def from_examples(cls, examples: list[Example], vocab_size: int, num_negatives: int,
                      seed: int) -> "CandidateVocab":
        tokens = torch.tensor(sorted({t for e in examples for t in e.ids[e.answer_start:]}), dtype=torch.long)
        return cls(tokens, vocab_size, num_negatives, seed)


def batch_loss(model: "DraftLM", batch: dict[str, torch.Tensor], device: torch.device, amp: bool,
               vocab: CandidateVocab | None = None, state_weight: float = 0.0):
    """(loss, answer tokens, answers whose top-1 is the target's) over the positions with
    weight > 0 (the head only runs on those): weighted (soft) CE, plus ``state_weight`` times
    the relative squared error of the final state when the batch has state targets."""
    batch = {k: v.to(device) for k, v in batch.items()}
    keep = batch["weights"] > 0
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
        hidden = model(batch["ids"])[keep]                                 # [M, H]
    labels = batch["labels"][keep]
    if "soft_ids" in batch:
        label_ids, label_probs = batch["soft_ids"][keep], batch["soft_probs"][keep]
    else:
        label_ids, label_probs = labels[:, None], torch.ones(len(labels), 1, device=device)
    ce, top = tied_head_ce(model, hidden, label_ids, label_probs, amp, vocab)
    w = batch["weights"][keep]
    loss = (ce * w).sum() / w.sum()
    if state_weight and "states" in batch:
        target = batch["states"][keep]
        error = (hidden.float() - target).pow(2).sum(-1) / target.pow(2).sum(-1).mean()
        loss = loss + state_weight * (error * w).sum() / w.sum()
    answer = batch["is_answer"][keep]
    correct = (top == labels) & answer
    return loss, int(answer.sum()), int(correct.sum())


@torch.no_grad()
def evaluate(model: "DraftLM", examples: list[Example], tokens_per_batch: int, device: torch.device,
             amp: bool, source: CaptureSource | None = None) -> dict:
    """Agreement with the target's next token on answer positions: loss, top-1, top-3, and the
    tokens per verify a greedy chain of depth S would get under teacher forcing (1 + run of
    correct drafts, <= S)."""
    was_training = model.training
    model.eval()
    total_ce, total, top1, top3 = 0.0, 0, 0, 0
    per_depth = {s: 0 for s in CHAIN_DEPTHS}
    plain = CaptureSource(source.dataset, 1) if source is not None else None   # labels only
    for batch_ids in make_batches(examples, tokens_per_batch, seed=0):
        batch = collate([examples[i] for i in batch_ids], 0.0, plain)
        ids, labels, is_answer = (batch[k].to(device) for k in ("ids", "labels", "is_answer"))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model.logits(model(ids)[is_answer]).float()            # [M, V]
        target = labels[is_answer]
        total_ce += float(F.cross_entropy(logits, target, reduction="sum"))
        hits = logits.topk(3, dim=-1).indices == target[:, None]            # [M, 3]
        top1, top3, total = top1 + int(hits[:, 0].sum()), top3 + int(hits.any(-1).sum()), total + len(target)
        runs = _correct_runs(hits[:, 0].cpu(), is_answer.sum(1).tolist())
        for s in CHAIN_DEPTHS:
            per_depth[s] += int((1 + runs.clamp(max=s)).sum())
    model.train(was_training)
    n = max(total, 1)
    return {"tokens": total, "loss": total_ce / n, "top1": top1 / n, "top3": top3 / n,
            **{f"chain{s}_tokens_per_verify": per_depth[s] / n for s in CHAIN_DEPTHS}}


def _correct_runs(correct: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """For each position, how many consecutive correct predictions start there (within its example)."""
    runs = torch.zeros(len(correct), dtype=torch.long)
    flags = correct.tolist()
    end = 0
    for n in lengths:
        run, start, end = 0, end, end + n
        for p in range(end - 1, start - 1, -1):
            run = run + 1 if flags[p] else 0
            runs[p] = run
    return runs


# ---- training -------------------------------------------------------------------------------

def lr_factor(step: int, progress: float, warmup_steps: int, min_ratio: float) -> float:
    warm = min(1.0, (step + 1) / max(1, warmup_steps))
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return warm * (min_ratio + (1 - min_ratio) * cosine)


def make_optimizer(model: "DraftLM", args: StandaloneTrainArgs) -> torch.optim.Optimizer:
    """AdamW; weight decay on the layers' matrices only; norm scales (O(1) values that set the
    logit scale) get ``norm_lr_mult`` times the LR."""
    named = list(model.named_parameters())
    groups = [([p for n, p in named if p.dim() == 2 and "embed_tokens" not in n], args.weight_decay, 1.0),
              ([p for n, p in named if "embed_tokens" in n], 0.0, 1.0),
              ([p for n, p in named if p.dim() == 1], 0.0, args.norm_lr_mult)]
    return torch.optim.AdamW([{"params": ps, "weight_decay": wd, "lr_mult": mult} for ps, wd, mult in groups if ps],
                             lr=args.lr, betas=(0.9, 0.95))


def read_target(path: str | None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The target's config and the tensors the draft starts from (embedding, final norm)."""
    from specserve.loading.loader import read_checkpoint, resolve_model_path

    cfg, weights = read_checkpoint(resolve_model_path(path))
    wanted = ("model.embed_tokens.weight", "model.norm.weight")
    return cfg, {k: v for k, v in weights if k in wanted}


@dataclass
class _Data:
    train: list[Example]
    heldout: list[Example]
    num_records: int
    source: CaptureSource | None = None     # the capture's soft labels / states


def load_data(args: StandaloneTrainArgs, num_records: int | None) -> _Data:
    limit = num_records or args.max_records
    if args.capture:
        examples, count, dataset = load_capture_examples(args.capture, args.max_len, limit)
        source = CaptureSource(dataset, args.soft_top_k)
    else:
        (examples, count), source = load_examples(args.data, args.max_len, limit), None
    train, heldout = split_examples(examples, args.heldout_frac)
    if not train or not heldout:
        raise ValueError(f"{args.capture or args.data}: {len(train)} training and {len(heldout)} held-out "
                         f"examples; need both")
    return _Data(train, heldout, count, source)


@dataclass
class _State:
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    elapsed_s: float = 0.0
    num_records: int | None = None
    initial_eval: dict | None = None
    history: list = field(default_factory=list)


def train_standalone(args: StandaloneTrainArgs | None = None, **kwargs) -> dict:
    """Train (or resume) a STANDALONE draft and export it to ``args.out``; returns the metrics
    (held-out agreement, tokens, minutes). Pass a ``StandaloneTrainArgs`` or its fields."""
    args = args or StandaloneTrainArgs(**kwargs)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device, amp = torch.device(args.device), args.amp == "bf16"
    work = args.resolved_work_dir()
    work.mkdir(parents=True, exist_ok=True)
    target_cfg, target = read_target(args.target)
    model = DraftLM(draft_config(target_cfg, args.shape), max_len=args.max_len + 1)
    model.init_random(args.seed)
    saved = _read_checkpoint(work, args) if args.resume else None
    state = _State(**saved["state"]) if saved else _State()
    data = load_data(args, state.num_records)
    state.num_records = data.num_records
    states = None
    if data.source is not None and not saved:
        states = sample_states(data.train, data.source.dataset, args.init_states, args.seed)
    state_map = init_head(model, target_cfg, target, states, args.head_init_scale)
    model.to(device)
    opt = make_optimizer(model, args)
    if saved:
        state_map = _restore(saved, model, opt, args)
    if data.source is not None and args.state_weight and state_map is not None:
        data.source.state_map = state_map
    _log(args, f"draft {args.shape}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params; "
               f"{len(data.train)} training / {len(data.heldout)} held-out examples "
               f"({sum(len(e.ids) - e.answer_start for e in data.train)} training answer tokens)")
    _train_loop(model, opt, state, data, args, device, amp, work, state_map)
    metrics = {"heldout": evaluate(model, data.heldout, args.tokens_per_batch, device, amp, data.source),
               "initial_heldout": state.initial_eval, "steps": state.step, "epochs": _epochs(state, data, args),
               "minutes": state.elapsed_s / 60, "train_answer_tokens_seen": sum(row[3] for row in state.history),
               "num_records": state.num_records, "args": _jsonable(dataclasses.asdict(args)),
               "history": state.history}
    export_draft(model, args.out)
    (work / METRICS_NAME).write_text(json.dumps(metrics, indent=2) + "\n")
    _log(args, f"held-out agreement: {json.dumps(metrics['heldout'])}; exported {args.out}")
    return metrics


def _train_loop(model: "DraftLM", opt, state: _State, data: _Data, args: StandaloneTrainArgs,
                device: torch.device, amp: bool, work: Path, state_map: torch.Tensor | None) -> None:
    budget_s = args.max_minutes * 60 if args.max_minutes else math.inf
    progress = lambda: max(state.step / args.max_steps, state.elapsed_s / budget_s)  # noqa: E731
    eval_set = data.heldout[:args.max_eval_examples]
    vocab = None
    if args.num_negatives >= 0:
        vocab = CandidateVocab.from_examples(data.train, model.config.vocab_size, args.num_negatives,
                                             args.seed + state.step)
        _log(args, f"sampled softmax: {len(vocab.answer_tokens)} answer tokens + {args.num_negatives} negatives")
    bar = tqdm(total=100, unit="%", desc="standalone", disable=args.quiet,
               bar_format="{l_bar}{bar}| {n:.1f}/{total}% [{elapsed}<{remaining}{postfix}]")
    bar.update(100 * min(1.0, progress()))
    if state.step == 0 and args.eval_every:
        state.initial_eval = evaluate(model, eval_set, args.tokens_per_batch, device, amp, data.source)
        bar.write(f"before training: held-out {_brief(state.initial_eval)}")
    last_save = time.monotonic()
    model.train()
    while progress() < 1.0:
        batches = make_batches(data.train, args.tokens_per_batch, seed=args.seed * 1000 + state.epoch)
        while state.batch_in_epoch < len(batches) and progress() < 1.0:
            start, before = time.monotonic(), progress()
            for group in opt.param_groups:
                group["lr"] = args.lr * group["lr_mult"] * lr_factor(state.step, before, args.warmup_steps,
                                                                      args.min_lr_ratio)
            batch = collate([data.train[i] for i in batches[state.batch_in_epoch]], args.prompt_weight, data.source)
            loss, num_answer, num_correct = batch_loss(model, batch, device, amp, vocab, args.state_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            state.step, state.batch_in_epoch = state.step + 1, state.batch_in_epoch + 1
            state.elapsed_s += time.monotonic() - start
            state.history.append([state.step, round(state.elapsed_s, 2), round(loss.item(), 4), num_answer,
                                  num_correct])
            bar.set_postfix(loss=f"{state.history[-1][2]:.3f}", acc=f"{num_correct / max(1, num_answer):.3f}",
                            lr=f"{opt.param_groups[0]['lr']:.1e}", ep=state.epoch, refresh=False)
            bar.update(100 * (min(1.0, progress()) - min(1.0, before)))
            if args.eval_every and state.step % args.eval_every == 0:
                result = evaluate(model, eval_set, args.tokens_per_batch, device, amp, data.source)
                bar.write(f"step {state.step}: held-out {_brief(result)}")
            if time.monotonic() - last_save > args.checkpoint_minutes * 60:
                _save_checkpoint(work, model, opt, state, args, state_map)
                last_save = time.monotonic()
        if state.batch_in_epoch >= len(batches):
            state.epoch, state.batch_in_epoch = state.epoch + 1, 0
    bar.close()
    _save_checkpoint(work, model, opt, state, args, state_map)


def _brief(result: dict) -> str:
    return (f"top1 {result['top1']:.4f} top3 {result['top3']:.4f} loss {result['loss']:.3f} "
            f"chain3 {result['chain3_tokens_per_verify']:.3f}")


def _epochs(state: _State, data: _Data, args: StandaloneTrainArgs) -> float:
    return state.epoch + state.batch_in_epoch / max(1, len(make_batches(data.train, args.tokens_per_batch, 0)))


# ---- checkpoints ----------------------------------------------------------------------------

_FIXED_FIELDS = ("shape", "max_len", "target", "data", "capture", "head_init_scale", "seed", "heldout_frac",
                 "soft_top_k", "init_states")


def _save_checkpoint(work: Path, model: "DraftLM", opt, state: _State, args: StandaloneTrainArgs,
                     state_map: torch.Tensor | None) -> None:
    tmp = work / (CHECKPOINT_NAME + ".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "state": dataclasses.asdict(state),
                "args": _jsonable(dataclasses.asdict(args)), "torch_rng": torch.get_rng_state(),
                "state_map": state_map}, tmp)
    os.replace(tmp, work / CHECKPOINT_NAME)


def _read_checkpoint(work: Path, args: StandaloneTrainArgs) -> dict | None:
    path = work / CHECKPOINT_NAME
    if not path.is_file():
        _log(args, f"--resume: no checkpoint at {path}; starting fresh")
        return None
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    saved, now = ckpt["args"], _jsonable(dataclasses.asdict(args))
    changed = [k for k in _FIXED_FIELDS if saved.get(k) != now.get(k)]
    if changed:
        raise ValueError(f"--resume: {path} was trained with different {', '.join(changed)}")
    return ckpt


def _restore(ckpt: dict, model: "DraftLM", opt, args: StandaloneTrainArgs) -> torch.Tensor | None:
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    torch.set_rng_state(ckpt["torch_rng"])
    state = ckpt["state"]
    _log(args, f"resumed at step {state['step']} (epoch {state['epoch']}, {state['elapsed_s'] / 60:.1f} min)")
    return ckpt["state_map"]


# ---- export ---------------------------------------------------------------------------------

def export_draft(model: DraftLM, out_dir: str | os.PathLike, dtype: torch.dtype = torch.bfloat16) -> Path:
    """config.json + model.safetensors (HF names, tied head not stored) in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(model.config, torch_dtype=str(dtype).removeprefix("torch."))
    hf = {k: v for k, v in cfg.to_hf().items() if v is not None}
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# ---- command line ---------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    d, s = StandaloneTrainArgs(data="-", out=""), DraftShape()
    parser.add_argument("--data", default=None, help="regenerate JSONL (prompts + the target's greedy answers)")
    parser.add_argument("--capture", default=None,
                        help="capture folder (target top-K log-probs and final states); used instead of --data")
    parser.add_argument("--out", required=True, help="exported draft directory (config.json + model.safetensors)")
    parser.add_argument("--work-dir", default=None, help="checkpoints and metrics (default: cache/train/<out name>)")
    parser.add_argument("--target", default=None, help="target checkpoint (default: the default model)")
    for name in ("hidden_size", "num_layers", "intermediate_size", "num_heads", "num_kv_heads", "head_dim"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(s, name))
    for name in ("max_steps", "max_records", "num_negatives", "soft_top_k", "init_states", "warmup_steps",
                 "tokens_per_batch", "max_len", "max_eval_examples", "eval_every", "seed"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("max_minutes", "lr", "min_lr_ratio", "weight_decay", "norm_lr_mult", "head_init_scale", "clip",
                 "prompt_weight", "state_weight", "heldout_frac", "checkpoint_minutes"):
        parser.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--threads", type=int, default=None, help="torch compute threads")
    parser.add_argument("--amp", default="bf16", choices=("bf16", "none"), help="autocast dtype for matmuls")
    parser.add_argument("--resume", action="store_true", help="continue from the work dir's checkpoint")
    parser.add_argument("--quiet", action="store_true")


def args_from_namespace(ns: argparse.Namespace) -> StandaloneTrainArgs:
    shape = DraftShape(ns.hidden_size, ns.num_layers, ns.intermediate_size, ns.num_heads, ns.num_kv_heads,
                       ns.head_dim)
    fields = {f.name for f in dataclasses.fields(StandaloneTrainArgs)} - {"shape"}
    return StandaloneTrainArgs(shape=shape, **{k: getattr(ns, k) for k in fields})


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=list))


def _log(args: StandaloneTrainArgs, message: str) -> None:
    if not args.quiet:
        tqdm.write(f"[standalone] {message}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    metrics = train_standalone(args_from_namespace(parser.parse_args(argv)))
    print(json.dumps(metrics["heldout"], indent=2))


if __name__ == "__main__":
    main()
