"""Advice to the C library about this process's memory (Linux, glibc): pages advised huge or
dropped, the heap's free pages handed back. Each call is a no-op where the library or the
call is missing (another OS, another C library)."""
from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import sys

import numpy as np

logger = logging.getLogger(__name__)
MADV_DONTNEED, MADV_HUGEPAGE = 4, 14


def advise(address: int, length: int, advice: int) -> bool:
    """``madvise(address, length, advice)``; whether it was taken."""
    libc = _libc()
    if libc is None or not hasattr(libc, "madvise"):
        return False
    if libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), advice) == 0:
        return True
    logger.debug("madvise(%d) failed: errno %d", advice, ctypes.get_errno())
    return False


def drop_pages(array: np.ndarray) -> None:
    """The whole pages under ``array``, a view of a read-only file map, dropped from this
    process (read again from the file if touched again)."""
    page = mmap.PAGESIZE
    start = -(-array.ctypes.data // page) * page
    end = (array.ctypes.data + array.nbytes) // page * page
    if end > start:
        advise(start, end - start, MADV_DONTNEED)


def trim_heap() -> None:
    """glibc's ``malloc_trim(0)``: the heap's free pages handed back to the system."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


@functools.cache
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
