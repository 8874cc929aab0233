"""Strict weight loading onto a module: every checkpoint tensor placed, every
parameter filled, every shape checked; errors name the tensor.

A checkpoint tensor may carry ``block_codes`` (``kernels.coded.BlockCodes``, from a quantized
GGUF): when every row of a parameter came with codes, the parameter gets them as its own
``block_codes`` attribute (fused parameters: the parts' codes stacked in row order).

Parameters named ``codes_only`` keep no dense copy where their codes are all a kernel needs: a
part whose codes rebuild its values exactly is not copied, and once the parameter is whole,
if ``codes_suffice(codes)`` it becomes a meta tensor carrying them (its values never written,
so never resident: a GGUF's decoder layers need ~4 bytes a weight less while loading), handed
at once to ``on_codes_only`` (its module); else the skipped rows are written from their codes
(the same values)."""
from __future__ import annotations

import contextlib
from typing import Callable, Collection, Iterable, Iterator

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
    def __init__(self, module: nn.Module, codes_only: Collection[str] = (),
                 codes_suffice: Callable[[BlockCodes], bool] | None = None,
                 on_codes_only: Callable[[nn.Module], None] | None = None) -> None:
        self.module = module
        self.params = dict(module.named_parameters())
        self.codes_only = set(codes_only) if codes_suffice is not None else set()
        self.codes_suffice, self.on_codes_only = codes_suffice, on_codes_only
        self.skipped: dict[str, list[tuple[int, BlockCodes]]] = {}   # codes_only parts not copied
        self.copied: set[str] = set()                                   # codes_only parameters with parts copied
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
        if target in self.codes_only and param.is_meta:
            raise WeightLoadError(f"checkpoint tensor {name!r} loads rows of {target!r} already loaded")
        dest = param.data if num_rows is None else param.data[row0:row0 + num_rows]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise WeightLoadError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(dest.shape)} (for parameter {target!r})")
        codes = getattr(tensor, "block_codes", None)
        if target in self.codes_only and codes is not None and _rebuilds_exactly(codes, tensor):
            self.skipped.setdefault(target, []).append((row0, codes))
        else:
            dest.copy_(_values(tensor).to(dest.dtype))
            if target in self.codes_only:
                self.copied.add(target)
        self.rows_loaded[target] += dest.shape[0] if dest.dim() else 1
        if codes is not None and dest.dim() == 2:
            self.codes.setdefault(target, []).append((row0, codes))
        if target in self.skipped and self.rows_loaded[target] == param.shape[0]:
            self._settle(target)

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

    def _settle(self, name: str) -> None:
        """A whole parameter with skipped parts: a meta tensor carrying its codes where every part
        was skipped and they suffice (then ``on_codes_only`` of its module, e.g. to pack them at
        once), else its skipped rows written from their codes."""
        skipped = self.skipped.pop(name)
        codes = None if name in self.copied else self._whole_codes(name)
        if codes is not None and self.codes_suffice(codes):
            del self.codes[name]
            self._replace_with_meta(name, codes)
            return
        param = self.params[name]
        for row0, part in skipped:
            param.data[row0:row0 + part.shape[0]].copy_(part.expand().to(param.dtype))

    def _replace_with_meta(self, name: str, codes: BlockCodes) -> None:
        owner_name, _, attr = name.rpartition(".")
        owner, param = self.module.get_submodule(owner_name), self.params[name]
        meta = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=False)
        meta.block_codes = codes
        setattr(owner, attr, meta)
        self.params[name] = meta
        if self.on_codes_only is not None:
            self.on_codes_only(owner)

    def _whole_codes(self, name: str) -> BlockCodes | None:
        """The parts' codes stacked in row order, if they cover the whole parameter."""
        param = self.params[name]
        parts = sorted(self.codes.get(name, []), key=lambda part: part[0])
        if sum(codes.shape[0] for _, codes in parts) != param.shape[0]:
            return None
        codes = BlockCodes.cat([codes for _, codes in parts])
        return codes if codes is not None and codes.shape == tuple(param.shape) else None

    def _attach_codes(self) -> None:
        for name in self.codes:
            codes = self._whole_codes(name)
            if codes is not None:
                self.params[name].block_codes = codes


def _values(tensor: torch.Tensor) -> torch.Tensor:
    """A checkpoint tensor's values: a meta tensor carrying ``block_codes`` stands for theirs
    (``read_checkpoint``'s ``dense_from_blocks``)."""
    codes = getattr(tensor, "block_codes", None)
    if tensor.is_meta and codes is not None:
        return codes.expand()
    return tensor


def _rebuilds_exactly(codes: BlockCodes, tensor: torch.Tensor) -> bool:
    """Whether the codes give the checkpoint tensor's values (``BlockCodes.rebuilds``); a meta
    tensor's values are its own codes' (``_values``)."""
    if tensor.is_meta:
        return codes.shape == tuple(tensor.shape) and getattr(tensor, "block_codes", None) is codes
    return codes.rebuilds(tensor)
