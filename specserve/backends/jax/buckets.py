"""Padded shapes ("buckets") of the jitted step, so shapes do not recompile per request.

A forward is laid out as ``[B, Q]``: B requests (padded to a batch bucket) by Q new
tokens each (padded to a query bucket). SGL-JAX's flags choose them:
``--precompile-bs-paddings`` (batch sizes) and ``--precompile-token-paddings``
(prefill tokens per request; decode and verify also pad to 1, 4, 8, 16 or 32 new tokens). Widths past the
largest bucket round up to a power of two (compiled on first use, with a warning).

Row invariance: XLA's CPU matmul takes a one-row kernel for one row, another for 2 to
32 rows and a third beyond, and their roundings differ. ``model.matmul_rows`` takes
wider forwards 32 rows at a time, and no forward runs a single row (``MIN_ROWS``): every
product then takes the 2..32-row kernel, so a row's bits do not depend on the batch.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

DEFAULT_BS_PADDINGS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_TOKEN_PADDINGS = (16, 64, 128, 256, 512)
SMALL_QUERY_PADDINGS = (1, 4, 8, 16, 32)
MIN_ROWS = 2


def parse_paddings(text: str | None, default: tuple[int, ...], flag: str) -> tuple[int, ...]:
    """``"1,2,4"`` or ``"1 2 4"`` -> (1, 2, 4); None -> ``default``."""
    if text is None or not str(text).strip():
        return default
    try:
        values = sorted({int(v) for v in str(text).replace(",", " ").split()})
    except ValueError:
        raise ValueError(f"{flag}: expected integers separated by commas or spaces; got {text!r}") from None
    if not values or values[0] < 1:
        raise ValueError(f"{flag}: paddings must be positive; got {text!r}")
    return tuple(values)


def _round_up(n: int, paddings: tuple[int, ...], what: str) -> int:
    for p in paddings:
        if p >= n:
            return p
    padded = 1 << (n - 1).bit_length()
    logger.warning("%s %d exceeds the largest padding %d: padded to %d (compiled on first use)", what, n,
                   paddings[-1], padded)
    return padded


@dataclass(frozen=True)
class Buckets:
    bs_paddings: tuple[int, ...] = DEFAULT_BS_PADDINGS
    token_paddings: tuple[int, ...] = DEFAULT_TOKEN_PADDINGS

    def batch(self, num_requests: int) -> int:
        return _round_up(num_requests, self.bs_paddings, "batch size")

    def queries(self, max_new_tokens: int, is_prefill: bool = False) -> int:
        """Prefill pads to the token paddings; decode and verify also to small widths."""
        paddings = self.token_paddings if is_prefill else tuple(sorted(set(SMALL_QUERY_PADDINGS)
                                                                      | set(self.token_paddings)))
        return _round_up(max_new_tokens, paddings, "new tokens per request")

    def shape(self, num_requests: int, max_new_tokens: int, is_prefill: bool = False) -> tuple[int, int]:
        """(B, Q) of a forward; never a single row (see the module docstring)."""
        bsz, num_q = self.batch(num_requests), self.queries(max_new_tokens, is_prefill)
        if bsz * num_q < MIN_ROWS:
            bsz = MIN_ROWS
        return bsz, num_q
