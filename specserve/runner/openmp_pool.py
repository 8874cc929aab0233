"""Keep one OpenMP thread team in the process, so that parallel regions run at full speed
whatever thread enters them.

Why: torch and the native kernels share one OpenMP runtime (GNU libgomp, loaded by torch).
libgomp gives every thread that starts a parallel region its own team of worker threads
and counts all of them in one process-wide number of "managed threads". Once that number
exceeds the CPUs the process may use, every barrier falls back from spinning (~300,000
iterations) to a throttled spin of 1,000 iterations followed by a futex sleep, so each of
the ~2,000 parallel regions of a decode step pays a futex wake-up. On a 2-core machine the
main thread's team (created while the model loads) plus a second thread's team is enough:
the same Engine decoded 125 tokens/s from the main thread and 48 from a ``threading.Thread``
(strace: ~15,000 futex calls a second per worker). ``OMP_WAIT_POLICY=ACTIVE`` does not help
(the throttled spin count is capped at 1,000 whatever the policy) and made it worse (idle
teams spin and steal the cores).

The cure is to release a thread's team when that thread is done with the model:
``omp_pause_resource_all`` (OpenMP 5.0; libgomp frees the calling thread's team and
lowers the managed count). The next thread that computes builds a fresh team and is then
the only one. The cost is creating the worker threads again: tens of microseconds.
"""
from __future__ import annotations

import ctypes
import logging
import os
from functools import lru_cache

logger = logging.getLogger(__name__)
OMP_PAUSE_SOFT = 1
_RUNTIME_NAMES = ("libgomp.so.1", "libiomp5.so", "libomp.so")


@lru_cache(maxsize=1)
def _loaded_openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime already in the process (torch's), never a newly loaded one."""
    import torch  # noqa: F401 - torch loads the runtime the kernels share

    for name in _RUNTIME_NAMES:
        try:
            runtime = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        except OSError:
            continue
        if hasattr(runtime, "omp_pause_resource_all"):
            runtime.omp_pause_resource_all.restype = ctypes.c_int
            runtime.omp_pause_resource_all.argtypes = [ctypes.c_int]
            return runtime
    return None


def release_thread_team() -> bool:
    """Free the OpenMP worker team of the calling thread (if it has one). Returns whether the
    runtime did; a runtime without ``omp_pause_resource_all`` is left alone."""
    runtime = _loaded_openmp_runtime()
    if runtime is None:
        return False
    status = runtime.omp_pause_resource_all(OMP_PAUSE_SOFT)
    if status != 0:
        logger.debug("omp_pause_resource_all returned %d (called inside a parallel region?)", status)
    return status == 0
