"""The process's memory advice: a read-only file map's pages dropped after reading (what the GGUF
loader does with each tensor) leave this process, and the values read again are the file's."""
from __future__ import annotations

import sys

import numpy as np
import psutil
import pytest

from specserve.kernels import os_memory

MIB = 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's here")
def test_dropped_pages_of_a_file_map_leave_the_process_and_read_back_the_same(tmp_path):
    values = np.random.default_rng(0).integers(0, 255, size=64 * MIB, dtype=np.uint8)
    path = tmp_path / "blob.bin"
    values.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    process = psutil.Process()
    before = process.memory_info().rss
    total = int(mapped.sum(dtype=np.int64))            # every page read in
    touched = process.memory_info().rss
    os_memory.drop_pages(mapped[8 * MIB:])
    dropped = process.memory_info().rss
    assert touched - before > 48 * MIB and touched - dropped > 48 * MIB
    assert int(mapped.sum(dtype=np.int64)) == total == int(values.sum(dtype=np.int64))


def test_trimming_the_heap_keeps_what_is_allocated():
    kept = [np.full(MIB, i, dtype=np.uint8) for i in range(8)]
    freed = [np.ones(4 * MIB, dtype=np.uint8) for _ in range(8)]
    del freed
    os_memory.trim_heap()
    assert all(int(a[0]) == i and int(a[-1]) == i for i, a in enumerate(kept))
