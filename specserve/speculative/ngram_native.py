"""The n-gram cache and corpus in native code (``kernels/ngram_trie.c``, ``ngram_corpus.c``):
``NgramCache``'s and ``NgramCorpus``'s structures and results, ~100x and ~13x cheaper.
``make_ngram_cache`` and ``make_ngram_corpus`` pick them where the CPU kernels load
(``SPECSERVE_KERNELS=0`` or no compiler: the Python classes, the references)."""
from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from specserve.kernels import build
from specserve.speculative.ngram_cache import NgramCache, _check_num_new
from specserve.speculative.ngram_corpus import NgramCorpus
from specserve.speculative.tree import DraftTree, root_only

if TYPE_CHECKING:
    from specserve.config import ServerArgs

_P, _I32P = ctypes.c_void_p, np.ctypeslib.ndpointer(dtype=np.int32, flags="C_CONTIGUOUS")


def make_ngram_cache(args: "ServerArgs") -> NgramCache:
    """The native cache where the kernels load, else the Python one (same results)."""
    return (NativeNgramCache if native_available() else NgramCache).from_server_args(args)


def make_ngram_corpus(documents, args: "ServerArgs") -> NgramCorpus:
    """The native corpus where the kernels load, else the Python one (same trees)."""
    return (NativeNgramCorpus if native_available() else NgramCorpus).from_server_args(documents, args)


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
        self._ids = self._out_tokens = self._out_parents = np.empty(0, np.int32)    # feed_and_match's buffers

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
        return _tree(tokens, parents, n)

    def feed_and_match(self, context: Sequence[int], num_new: int, num_draft_tokens: int | None = None,
                       suffix_keys: list[int] | None = None) -> tuple[DraftTree, None]:
        """``NgramCache.feed_and_match`` in one native call on reused buffers."""
        total = len(context)
        _check_num_new(num_new, total)
        max_nodes, kind = self._match_args(context, num_draft_tokens, None)
        ids = context[max(total - num_new - self.max_depth, 0):]
        if len(ids) > len(self._ids) or max_nodes > len(self._out_tokens):
            self._grow_buffers(len(ids), max_nodes)
        self._ids[:len(ids)] = ids
        n = self._lib.ngram_feed_match(self._handle, self._ids_address, len(ids), num_new, max_nodes,
                                       int(kind == "PROB"), self._tokens_address, self._parents_address)
        if n == 1:                      # no match: the root is the context's last token
            return root_only(context[-1]), None
        return _tree(self._out_tokens, self._out_parents, n), None

    def _grow_buffers(self, num_ids: int, max_nodes: int) -> None:
        """feed_and_match's input and output arrays, reused call after call and passed by address:
        in a decode step, after the weights went through the caches, each fresh array and each
        checked array argument cost microseconds (the call took ~0.1 ms; C alone ~0.015)."""
        self._ids = np.empty(max(num_ids, 2 * len(self._ids), 64), np.int32)
        nodes = max(max_nodes, len(self._out_tokens), 16)
        self._out_tokens, self._out_parents = np.empty(nodes, np.int32), np.empty(nodes, np.int32)
        self._ids_address = self._ids.ctypes.data
        self._tokens_address, self._parents_address = self._out_tokens.ctypes.data, self._out_parents.ctypes.data


class NativeNgramCorpus(NgramCorpus):
    """``NgramCorpus`` with its suffix order and matching in C (the order built there too)."""

    def _index(self) -> None:
        self._lib = _library()
        if self._lib is None:
            raise RuntimeError("the native n-gram corpus needs the CPU kernels (see kernels/build.py)")
        self._handle = self._lib.corpus_new(self.tokens, len(self.tokens), self.min_window, self.max_window,
                                            self.branch_length)
        if not self._handle:
            raise MemoryError("corpus_new failed")
        self._out_tokens = self._out_parents = np.empty(0, np.int32)

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._lib.corpus_free(handle)

    def match(self, context_tail: Sequence[int], max_nodes: int) -> DraftTree:
        tail = _ids(context_tail[-self.max_window:])
        if max_nodes > len(self._out_tokens):
            self._out_tokens, self._out_parents = np.empty(max_nodes, np.int32), np.empty(max_nodes, np.int32)
        n = self._lib.corpus_match(self._handle, tail, len(tail), max_nodes, self._out_tokens, self._out_parents)
        return _tree(self._out_tokens, self._out_parents, n)


def _tree(tokens: np.ndarray, parents: np.ndarray, n: int) -> DraftTree:
    """The tree of a native match's first n nodes (n < 1: it ran out of memory)."""
    if n < 1:
        raise MemoryError("the native n-gram cache ran out of memory")
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
        "ngram_feed_match": (ctypes.c_int, [_P, _P] + [ctypes.c_int] * 4 + [_P, _P]),      # buffers by address
        "corpus_new": (_P, [_I32P, ctypes.c_long] + [ctypes.c_int] * 3),
        "corpus_free": (None, [_P]),
        "corpus_match": (ctypes.c_int, [_P, _I32P, ctypes.c_int, ctypes.c_int, _I32P, _I32P]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib
