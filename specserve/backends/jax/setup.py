"""Process-wide JAX settings, applied once when the backend is imported (before any
array exists): float64 for the attention and norm statistics (row invariance,
``attention.py``) and a persistent compilation cache under ``$SPECSERVE_CACHE/jax``,
so a restarted server or a test run reuses earlier compiles."""
from __future__ import annotations

import jax

from specserve.config import cache_root

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_compilation_cache_dir", str(cache_root() / "jax"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
