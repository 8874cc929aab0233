"""The skinny linear kernel (``skinny_linear.c``): built once per machine, loaded with ctypes.

``skinny_linear(x, weight, bias)`` computes ``F.linear`` for float32 or bfloat16 CPU tensors
with few rows: the weights stream from memory once per call for every row, and each row's
result is bit-for-bit independent of the other rows (see the C file). It is built on first
use with the C compiler (``$CC`` or ``cc``; AVX2 + FMA, OpenMP) into
``$SPECSERVE_CACHE/kernels`` and reused; where it cannot be built or loaded (no compiler, a
CPU without AVX2), ``is_available()`` is False and callers keep torch's kernels.
``SPECSERVE_KERNELS=0`` turns it off.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("skinny_linear.c")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def cache_dir() -> Path:
    root = os.environ.get("SPECSERVE_CACHE") or Path.home() / ".cache" / "specserve"
    return Path(root) / "kernels"


def is_available() -> bool:
    return _library() is not None


def can_run(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``skinny_linear(x, weight)`` applies (the caller checks grad mode)."""
    return (x.device.type == "cpu" and x.dtype == weight.dtype and x.dtype in DTYPE_CODES
            and weight.shape[1] % 8 == 0 and is_available())


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias32: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` of shape [..., K] and a contiguous ``weight``
    [N, K] of x's dtype; ``bias32`` is the bias in float32 (or None)."""
    x = x.contiguous()
    num_out, num_in = weight.shape
    num_rows = x.numel() // num_in
    out = torch.empty(*x.shape[:-1], num_out, dtype=x.dtype)
    if num_rows == 0:
        return out
    status = _library().skinny_linear(
        x.data_ptr(), weight.data_ptr(), None if bias32 is None else bias32.data_ptr(), out.data_ptr(),
        num_rows, num_out, num_in, DTYPE_CODES[x.dtype], torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"skinny_linear rejected shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    return out


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("SPECSERVE_KERNELS", "1") == "0" or not _cpu_supports_avx2():
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("the skinny linear kernel could not be built or loaded (%s); using torch's kernels", exc)
        return None
    lib.skinny_linear.restype = ctypes.c_int
    lib.skinny_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5
    return lib


def _cpu_supports_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _build() -> Path:
    """Compile the kernel once for this source and these flags; concurrent builders each
    write a temporary file and rename it into place."""
    source = SOURCE.read_bytes()
    compiler = os.environ.get("CC", "cc")
    digest = hashlib.sha256(source + " ".join([compiler, *CFLAGS]).encode()).hexdigest()[:16]
    target = cache_dir() / f"skinny_linear-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *CFLAGS, str(SOURCE), "-o", str(built)],
                                capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise OSError(f"{compiler} failed: {result.stderr.strip()[:500]}")
        os.replace(built, target)
    logger.info("built the skinny linear kernel: %s", target)
    return target
