"""``--kv-cache-dtype bf16``: the cache holds bfloat16; the native kernel multiplies in bfloat16
over it, the torch path in float32."""
from __future__ import annotations

import pytest
import torch

from specserve.config import ConfigError, ServerArgs
from specserve.kernels import attention as attention_kernel
from specserve.models.attention import KVCache, TorchSDPABackend, build_metadata
from specserve.runner.model_runner import resolve_kv_dtype
from tests.unit.test_attention_invariance import attention_of_every_variant, runnable_variants

NUM_KV, GROUP, HEAD_DIM = 2, 3, 64


def test_kv_cache_dtype_values():
    assert resolve_kv_dtype("auto", torch.float32) == torch.float32
    assert resolve_kv_dtype("bf16", torch.float32) == torch.bfloat16
    assert resolve_kv_dtype("bfloat16", torch.float32) == torch.bfloat16
    with pytest.raises(ConfigError, match="kv-cache-dtype"):
        ServerArgs(kv_cache_dtype="fp8_e5m2")


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().double()


KEY_SPLIT = 256       # paged_attention.c: a row's keys in splits, each with its own softmax max


def _reference(q, keys, values, products_in_bf16: bool) -> torch.Tensor:
    """Attention of one query head over float32 keys/values (bfloat16 values already): float64
    sums; with bfloat16 products the scaled query and the softmax weights rounded to bfloat16,
    the weights as the kernel has them: exp(score - max of its split of KEY_SPLIT keys), the
    splits merged by exp(split max - max)."""
    scaled = (q.float() * (1 / torch.tensor(float(q.shape[-1])).sqrt())).double()   # the kernel's float32 scale
    scaled = _bf16(scaled) if products_in_bf16 else scaled
    scores = keys.double() @ scaled
    top = scores.max()
    numerator = denominator = 0.0
    for c in range(0, len(scores), KEY_SPLIT):
        split = scores[c:c + KEY_SPLIT]
        w = torch.exp(split - split.max())
        w = _bf16(w.float()) if products_in_bf16 else w
        factor = torch.exp(split.max() - top)
        numerator = numerator + factor * (w @ values[c:c + KEY_SPLIT].double())
        denominator = denominator + factor * w.sum()
    return numerator / denominator


def _assert_matches(outs: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """Each head's output equals its reference to float32 rounding, but for the rare head where
    the kernel's exp and torch's land on two sides of a bfloat16 rounding boundary (one weight
    one bfloat16 step apart): at most 1 in 20 heads, and those within 1e-3."""
    errors = torch.tensor([(o.double() - e).abs().max().item() for o, e in zip(outs, expected)])
    assert (errors > 2e-6).float().mean() <= 0.05 and errors.max() < 1e-3, errors


@pytest.mark.parametrize("use_kernel", [True, False])
def test_float32_queries_over_a_bfloat16_cache(use_kernel, monkeypatch):
    """New K/V are rounded to bfloat16 as they are written. The native kernel multiplies in
    bfloat16 (the scaled query and the softmax weights rounded to bfloat16, every product exact,
    float32 sums: paged_attention.c, PAIR_DIMS); the torch path computes in float32 over the
    rounded K/V."""
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
    outs, expected, other = [], [], []
    for t in range(n):
        for h in range(NUM_KV * GROUP):
            seen = prefix + t + 1
            args = (q[t, h], keys[:seen, h // GROUP], values[:seen, h // GROUP])
            outs.append(out[t, h])
            expected.append(_reference(*args, products_in_bf16=use_kernel))
            other.append(_reference(*args, products_in_bf16=not use_kernel))
    _assert_matches(outs, expected)
    assert min((o.double() - e).abs().max().item() for o, e in zip(outs, other)) > 1e-5   # told apart


@pytest.mark.parametrize("head_dim", [40, 96, 128])
def test_bfloat16_products_at_every_head_size_and_variant(head_dim):
    """Heads that are not a whole number of the kernel's 32-dim chunks (the last chunk's lanes
    masked) and 128: every kernel variant this CPU runs (vdpbf16ps where the CPU has it, FMAs
    over pair-split rows elsewhere) gives the same bits, the bfloat16-product attention."""
    if not attention_kernel.is_available():
        pytest.skip("CPU kernels not built here (or SPECSERVE_KERNELS=0)")
    torch.manual_seed(1)
    cache = KVCache(1, 512, NUM_KV, head_dim, torch.bfloat16, "cpu")
    cache.k[0], cache.v[0] = torch.randn(512, NUM_KV, head_dim), torch.randn(512, NUM_KV, head_dim)
    prefix_lens, extend_lens = [300, 37], [5, 1]              # a verify of 5 beside a decode row
    rows = [list(range(b * 340, b * 340 + p + e)) for b, (p, e) in enumerate(zip(prefix_lens, extend_lens))]
    kv_indices = torch.full((2, 320), 511, dtype=torch.int64)
    for b, slots in enumerate(rows):
        kv_indices[b, :len(slots)] = torch.tensor(slots)
    meta = build_metadata(prefix_lens, extend_lens, kv_indices, torch.tensor(rows[0][-5:] + rows[1][-1:]),
                          num_kv_groups=GROUP, pad_slot=511)
    q = torch.randn(sum(extend_lens), NUM_KV * GROUP, head_dim)
    out = attention_of_every_variant(q, cache, meta, runnable_variants()).view(len(q), NUM_KV * GROUP, head_dim)
    keys, values = cache.k[0].float(), cache.v[0].float()
    outs, expected = [], []
    for t, (b, j) in enumerate(zip(meta.row_batch.tolist(), meta.row_query.tolist())):
        seen = torch.tensor(rows[b][:prefix_lens[b] + j + 1])
        for h in range(NUM_KV * GROUP):
            outs.append(out[t, h])
            expected.append(_reference(q[t, h], keys[seen, h // GROUP], values[seen, h // GROUP], True))
    _assert_matches(outs, expected)
