"""Per-request speculative state (``req.spec_state``), shared by the worker and proposers."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from specserve.core import Request
from specserve.speculative.policy import RequestPolicyState


@dataclass
class RequestSpecState:
    proposer: Any = None                           # proposer-private
    ngram: Any = None                              # NGRAM's (its own field: it may assist another proposer)
    cpu_generator: torch.Generator | None = None   # seeded coins for sample_accept
    policy: RequestPolicyState = field(default_factory=RequestPolicyState)


def spec_state(req: Request) -> RequestSpecState:
    if req.spec_state is None:
        req.spec_state = RequestSpecState()
    return req.spec_state


def tail_ids(req: Request, n: int) -> list[int]:
    """The last ``n`` tokens of ``req.all_ids`` without copying the whole sequence."""
    out = req.output_ids
    if n <= len(out):
        return out[-n:]
    return req.input_ids[-(n - len(out)):] + out
