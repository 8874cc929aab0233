"""Kernel builds in the cache: a new version's build clears out old versions' libraries."""
from __future__ import annotations

import os
import time

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
