"""Build a kernel's C file once per machine and load it with ctypes.

``cpu_kernels.c`` (which includes the other C files here) is compiled on first use with
the C compiler (``$CC`` or ``cc``; AVX2 + FMA, OpenMP) into ``$SPECSERVE_CACHE/kernels``
(default ``~/.cache/specserve/kernels``), named by a hash of every C source and header
here and the flags, and reused; building a new version deletes other versions' builds
older than a week. ``load()`` returns None where it cannot be built or
loaded (no compiler, a CPU without AVX2, ``SPECSERVE_KERNELS=0``): callers then keep
torch's kernels.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from specserve.config import cache_root

logger = logging.getLogger(__name__)

CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]


SOURCE_DIR = Path(__file__).parent
LIBRARY = "cpu_kernels"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}    # common.h: DTYPE_F32, DTYPE_BF16
STALE_BUILD_AGE_S = 7 * 24 * 3600     # other versions' builds older than this are deleted


def cache_dir() -> Path:
    return cache_root() / "kernels"


@functools.cache
def load() -> ctypes.CDLL | None:
    if os.environ.get("SPECSERVE_KERNELS", "1") == "0" or not _cpu_supports_avx2():
        return None
    try:
        return ctypes.CDLL(str(_build(SOURCE_DIR / f"{LIBRARY}.c")))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("the CPU kernels could not be built or loaded (%s); using torch's kernels", exc)
        return None


def function(name: str, argtypes: list) -> Callable[..., int] | None:
    """The library's C function ``name`` (returning int) with these argument types, or None."""
    lib = load()
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return fn


def _cpu_supports_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _build(source_path: Path) -> Path:
    """Compile once for these sources and flags; concurrent builders each write a
    temporary file and rename it into place."""
    source = b"".join(p.read_bytes() for p in sorted(SOURCE_DIR.glob("*.[ch]")))
    compiler = os.environ.get("CC", "cc")
    digest = hashlib.sha256(source + " ".join([compiler, *CFLAGS]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{source_path.stem}-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *CFLAGS, str(source_path), "-o", str(built)],
                                capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise OSError(f"{compiler} failed: {result.stderr.strip()[:500]}")
        os.replace(built, target)
    logger.info("built kernel %s", target)
    remove_stale_builds(target)
    return target


def remove_stale_builds(current: Path, max_age_s: float = STALE_BUILD_AGE_S) -> None:
    """Delete builds of other source versions older than ``max_age_s`` (each source change
    leaves one; a build another checkout still uses is rebuilt on its next start)."""
    cutoff = time.time() - max_age_s
    for path in current.parent.glob(f"{LIBRARY}-*.so"):
        try:
            if path != current and path.stat().st_mtime < cutoff:
                path.unlink()
        except OSError:                     # removed by a concurrent builder
            pass
