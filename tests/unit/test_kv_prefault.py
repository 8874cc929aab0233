"""KVCache.prefault writes the first slots (all of them, or as many as the byte cap holds) of
every layer's K and V, and nothing past them."""
import torch

from specserve.models.attention import KVCache


def _filled_cache() -> KVCache:
    cache = KVCache(num_layers=3, num_slots=10, num_kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")
    cache.k.fill_(1.0)
    cache.v.fill_(2.0)
    return cache


def test_a_capped_prefault_touches_the_first_slots_of_every_layer() -> None:
    cache = _filled_cache()
    slot_bytes = 2 * 3 * 2 * 4 * 4             # K and V, 3 layers, 2 heads x 4 dims, float32
    written = cache.prefault(max_bytes=4 * slot_bytes + slot_bytes // 2)
    assert written == 4 * slot_bytes
    assert torch.all(cache.k[:, :4] == 0) and torch.all(cache.v[:, :4] == 0)
    assert torch.all(cache.k[:, 4:] == 1) and torch.all(cache.v[:, 4:] == 2)


def test_an_uncapped_prefault_touches_the_whole_cache() -> None:
    cache = _filled_cache()
    assert cache.prefault() == cache.k.numel() * 4 * 2
    assert not cache.k.any() and not cache.v.any()
