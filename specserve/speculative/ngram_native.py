"""The n-gram cache in native code (``kernels/ngram_trie.c``): ``NgramCache``'s structure and
results, ~100x cheaper to feed. ``make_ngram_cache`` picks it where the CPU kernels load
(``SPECSERVE_KERNELS=0`` or no compiler: the Python ``NgramCache``, the reference)."""
from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from specserve.kernels import build
from specserve.speculative.ngram_cache import NgramCache, _check_num_new
from specserve.speculative.tree import DraftTree, root_only

if TYPE_CHECKING:
    from specserve.config import ServerArgs

_P, _I32P = ctypes.c_void_p, np.ctypeslib.ndpointer(dtype=np.int32, flags="C_CONTIGUOUS")


def make_ngram_cache(args: "ServerArgs") -> NgramCache:
    """The native cache where the kernels load, else the Python one (same results)."""
    return (NativeNgramCache if native_available() else NgramCache).from_server_args(args)


def native_available() -> bool:
    return _library() is not None


class NativeNgramCache(NgramCache):
    """``NgramCache`` with its trie in C; ``suffix_keys``/``prev_keys`` are not needed (the C
    code hashes the few context tokens it is given) and ``insert_incremental`` returns None."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        lib = _library()
        if lib is None:
            raise RuntimeError("the native n-gram cache needs the CPU kernels (see kernels/build.py)")
        self._lib = lib
        self._handle = lib.ngram_new(self.capacity, self.min_match_window_size, self.max_match_window_size,
                                     self.branch_length, self.min_bfs_breadth, self.max_bfs_breadth)
        if not self._handle:
            raise MemoryError("ngram_new failed")

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._lib.ngram_free(handle)

    @property
    def num_nodes(self) -> int:
        return self._lib.ngram_num_nodes(self._handle)

    def ngram_count(self, ngram: Sequence[int]) -> int:
        ids = _ids(ngram)
        return self._lib.ngram_count(self._handle, ids, len(ids)) if len(ids) else 0

    def clear(self) -> None:
        self._lib.ngram_clear(self._handle)

    def insert_incremental(self, tokens_so_far: Sequence[int], num_new: int,
                           prev_keys: list[int] | None = None) -> None:
        total = len(tokens_so_far)
        _check_num_new(num_new, total)
        ids = _ids(tokens_so_far[max(total - num_new - self.max_depth, 0):])
        if self._lib.ngram_insert(self._handle, ids, len(ids), num_new) != 0:
            raise MemoryError("ngram_insert ran out of memory")
        return None

    def match(self, context_tail: Sequence[int], num_draft_tokens: int | None = None,
              match_type: str | None = None, suffix_keys: list[int] | None = None) -> DraftTree:
        max_nodes, kind = self._match_args(context_tail, num_draft_tokens, match_type)
        tail = _ids(context_tail[-self.max_match_window_size:])
        tokens, parents = np.empty(max_nodes, np.int32), np.empty(max_nodes, np.int32)
        n = self._lib.ngram_match(self._handle, tail, len(tail), max_nodes, int(kind == "PROB"), tokens, parents)
        if n < 1:
            raise MemoryError("ngram_match ran out of memory")
        if n == 1:                      # no match (most steps of a chat answer): the cheap root-only tree
            return root_only(int(tokens[0]))
        return DraftTree(torch.from_numpy(tokens[:n].astype(np.int64)), torch.from_numpy(parents[:n].astype(np.int64)))


def _ids(tokens: Sequence[int]) -> np.ndarray:
    return np.ascontiguousarray(tokens, dtype=np.int32)


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = build.load()
    if lib is None:
        return None
    signatures = {
        "ngram_new": (_P, [ctypes.c_long] + [ctypes.c_int] * 5),
        "ngram_free": (None, [_P]),
        "ngram_clear": (None, [_P]),
        "ngram_num_nodes": (ctypes.c_long, [_P]),
        "ngram_count": (ctypes.c_long, [_P, _I32P, ctypes.c_int]),
        "ngram_insert": (ctypes.c_int, [_P, _I32P, ctypes.c_int, ctypes.c_int]),
        "ngram_match": (ctypes.c_int, [_P, _I32P, ctypes.c_int, ctypes.c_int, ctypes.c_int, _I32P, _I32P]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib
