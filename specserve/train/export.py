"""Step (d): a trained head as a serving checkpoint directory, in the published formats
(``LlamaForCausalLMEagle3`` / ``LlamaForCausalLMEagle``): ``model.safetensors`` (floating
tensors in bfloat16 by default; ``d2t`` int64 and ``t2d`` bool kept) and ``config.json``.
``models/draft_heads.load_draft_head`` reads it back."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from specserve.train.train_head import build_head, load_target_parts, load_trainable_state

logger = logging.getLogger(__name__)

EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def export_config(head, algorithm: str) -> dict:
    """config.json of the head: its ModelConfig in HF form plus the format's keys."""
    cfg = head.config
    out = cfg.to_hf()
    out.update(num_hidden_layers=1, tie_word_embeddings=False)
    out.pop("bos_token_id", None)
    out.pop("eos_token_id", None)
    if algorithm == "EAGLE3":
        out["draft_vocab_size"] = int(head.draft_vocab_size)
        out["target_hidden_size"] = cfg.hidden_size
        out["eagle_config"] = dict(cfg.extra["eagle_config"])
    else:
        out["bias"] = head.fc.bias is not None
    return out


def head_tensors(head, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's checkpoint tensors, floating ones cast to ``dtype``."""
    tensors = head.checkpoint_tensors()
    return {name: (t.to(dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
            for name, t in tensors.items()}


def model_card(algorithm: str, config: dict, info: dict) -> str:
    """README.md of an exported head: what it is, what it was trained on, how it did on held-out
    records (the serving accept length is measured by ``specserve bench speculative``)."""
    train = info.get("train_config", {})
    held_out = info.get("held_out_metrics") or {}
    accs = [f"{v:.3f}" for k, v in held_out.items() if k.startswith("val_acc")]    # in step order
    lines = [f"# {config['architectures'][0]} draft head", "",
             f"- algorithm: {algorithm}; hidden {config['hidden_size']}, one decoder layer"
             + (f", draft vocabulary {config['draft_vocab_size']}" if "draft_vocab_size" in config else ""),
             f"- target: {train.get('model_path') or 'the default model (SmolLM2-135M-Instruct Q4_1 GGUF)'}",
             f"- trained by `specserve train-draft`: {info.get('step')} optimizer steps of {train.get('batch_size')} "
             f"x {train.get('seq_len')} tokens, lr {train.get('lr')}, {train.get('num_ttt_steps')} unrolled steps, "
             f"warm start: {train.get('init_from') or 'none'}",
             f"- data: the target's own features in {train.get('capture_dir')}",
             f"- held-out top-1 agreement with the target per unrolled step: {', '.join(accs) or 'not evaluated'}",
             "", "Accept lengths and speedups served: `specserve bench speculative --algorithm "
             f"{algorithm} --draft-model-path THIS_FOLDER --quantization gguf --dtype float32`.", ""]
    return "\n".join(lines)


def export_head(head, algorithm: str, out_dir: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                extra_info: dict | None = None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = head_tensors(head, dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = export_config(head, algorithm)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if extra_info:
        (out / "training_info.json").write_text(json.dumps(extra_info, indent=2) + "\n")
        (out / "README.md").write_text(model_card(algorithm, config, extra_info))
    size = (out / "model.safetensors").stat().st_size
    logger.info("exported %s head to %s (%.1f MB)", algorithm, out, size / 1e6)
    return out


def export_checkpoint(checkpoint_path: str | os.PathLike, out_dir: str | os.PathLike, *,
                      model_path: str | None = None, dtype: str = "bfloat16", target=None) -> Path:
    """Rebuild the head of a training checkpoint (``train_head.HeadTrainer``) and export it."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"--export-dtype must be one of {tuple(EXPORT_DTYPES)}; got {dtype!r}")
    state = torch.load(checkpoint_path, map_location="cpu", weights_only=False)
    algorithm, cfg = state["algorithm"], state["config"]
    target = target if target is not None else load_target_parts(model_path or cfg.get("model_path"))
    head = build_head(algorithm, target, state["vocab_ids"], aux_layer_ids=state["aux_layer_ids"],
                      intermediate_size=cfg.get("intermediate_size"))
    load_trainable_state(head, state["head"])
    info = {"algorithm": algorithm, "step": state["step"], "checkpoint": str(checkpoint_path),
            "aux_layer_ids (target layer inputs)": state["aux_layer_ids"],
            "held_out_metrics": state.get("val_metrics"),
            "train_config": {k: v for k, v in cfg.items() if k not in ("resume",)}}
    return export_head(head, algorithm, out_dir, EXPORT_DTYPES[dtype], info)
