"""Memory budgeting: how many KV tokens fit, with a clear error when none do."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

GIB = 1024 ** 3
CPU_DEFAULT_MEM_FRACTION = 0.3
CUDA_DEFAULT_MEM_FRACTION = 0.88


class MemoryBudgetError(RuntimeError):
    pass


@dataclass
class KVBudget:
    num_tokens: int
    bytes_per_token: int
    budget_bytes: int
    model_bytes: int


def device_total_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan_kv_budget(*, device: str, model_bytes: int, bytes_per_token: int, min_tokens: int,
                   mem_fraction_static: float | None, max_total_tokens: int | None,
                   activation_bytes: int = 0) -> KVBudget:
    """Tokens of KV to allocate: ``max_total_tokens`` if given, else what the
    ``mem_fraction_static`` share of device memory leaves after the weights."""
    fraction = mem_fraction_static or (
        CUDA_DEFAULT_MEM_FRACTION if device.startswith("cuda") else CPU_DEFAULT_MEM_FRACTION)
    budget = int(device_total_bytes(device) * fraction)
    available = budget - model_bytes - activation_bytes
    if max_total_tokens is not None:
        need = max_total_tokens * bytes_per_token
        if need > available and mem_fraction_static is not None:
            raise MemoryBudgetError(_explain(model_bytes, need, budget, fraction,
                                             f"--max-total-tokens {max_total_tokens}"))
        return KVBudget(max_total_tokens, bytes_per_token, budget, model_bytes)
    num_tokens = max(available, 0) // bytes_per_token
    if num_tokens < min_tokens:
        raise MemoryBudgetError(_explain(model_bytes, min_tokens * bytes_per_token, budget, fraction,
                                         f"{min_tokens} KV tokens (one request at full context)"))
    return KVBudget(int(num_tokens), bytes_per_token, budget, model_bytes)


def _explain(model_bytes: int, kv_bytes: int, budget: int, fraction: float, what: str) -> str:
    return (f"not enough memory: the model needs {model_bytes / GIB:.2f} GiB and {what} need "
            f"{kv_bytes / GIB:.2f} GiB, but the budget is {budget / GIB:.2f} GiB "
            f"(--mem-fraction-static {fraction}). Raise --mem-fraction-static, lower "
            f"--context-length or --max-total-tokens, or use a smaller --dtype.")
