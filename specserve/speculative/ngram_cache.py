"""NGRAM drafter's data structure: a bounded, shared trie of recent n-grams.

Design
------
* A trie over token sequences. A node stands for an n-gram s (its path from
  the root) of length <= ``max_depth = max_match_window_size + branch_length``
  and records ``count`` (occurrences of s fed so far), ``last_used`` (clock of
  the last feed that contained s) and its children ``{token: child}``.
* ``insert(tokens)`` feeds, for every start position i, the window
  ``tokens[i : i + max_depth]``, i.e. every n-gram of length <= max_depth is
  counted once per occurrence. ``insert_incremental(tokens, num_new)`` feeds
  only the n-grams that END at one of the ``num_new`` new tokens, so a
  sequence inserted piecewise gives the same counts as one ``insert``.
* Nodes are also indexed by a 61-bit polynomial hash of their n-gram
  (hash-consing), so the node of any context window is one dict lookup and
  extending all the windows ending at a new token costs O(max_depth) per token
  instead of walking the trie from the root. A hash collision (probability
  ~1e-18 per pair) could only produce a bad draft, which verification rejects.
* Capacity: at most ``capacity`` nodes (the root not counted). Nodes are kept
  in least-recently-used order (a feed or a match that uses a node refreshes
  it); after each insert the oldest nodes are evicted and unlinked from their
  parent. Evicting an inner node keeps its descendants findable by hash.
* ``match(context_tail)`` tries the suffix windows of the context from
  ``max_match_window_size`` down to ``min_match_window_size``; the first
  (longest) window whose node has a continuation is the draft root. From it a
  ``DraftTree`` of at most ``num_draft_tokens`` nodes (root = last context
  token) and depth <= ``branch_length`` is built:
    - BFS: level by level, each node keeps up to ``breadth`` children, the most
      recently seen first (ties: more frequent first). ``breadth`` shrinks
      linearly with the matched window length, from ``max_bfs_breadth`` at
      ``min_match_window_size`` to ``min_bfs_breadth`` at
      ``max_match_window_size``: a long match is trusted, a short one hedged.
    - PROB: best-first over the whole continuation: a node's score is the
      product of ``count(child) / sum(count(siblings))`` along its path; the
      highest-scoring frontier node is added next.
  Nodes are emitted parents-first, preferred children first.
Pure Python (dicts and lists); no model, no tensors except the returned tree.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import TYPE_CHECKING, Sequence

import torch

from specserve.speculative.tree import DraftTree

if TYPE_CHECKING:
    from specserve.config import ServerArgs

MATCH_TYPES = ("BFS", "PROB")
_MOD = (1 << 61) - 1  # Mersenne prime modulus of the n-gram hash
_BASE = 0x9E3779B97F4A7C15 % _MOD
_ROOT = 0  # key of the empty n-gram
# node record layout (a list, for speed)
_TOKEN, _COUNT, _LAST_USED, _PARENT, _CHILDREN = range(5)


class NgramCache:
    """Shared n-gram trie with LRU eviction; see the module docstring."""

    def __init__(self, capacity: int = 10_000_000, min_match_window_size: int = 1,
                 max_match_window_size: int = 12, branch_length: int = 18,
                 min_bfs_breadth: int = 1, max_bfs_breadth: int = 10, match_type: str = "BFS",
                 num_draft_tokens: int = 12):
        if capacity < 1 or branch_length < 1 or num_draft_tokens < 1:
            raise ValueError("capacity, branch_length and num_draft_tokens must be >= 1")
        if not 1 <= min_match_window_size <= max_match_window_size:
            raise ValueError("need 1 <= min_match_window_size <= max_match_window_size")
        if not 1 <= min_bfs_breadth <= max_bfs_breadth:
            raise ValueError("need 1 <= min_bfs_breadth <= max_bfs_breadth")
        _check_match_type(match_type)
        self.capacity = capacity
        self.min_match_window_size = min_match_window_size
        self.max_match_window_size = max_match_window_size
        self.branch_length = branch_length
        self.min_bfs_breadth = min_bfs_breadth
        self.max_bfs_breadth = max_bfs_breadth
        self.match_type = match_type.upper()
        self.num_draft_tokens = num_draft_tokens
        self.max_depth = max_match_window_size + branch_length  # longest stored n-gram
        self._nodes: OrderedDict[int, list] = OrderedDict()  # key -> record, oldest first
        self._root_children: dict[int, int] = {}  # token -> key of the unigram
        self._clock = 0

    @classmethod
    def from_server_args(cls, args: "ServerArgs") -> "NgramCache":
        return cls(capacity=args.speculative_ngram_capacity,
                   min_match_window_size=args.speculative_ngram_min_match_window_size,
                   max_match_window_size=args.speculative_ngram_max_match_window_size,
                   branch_length=args.speculative_ngram_branch_length,
                   min_bfs_breadth=args.speculative_ngram_min_bfs_breadth,
                   max_bfs_breadth=args.speculative_ngram_max_bfs_breadth,
                   match_type=args.speculative_ngram_match_type,
                   num_draft_tokens=(args.speculative_num_draft_tokens
                                     or args.speculative_ngram_max_match_window_size))

    # ---- inspection -------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        """Stored n-grams (trie nodes without the root)."""
        return len(self._nodes)

    def ngram_count(self, ngram: Sequence[int]) -> int:
        """Occurrences recorded for ``ngram`` (0 if absent or evicted)."""
        if not ngram:
            return 0
        rec = self._nodes.get(_hash(ngram))
        return rec[_COUNT] if rec is not None and rec[_TOKEN] == ngram[-1] else 0

    def clear(self) -> None:
        self._nodes.clear()
        self._root_children.clear()

    # ---- insertion --------------------------------------------------------------

    def insert(self, tokens: Sequence[int]) -> None:
        """Feed every n-gram (length <= max_depth) of ``tokens``."""
        self.insert_incremental(tokens, len(tokens))

    def insert_incremental(self, tokens_so_far: Sequence[int], num_new: int,
                           prev_keys: list[int] | None = None) -> list[int]:
        """Feed the n-grams of ``tokens_so_far`` that end at one of its last ``num_new`` tokens.
        Returns the keys of the windows ending at its last token, longest first (lengths
        max_depth-1 .. 1): pass them as ``prev_keys`` to the next call on the same sequence (or
        as ``match``'s ``suffix_keys``) and they are not hashed again."""
        total_len = len(tokens_so_far)
        _check_num_new(num_new, total_len)
        start = total_len - num_new
        self._clock += 1
        # keys of the n-grams ending just before `start`, longest first (lengths max_depth-1 .. 1)
        prev = list(prev_keys) if prev_keys is not None else _suffix_keys(tokens_so_far, start, self.max_depth - 1)
        for pos in range(start, total_len):
            token = tokens_so_far[pos]
            code = token + 1
            keys = [(k * _BASE + code) % _MOD for k in prev]
            keys.append(code)
            prev.append(_ROOT)  # parents of `keys`, aligned
            self._feed(keys, prev, token)
            prev = keys if len(keys) < self.max_depth else keys[1:]
        self._evict()
        return prev

    def _feed(self, keys: list[int], parent_keys: list[int], token: int) -> None:
        """Count one occurrence of each n-gram in ``keys`` (all end with ``token``) and link it
        under its parent (a parent that was evicted is skipped: the child stays findable by hash)."""
        nodes, now = self._nodes, self._clock
        get, move_to_end = nodes.get, nodes.move_to_end
        for key, parent in zip(keys, parent_keys):
            rec = get(key)
            if rec is None:
                nodes[key] = [token, 1, now, parent, None]
            else:
                rec[_COUNT] += 1
                rec[_LAST_USED] = now
                move_to_end(key)
            if parent == _ROOT:
                self._root_children[token] = key
                continue
            prec = get(parent)
            if prec is not None:
                children = prec[_CHILDREN]
                if children is None:
                    prec[_CHILDREN] = {token: key}
                else:
                    children[token] = key

    def _evict(self) -> None:
        nodes = self._nodes
        while len(nodes) > self.capacity:
            key, rec = nodes.popitem(last=False)
            parent, token = rec[_PARENT], rec[_TOKEN]
            if parent == _ROOT:
                children = self._root_children
            else:
                prec = nodes.get(parent)
                children = prec[_CHILDREN] if prec is not None else None
            if children is not None and children.get(token) == key:
                del children[token]

    # ---- matching ---------------------------------------------------------------

    def match(self, context_tail: Sequence[int], num_draft_tokens: int | None = None,
              match_type: str | None = None, suffix_keys: list[int] | None = None) -> DraftTree:
        """Draft tree continuing ``context_tail`` (root = its last token); root-only if no match.
        ``suffix_keys``: ``insert_incremental``'s keys for a sequence ending with this tail."""
        max_nodes, kind = self._match_args(context_tail, num_draft_tokens, match_type)
        root_token = context_tail[-1]
        found = self._find_window(context_tail, suffix_keys)
        if found is None or max_nodes == 1:
            return DraftTree.from_lists([root_token], [-1])
        rec, window_len = found
        if kind == "BFS":
            tokens, parents = self._build_bfs(rec, self._bfs_breadth(window_len), max_nodes)
        else:
            tokens, parents = self._build_prob(rec, max_nodes)
        return DraftTree.from_lists(tokens, parents)

    def feed_and_match(self, context: Sequence[int], num_new: int, num_draft_tokens: int | None = None,
                       suffix_keys: list[int] | None = None) -> tuple[DraftTree, list[int] | None]:
        """A proposer's step in one call: ``insert_incremental(context, num_new, suffix_keys)``
        when there is something new, then ``match`` of the context's tail. Returns the tree and
        the suffix keys after the feed (for the next call)."""
        if num_new:
            suffix_keys = self.insert_incremental(context, num_new, suffix_keys)
        tail = context[-self.max_match_window_size:]
        return self.match(tail, num_draft_tokens, suffix_keys=suffix_keys), suffix_keys

    def _match_args(self, context_tail: Sequence[int], num_draft_tokens: int | None,
                    match_type: str | None) -> tuple[int, str]:
        """``match``'s checked arguments: (tree size cap, "BFS" or "PROB")."""
        if not context_tail:
            raise ValueError("match needs at least one context token")
        kind = (match_type or self.match_type).upper()
        _check_match_type(kind)
        return num_draft_tokens or self.num_draft_tokens, kind

    def _find_window(self, context_tail: Sequence[int], suffix_keys: list[int] | None = None
                     ) -> tuple[list, int] | None:
        """(record, window length) of the longest suffix window that has a continuation."""
        width = min(self.max_match_window_size, len(context_tail))
        if suffix_keys is not None and len(suffix_keys) >= width:
            keys = suffix_keys[len(suffix_keys) - width:]                                  # longest first
        else:
            keys = _suffix_keys(context_tail, len(context_tail), self.max_match_window_size)
        last = context_tail[-1]
        for i, key in enumerate(keys):
            window_len = len(keys) - i
            if window_len < self.min_match_window_size:
                break
            rec = self._nodes.get(key)
            if rec is not None and rec[_TOKEN] == last and rec[_CHILDREN]:
                self._nodes.move_to_end(key)
                return rec, window_len
        return None

    def _bfs_breadth(self, window_len: int) -> int:
        span = self.max_match_window_size - self.min_match_window_size
        if span == 0:
            return self.max_bfs_breadth
        frac = (window_len - self.min_match_window_size) / span
        return round(self.max_bfs_breadth - frac * (self.max_bfs_breadth - self.min_bfs_breadth))

    def _children(self, rec: list, limit: int, key) -> list[tuple[int, list]]:
        """Up to ``limit`` (key, record) children of ``rec``, best first by ``key``."""
        children = rec[_CHILDREN]
        if not children:
            return []
        nodes = self._nodes
        live = [(k, nodes[k]) for k in children.values() if k in nodes]
        return heapq.nlargest(limit, live, key=key) if len(live) > limit else sorted(live, key=key, reverse=True)

    def _children_count(self, rec: list) -> int:
        nodes = self._nodes
        return sum(nodes[k][_COUNT] for k in rec[_CHILDREN].values() if k in nodes)

    def _build_bfs(self, root_rec: list, breadth: int, max_nodes: int) -> tuple[list[int], list[int]]:
        tokens, parents, records, depth = [root_rec[_TOKEN]], [-1], [root_rec], [0]
        recency = _recency_key
        i = 0
        while i < len(tokens) and len(tokens) < max_nodes:
            if depth[i] < self.branch_length:
                for key, rec in self._children(records[i], breadth, recency):
                    if len(tokens) >= max_nodes:
                        break
                    tokens.append(rec[_TOKEN])
                    parents.append(i)
                    records.append(rec)
                    depth.append(depth[i] + 1)
                    self._nodes.move_to_end(key)
            i += 1
        return tokens, parents

    def _build_prob(self, root_rec: list, max_nodes: int) -> tuple[list[int], list[int]]:
        tokens, parents = [root_rec[_TOKEN]], [-1]
        heap: list[tuple[float, int, int, int, list, int]] = []  # (-score, tiebreak, parent, key, rec, depth)
        tiebreak = 0

        def push_children(rec: list, node: int, score: float, depth: int) -> None:
            nonlocal tiebreak
            if depth >= self.branch_length:
                return
            kids = self._children(rec, max_nodes - 1, _count_key)
            if not kids:
                return
            total = self._children_count(rec)
            for key, kid in kids:
                tiebreak += 1
                heapq.heappush(heap, (-score * kid[_COUNT] / total, tiebreak, node, key, kid, depth + 1))

        push_children(root_rec, 0, 1.0, 0)
        while heap and len(tokens) < max_nodes:
            neg_score, _, parent, key, rec, depth = heapq.heappop(heap)
            tokens.append(rec[_TOKEN])
            parents.append(parent)
            self._nodes.move_to_end(key)
            push_children(rec, len(tokens) - 1, -neg_score, depth)
        return tokens, parents


def _check_num_new(num_new: int, total_len: int) -> None:
    if not 0 <= num_new <= total_len:
        raise ValueError(f"num_new={num_new} out of range for {total_len} tokens")


def _check_match_type(match_type: str) -> None:
    if match_type.upper() not in MATCH_TYPES:
        raise ValueError(f"--speculative-ngram-match-type must be BFS or PROB; got {match_type!r}")


def _recency_key(item: tuple[int, list]) -> tuple[int, int]:
    return item[1][_LAST_USED], item[1][_COUNT]


def _count_key(item: tuple[int, list]) -> tuple[int, int]:
    return item[1][_COUNT], item[1][_LAST_USED]


def _hash(ngram: Sequence[int]) -> int:
    key = _ROOT
    for token in ngram:
        key = (key * _BASE + token + 1) % _MOD
    return key


def _suffix_keys(tokens: Sequence[int], end: int, max_len: int) -> list[int]:
    """Keys of ``tokens[end - m : end]`` for m = min(max_len, end) .. 1 (longest first)."""
    keys = []
    key, power = _ROOT, 1
    for pos in range(end - 1, max(end - max_len, 0) - 1, -1):
        key = ((tokens[pos] + 1) * power + key) % _MOD
        power = power * _BASE % _MOD
        keys.append(key)
    keys.reverse()
    return keys
