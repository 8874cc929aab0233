"""Strict weight loading onto a module: every checkpoint tensor placed, every
parameter filled, every shape checked; errors name the tensor.

A checkpoint tensor may carry ``block_codes`` (``kernels.coded.BlockCodes``, from a quantized
GGUF): when every row of a parameter came with codes, the parameter gets them as its own
``block_codes`` attribute (fused parameters: the parts' codes stacked in row order)."""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
from torch import nn

from specserve.kernels.coded import BlockCodes


class WeightLoadError(ValueError):
    pass


@contextlib.contextmanager
def built_on_meta() -> Iterator[None]:
    """Modules built inside go on the meta device, with ``torch.nn.init``'s functions skipped: their
    values are all loaded strictly afterwards. The first of those calls imports ``torch._dynamo``
    (~0.5 s of a server's startup) only to fill tensors that hold no data."""
    names = [name for name in dir(torch.nn.init) if name.endswith("_") and not name.startswith("_")]
    saved = {name: getattr(torch.nn.init, name) for name in names}
    try:
        for name in names:
            setattr(torch.nn.init, name, _left_as_is)
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def _left_as_is(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


class StrictLoader:
    def __init__(self, module: nn.Module) -> None:
        self.params = dict(module.named_parameters())
        self.rows_loaded = {name: 0 for name in self.params}
        self.fused: list[tuple[str, str, int, int]] = []   # (src infix, dst infix, row0, rows)
        self.ignored_names: set[str] = set()
        self.ignored_suffixes: list[str] = []
        self.codes: dict[str, list[tuple[int, BlockCodes]]] = {}   # param -> (row0, codes) parts

    def add_fused(self, src: str, dst: str, row0: int, num_rows: int) -> None:
        self.fused.append((f".{src}.", f".{dst}.", row0, num_rows))

    def ignore(self, name: str) -> None:
        self.ignored_names.add(name)

    def ignore_suffix(self, suffix: str) -> None:
        self.ignored_suffixes.append(suffix)

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named_tensors:
            if name in self.ignored_names or any(name.endswith(s) for s in self.ignored_suffixes):
                continue
            self._place(name, tensor)
        self._check_complete()
        self._attach_codes()

    def _place(self, name: str, tensor: torch.Tensor) -> None:
        target, row0, num_rows = self._target(name)
        param = self.params[target]
        dest = param.data if num_rows is None else param.data[row0:row0 + num_rows]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise WeightLoadError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(dest.shape)} (for parameter {target!r})")
        dest.copy_(tensor.to(dest.dtype))
        self.rows_loaded[target] += dest.shape[0] if dest.dim() else 1
        codes = getattr(tensor, "block_codes", None)
        if codes is not None and dest.dim() == 2:
            self.codes.setdefault(target, []).append((row0, codes))

    def _target(self, name: str) -> tuple[str, int, int | None]:
        if name in self.params:
            return name, 0, None
        for src, dst, row0, num_rows in self.fused:
            if src in name:
                fused_name = name.replace(src, dst)
                if fused_name in self.params:
                    return fused_name, row0, num_rows
        raise WeightLoadError(f"checkpoint tensor {name!r} does not match any parameter of the model")

    def _check_complete(self) -> None:
        missing = [n for n, p in self.params.items()
                   if self.rows_loaded[n] != (p.shape[0] if p.dim() else 1)]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise WeightLoadError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")

    def _attach_codes(self) -> None:
        for name, parts in self.codes.items():
            param = self.params[name]
            parts.sort(key=lambda part: part[0])
            rows = sum(codes.shape[0] for _, codes in parts)
            codes = BlockCodes.cat([codes for _, codes in parts]) if rows == param.shape[0] else None
            if codes is not None and codes.shape == tuple(param.shape):
                param.block_codes = codes
