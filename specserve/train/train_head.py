"""Step (c) of draft training: EAGLE3 and EAGLE heads on captured target features.

The trainable head *is* the serving class (``models/eagle3.py`` / ``models/eagle.py``),
with its attention backend swapped for the training-time-test backend (``ttt.py``), so
training and serving run one forward. Step ``j`` of ``num_ttt_steps`` at index ``i``
consumes token ``i + 1 + j`` and the previous step's output (step 0: the target feature
at ``i``), at rope position ``i + j``; it is scored against the target's distribution at
position ``i + 1 + j`` restricted to the draft vocabulary (soft labels from the captured
top-k), with weight ``step_weight_decay ** j``.

EAGLE3: cross-entropy only; the head's ``lm_head`` starts as the target's rows of the draft
vocabulary, its embedding is the target's (frozen). EAGLE: smooth-L1 between the output and
the target's final hidden state at ``i + 1 + j`` plus ``ce_weight`` x the cross-entropy of
the target's frozen lm_head (rows of the draft vocabulary) on the output.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specserve.config import ModelConfig
from specserve.loading.loader import read_checkpoint, resolve_model_path
from specserve.models.draft_head import DRAFT_VOCAB_TENSOR, draft_vocab_ids
from specserve.models.llama import LlamaForCausalLM
from specserve.train.dataset import Batch, BatchLoader, CaptureDataset, shift, split_records, step_view
from specserve.train.frspec import draft_vocab_maps
from specserve.train.ttt import TTTBackend, TTTCache, TTTMeta

logger = logging.getLogger(__name__)

ALGORITHMS = ("EAGLE3", "EAGLE")
CHECKPOINT_DIR = "checkpoints"
BEST_CHECKPOINT = "best.pt"
TARGET_PART_NAMES = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


@dataclass
class TrainConfig:
    algorithm: str
    capture_dir: str
    out_dir: str                         # checkpoints and the training log
    model_path: str | None = None        # the target (None: the default model)
    num_ttt_steps: int | None = None     # None: 3 for EAGLE3, 1 for EAGLE
    step_weight_decay: float = 0.8
    seq_len: int = 1024
    batch_size: int = 2                  # packed rows per optimizer step
    epochs: float = 1.0
    max_steps: int | None = None
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    seed: int = 0
    device: str = "cpu"
    bf16: bool = False                   # bfloat16 autocast
    save_every: int = 200
    keep_checkpoints: int = 2
    eval_every: int = 0                  # 0: at checkpoints and at the end
    val_records: int = 64
    early_stop_patience: int = 0         # stop after this many evaluations without a better val_loss (0: off)
    resume: bool = False
    init_from: str | None = None         # a checkpoint whose head weights start a fresh run (warm start)
    ce_weight: float = 0.1               # EAGLE: weight of the cross-entropy next to smooth-L1
    regression_weight: float = 1.0
    intermediate_size: int | None = None  # the head's MLP width (default: the target's)

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"--algorithm must be one of {ALGORITHMS}; got {self.algorithm!r}")
        if self.num_ttt_steps is None:
            self.num_ttt_steps = 3 if self.algorithm == "EAGLE3" else 1
        checks = {"--ttt-steps": self.num_ttt_steps >= 1, "--seq-len": self.seq_len >= 2,
                  "--batch-size": self.batch_size >= 1, "--lr": self.lr > 0, "--epochs": self.epochs > 0,
                  "--grad-clip": self.grad_clip > 0, "--save-every": self.save_every >= 1,
                  "--max-steps": self.max_steps is None or self.max_steps >= 1,
                  "--early-stop-patience": self.early_stop_patience >= 0}
        bad = [flag for flag, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid value for {', '.join(bad)}")

    @property
    def feature_kind(self) -> str:
        return "aux" if self.algorithm == "EAGLE3" else "final"


# ---- the head ------------------------------------------------------------------------

def load_target_parts(model_path: str | None, device="cpu") -> LlamaForCausalLM:
    """The target without its decoder layers: embedding, final norm and lm_head (float32)."""
    cfg, weights = read_checkpoint(resolve_model_path(model_path))
    return target_parts_from(cfg, weights, device)


def target_parts_from(cfg: ModelConfig, weights, device="cpu") -> LlamaForCausalLM:
    parts = LlamaForCausalLM(dataclasses.replace(cfg, num_hidden_layers=0))
    parts.load_weights((n, t) for n, t in weights if n in TARGET_PART_NAMES)
    parts.config = cfg                   # the real layer count (aux layer checks)
    parts.requires_grad_(False)
    return parts.to(device).eval()


def head_config(target_cfg: ModelConfig, algorithm: str, *, draft_vocab_size: int,
                aux_layer_ids: tuple[int, ...] = (), intermediate_size: int | None = None) -> ModelConfig:
    """The one-layer head's config: the target's shapes, the format's architecture and extras."""
    extra: dict = {"model_type": "llama"}
    if algorithm == "EAGLE3":
        extra["draft_vocab_size"] = draft_vocab_size
        # SGLang's convention: ids of the layers whose *outputs* are captured = our input ids - 1
        extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [int(i) - 1 for i in aux_layer_ids],
                                 "use_aux_hidden_state": True}
    return dataclasses.replace(
        target_cfg, architecture="LlamaForCausalLMEagle3" if algorithm == "EAGLE3" else "LlamaForCausalLMEagle",
        num_hidden_layers=1, tie_word_embeddings=False, intermediate_size=intermediate_size or
        target_cfg.intermediate_size, torch_dtype="bfloat16", eos_token_ids=target_cfg.eos_token_ids, extra=extra)


def build_head(algorithm: str, target: LlamaForCausalLM, vocab_ids: list[int], *, aux_layer_ids=(),
               intermediate_size: int | None = None, max_position: int = 4096, seed: int = 0):
    """A freshly initialized serving head bound to ``target`` (its embedding, frozen).

    EAGLE3: ``lm_head`` = the target's rows of ``vocab_ids`` (its draft vocabulary), ``norm``
    = the target's final norm. EAGLE: the target's lm_head restricted to ``vocab_ids`` for the
    training cross-entropy (FR-Spec style; the exported head keeps using the full one)."""
    tcfg = target.config
    cfg = head_config(tcfg, algorithm, draft_vocab_size=len(vocab_ids), aux_layer_ids=tuple(aux_layer_ids),
                      intermediate_size=intermediate_size)
    torch.manual_seed(seed)
    device = target.lm_head.weight.device
    if algorithm == "EAGLE3":
        from specserve.models.eagle3 import Eagle3Head

        head = Eagle3Head(cfg, target_hidden_size=tcfg.hidden_size).to(device)
        d2t, _ = draft_vocab_maps(vocab_ids, tcfg.vocab_size)
        head.set_d2t(d2t.to(device))
        ids = head.draft_to_target(torch.arange(len(vocab_ids), device=device))
        _init_decoder(head)
        with torch.no_grad():
            head.lm_head.weight.copy_(target.lm_head.weight[ids])
            head.norm.weight.copy_(target.model.norm.weight)
    else:
        from specserve.models.eagle import EagleHead

        head = EagleHead(cfg, fc_bias=True).to(device)
        _init_decoder(head)
        head.set_token_map(sorted(vocab_ids))
    head.bind_target(target)
    head.init_rotary(max_position, device)
    return head


def _init_decoder(head: torch.nn.Module, std: float = 0.02) -> None:
    """HF's Llama init: normal(0, std) linears, zero biases (norms stay at one)."""
    with torch.no_grad():
        for module in head.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, std)
                if module.bias is not None:
                    module.bias.zero_()


def trainable_state(head: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The head's own state (no FR-Spec restricted copy of the target's lm_head)."""
    return {k: v for k, v in head.state_dict().items() if not k.startswith("restricted_head.")}


def load_trainable_state(head: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("restricted_head.")]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the head: missing {missing[:5]}, unexpected {unexpected[:5]}")


# ---- losses --------------------------------------------------------------------------

def soft_cross_entropy(logits: torch.Tensor, topk_ids: torch.Tensor, topk_logp: torch.Tensor,
                       vocab_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row CE between the draft's logits [N, Vd] and the target's top-k distribution
    restricted to the draft vocabulary and renormalized; and per-row top-1 agreement.
    ``vocab_index`` [V]: target id -> draft id, -1 outside the draft vocabulary."""
    draft_ids = vocab_index[topk_ids]                                    # [N, K]
    probs = topk_logp.exp() * (draft_ids >= 0)
    probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-20)
    logq = torch.log_softmax(logits.float(), dim=-1)
    ce = -(probs * logq.gather(1, draft_ids.clamp_min(0))).sum(-1)      # [N]
    correct = logits.argmax(-1) == draft_ids[:, 0]
    return ce, correct


def step_weights(num_steps: int, decay: float) -> list[float]:
    return [decay ** j for j in range(num_steps)]


class LossComputer:
    """The unrolled forward of one batch and its loss; per-step metrics."""

    def __init__(self, head, cfg: TrainConfig, vocab_ids: list[int], vocab_size: int) -> None:
        self.head, self.cfg = head, cfg
        index = torch.full((vocab_size,), -1, dtype=torch.int64)
        draft_order = head.draft_to_target(torch.arange(len(vocab_ids), device=head.lm_head_module().weight.device))
        index[draft_order.cpu()] = torch.arange(len(vocab_ids))
        self.vocab_index = index.to(draft_order.device)
        self.weights = step_weights(cfg.num_ttt_steps, cfg.step_weight_decay)

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        bsz, seq_len = batch.tokens.shape
        meta, cache = TTTMeta.from_segments(batch.segment), TTTCache()
        hidden = batch.feature.reshape(bsz * seq_len, -1)
        total = hidden.new_zeros(())
        metrics: dict[str, float] = {}
        for j, weight in enumerate(self.weights):
            ids, mask, positions = step_view(batch, j)
            out = self.head(ids.reshape(-1), hidden, positions.reshape(-1), cache, meta)     # [T, H]
            rows = mask.reshape(-1).nonzero().squeeze(1)
            loss, step_metrics = self.step_loss(out.index_select(0, rows), batch, j, rows)
            total = total + weight * loss
            metrics.update({f"{k}{j}": v for k, v in step_metrics.items()})
            hidden = out
        metrics["loss"] = float(total.detach())
        return total, metrics

    def step_loss(self, out: torch.Tensor, batch: Batch, j: int, rows: torch.Tensor):
        if rows.numel() == 0:
            return out.sum() * 0.0, {"acc": float("nan")}
        k = batch.topk_ids.shape[-1]
        topk_ids = shift(batch.topk_ids, 1 + j, 0).reshape(-1, k).index_select(0, rows)
        topk_logp = shift(batch.topk_logp, 1 + j, -1e4).reshape(-1, k).index_select(0, rows)
        logits = self.head.compute_logits(out)                                             # [N, Vd]
        ce, correct = soft_cross_entropy(logits, topk_ids, topk_logp, self.vocab_index)
        metrics = {"acc": float(correct.float().mean()), "ce": float(ce.mean().detach())}
        if self.cfg.algorithm == "EAGLE3":
            return ce.mean(), metrics
        hidden_size = batch.final.shape[-1]
        wanted = shift(batch.final, 1 + j, 0.0).reshape(-1, hidden_size).index_select(0, rows)
        l1 = F.smooth_l1_loss(out.float(), wanted, reduction="mean")
        metrics["l1"] = float(l1.detach())
        return self.cfg.regression_weight * l1 + self.cfg.ce_weight * ce.mean(), metrics


# ---- the loop ------------------------------------------------------------------------

def lr_lambda(warmup: int, total: int, min_ratio: float):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


class HeadTrainer:
    def __init__(self, cfg: TrainConfig, vocab_ids: list[int], target: LlamaForCausalLM | None = None) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available")
        self.data = CaptureDataset(cfg.capture_dir, cfg.feature_kind)
        if cfg.algorithm == "EAGLE" and "final" not in self.data.info.features:
            raise ValueError("EAGLE training needs 'final' features; capture with --capture-features final")
        target = target if target is not None else load_target_parts(cfg.model_path)
        target = target.to(self.device)
        self._check_capture(target.config)
        self.vocab_ids = list(vocab_ids)
        self.head = build_head(cfg.algorithm, target, self.vocab_ids, aux_layer_ids=self.data.info.aux_layer_ids,
                               intermediate_size=cfg.intermediate_size, max_position=cfg.seq_len + cfg.num_ttt_steps + 1,
                               seed=cfg.seed)
        self.head.backend = TTTBackend()
        self.head.train()
        self.loss = LossComputer(self.head, cfg, self.vocab_ids, target.config.vocab_size)
        train_ids, self.val_ids = split_records(len(self.data), cfg.val_records, cfg.seed)
        common = dict(seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed,
                      with_final=cfg.algorithm == "EAGLE")
        self.loader = BatchLoader(self.data, train_ids, **common)
        self.val_loader = BatchLoader(self.data, self.val_ids, shuffle=False, **common) if self.val_ids else None
        self.steps_per_epoch = self.loader.steps_per_epoch()
        self.total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * self.steps_per_epoch))
        params = [p for p in self.head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(min(cfg.warmup_steps, self.total_steps // 10 + 1), self.total_steps,
                                      cfg.min_lr_ratio))
        self.step = 0
        self.best_val_loss, self.bad_evals = math.inf, 0
        self.out = Path(cfg.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        if cfg.resume:
            self.resume()
        if cfg.init_from and self.step == 0:
            self.warm_start(Path(cfg.init_from))

    def _check_capture(self, target_cfg: ModelConfig) -> None:
        info = self.data.info
        if (info.hidden_size, info.vocab_size) != (target_cfg.hidden_size, target_cfg.vocab_size):
            raise ValueError(f"the capture in {self.cfg.capture_dir} is of a target with hidden {info.hidden_size}, "
                             f"vocab {info.vocab_size}; --model-path has {target_cfg.hidden_size}, "
                             f"{target_cfg.vocab_size}")

    # ---- checkpoints ----
    def checkpoint_paths(self) -> list[Path]:
        return sorted((self.out / CHECKPOINT_DIR).glob("step_*.pt"))

    def checkpoint_state(self) -> dict:
        return {"algorithm": self.cfg.algorithm, "step": self.step, "head": trainable_state(self.head),
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "rng": torch.get_rng_state(), "vocab_ids": self.vocab_ids, "config": asdict(self.cfg),
                "head_config": self.head.config.to_hf() | {"extra": self.head.config.extra},
                "aux_layer_ids": list(self.data.info.aux_layer_ids),
                "best_val_loss": self.best_val_loss, "bad_evals": self.bad_evals}

    def save_checkpoint(self) -> Path:
        folder = self.out / CHECKPOINT_DIR
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"step_{self.step:07d}.pt"
        _save_atomically(self.checkpoint_state(), path)
        for old in self.checkpoint_paths()[:-self.cfg.keep_checkpoints]:
            old.unlink()
        return path

    def note_evaluation(self, metrics: dict[str, float]) -> bool:
        """Keep the best head so far as ``checkpoints/best.pt`` (by val_loss); True when the
        run should stop early (``early_stop_patience`` evaluations without improvement)."""
        val_loss = metrics.get("val_loss")
        if val_loss is None:
            return False
        if val_loss < self.best_val_loss:
            self.best_val_loss, self.bad_evals = val_loss, 0
            (self.out / CHECKPOINT_DIR).mkdir(parents=True, exist_ok=True)
            _save_atomically(self.checkpoint_state() | {"val_metrics": metrics},
                             self.out / CHECKPOINT_DIR / BEST_CHECKPOINT)
            return False
        self.bad_evals += 1
        patience = self.cfg.early_stop_patience
        if patience and self.bad_evals >= patience:
            logger.warning("early stop at step %d: val_loss %.4f has not beaten %.4f for %d evaluations",
                           self.step, val_loss, self.best_val_loss, self.bad_evals)
            return True
        return False

    def resume(self) -> None:
        paths = self.checkpoint_paths()
        if not paths:
            logger.warning("--resume: no checkpoint in %s; starting from scratch", self.out / CHECKPOINT_DIR)
            return
        state = self._load_head_weights(paths[-1], "--resume", "use another --out / --work-dir")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        self.step = state["step"]
        self.best_val_loss, self.bad_evals = state.get("best_val_loss", math.inf), state.get("bad_evals", 0)
        logger.info("resumed from %s (step %d)", paths[-1], self.step)

    def warm_start(self, path: Path) -> None:
        """Head weights from an earlier run's checkpoint, or from an exported head folder (a
        shipped draft); optimizer, schedule and data start fresh."""
        if path.is_dir():
            self._load_exported_head(path)
            logger.info("warm start from the exported head %s", path)
            return
        state = self._load_head_weights(path, "--init-from", f"copy its draft_vocab.pt into {self.out} first")
        logger.info("warm start from %s (its step %d)", path, state.get("step", -1))

    def _load_exported_head(self, folder: Path) -> None:
        tensors = read_exported_head(folder)
        if self.cfg.algorithm == "EAGLE3":
            ids = exported_vocab_ids(tensors, folder)
            if sorted(ids) != sorted(self.vocab_ids):
                raise ValueError(f"--init-from {folder}: its draft vocabulary differs from this run's; start the "
                                 f"run from that head's vocabulary (delete {self.out / 'draft_vocab.pt'})")
        with torch.no_grad():
            self.head.load_weights((name, t.float()) if t.is_floating_point() else (name, t)
                                   for name, t in tensors.items())

    def _load_head_weights(self, path: Path, flag: str, hint: str) -> dict:
        """Load ``path`` into the head after checking it is this run's algorithm and draft
        vocabulary; returns the whole checkpoint."""
        state = torch.load(path, map_location=self.device, weights_only=False)
        if state.get("algorithm") != self.cfg.algorithm or state.get("vocab_ids") != self.vocab_ids:
            raise ValueError(f"{flag} {path}: a {state.get('algorithm')} checkpoint with another draft "
                             f"vocabulary or algorithm; {hint}")
        load_trainable_state(self.head, state["head"])
        return state

    # ---- training ----
    def train_step(self, batch: Batch) -> dict[str, float]:
        batch = batch.to(self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16):
            loss, metrics = self.loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(
            [p for p in self.head.parameters() if p.requires_grad], self.cfg.grad_clip))
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return metrics

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        if self.val_loader is None:
            return {}
        self.head.eval()
        sums: dict[str, float] = {}
        count = 0
        for batch in self.val_loader.batches(0):
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16):
                _, metrics = self.loss(batch.to(self.device))
            for k, v in metrics.items():
                if not math.isnan(v):
                    sums[k] = sums.get(k, 0.0) + v
            count += 1
        self.head.train()
        return {f"val_{k}": v / count for k, v in sums.items()}

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch within it) of optimizer step ``step`` (epochs pack to different counts)."""
        epoch = 0
        while step >= len(self.loader.plan(epoch)):
            step -= len(self.loader.plan(epoch))
            epoch += 1
        return epoch, step

    def batches_from(self, step: int):
        epoch, start = self.position(step)
        while True:
            yield from self.loader.batches(epoch, start)
            epoch, start = epoch + 1, 0

    def train(self) -> dict[str, float]:
        cfg = self.cfg
        log_path = self.out / "train_log.jsonl"
        last: dict[str, float] = {}
        tokens, started = 0, time.perf_counter()
        batches = self.batches_from(self.step)
        with tqdm(total=self.total_steps, initial=self.step, desc=f"train {cfg.algorithm}", unit="step",
                  dynamic_ncols=True) as bar, open(log_path, "a", encoding="utf-8") as log:
            while self.step < self.total_steps:
                batch = next(batches)
                metrics = self.train_step(batch)
                tokens += batch.num_tokens
                metrics.update(step=self.step, lr=self.scheduler.get_last_lr()[0],
                               tok_per_s=tokens / (time.perf_counter() - started))
                is_last = self.step == self.total_steps
                if self.step % cfg.save_every == 0 or is_last:
                    self.save_checkpoint()
                if (cfg.eval_every and self.step % cfg.eval_every == 0) or (
                        not cfg.eval_every and (self.step % cfg.save_every == 0 or is_last)):
                    metrics.update(self.evaluate())
                stop = self.note_evaluation(metrics)
                log.write(json.dumps(metrics) + "\n")
                log.flush()
                bar.update(1)
                bar.set_postfix(_short(metrics, cfg.num_ttt_steps))
                last = metrics
                if stop:
                    break
        return last


def _short(metrics: dict[str, float], num_steps: int) -> dict[str, str]:
    shown = {"loss": f"{metrics['loss']:.3f}"}
    shown.update({f"acc{j}": f"{metrics.get(f'acc{j}', float('nan')):.3f}" for j in range(num_steps)})
    if "val_acc0" in metrics:
        shown["val_acc0"] = f"{metrics['val_acc0']:.3f}"
    shown["tok/s"] = f"{metrics['tok_per_s']:.0f}"
    return shown


def read_exported_head(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of an exported head folder (``export.py``: model.safetensors + config.json)."""
    from safetensors.torch import load_file

    path = Path(folder) / "model.safetensors"
    if not path.is_file():
        raise ValueError(f"--init-from {folder}: no model.safetensors in it (an exported head folder, "
                         f"or a training checkpoint file)")
    return load_file(str(path))


def exported_vocab_ids(tensors: dict[str, torch.Tensor], folder) -> list[int]:
    """Target ids of an exported EAGLE3 head's draft vocabulary (from its ``d2t``)."""
    if DRAFT_VOCAB_TENSOR not in tensors:
        raise ValueError(f"--init-from {folder}: not an EAGLE3 head with a draft vocabulary (no d2t tensor)")
    return draft_vocab_ids(tensors[DRAFT_VOCAB_TENSOR]).tolist()


def _save_atomically(state: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def best_checkpoint(out_dir: str | os.PathLike) -> Path:
    """The checkpoint with the lowest val_loss (``best.pt``), else the latest one."""
    best = Path(out_dir) / CHECKPOINT_DIR / BEST_CHECKPOINT
    return best if best.is_file() else latest_checkpoint(out_dir)


def latest_checkpoint(out_dir: str | os.PathLike) -> Path:
    paths = sorted((Path(out_dir) / CHECKPOINT_DIR).glob("step_*.pt"))
    if not paths:
        raise FileNotFoundError(f"no training checkpoint in {Path(out_dir) / CHECKPOINT_DIR}; run --stage train first")
    return paths[-1]
