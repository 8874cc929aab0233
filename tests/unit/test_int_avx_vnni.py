"""The avx_vnni build of the integer kernel (AVX2 CPUs with 256-bit vpdpbusd): its tile gives the
avx2 build's bits, for every GGUF format and row count. It runs here through the same tile over
vpdpbusd's AVX-512 encoding (``build.EVEX_AVX_VNNI``: the same instruction, other bytes); on a
CPU with AVX-VNNI the real build is compared too."""
from __future__ import annotations

import pytest
import torch

from specserve.kernels import build, int_codes
from tests.unit.test_int_amx import ROW_COUNTS, _case, _library
from tests.unit.test_int_linear import KINDS, _inputs


@pytest.mark.parametrize("kind", [*KINDS, "F8H"])
@pytest.mark.parametrize("variant", [build.EVEX_AVX_VNNI.name, "avx_vnni"])
def test_avx_vnni_tile_gives_the_avx2_bits(kind, variant):
    vnni, avx2 = _library(variant), _library("avx2")
    codes, panels, fmt = _case(kind)
    for rows in ROW_COUNTS:
        for dtype in (torch.float32, torch.bfloat16):
            x = _inputs(rows, codes.shape[1], seed=52 + rows).to(dtype)
            assert torch.equal(int_codes.int_linear(x, panels, fmt, codes.shape, library=vnni),
                               int_codes.int_linear(x, panels, fmt, codes.shape, library=avx2)), (rows, dtype)


def test_the_avx_vnni_build_is_its_own_variant():
    """Dispatch names it (level 5) and puts it below the AVX-512 builds, above avx2."""
    names = list(build.VARIANT_NAMES)
    assert names.index("avx512_vnni") < names.index("avx_vnni") < names.index("avx2")
    library = _library(build.EVEX_AVX_VNNI.name)
    assert build.function_of(library, "int_kernel_level", [])() == 5
