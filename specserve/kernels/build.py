"""Build the kernels' C files once per machine and ISA variant, load the best with ctypes.

``cpu_kernels.c`` (which includes the other C files here) is compiled on first use with the C
compiler (``$CC`` or ``cc``, OpenMP) into ``$SPECSERVE_CACHE/kernels`` (default
``~/.cache/specserve/kernels``), one library per ISA variant (``VARIANTS``, best first: the
integer kernels of ``int_linear.c`` use AVX-512 VNNI where built so, AVX2 otherwise, and in the
``avx512_amx`` build AMX tiles for 4 or more input rows; attention uses AVX-512 where built so
and AVX-512 BF16's ``vdpbf16ps`` over a bfloat16 cache from the ``avx512_bf16`` build up, with
the same bits as the FMAs of the others), named by the variant and
a hash of every C source and header here and the flags, and reused; building a new version
deletes other versions' builds older than a week.

Runtime dispatch: ``load()`` takes the best variant this CPU runs (``/proc/cpuinfo`` flags),
or the best at or below ``$SPECSERVE_ISA`` (e.g. ``avx2``: test a lower variant on a higher
CPU). ``avx512_amx`` has not yet run on an AMX CPU, so it is a candidate only with
``$SPECSERVE_AMX=1`` (its logic is tested everywhere through ``EMULATED_AMX``, a build of the
same code over a C model of the tile instructions); loading it asks Linux for the tile state
(``int_amx_enable``) and gives way to the next variant if refused. A variant that fails to
build (an old compiler without the ISA's flags) gives way to the next one down. It returns None
where nothing can be built or loaded (no compiler, a CPU without AVX2, ``SPECSERVE_KERNELS=0``):
callers then keep torch's kernels.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from specserve.config import cache_root

logger = logging.getLogger(__name__)

CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...]            # compiler flags beyond CFLAGS
    cpu_flags: tuple[str, ...]        # /proc/cpuinfo flags the CPU needs
    level: int                        # int_linear.c's IQ_LEVEL for this build


_AVX512_BF16_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx512bf16")
_AVX512_BF16_CPU = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16")
VARIANTS = (    # best first
    Variant("avx512_amx", (*_AVX512_BF16_FLAGS, "-mamx-tile", "-mamx-int8"),
            (*_AVX512_BF16_CPU, "amx_tile", "amx_int8"), 4),
    Variant("avx512_bf16", _AVX512_BF16_FLAGS, _AVX512_BF16_CPU, 3),
    Variant("avx512_vnni", ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"),
            ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"), 2),
    Variant("avx_vnni", ("-mavxvnni",), ("avx2", "fma", "f16c", "avx_vnni"), 5),
    Variant("avx2", (), ("avx2", "fma", "f16c"), 1),
)
VARIANT_NAMES = tuple(v.name for v in VARIANTS)
# avx512_amx has not run on an AMX CPU yet: it is a candidate only where this is set to 1
AMX_SWITCH = "SPECSERVE_AMX"
# avx512_amx's code over a C model of the tile instructions (int_amx.h), for tests on any AVX-512 CPU
EMULATED_AMX = Variant("avx512_amx_emulated", (*_AVX512_BF16_FLAGS, "-DIQ_AMX_EMULATE"), _AVX512_BF16_CPU, 4)
# avx_vnni's 256-bit integer tile through vpdpbusd's AVX-512 (EVEX) encoding, for tests on AVX-512 CPUs
_AVX512_VNNI = VARIANTS[VARIANT_NAMES.index("avx512_vnni")]
EVEX_AVX_VNNI = Variant("avx_vnni_evex", (*_AVX512_VNNI.flags, "-DIQ_TILE_256"), _AVX512_VNNI.cpu_flags, 5)
TEST_BUILDS = {v.name: v for v in (EMULATED_AMX, EVEX_AVX_VNNI)}


SOURCE_DIR = Path(__file__).parent
LIBRARY = "cpu_kernels"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}    # common.h: DTYPE_F32, DTYPE_BF16
STALE_BUILD_AGE_S = 7 * 24 * 3600     # other versions' builds older than this are deleted


def cache_dir() -> Path:
    return cache_root() / "kernels"


_library_override: list[ctypes.CDLL] = []     # use_library's, innermost last
_cached_lookups: list = []                     # cached_lookup's functions, cleared as the library changes


def load() -> ctypes.CDLL | None:
    """The best variant this CPU runs (see the module doc), or None; inside ``use_library``, its
    library."""
    return _library_override[-1] if _library_override else _load_best()


@contextlib.contextmanager
def use_library(library: ctypes.CDLL):
    """``load()`` gives ``library`` inside the block, and the kernels' functions are looked up in it
    (``cached_lookup``): another build of the kernels in the same process, for benchmarks that take
    turns between builds (``bench/kernel_ab.py``). Not for serving: weights packed by one build are
    read by the other, so they must lay them out alike."""
    _library_override.append(library)
    _clear_lookups()
    try:
        yield library
    finally:
        _library_override.pop()
        _clear_lookups()


def cached_lookup(lookup: Callable[[], Callable | None]) -> Callable[[], Callable | None]:
    """``functools.cache`` for a module's lookup of a kernel function (``function``), cleared when
    ``use_library`` changes the library."""
    cached = functools.cache(lookup)
    _cached_lookups.append(cached)
    return cached


def _clear_lookups() -> None:
    for cached in _cached_lookups:
        cached.cache_clear()


@functools.cache
def _load_best() -> ctypes.CDLL | None:
    if os.environ.get("SPECSERVE_KERNELS", "1") == "0":
        return None
    for variant in candidate_variants():
        library = load_variant(variant.name)
        if library is not None:
            logger.info("CPU kernels: %s variant", variant.name)
            return library
    return None


def variant_name() -> str:
    """The ISA variant of the loaded kernels ("avx512_amx", "avx512_bf16", "avx512_vnni", "avx_vnni",
    "avx2"), or "none"."""
    library = load()
    return "none" if library is None else _variant_of(library).name


def _variant_of(library: ctypes.CDLL) -> Variant:
    """The variant ``library`` was built as (its ``int_kernel_level``)."""
    level = _level_function(library)()
    return next(v for v in VARIANTS if v.level == level)


def candidate_variants() -> list[Variant]:
    """The variants this CPU runs, best first, at or below ``$SPECSERVE_ISA`` if set; avx512_amx
    only with ``$SPECSERVE_AMX=1``."""
    amx = os.environ.get(AMX_SWITCH, "0").strip() == "1"
    runnable = [v for v in VARIANTS if cpu_runs(v) and (amx or v.name != "avx512_amx")]
    forced = os.environ.get("SPECSERVE_ISA", "").strip().lower()
    if forced:
        if forced not in VARIANT_NAMES:
            logger.warning("SPECSERVE_ISA=%s is not one of %s; ignored", forced, ", ".join(VARIANT_NAMES))
        else:
            runnable = [v for v in runnable if VARIANT_NAMES.index(v.name) >= VARIANT_NAMES.index(forced)]
    return runnable


def cpu_runs(variant: Variant) -> bool:
    return set(variant.cpu_flags) <= cpu_flags()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them; without it, what torch reports."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    capability = torch.backends.cpu.get_cpu_capability()
    avx2 = {"avx2", "fma", "f16c"} if capability in ("AVX2", "AVX512") else set()
    return frozenset(avx2 | ({"avx512f", "avx512bw", "avx512vl", "avx512dq"} if capability == "AVX512" else set()))


@functools.cache
def load_variant(name: str) -> ctypes.CDLL | None:
    """Variant ``name``'s library, built if needed; None if this CPU cannot run it or it fails
    to build or load."""
    variant = TEST_BUILDS[name] if name in TEST_BUILDS else VARIANTS[VARIANT_NAMES.index(name)]
    if not cpu_runs(variant):
        return None
    try:
        library = ctypes.CDLL(str(_build(SOURCE_DIR / f"{LIBRARY}.c", variant)))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("the %s CPU kernels could not be built or loaded (%s)", name, exc)
        return None
    if _level_function(library)() != variant.level:
        logger.warning("the %s CPU kernels built as another variant; not used", name)
        return None
    if variant.level == 4 and function_of(library, "int_amx_enable", [])() != 0:
        logger.warning("the %s CPU kernels are not used: the OS refused this process the AMX tile state", name)
        return None
    return library


def _level_function(library: ctypes.CDLL):
    fn = library.int_kernel_level
    fn.restype, fn.argtypes = ctypes.c_int, []
    return fn


def function(name: str, argtypes: list) -> Callable[..., int] | None:
    """The library's C function ``name`` (returning int) with these argument types, or None."""
    lib = load()
    return None if lib is None else function_of(lib, name, argtypes)


def function_of(library: ctypes.CDLL, name: str, argtypes: list) -> Callable[..., int]:
    """``library``'s C function ``name`` (returning int) with these argument types."""
    fn = getattr(library, name)
    fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return fn


def load_sources(source_dir: str | Path) -> ctypes.CDLL:
    """The kernels of another folder of these sources (another checkout's ``specserve/kernels``),
    built as the variant ``load()`` took (``OSError`` if they do not build or nothing was loaded)."""
    loaded = _load_best()
    if loaded is None:
        raise OSError("no kernel variant is loaded here, so there is none to build other sources as")
    source_dir = Path(source_dir)
    if not (source_dir / f"{LIBRARY}.c").is_file():
        raise OSError(f"{source_dir} has no {LIBRARY}.c")
    return ctypes.CDLL(str(_build(source_dir / f"{LIBRARY}.c", _variant_of(loaded))))


def _build(source_path: Path, variant: Variant) -> Path:
    """Compile once for these sources (the folder of ``source_path``) and flags; concurrent
    builders each write a temporary file and rename it into place."""
    source = b"".join(p.read_bytes() for p in sorted(source_path.parent.glob("*.[ch]")))
    compiler = os.environ.get("CC", "cc")
    flags = [*CFLAGS, *variant.flags]
    digest = hashlib.sha256(source + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{source_path.stem}-{variant.name}-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *flags, str(source_path), "-o", str(built)],
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
