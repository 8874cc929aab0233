"""Export any checkpoint we can read as an HF directory that transformers loads.

Used to compare our engine against transformers on exactly the same (dequantized) weights.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from specserve.loading.loader import read_checkpoint


def export_hf_dir(model_path: str | os.PathLike, out_dir: str | os.PathLike,
                  dtype: torch.dtype = torch.float32) -> Path:
    """Write config.json, generation_config.json, model.safetensors, tokenizer.json and
    tokenizer_config.json for ``model_path`` (GGUF file or HF directory) into ``out_dir``."""
    from specserve.tokenizer import Tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config, weights = read_checkpoint(model_path)
    tokenizer = Tokenizer.load(model_path)
    config = dataclasses.replace(config, torch_dtype=str(dtype).removeprefix("torch."))
    _write_json(out / "config.json", config.to_hf())
    _write_json(out / "generation_config.json", _generation_config(config))
    save_file(_state_dict(weights, config.tie_word_embeddings, dtype), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    write_hf_tokenizer(tokenizer, out, model_max_length=config.max_position_embeddings)
    return out


def write_hf_tokenizer(tokenizer, out_dir: Path, model_max_length: int) -> None:
    """tokenizer.json and tokenizer_config.json (with chat template and bos/eos) for ``tokenizer``."""
    tokenizer.backend.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.eos_token,
        "chat_template": tokenizer.chat_template,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    })


def _state_dict(weights, tied: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {name: tensor.to(dtype).contiguous() for name, tensor in weights
            if not (tied and name == "lm_head.weight")}


def _generation_config(config) -> dict:
    eos = list(config.eos_token_ids)
    return {"bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "pad_token_id": eos[0] if eos else None}


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
