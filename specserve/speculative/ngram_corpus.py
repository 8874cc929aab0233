"""A read-only corpus of the target's own answers for the NGRAM drafter.

The live n-gram cache knows only what this server has seen: on a fresh chat request it
rarely matches, so NGRAM drafts on few steps. A small model answers in set phrases, and
its answers to other prompts hold them: where the cache has no match, the proposer asks
the corpus (``--speculative-ngram-corpus``; the default model ships one, made from its
answers to training prompts by ``python -m specserve.train.ngram_corpus``).

Design
------
* The corpus is its documents' tokens, each followed by -1, and the suffixes starting at
  a token, ordered by their first ``max_window`` tokens (a suffix's tokens after its first
  -1 count as -1), ties by position: a suffix array, 8 bytes a token, built at load.
* ``match(context_tail, max_nodes)`` tries the context's last w tokens for w from
  ``max_window`` (at most ``MAX_WINDOW``) down to ``min_window``; the suffixes that
  start with them are one range of the order, found by binary search. The first (longest)
  window with a continuation is used: up to ``SAMPLE`` of its occurrences, evenly spaced
  over the range, give continuations of up to min(branch_length, max_nodes - 1) tokens (cut
  at a document's end). They make a small trie whose nodes count the continuations through
  them; the tree keeps the max_nodes - 1 most counted nodes (ties: first reached by an earlier
  continuation, then shallower), so a parent always precedes its children, preferred siblings
  come first, and a smaller cap's tree is a prefix of a larger one's.
This is the reference; ``NativeNgramCorpus`` (``kernels/ngram_corpus.c``) gives the same
trees, a match ~13x faster (~17 against ~230 us on the shipped corpus) and its order built ~4x
faster.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from specserve.speculative.tree import DraftTree, root_only

if TYPE_CHECKING:
    from specserve.config import ServerArgs

MAX_WINDOW = 32
SAMPLE = 64
FORMAT = "specserve-ngram-corpus"
CONFIG_FILE, TOKENS_FILE = "config.json", "corpus.safetensors"


class NgramCorpus:
    def __init__(self, documents: Sequence[Sequence[int]], min_window: int, max_window: int,
                 branch_length: int) -> None:
        if not 1 <= min_window <= max_window or branch_length < 1:
            raise ValueError("need 1 <= min_window <= max_window and branch_length >= 1")
        self.min_window, self.max_window = min_window, min(max_window, MAX_WINDOW)
        self.branch_length = branch_length
        self.tokens = _joined(documents)
        self.num_documents = len(documents)
        self._index()

    def _index(self) -> None:
        self.order = self._suffix_order()

    @classmethod
    def from_server_args(cls, documents: Sequence[Sequence[int]], args: "ServerArgs") -> "NgramCorpus":
        return cls(documents, args.speculative_ngram_min_match_window_size,
                   args.speculative_ngram_max_match_window_size, args.speculative_ngram_branch_length)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) - self.num_documents

    def match(self, context_tail: Sequence[int], max_nodes: int) -> DraftTree:
        tail = [int(t) for t in context_tail[-self.max_window:]]
        if max_nodes <= 1 or len(self.order) == 0:
            return root_only(tail[-1])
        for w in range(min(self.max_window, len(tail)), self.min_window - 1, -1):
            lo, hi = self._range(tail[len(tail) - w:])
            if lo == hi:
                continue
            tokens, parents = _best_nodes(self._continuations(lo, hi, w, max_nodes), tail[-1], max_nodes)
            if len(tokens) > 1:
                return DraftTree(torch.tensor(tokens, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64))
        return root_only(tail[-1])

    def _suffix_order(self) -> np.ndarray:
        starts = np.flatnonzero(self.tokens >= 0)
        padded = np.concatenate([self.tokens, np.full(self.max_window, -1, np.int32)])
        keys = np.stack([padded[starts + k] for k in range(self.max_window)])
        keys[np.maximum.accumulate(keys < 0, axis=0)] = -1     # past a document's end: -1
        return starts[np.lexsort(keys[::-1])].astype(np.int32)   # stable: ties by position

    def _range(self, pattern: list[int]) -> tuple[int, int]:
        """[lo, hi) of the order whose suffixes start with ``pattern``."""
        return self._bound(pattern, upper=False), self._bound(pattern, upper=True)

    def _bound(self, pattern: list[int], upper: bool) -> int:
        lo, hi = 0, len(self.order)
        while lo < hi:
            mid = (lo + hi) // 2
            c = _compare(self.tokens, int(self.order[mid]), pattern)
            if c < 0 or (upper and c == 0):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _continuations(self, lo: int, hi: int, w: int, max_nodes: int) -> list[list[int]]:
        count, depth = hi - lo, min(self.branch_length, max_nodes - 1)
        picks = range(lo, hi) if count <= SAMPLE else (lo + j * count // SAMPLE for j in range(SAMPLE))
        out = []
        for i in picks:
            start = int(self.order[i]) + w
            cont = self.tokens[start:start + depth].tolist()
            out.append(cont[:cont.index(-1)] if -1 in cont else cont)
        return out


def _joined(documents: Sequence[Sequence[int]]) -> np.ndarray:
    parts = []
    for doc in documents:
        ids = np.asarray(doc, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
            raise ValueError("corpus token ids must be non-negative int32")
        parts += [ids.astype(np.int32), np.array([-1], np.int32)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def _compare(tokens: np.ndarray, start: int, pattern: list[int]) -> int:
    """The suffix at ``start`` against ``pattern`` over len(pattern) tokens: -1, 0 or 1."""
    for k, p in enumerate(pattern):
        t = int(tokens[start + k]) if start + k < len(tokens) else -1
        if t != p:
            return -1 if t < p else 1
    return 0


def _best_nodes(continuations: list[list[int]], root: int, max_nodes: int) -> tuple[list[int], list[int]]:
    """The max_nodes - 1 most counted nodes of the continuations' trie, below ``root``; ties go
    to the node first reached by an earlier continuation, then to the shallower. A node's key
    does not depend on how deep the continuations were read, and a parent's comes before its
    children's, so a smaller cap's tree is a prefix of a larger one's (``Proposer.is_cheap``)."""
    token, parent, count, key_of, children = [root], [-1], [0], [None], [{}]
    for j, cont in enumerate(continuations):
        node = 0
        for depth, t in enumerate(cont, start=1):
            child = children[node].get(t)
            if child is None:
                child = children[node][t] = len(token)
                token.append(t), parent.append(node), count.append(0), key_of.append((j, depth)), children.append({})
            count[child] += 1
            node = child
    kept = sorted(range(1, len(token)), key=lambda i: (-count[i], key_of[i]))[:max_nodes - 1]
    index = {0: 0}
    for i in kept:
        index[i] = len(index)
    return [root] + [token[i] for i in kept], [-1] + [index[parent[i]] for i in kept]


def is_corpus_folder(path: str | Path) -> bool:
    folder = Path(path)
    return (folder / CONFIG_FILE).is_file() and (folder / TOKENS_FILE).is_file()


def read_corpus_documents(path: str | Path) -> tuple[list[list[int]], dict]:
    """The documents and config of a corpus folder (``config.json`` + ``corpus.safetensors``)."""
    from safetensors.torch import load_file

    folder = Path(path)
    config_path, tokens_path = folder / CONFIG_FILE, folder / TOKENS_FILE
    if not is_corpus_folder(folder):
        raise FileNotFoundError(f"{folder}: not an n-gram corpus folder (needs {CONFIG_FILE} and {TOKENS_FILE})")
    config = json.loads(config_path.read_text())
    if config.get("format") != FORMAT:
        raise ValueError(f"{config_path}: format is {config.get('format')!r}, not {FORMAT!r}")
    tensors = load_file(str(tokens_path))
    tokens, offsets = tensors["tokens"].tolist(), tensors["offsets"].tolist()
    return [tokens[a:b] for a, b in zip(offsets, offsets[1:])], config


def write_corpus(documents: Sequence[Sequence[int]], out: str | Path, config: dict) -> Path:
    from safetensors.torch import save_file

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    offsets = np.cumsum([0] + [len(d) for d in documents])
    tokens = torch.tensor([t for d in documents for t in d], dtype=torch.int32)
    save_file({"tokens": tokens, "offsets": torch.from_numpy(offsets.astype(np.int64))}, str(folder / TOKENS_FILE))
    config = dict(config, format=FORMAT, documents=len(documents), tokens=int(offsets[-1]))
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
    return folder
