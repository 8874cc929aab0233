"""Pure-Python bookkeeping of the paged KV pool: which pages are free, who holds them.

The pool has ``num_pages`` pages of ``page_size`` token slots each; the slot of
offset ``o`` in page ``p`` is ``p * page_size + o``. The KV tensors themselves
live elsewhere (kv_pool.py); this module only hands out and takes back ids.

Pages are reference counted. ``alloc_pages`` gives refcount 1, every holder
(a running request's ``kv_slots``, the radix cache) adds one with ``incref``
and drops it with ``decref``; at 0 the page goes back to the free list.

No page is reserved: every page 0..num_pages-1 is allocatable and counted in
``capacity_tokens``. A padding/dummy slot for padded batches (CUDA graphs), if
one is needed, belongs to the tensor side (e.g. one extra page past the pool).

Slot-list layout (what ``extend_slots`` produces and the other slot methods
assume): token ``i`` of a request sits at offset ``i % page_size`` of its page,
so a request's slots are consecutive within each page and a page holds one
contiguous run of the request's tokens. This lets every slot-list method work
in O(pages touched) rather than O(tokens).

With pages of one slot, a request's slots are kept in runs where the pool allows
(``extend_slots``): new slots continue from the request's last one while the
slots after it are free, and otherwise (a request's first slots too) start a
run RUN_GAP slots into a free stretch of RUN_GAP + n + RUN_GAP, so that the
request before it has room to grow. No slot is reserved: where no stretch is
free, slots come from the free list as before. Handed out one at a time from the
free list, the decoded tokens of requests decoding together took slots in turn,
a request's K/V rows a batch apart, and batched decode attention read them at a
third of the streaming rate (`python -m specserve.bench.decode_attention`: 4
requests of 100 + 900 tokens 29% faster in runs of 256, 16 of 100 + 400 43%).
In runs, 4 requests x 1,000 tokens decoded 1.24x faster end to end, 1 request
1.01x-1.02x (2-core AVX-512 Zen4, the two pools taking turns in one process).
"""
from __future__ import annotations

from collections.abc import Iterable

RUN_GAP = 256     # pages of one slot: free slots kept on each side of a request's first slots


class BlockPool:
    """Free list plus per-page reference counts for a paged KV pool."""

    def __init__(self, num_pages: int, page_size: int = 1, run_gap: int = RUN_GAP) -> None:
        """``run_gap``: RUN_GAP, or 0 for the free list's order alone (pages of one slot)."""
        if num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self._num_pages = num_pages
        self._page_size = page_size
        self._refcounts = [0] * num_pages
        # A stack popped from the end; reversed so fresh pools hand out 0, 1, 2, ... Pages taken
        # out of its order (``_extend_run``) stay in it until popped: ``_is_free`` says which are.
        self._free_pages = list(range(num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_pages
        self._num_free = num_pages
        self._run_gap = run_gap if page_size == 1 else 0
        self._no_stretch = (0, 0)     # (length, free pages) of the last stretch searched in vain

    # ------------------------------------------------------------------ sizes
    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def capacity_tokens(self) -> int:
        return self._num_pages * self._page_size

    @property
    def num_free_pages(self) -> int:
        return self._num_free

    @property
    def num_free_tokens(self) -> int:
        return self._num_free * self._page_size

    def refcount(self, page: int) -> int:
        """Current reference count of ``page`` (0 when free)."""
        return self._refcounts[page]

    def page_of(self, slot: int) -> int:
        return slot // self._page_size

    # ------------------------------------------------------------ page level
    def alloc_pages(self, num: int) -> list[int] | None:
        """Take ``num`` free pages at refcount 1; None (nothing taken) if too few."""
        if num < 0:
            raise ValueError(f"cannot allocate {num} pages")
        if num > self._num_free:
            return None
        pages, stack, is_free, refcounts = [], self._free_pages, self._is_free, self._refcounts
        while len(pages) < num:
            page = stack.pop()
            if is_free[page]:                 # else taken out of order since it was pushed
                is_free[page], refcounts[page] = 0, 1
                pages.append(page)
        self._num_free -= num
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Add one reference to each (allocated) page."""
        refcounts = self._refcounts
        for page in pages:
            self._check_page(page)
            if refcounts[page] <= 0:
                raise ValueError(f"incref of free page {page}")
            refcounts[page] += 1

    def decref(self, pages: Iterable[int]) -> None:
        """Drop one reference from each page; a page reaching 0 becomes free. Pages freed together
        are handed out again in the order given (allocation takes from the list's end): a
        speculative step gives back the slots its draft did not keep, and the request's next
        slots then follow the kept one in memory, as in plain decoding. Given back in ascending
        order they came back descending, and each step's K/V row lay ~10 slots from the last
        one's: attention took ~9% longer for a request whose drafts were declined (NGRAM on
        chat, 2-core Zen3)."""
        refcounts = self._refcounts
        freed = []
        for page in pages:
            self._check_page(page)
            count = refcounts[page]
            if count <= 0:
                raise ValueError(f"decref of free page {page}")
            refcounts[page] = count - 1
            if count == 1:
                freed.append(page)
                self._is_free[page] = 1
        freed.reverse()
        self._num_free += len(freed)
        if len(self._free_pages) + len(freed) > 2 * self._num_pages:
            self._drop_stale_entries()
        self._free_pages.extend(freed)

    def _drop_stale_entries(self) -> None:
        """The free list without entries of pages taken out of its order (each free page once,
        where it was last pushed)."""
        seen, kept = set(), []
        for page in reversed(self._free_pages):
            if self._is_free[page] and page not in seen:
                seen.add(page)
                kept.append(page)
        kept.reverse()
        self._free_pages = kept

    def _check_page(self, page: int) -> None:
        if not 0 <= page < self._num_pages:
            raise IndexError(f"page {page} out of range [0, {self._num_pages})")

    # ------------------------------------------------------------ slot level
    def pages_of(self, slots: list[int]) -> list[int]:
        """Pages touched by a slot list (see the module's layout rule), unique, in order."""
        page_size = self._page_size
        if page_size == 1:
            return list(slots)
        pages = []
        index, num_slots = 0, len(slots)
        while index < num_slots:
            slot = slots[index]
            pages.append(slot // page_size)
            index += page_size - slot % page_size   # jump to the next page's first slot
        return pages

    def extend_slots(self, slots: list[int], num: int) -> list[int] | None:
        """Return ``num`` new slots continuing ``slots`` (which is not modified).

        The free offsets of the last, partial page come first, then new pages.
        Returns None, allocating nothing, if the pool lacks pages. The partial
        last page must be held by this request alone (refcount 1): other
        holders see the whole page, so writing into it would corrupt theirs.
        """
        if num <= 0:
            if num < 0:
                raise ValueError(f"cannot extend by {num} slots")
            return []
        page_size = self._page_size
        if page_size == 1:
            return self._extend_run(slots, num) if self._run_gap else self.alloc_pages(num)
        tail = self._tail_slots(slots, num)
        num_rest = num - len(tail)
        pages = self.alloc_pages(-(-num_rest // page_size))
        if pages is None:
            return None
        for page in pages:
            first = page * page_size
            tail.extend(range(first, first + min(page_size, num_rest)))
            num_rest -= page_size
        return tail

    def _extend_run(self, slots: list[int], num: int) -> list[int] | None:
        """Pages of one slot: ``num`` new slots, continuing ``slots``' last one while the slots
        after it are free; the rest (all of them for a request without slots yet) in the middle
        of a free stretch of RUN_GAP + n + RUN_GAP, a new run; what neither gives, from the free
        list."""
        if num > self._num_free:
            return None
        is_free, run = self._is_free, []
        if slots:
            first = slots[-1] + 1
            end = min(first + num, self._num_pages)
            stop = is_free.find(b"\x00", first, end)
            run = list(range(first, end if stop < 0 else stop))
        rest = num - len(run)
        if rest and self._run_gap and self._may_find_stretch(rest + 2 * self._run_gap):
            start = is_free.find(b"\x01" * (rest + 2 * self._run_gap))
            if start >= 0:
                run += range(start + self._run_gap, start + self._run_gap + rest)
            else:
                self._no_stretch = (rest + 2 * self._run_gap, self._num_free)
        refcounts = self._refcounts
        for page in run:
            is_free[page], refcounts[page] = 0, 1
        self._num_free -= len(run)
        return run + self.alloc_pages(num - len(run)) if len(run) < num else run

    def _may_find_stretch(self, length: int) -> bool:
        """False where a search for a free stretch this long cannot succeed: one as long or
        shorter failed, and fewer than 2 * RUN_GAP pages were freed since (a full or fragmented
        pool then costs no scan of every page at each step)."""
        failed_length, free_then = self._no_stretch
        return length < failed_length or self._num_free >= free_then + 2 * self._run_gap

    def _tail_slots(self, slots: list[int], num: int) -> list[int]:
        """Up to ``num`` slots left in the request's last, partially filled page."""
        if not slots:
            return []
        last = slots[-1]
        num_room = self._page_size - 1 - last % self._page_size
        if num_room == 0:
            return []
        page = last // self._page_size
        if self._refcounts[page] != 1:
            raise ValueError(
                f"cannot extend into page {page}: shared (refcount {self._refcounts[page]})")
        return list(range(last + 1, last + 1 + min(num_room, num)))

    def truncate_slots(self, slots: list[int], new_len: int) -> list[int]:
        """Keep the first ``new_len`` slots, freeing pages only the dropped tail used.

        Truncates ``slots`` IN PLACE (O(dropped tokens), no copy of the kept
        prefix) and returns that same list. ``new_len >= len(slots)`` is a no-op.
        """
        if new_len < 0:
            raise ValueError(f"new_len must be >= 0, got {new_len}")
        if new_len >= len(slots):
            return slots
        dropped_pages = self.pages_of(slots[new_len:])
        if new_len > 0 and self.page_of(slots[new_len - 1]) == dropped_pages[0]:
            dropped_pages = dropped_pages[1:]   # still used by the kept prefix
        self.decref(dropped_pages)
        del slots[new_len:]
        return slots

    def release_slots(self, slots: list[int]) -> None:
        """Drop the holder's reference on every page the slot list touches (once per page)."""
        self.decref(self.pages_of(slots))

    def __repr__(self) -> str:
        return (f"BlockPool(num_pages={self._num_pages}, page_size={self._page_size}, "
                f"free_pages={self.num_free_pages})")
