"""``specserve train-draft``: regenerate answers, capture target features, train an EAGLE3 or
EAGLE head, export it (and the FR-Spec token map).

    specserve train-draft --algorithm EAGLE3 --stage all --work-dir WORK --out drafts/eagle3
    specserve train-draft --algorithm EAGLE --stage train --work-dir WORK --resume

Work folder layout: ``answers.jsonl`` (regenerate), ``capture/`` (shards),
``train_{algorithm}/`` (draft vocabulary, checkpoints, ``train_log.jsonl``).
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Sequence

import torch

STAGES = ("regenerate", "capture", "train", "export", "frspec", "all")
ALL_STAGES = ("regenerate", "capture", "frspec", "train", "export")
STAGES_NEEDING_ALGORITHM = ("train", "export")
FRESH_LR, WARM_START_LR = 1e-3, 1e-4     # peak learning rates: a new head, a warm start (--init-from)


class UsageError(ValueError):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve train-draft", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--algorithm", choices=("EAGLE3", "EAGLE"), type=str.upper, default=None,
                   help="draft head to train (needed by the train and export stages)")
    p.add_argument("--stage", choices=STAGES, default="all",
                   help="all = regenerate, capture, frspec, train, export (each resumes where it stopped)")
    p.add_argument("--work-dir", required=True, help="folder for answers, captured features and checkpoints")
    p.add_argument("--out", default=None, help="exported head directory (export stage)")
    p.add_argument("--model-path", default=None, help="target model (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--answers", default=None,
                   help="answer JSONL file(s), comma-separated (default WORK/answers.jsonl; regenerate "
                        "appends to the first)")
    p.add_argument("--threads", type=int, default=None, help="torch compute threads")
    p.add_argument("--device", default="cpu", help="cpu or cuda (capture and train)")
    p.add_argument("-v", "--verbose", action="store_true")
    g = p.add_argument_group("regenerate")
    g.add_argument("--num-prompts", type=int, default=None, help="training prompts to answer (default all)")
    g.add_argument("--prompt-dir", default=None, help="training prompt folder (default ../shared/data/train)")
    g.add_argument("--first-prompt", type=int, default=0,
                   help="skip the prompts before this index of the fixed order (answered in an earlier "
                        "run whose answers are not here); the answers keep their indices")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--regen-dtype", default="auto", help="target dtype while regenerating")
    g.add_argument("--regen-quantization", default="gguf", choices=("gguf", "none"),
                   help="gguf: the integer kernels `make serve` runs (the answers are the served target's own); "
                        "none: the exact float path")
    g.add_argument("--regen-batch", type=int, default=64, help="concurrent requests while regenerating")
    g = p.add_argument_group("capture")
    g.add_argument("--aux-layer-ids", default=None,
                   help="EAGLE3: three target layers whose inputs are captured, e.g. 2,15,27 (default 2,L//2,L-3)")
    g.add_argument("--capture-features", default="aux,final", help="aux (EAGLE3) and/or final (EAGLE)")
    g.add_argument("--top-k", type=int, default=32, help="target log-probs kept per position (soft labels)")
    g.add_argument("--feature-dtype", default="float16", choices=("float16", "bfloat16"))
    g.add_argument("--capture-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="target dtype while capturing (bfloat16: faster on CPUs with AMX, features "
                        "within bf16 rounding of the float32 serving ones)")
    g.add_argument("--capture-quantization", default="gguf", choices=("gguf", "none"),
                   help="gguf: features from the integer kernels `make serve` runs (what the head sees when "
                        "served); none: the exact float path")
    g.add_argument("--capture-batch-tokens", type=int, default=2048, help="tokens per batched target prefill")
    g.add_argument("--shard-tokens", type=int, default=32768, help="tokens per shard file")
    g.add_argument("--max-seq-len", type=int, default=2048, help="records are truncated to this many tokens")
    g.add_argument("--max-records", type=int, default=None, help="capture only the first N answers")
    g = p.add_argument_group("vocabularies")
    g.add_argument("--draft-vocab-size", type=int, default=8192,
                   help="EAGLE3 draft vocabulary (EAGLE: vocabulary of the training cross-entropy)")
    g.add_argument("--token-map-size", type=int, default=8192, help="FR-Spec token map size")
    g.add_argument("--token-map-out", default=None, help="FR-Spec map file (default OUT/frspec_token_map.pt, "
                                                         "else WORK/frspec_token_map.pt)")
    g = p.add_argument_group("train")
    g.add_argument("--ttt-steps", type=int, default=None, help="unrolled steps (default 3 EAGLE3, 1 EAGLE)")
    g.add_argument("--step-weight-decay", type=float, default=0.8, help="loss weight of step j = decay ** j")
    g.add_argument("--seq-len", type=int, default=1024, help="packed row length")
    g.add_argument("--batch-size", type=int, default=2, help="packed rows per optimizer step")
    g.add_argument("--epochs", type=float, default=1.0)
    g.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    g.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (default {FRESH_LR}; {WARM_START_LR} with --init-from: at 5e-4 the "
                        "shipped EAGLE3 head lost 4 points of held-out agreement in 100 steps)")
    g.add_argument("--min-lr-ratio", type=float, default=0.05, help="cosine floor as a fraction of --lr")
    g.add_argument("--warmup-steps", type=int, default=50)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--grad-clip", type=float, default=0.5)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    g.add_argument("--save-every", type=int, default=200, help="checkpoint every N steps")
    g.add_argument("--eval-every", type=int, default=0, help="validation every N steps (0: at checkpoints)")
    g.add_argument("--val-records", type=int, default=64, help="records held out for validation")
    g.add_argument("--early-stop-patience", type=int, default=0,
                   help="stop after this many evaluations without a lower val_loss (0: off); the best head "
                        "is kept as checkpoints/best.pt either way")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    g.add_argument("--init-from", default=None,
                   help="start from this checkpoint's head weights, or an exported head folder such as a shipped "
                        "draft (EAGLE3: its draft vocabulary too); fresh optimizer, schedule and data order")
    g.add_argument("--ce-weight", type=float, default=0.1, help="EAGLE: cross-entropy weight")
    g.add_argument("--intermediate-size", type=int, default=None, help="head MLP width (default the target's)")
    g = p.add_argument_group("export")
    g.add_argument("--export-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    g.add_argument("--checkpoint", default=None,
                   help="training checkpoint to export (default checkpoints/best.pt: the lowest val_loss, "
                        "else the latest)")
    return p


# ---- stages --------------------------------------------------------------------------

def answers_paths(args) -> list[Path]:
    if args.answers:
        return [Path(p) for p in args.answers.split(",") if p.strip()]
    return [Path(args.work_dir) / "answers.jsonl"]


def answers_path(args) -> Path:
    """The file regenerate writes to."""
    return answers_paths(args)[0]


def _need_answers(args, why: str) -> list[Path]:
    paths = answers_paths(args)
    for path in paths:
        _need_file(path, f"--answers ({why})")
    return paths


def capture_dir(args) -> Path:
    return Path(args.work_dir) / "capture"


def train_dir(args) -> Path:
    return Path(args.work_dir) / f"train_{args.algorithm}"


def run_regenerate(args) -> None:
    from specserve.config import ServerArgs
    from specserve.engine import LLMEngine
    from specserve.train.prompts import load_training_prompts
    from specserve.train.regenerate import regenerate

    prompts = load_training_prompts(args.prompt_dir, limit=args.num_prompts)   # fixed order: indices resume
    quantization = None if args.regen_quantization == "none" else args.regen_quantization
    engine = LLMEngine(ServerArgs.from_kwargs(model_path=args.model_path, dtype=args.regen_dtype,
                                              quantization=quantization, max_running_requests=args.regen_batch,
                                              log_level="warning"))
    written = regenerate(engine, prompts, answers_path(args), max_new_tokens=args.max_new_tokens,
                         first_prompt=args.first_prompt)
    print(f"regenerate: {written} new answers in {answers_path(args)}")


def run_capture(args) -> None:
    from specserve.train.capture import CaptureConfig, capture

    paths = _need_answers(args, "or run --stage regenerate")
    cfg = CaptureConfig(model_path=args.model_path, answers_path=[str(p) for p in paths], out_dir=str(capture_dir(args)),
                        aux_layer_ids=_int_list(args.aux_layer_ids, "--aux-layer-ids"),
                        features=tuple(f.strip() for f in args.capture_features.split(",") if f.strip()),
                        top_k=args.top_k, feature_dtype=args.feature_dtype, batch_tokens=args.capture_batch_tokens,
                        shard_tokens=args.shard_tokens, max_seq_len=args.max_seq_len, max_records=args.max_records,
                        device=args.device, target_dtype=args.capture_dtype,
                        quantization=None if args.capture_quantization == "none" else args.capture_quantization)
    tokens = capture(cfg)
    print(f"capture: {tokens} new tokens in {capture_dir(args)}")


def run_frspec(args) -> None:
    from specserve.train.frspec import count_tokens, top_frequent_ids, write_token_map

    paths = _need_answers(args, "or run --stage regenerate")
    vocab_size = _target_vocab_size(args)
    ids = top_frequent_ids(count_tokens(paths), args.token_map_size, vocab_size)
    if args.token_map_out:
        out = Path(args.token_map_out)
    else:
        out = Path(args.out or args.work_dir) / "frspec_token_map.pt"
    write_token_map(ids, out)
    print(f"frspec: {len(ids)} most frequent ids -> {out}")


def draft_vocab(args, vocab_size: int) -> list[int]:
    """The draft vocabulary of this training run: computed from the answers once, then
    kept in the train folder (so a resumed run uses the same one)."""
    from specserve.train.frspec import count_tokens, top_frequent_ids

    path = train_dir(args) / "draft_vocab.pt"
    if path.is_file():
        ids = torch.load(path, weights_only=True)
        if len(ids) != args.draft_vocab_size:
            raise UsageError(f"--draft-vocab-size {args.draft_vocab_size}: {path} holds {len(ids)} ids from an "
                             f"earlier run; delete it (and the checkpoints) or pass --draft-vocab-size {len(ids)}")
        return list(ids)
    if args.algorithm == "EAGLE3" and args.init_from and Path(args.init_from).is_dir():
        from specserve.train.train_head import exported_vocab_ids, read_exported_head

        ids = exported_vocab_ids(read_exported_head(args.init_from), args.init_from)   # the warm start's own
        if len(ids) != args.draft_vocab_size:
            raise UsageError(f"--draft-vocab-size {args.draft_vocab_size}: the --init-from head has "
                             f"{len(ids)} draft ids; pass --draft-vocab-size {len(ids)}")
    else:
        paths = _need_answers(args, "the draft vocabulary comes from the answers")
        ids = top_frequent_ids(count_tokens(paths), args.draft_vocab_size, vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ids, path)
    return ids


def run_train(args) -> None:
    from specserve.train.train_head import HeadTrainer, TrainConfig, load_target_parts

    target = load_target_parts(args.model_path, args.device)
    vocab = draft_vocab(args, target.config.vocab_size)
    cfg = TrainConfig(algorithm=args.algorithm, capture_dir=str(capture_dir(args)), out_dir=str(train_dir(args)),
                      model_path=args.model_path, num_ttt_steps=args.ttt_steps,
                      step_weight_decay=args.step_weight_decay, seq_len=args.seq_len, batch_size=args.batch_size,
                      epochs=args.epochs, max_steps=args.max_steps, lr=peak_lr(args), min_lr_ratio=args.min_lr_ratio,
                      warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
                      seed=args.seed, device=args.device, bf16=args.bf16, save_every=args.save_every,
                      eval_every=args.eval_every, val_records=args.val_records, resume=args.resume,
                      early_stop_patience=args.early_stop_patience,
                      init_from=args.init_from,
                      ce_weight=args.ce_weight, intermediate_size=args.intermediate_size)
    trainer = HeadTrainer(cfg, vocab, target=target)
    print(f"train: {len(trainer.data)} records ({trainer.data.num_tokens} tokens), {trainer.steps_per_epoch} "
          f"steps/epoch, {trainer.total_steps} steps, from step {trainer.step}")
    metrics = trainer.train()
    shown = {k: round(v, 4) for k, v in metrics.items() if k.startswith(("val_", "acc", "loss", "tok"))}
    print(f"train: done at step {trainer.step}: {shown}")


def peak_lr(args) -> float:
    """--lr, else the default for a fresh head or a warm start (--init-from)."""
    if args.lr is not None:
        return args.lr
    return WARM_START_LR if args.init_from else FRESH_LR


def run_export(args) -> None:
    from specserve.train.export import export_checkpoint
    from specserve.train.train_head import best_checkpoint

    if not args.out:
        raise UsageError("--out is required for the export stage (the head directory to write)")
    checkpoint = Path(args.checkpoint) if args.checkpoint else best_checkpoint(train_dir(args))
    out = export_checkpoint(checkpoint, args.out, model_path=args.model_path, dtype=args.export_dtype)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"export: {checkpoint} -> {out} ({size / 1e6:.1f} MB)")


RUNNERS = {"regenerate": run_regenerate, "capture": run_capture, "frspec": run_frspec, "train": run_train,
           "export": run_export}


# ---- helpers -------------------------------------------------------------------------

def _int_list(text: str | None, flag: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{flag} expects comma-separated integers; got {text!r}") from None


def _need_file(path: Path, flag: str) -> None:
    if not path.is_file():
        raise UsageError(f"{path} does not exist; set {flag}")


def _target_vocab_size(args) -> int:
    from specserve.loading.loader import read_checkpoint, resolve_model_path

    cfg, _ = read_checkpoint(resolve_model_path(args.model_path))
    return cfg.vocab_size


def check_args(args) -> list[str]:
    stages = list(ALL_STAGES) if args.stage == "all" else [args.stage]
    if args.algorithm is None and any(s in STAGES_NEEDING_ALGORITHM for s in stages):
        raise UsageError(f"--algorithm (EAGLE3 or EAGLE) is required for --stage {args.stage}")
    if args.stage == "all" and not args.out:
        raise UsageError("--out is required for --stage all (the exported head directory)")
    if args.threads is not None and args.threads < 1:
        raise UsageError("--threads must be >= 1")
    if args.first_prompt < 0:
        raise UsageError("--first-prompt must be >= 0")
    return stages


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        stages = check_args(args)
        if args.threads:
            torch.set_num_threads(args.threads)
        for stage in stages:
            RUNNERS[stage](args)
    except (ValueError, FileNotFoundError, OverflowError) as exc:
        print(f"specserve train-draft: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
