"""``--kv-cache-dtype bf16``: the cache holds bfloat16, attention computes in float32 over it."""
from __future__ import annotations

import pytest
import torch

from specserve.config import ConfigError, ServerArgs
from specserve.kernels import attention as attention_kernel
from specserve.models.attention import KVCache, TorchSDPABackend, build_metadata
from specserve.runner.model_runner import resolve_kv_dtype

NUM_KV, GROUP, HEAD_DIM = 2, 3, 64


def test_kv_cache_dtype_values():
    assert resolve_kv_dtype("auto", torch.float32) == torch.float32
    assert resolve_kv_dtype("bf16", torch.float32) == torch.bfloat16
    assert resolve_kv_dtype("bfloat16", torch.float32) == torch.bfloat16
    with pytest.raises(ConfigError, match="kv-cache-dtype"):
        ServerArgs(kv_cache_dtype="fp8_e5m2")


@pytest.mark.parametrize("use_kernel", [True, False])
def test_float32_queries_over_a_bfloat16_cache(use_kernel, monkeypatch):
    """New K/V are rounded to bfloat16 as they are written; scores and weighted values are the
    float32 attention over those rounded values (native kernel and torch path alike)."""
    if use_kernel and not attention_kernel.is_available():
        pytest.skip("CPU kernels not built here")
    if not use_kernel:
        monkeypatch.setattr(attention_kernel, "can_run", lambda q, k: False)
    torch.manual_seed(0)
    cache = KVCache(1, 256, NUM_KV, HEAD_DIM, torch.bfloat16, "cpu")
    n, prefix = 3, 40
    slots = list(range(10, 10 + prefix + n))
    old_k, old_v = torch.randn(prefix, NUM_KV, HEAD_DIM), torch.randn(prefix, NUM_KV, HEAD_DIM)
    cache.k[0, slots[:prefix]], cache.v[0, slots[:prefix]] = old_k.bfloat16(), old_v.bfloat16()
    q = torch.randn(n, NUM_KV * GROUP, HEAD_DIM)
    k, v = torch.randn(n, NUM_KV, HEAD_DIM), torch.randn(n, NUM_KV, HEAD_DIM)
    meta = build_metadata([prefix], [n], torch.tensor([slots]), torch.tensor(slots[prefix:]),
                          num_kv_groups=GROUP, pad_slot=255)
    out = TorchSDPABackend().forward(q, k, v, 0, cache, meta).view(n, NUM_KV * GROUP, HEAD_DIM)
    assert out.dtype == torch.float32
    assert torch.equal(cache.k[0, slots[prefix:]], k.bfloat16())
    keys = torch.cat([old_k, k]).bfloat16().float()
    values = torch.cat([old_v, v]).bfloat16().float()
    for t in range(n):
        for h in range(NUM_KV * GROUP):
            seen = prefix + t + 1
            w = torch.softmax(keys[:seen, h // GROUP] @ q[t, h] / HEAD_DIM ** 0.5, 0)
            torch.testing.assert_close(out[t, h], w @ values[:seen, h // GROUP], atol=1e-5, rtol=1e-5)
