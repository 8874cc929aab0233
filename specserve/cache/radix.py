"""Radix-tree prefix cache over token ids (the RadixAttention idea).

Each edge holds a run of token ids (``key``) and the KV slots computed for
them (``value``). With ``page_size > 1`` only whole pages are cached: keys
are page-aligned, children are looked up by their first page, and matches
are rounded down to a page boundary.

Reference-count contract (pages of the BlockPool):

* The tree holds ONE reference on every page it stores. ``insert`` increfs
  the pages it newly stores; ``evict`` and ``reset`` decref them.
* ``match_prefix`` changes no refcount. A request that adopts the matched
  slots into its ``kv_slots`` must ``pool.incref(pool.pages_of(slots))`` and
  ``cache.lock(node)``. So a request's ``kv_slots`` always own one ref per
  page and ``pool.release_slots(req.kv_slots)`` frees it uniformly.
* When a request finishes: ``cache.insert(token_ids, req.kv_slots)`` (token
  ids whose KV is computed), then ``cache.unlock(req.prefix_node)`` and
  ``pool.release_slots(req.kv_slots)``. Pages the tree already had (with other
  slots) are not adopted and are freed by that release.
* Locks keep nodes (and their ancestors) from eviction. Every tree page a
  running request holds must be locked by it, so that evicting a node really
  frees its pages; a running request that inserts its own prefix early should
  match it again and move its lock to the new node.

Callers must never match a full prompt: the engine passes ``token_ids[:-1]``
so at least one token is computed (this module does not special-case it).
"""
from __future__ import annotations

import heapq
import itertools

from specserve.cache.block_pool import BlockPool

_node_ids = itertools.count()


class Node:
    """One edge of the tree: tokens ``key`` whose KV sits in slots ``value``."""

    __slots__ = ("id", "key", "value", "parent", "children", "lock_ref",
                 "last_access", "is_detached")

    def __init__(self, key: list[int], value: list[int], parent: Node | None,
                 last_access: int = 0) -> None:
        self.id = next(_node_ids)
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict = {}
        self.lock_ref = 0
        self.last_access = last_access
        self.is_detached = False   # evicted or dropped by reset: lock/unlock ignore it

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        return f"Node(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


class RadixCache:
    """Prefix cache over token ids storing KV slots of a ``BlockPool``."""

    def __init__(self, pool: BlockPool, disabled: bool = False) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.disabled = disabled
        self._clock = itertools.count(1)
        self._init_tree()

    def _init_tree(self) -> None:
        self.root_node = Node([], [], None)
        self.root_node.lock_ref = 1     # never evicted, never counted
        self._evictable_tokens = 0
        self._protected_tokens = 0

    # ------------------------------------------------------------------ sizes
    def evictable_size(self) -> int:
        """Tokens stored in unlocked nodes."""
        return self._evictable_tokens

    def protected_size(self) -> int:
        """Tokens stored in nodes locked by running requests."""
        return self._protected_tokens

    def total_size(self) -> int:
        """Tokens stored in the tree."""
        return self._evictable_tokens + self._protected_tokens

    # ---------------------------------------------------------------- helpers
    def _aligned_len(self, num_tokens: int) -> int:
        return num_tokens - num_tokens % self.page_size

    def _child_key(self, tokens: list[int], start: int = 0):
        if self.page_size == 1:
            return tokens[start]
        return tuple(tokens[start:start + self.page_size])

    def _common_len(self, key: list[int], tokens: list[int], start: int) -> int:
        """Page-aligned length of the common prefix of ``key`` and ``tokens[start:]``."""
        if tokens[start:start + len(key)] == key:
            return len(key)
        limit = min(len(key), len(tokens) - start)
        index = 0
        while index < limit and key[index] == tokens[start + index]:
            index += 1
        return self._aligned_len(index)

    def _touch(self, node: Node) -> None:
        node.last_access = next(self._clock)

    def _split(self, node: Node, split_len: int) -> Node:
        """Cut ``node``'s edge at ``split_len`` (page-aligned); return the new upper node."""
        upper = Node(node.key[:split_len], node.value[:split_len], node.parent,
                     node.last_access)
        upper.lock_ref = node.lock_ref
        upper.parent.children[self._child_key(node.key)] = upper
        node.key = node.key[split_len:]
        node.value = node.value[split_len:]
        node.parent = upper
        upper.children[self._child_key(node.key)] = node
        return upper

    # ------------------------------------------------------------------ match
    def match_prefix(self, token_ids: list[int]) -> tuple[list[int], Node]:
        """Longest cached page-aligned prefix: (its slots, last matched node).

        Refreshes the LRU time of the matched path; splits a node when the
        match ends inside it. Takes no pool reference and no lock (see module doc).
        """
        if self.disabled:
            return [], self.root_node
        tokens = token_ids[:self._aligned_len(len(token_ids))]
        node, matched, slots = self.root_node, 0, []
        while matched < len(tokens):
            child = node.children.get(self._child_key(tokens, matched))
            if child is None:
                break
            common = self._common_len(child.key, tokens, matched)
            is_partial = common < len(child.key)
            if is_partial:
                child = self._split(child, common)
            self._touch(child)
            slots.extend(child.value)
            matched += common
            node = child
            if is_partial:
                break
        return slots, node

    # ------------------------------------------------------------------ locks
    def lock(self, node: Node) -> None:
        """Protect ``node`` and its ancestors from eviction (counted, nestable)."""
        if node.is_detached:
            return
        while not node.is_root:
            if node.lock_ref == 0:
                self._evictable_tokens -= len(node.key)
                self._protected_tokens += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        """Undo one ``lock(node)``. A node dropped by ``reset`` is ignored."""
        if node.is_detached:
            return
        while not node.is_root:
            if node.lock_ref <= 0:
                raise ValueError(f"unlock of unlocked {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable_tokens += len(node.key)
                self._protected_tokens -= len(node.key)
            node = node.parent

    # ----------------------------------------------------------------- insert
    def insert(self, token_ids: list[int], slots: list[int]) -> int:
        """Store the page-aligned part of a sequence; return tokens already present.

        Newly stored pages get one tree reference. Where the tree already has
        these tokens (under the same or other slots) it keeps its own slots
        and takes no reference on the caller's.
        """
        if self.disabled:
            return 0
        if len(token_ids) != len(slots):
            raise ValueError(f"{len(token_ids)} token ids but {len(slots)} slots")
        num_tokens = self._aligned_len(len(token_ids))
        tokens = token_ids[:num_tokens]
        node, present = self.root_node, 0
        while present < num_tokens:
            child = node.children.get(self._child_key(tokens, present))
            if child is None:
                self._add_leaf(node, tokens[present:], slots[present:num_tokens])
                break
            common = self._common_len(child.key, tokens, present)
            if common < len(child.key):
                child = self._split(child, common)
            self._touch(child)
            present += common
            node = child
        return present

    def _add_leaf(self, parent: Node, key: list[int], value: list[int]) -> None:
        if value[0] % self.page_size != 0:
            raise ValueError(f"slot {value[0]} does not start a page: slots are not page-aligned")
        self.pool.incref(self.pool.pages_of(value))
        leaf = Node(key, value, parent, next(self._clock))
        parent.children[self._child_key(key)] = leaf
        self._evictable_tokens += len(key)

    # ------------------------------------------------------------------ evict
    def evict(self, num_tokens: int) -> int:
        """Drop least-recently-used unlocked leaves until ``num_tokens`` are evicted.

        Stops early when nothing evictable remains. Returns tokens evicted
        (whole nodes, so possibly more than asked). Their pages are decref'd:
        they become free unless a request still holds them.
        """
        if self.disabled or num_tokens <= 0:
            return 0
        heap = [(leaf.last_access, leaf.id, leaf) for leaf in self._evictable_leaves()]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            evicted += self._remove_leaf(leaf)
            if not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return evicted

    def _evictable_leaves(self) -> list[Node]:
        leaves, stack = [], [self.root_node]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.lock_ref == 0:
                leaves.append(node)
        return leaves

    def _remove_leaf(self, leaf: Node) -> int:
        del leaf.parent.children[self._child_key(leaf.key)]
        self.pool.decref(self.pool.pages_of(leaf.value))
        leaf.is_detached = True
        self._evictable_tokens -= len(leaf.key)
        return len(leaf.key)

    # ------------------------------------------------------------------ reset
    def reset(self) -> None:
        """Drop every node, releasing the tree's page references (/flush_cache).

        Safe while requests run: they keep their own page references, and a
        later ``unlock`` of a dropped node is ignored.
        """
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            self.pool.decref(self.pool.pages_of(node.value))
            node.is_detached = True
        self.root_node.is_detached = True
        self._init_tree()

    # ------------------------------------------------------------------ debug
    def pretty(self, max_tokens: int = 8) -> str:
        """Indented dump of the tree: tokens (abbreviated), length, lock count, LRU time."""
        lines = [f"root (stored={self.total_size()}, evictable={self.evictable_size()}, "
                 f"protected={self.protected_size()})"]
        stack = [(child, 1) for child in reversed(list(self.root_node.children.values()))]
        while stack:
            node, depth = stack.pop()
            shown = node.key[:max_tokens]
            more = "..." if len(node.key) > max_tokens else ""
            lines.append(f"{'  ' * depth}{shown}{more} len={len(node.key)} "
                         f"lock={node.lock_ref} t={node.last_access}")
            stack.extend((child, depth + 1) for child in reversed(list(node.children.values())))
        return "\n".join(lines)
