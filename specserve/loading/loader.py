"""Find a checkpoint and read it, whatever its format (GGUF file or HF safetensors directory)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import torch

from specserve.config import ConfigError, ModelConfig

WeightIterator = Iterator[tuple[str, torch.Tensor]]


SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "MiMoForCausalLM")


def resolve_model_path(model_path: str | None, revision: str | None = None,
                       flag: str = "--model-path") -> str:
    """A local path for ``model_path`` (a Hub id is downloaded into the HF cache), or the default
    model's GGUF (fetched if needed) when None. Errors are ``ConfigError`` naming ``flag``."""
    if model_path is None:
        from specserve.loading.default_model import ensure_default_model

        return ensure_default_model()
    from specserve.loading.hub import resolve_checkpoint

    return resolve_checkpoint(os.fspath(model_path), flag, revision)


def check_load_format(path: str | os.PathLike, load_format: str | None, flag: str = "--load-format") -> None:
    """``auto`` takes what is there; ``safetensors`` / ``gguf`` must match the checkpoint."""
    if load_format in (None, "auto"):
        return
    if load_format not in ("safetensors", "gguf"):
        raise ConfigError(f"{flag} {load_format}: not supported here (supported: auto, safetensors, gguf)")
    found = checkpoint_format(path)
    if found != load_format:
        raise ConfigError(f"{flag} {load_format}: {path} is a {found} checkpoint")


def check_architecture(config: ModelConfig, path: str, flag: str = "--model-path") -> None:
    if config.architecture not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"{flag} {path}: architecture {config.architecture} is not supported "
                          f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")


def checkpoint_format(path: str | os.PathLike) -> str:
    """``"gguf"`` for a .gguf file, ``"safetensors"`` for an HF directory; errors name the path."""
    checkpoint = Path(path)
    if not checkpoint.exists():
        raise FileNotFoundError(f"model path does not exist: {checkpoint}")
    if checkpoint.is_file():
        if checkpoint.suffix.lower() == ".gguf":
            return "gguf"
        raise ValueError(f"unsupported model file {checkpoint}: expected a .gguf file "
                         f"or an HF directory with config.json and *.safetensors")
    if (checkpoint / "config.json").is_file():
        return "safetensors"
    raise ValueError(f"model directory {checkpoint} has no config.json; expected a .gguf file "
                     f"or an HF directory with config.json and *.safetensors")


def read_checkpoint(path: str | os.PathLike, dense_from_blocks: bool = False) -> tuple[ModelConfig, WeightIterator]:
    """``(config, iterator of (HF name, tensor))`` for a GGUF file or an HF safetensors directory.

    GGUF tensors come dequantized to float32 (``dense_from_blocks``: block-coded matrices as
    meta tensors carrying their blocks, for ``StrictLoader``); safetensors tensors keep their
    stored dtype.
    """
    if checkpoint_format(path) == "gguf":
        from specserve.loading.gguf import read_gguf

        return read_gguf(path, dense_from_blocks)
    from specserve.loading.safetensors import read_safetensors_dir

    return read_safetensors_dir(path)
