"""Read an HF checkpoint directory: config.json plus one or many ``*.safetensors`` files."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from specserve.config import ModelConfig

WeightIterator = Iterator[tuple[str, torch.Tensor]]
SHARD_INDEX = "model.safetensors.index.json"


def read_safetensors_dir(path: str | os.PathLike) -> tuple[ModelConfig, WeightIterator]:
    """``(config, iterator of (name, tensor))``; tensors keep their stored dtype and load lazily."""
    directory = Path(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in checkpoint directory {directory}")
    config = ModelConfig.from_hf(json.loads(config_file.read_text()))
    files = safetensors_files(directory)
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in checkpoint directory {directory}")
    return config, _iter_tensors(files)


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files: those named by the shard index when there is one, else every *.safetensors."""
    index_file = directory / SHARD_INDEX
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    return sorted(directory.glob("*.safetensors"))


def _iter_tensors(files: list[Path]) -> WeightIterator:
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
