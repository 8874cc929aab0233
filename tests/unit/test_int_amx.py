"""The AMX tile of the integer kernel (``int_amx.h``, the ``avx512_amx`` build): the same bits as
the AVX-512 VNNI tile for every GGUF format and row count. It runs here through the build of the
same code over a C model of the tile instructions (``build.EMULATED_AMX``), which also counts any
tile use the hardware would refuse; on a CPU with AMX the real build is compared too. The
``avx512_amx`` variant is a dispatch candidate only with ``SPECSERVE_AMX=1``."""
from __future__ import annotations

import ctypes

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from specserve.kernels import build, int_codes
from specserve.kernels.coded import BlockCodes
from specserve.kernels.int_codes import INT_F8H
from tests.unit.test_int_linear import KINDS, _codes, _inputs, _panels, _width

ROW_COUNTS = (1, 3, 4, 5, 8, 13, 16, 17, 40)     # below, at and past the AMX tile's 4 rows; several tiles


def _library(name: str) -> ctypes.CDLL:
    library = build.load_variant(name)
    if library is None:
        pytest.skip(f"the {name} kernels do not run on this CPU")
    return library


def _faults(library: ctypes.CDLL) -> int:
    return build.function_of(library, "int_amx_emulation_faults", [])()


def _case(kind):
    """(codes, panels, format) of a 40 x ~288 matrix of GGUF type ``kind``, or of F8H (8-bit codes,
    a scale per 16 weights: no GGUF type packs to it)"""
    if kind == "F8H":
        q6 = _codes(Q.Q6_K, 40, 256, seed=31)
        codes = BlockCodes(q6.codes * 2, q6.scales, q6.mins, 8)
        fmt = int_codes.int_format(codes)
        assert fmt == INT_F8H
        return codes, int_codes.panels(codes, fmt), fmt
    codes = _codes(kind, 40, _width(kind, 288), seed=31)
    return (codes, *_panels(codes, kind))


@pytest.mark.parametrize("kind", [*KINDS, "F8H"])
@pytest.mark.parametrize("variant", [build.EMULATED_AMX.name, "avx512_amx"])
def test_amx_tile_gives_the_vnni_bits(kind, variant):
    amx, vnni = _library(variant), _library("avx512_vnni")
    codes, panels, fmt = _case(kind)
    cols = codes.shape[1]
    for rows in ROW_COUNTS:
        x = _inputs(rows, cols, seed=32 + rows)
        expected = int_codes.int_linear(x, panels, fmt, codes.shape, library=vnni)
        assert torch.equal(int_codes.int_linear(x, panels, fmt, codes.shape, library=amx), expected), rows
        assert torch.equal(int_codes.int_linear(x.bfloat16(), panels, fmt, codes.shape, library=amx),
                           int_codes.int_linear(x.bfloat16(), panels, fmt, codes.shape, library=vnni)), rows
    assert _faults(amx) == 0


def test_the_emulation_counts_what_the_hardware_refuses():
    """A tile used before any configuration is a fault (the hardware raises #UD)."""
    library = _library(build.EMULATED_AMX.name)
    before = _faults(library)
    x, codes = _inputs(8, 64, seed=3), _codes(list(KINDS)[0], 16, 64, seed=4)
    panels, fmt = _panels(codes, list(KINDS)[0])
    int_codes.int_linear(x, panels, fmt, codes.shape, library=library)
    assert _faults(library) == before
    build.function_of(library, "int_amx_probe_unconfigured", [])()
    assert _faults(library) == before + 1


def test_amx_is_a_candidate_only_when_switched_on(monkeypatch):
    flags = build.cpu_flags() | {"amx_tile", "amx_int8", *build.VARIANTS[0].cpu_flags}
    monkeypatch.setattr(build, "cpu_flags", lambda: flags)
    monkeypatch.delenv("SPECSERVE_ISA", raising=False)
    monkeypatch.delenv(build.AMX_SWITCH, raising=False)
    assert "avx512_amx" not in [v.name for v in build.candidate_variants()]
    monkeypatch.setenv(build.AMX_SWITCH, "1")
    assert [v.name for v in build.candidate_variants()][0] == "avx512_amx"
    monkeypatch.setenv("SPECSERVE_ISA", "avx512_bf16")
    assert "avx512_amx" not in [v.name for v in build.candidate_variants()]
