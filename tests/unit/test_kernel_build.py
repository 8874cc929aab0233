"""Kernel builds in the cache: a new version's build clears out old versions' libraries; another
build can stand in for the loaded one (``use_library``)."""
from __future__ import annotations

import ctypes
import os
import time

import pytest

from specserve.kernels import build


def test_a_new_build_removes_stale_builds_of_other_versions(tmp_path):
    """Only other versions' libraries older than the age limit go; the current one and
    recent ones (another checkout may use them) stay, and other files are left alone."""
    current, recent, stale = (tmp_path / f"{build.LIBRARY}-{v}.so" for v in ("cur", "new", "old"))
    unrelated = tmp_path / "notes.txt"
    for path in (current, recent, stale, unrelated):
        path.write_bytes(b"")
    week_ago = time.time() - build.STALE_BUILD_AGE_S - 60
    for path in (current, stale, unrelated):
        os.utime(path, (week_ago, week_ago))
    build.remove_stale_builds(current)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([current.name, recent.name, unrelated.name])


def test_use_library_points_the_kernels_functions_at_another_build():
    from specserve.kernels import attention

    loaded, other = build.load(), build.load_variant("avx2")
    if loaded is None or other is None:
        pytest.skip("CPU kernels not built here")
    address = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value      # noqa: E731
    before = address(attention._function())
    with build.use_library(other):
        assert build.load() is other
        assert address(attention._function()) == address(other.paged_attention)
    assert build.load() is loaded and address(attention._function()) == before
