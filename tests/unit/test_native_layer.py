"""The native decoder layer computes what the torch layer computes, row-invariantly."""
from __future__ import annotations

import pytest
import torch

from specserve.config import ModelConfig
from specserve.kernels import layer as native_layer
from specserve.models.attention import KVCache, TorchSDPABackend, build_metadata
from specserve.models.layers import RotaryEmbedding
from specserve.models.llama import LlamaDecoderLayer
from specserve.models.packed_linear import has_packed_kernels, pack_linears_for_cpu

pytestmark = pytest.mark.skipif(not native_layer.is_available(),
                                reason="native kernels not built here (no AVX2 or no C compiler)")

CFG = ModelConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, attention_bias=True)
PAD_SLOT = 511
# Where the CPU has oneDNN's bfloat16 kernels (AVX-512 BW and up), bfloat16 linears run oneDNN and
# the native layer (which needs every linear on the skinny kernel) runs float32 only.
BF16_ON_ONEDNN = has_packed_kernels(torch.bfloat16)
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    BF16_ON_ONEDNN, reason="bfloat16 linears run oneDNN on this CPU, so the native layer runs float32 only "
                           "(see test_the_native_layer_runs_where_its_linears_run_the_skinny_kernel)"))]


def _layer(dtype: torch.dtype) -> LlamaDecoderLayer:
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(CFG, layer_id=0)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.2)
    layer = layer.to(dtype).eval()
    pack_linears_for_cpu(layer)
    return layer


def _cache(dtype: torch.dtype) -> KVCache:
    torch.manual_seed(1)
    cache = KVCache(1, PAD_SLOT + 1, CFG.num_key_value_heads, CFG.head_dim, dtype, "cpu")
    cache.k[0, :PAD_SLOT] = torch.randn(PAD_SLOT, CFG.num_key_value_heads, CFG.head_dim).to(dtype)
    cache.v[0, :PAD_SLOT] = torch.randn(PAD_SLOT, CFG.num_key_value_heads, CFG.head_dim).to(dtype)
    return cache


def _run(layer, h, prefix_lens, extend_lens, slot_rows, new_slots, tree_masks=None, native=True,
         cache=None, positions=None):
    """One decode-shaped forward of the layer (over a fresh random KV cache unless given)."""
    dtype = h.dtype
    cache = cache or _cache(dtype)
    kv_indices = torch.full((len(slot_rows), 100), PAD_SLOT, dtype=torch.int64)
    for b, slots in enumerate(slot_rows):
        kv_indices[b, :len(slots)] = torch.tensor(slots)
    meta = build_metadata(prefix_lens, extend_lens, kv_indices, torch.tensor(new_slots), tree_masks,
                          num_kv_groups=CFG.num_attention_heads // CFG.num_key_value_heads, pad_slot=PAD_SLOT)
    if positions is None:
        positions = [p + j for p, e in zip(prefix_lens, extend_lens) for j in range(e)]
    positions = torch.tensor(positions)
    rotary = RotaryEmbedding(CFG.head_dim, 256, CFG.rope_theta)
    cos, sin = rotary.cos_sin(positions, dtype)
    with torch.inference_mode():
        if native:
            assert meta.row_batch is not None and layer.can_run_native(h.shape[0])
            out = h.clone()
            layer.forward_native(out, cos, sin, cache, meta)
        else:
            out = layer(h, cos, sin, cache, meta, TorchSDPABackend())
    return out, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_layer_runs_where_its_linears_run_the_skinny_kernel(dtype):
    layer = _layer(dtype)
    runs_native = dtype == torch.float32 or not BF16_ON_ONEDNN
    with torch.inference_mode():
        assert layer.can_run_native(5) == runs_native
    assert (layer.mlp.down_proj.skinny_max_rows >= 5) == runs_native


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_layer_matches_the_torch_layer(dtype):
    layer = _layer(dtype)
    h = torch.randn(5, CFG.hidden_size).to(dtype)
    args = ([30, 12], [3, 2], [list(range(100, 133)), list(range(200, 214))], [130, 131, 132, 212, 213])
    native, native_cache = _run(layer, h, *args)
    reference, reference_cache = _run(layer, h, *args, native=False)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(native.float(), reference.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(native_cache.k.float(), reference_cache.k.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(native_cache.v.float(), reference_cache.v.float(), atol=tol, rtol=tol)


def test_new_keys_and_values_go_to_a_bfloat16_cache_rounded_as_torch_rounds():
    """A float32 layer over a bfloat16 cache (``--kv-cache-dtype bf16``) writes each new K/V
    value as ``.to(torch.bfloat16)`` rounds the one it writes to a float32 cache."""
    layer = _layer(torch.float32)
    h = torch.randn(5, CFG.hidden_size)
    args = ([30, 12], [3, 2], [list(range(100, 133)), list(range(200, 214))], [130, 131, 132, 212, 213])
    _, float_cache = _run(layer, h, *args)
    _, bf16_cache = _run(layer, h, *args, cache=_cache(torch.bfloat16))
    new = torch.tensor(args[3])
    assert bf16_cache.k.dtype == torch.bfloat16
    assert torch.equal(bf16_cache.k[0, new], float_cache.k[0, new].bfloat16())
    assert torch.equal(bf16_cache.v[0, new], float_cache.v[0, new].bfloat16())


FEW_ROWS = ([30], [1], [list(range(100, 131))], [130])                          # each thread norms its own copy
TWO_REQUESTS = ([30, 12], [2, 1], [list(range(100, 132)), list(range(200, 213))], [130, 131, 212])
MANY_ROWS = ([30, 12], [5, 4], [list(range(100, 135)), list(range(200, 216))],   # row-wise steps split by rows
             [130, 131, 132, 133, 134, 212, 213, 214, 215])


def _slot_major(cache: KVCache) -> KVCache:
    """A copy of ``cache`` laid out [layers, slots, kv heads, head_dim], contiguous."""
    copy = KVCache(1, 1, 1, 1, cache.k.dtype, "cpu")
    copy.k, copy.v, copy.num_slots = cache.k.contiguous(), cache.v.contiguous(), cache.num_slots
    return copy


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_layer_reads_and_writes_either_kv_layout_alike(dtype):
    """The CPU cache is head-major (each KV head's slots one stream); the kernels take a cache's
    strides, so a slot-major one gives the same output and the same K/V at every slot."""
    cache = _cache(dtype)
    assert cache.k[0].stride(1) == cache.num_slots * CFG.head_dim      # head-major
    slot_major = _slot_major(cache)
    assert slot_major.k[0].is_contiguous()
    layer = _layer(dtype)
    h = torch.randn(9, CFG.hidden_size).to(dtype)
    head_out, head_cache = _run(layer, h, *MANY_ROWS, cache=cache)
    slot_out, slot_cache = _run(layer, h, *MANY_ROWS, cache=slot_major)
    assert torch.equal(head_out, slot_out)
    assert torch.equal(head_cache.k, slot_cache.k) and torch.equal(head_cache.v, slot_cache.v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("args", [FEW_ROWS, TWO_REQUESTS, MANY_ROWS], ids=["1 row", "3 rows", "9 rows"])
def test_thread_count_does_not_change_the_layers_bits(dtype, args):
    """1, 3 or 9 rows on 2 or 3 threads (each thread norming its own copy of a few rows, or the
    row-wise steps split by rows: norms, residual adds, rotary, the KV write; the linears and
    attention shared) give one thread's bits, output and cache alike."""
    layer = _layer(dtype)
    h = torch.randn(sum(args[1]), CFG.hidden_size).to(dtype)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(_run(layer, h, *args))
    finally:
        torch.set_num_threads(threads)
    for out, cache in results[1:]:
        assert torch.equal(out, results[0][0])
        assert torch.equal(cache.k, results[0][1].k) and torch.equal(cache.v, results[0][1].v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tree_node_gets_the_bits_of_its_plain_decode(dtype):
    """Node 2 of the tree root -> {1, 2} (parents 0, 0) sees the prefix and the root, as the
    plain decode of the same token at the same position does (after the root's decode)."""
    layer = _layer(dtype)
    h = torch.randn(3, CFG.hidden_size).to(dtype)
    prefix = list(range(100, 140))
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    verify, _ = _run(layer, h, [40], [3], [prefix + [300, 301, 302]], [300, 301, 302], [tree],
                     positions=[40, 41, 41])
    plain_cache = _cache(dtype)
    root, _ = _run(layer, h[:1], [40], [1], [prefix + [300]], [300], cache=plain_cache)
    node2, _ = _run(layer, h[2:], [41], [1], [prefix + [300, 302]], [302], cache=plain_cache)
    assert torch.equal(verify[:1], root)
    assert torch.equal(verify[2:], node2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("native_norms", [False, True])
@pytest.mark.parametrize("with_ends", [True, False])
def test_the_one_call_model_gives_the_layer_paths_bits_and_eagle3_inputs(dtype, native_norms, with_ends, monkeypatch):
    """The whole decode-shaped forward in one native call (embedding, rotary tables, every layer,
    EAGLE-3's captured layer inputs, side by side in one tensor, the final norm where it runs
    natively), or the layer stack in one call with torch's ends where model_stack does not take
    them, gives the bits of the layer-by-layer path with torch's embedding, rotary rows and norm."""
    from specserve.models.layers import use_native_norms
    from specserve.models.llama import LlamaForCausalLM

    cfg = ModelConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=6,
                      num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, vocab_size=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.2)
    model = model.to(dtype)
    model.init_rotary(256, "cpu")
    pack_linears_for_cpu(model)
    if native_norms:
        use_native_norms(model)
    model.eval().aux_layer_ids = (0, 2)
    slot_rows = [list(range(0, 12)), list(range(40, 45))]
    new_slots = [11, 43, 44]
    kv_indices = torch.full((2, 100), PAD_SLOT, dtype=torch.int64)
    for b, slots in enumerate(slot_rows):
        kv_indices[b, :len(slots)] = torch.tensor(slots)
    meta = build_metadata([11, 3], [1, 2], kv_indices, torch.tensor(new_slots), num_kv_groups=3, pad_slot=PAD_SLOT)
    ids, positions = torch.tensor([5, 7, 9]), torch.tensor([11, 3, 4])
    calls = []
    one_call = native_layer.model_stack
    monkeypatch.setattr(native_layer, "model_stack", lambda *args, **kw: calls.append(1) or one_call(*args, **kw))
    if not with_ends:
        monkeypatch.setattr(native_layer.ModelEnds, "usable", lambda *args: False)
    runs = []
    for stack in (True, False):
        cache = KVCache(3, PAD_SLOT + 1, 2, 16, dtype, "cpu")
        torch.manual_seed(1)
        cache.k[:, :PAD_SLOT], cache.v[:, :PAD_SLOT] = torch.randn(2, 3, PAD_SLOT, 2, 16).to(dtype)
        if not stack:
            model._runs_stack_native = lambda *args: False
        with torch.inference_mode():
            assert LlamaForCausalLM._runs_stack_native(model, 3, meta)    # the stack can run: unpatched, it does
            runs.append(model(ids, positions, cache, meta))
        assert len(calls) == with_ends
    (h_stack, aux_stack), (h_layers, aux_layers) = runs
    assert torch.equal(h_stack, h_layers)
    assert len(aux_stack) == 2 and all(torch.equal(a, b) for a, b in zip(aux_stack, aux_layers))
    assert torch.equal(aux_stack.joined, torch.cat(aux_layers, dim=-1))   # what the EAGLE-3 head reads


def test_the_one_call_model_rejects_an_id_outside_the_vocabulary():
    from specserve.models.llama import LlamaForCausalLM

    cfg = ModelConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=6,
                      num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, vocab_size=128)
    model = LlamaForCausalLM(cfg).eval()
    model.init_rotary(256, "cpu")
    pack_linears_for_cpu(model)
    kv_indices = torch.full((1, 100), PAD_SLOT, dtype=torch.int64)
    kv_indices[0, 0] = 0
    meta = build_metadata([0], [1], kv_indices, torch.tensor([0]), num_kv_groups=3, pad_slot=PAD_SLOT)
    cache = KVCache(1, PAD_SLOT + 1, 2, 16, torch.float32, "cpu")
    with torch.inference_mode(), pytest.raises(RuntimeError, match="model_stack rejected"):
        model(torch.tensor([128]), torch.tensor([0]), cache, meta)


def test_eagle3_midlayer_runs_natively_from_its_2h_wide_input():
    """EAGLE-3's midlayer (attention over [ln(embedding), ln(hidden)], residual = hidden) in one
    native call from the caller-formed input computes what its torch path computes."""
    from specserve.models.eagle3 import Eagle3DecoderLayer

    torch.manual_seed(0)
    layer = Eagle3DecoderLayer(CFG)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.2)
    layer = layer.eval()
    pack_linears_for_cpu(layer)
    embeds, hidden = torch.randn(5, CFG.hidden_size), torch.randn(5, CFG.hidden_size)
    kv_indices = torch.full((2, 100), PAD_SLOT, dtype=torch.int64)
    kv_indices[0, :33], kv_indices[1, :14] = torch.arange(100, 133), torch.arange(200, 214)
    meta = build_metadata([30, 12], [3, 2], kv_indices, torch.tensor([130, 131, 132, 212, 213]),
                          num_kv_groups=CFG.num_attention_heads // CFG.num_key_value_heads, pad_slot=PAD_SLOT)
    cos, sin = RotaryEmbedding(CFG.head_dim, 256, CFG.rope_theta).cos_sin(torch.tensor([30, 31, 32, 12, 13]),
                                                                        torch.float32)
    outs, caches = [], []
    for native in (True, False):
        cache = _cache(torch.float32)
        layer.runs_native = (lambda n, m: True) if native else (lambda n, m: False)
        with torch.inference_mode():
            outs.append(layer(embeds, hidden, cos, sin, cache, meta, TorchSDPABackend()))
        caches.append(cache)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(caches[0].k, caches[1].k, atol=1e-4, rtol=1e-4)
    assert not torch.equal(outs[0], hidden)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("feature_width", [3 * CFG.hidden_size, CFG.hidden_size])
def test_an_eagle3_head_in_one_call_gives_the_bits_of_its_separate_calls(dtype, feature_width, monkeypatch):
    """An EAGLE-3 head's forward in one native call (fc of the target's 3H features, or the
    previous draft step's H-wide output as is; embedding, both norms, rotary rows, the midlayer)
    gives the bits of the separate calls, and its K/V."""
    from specserve.models.eagle3 import Eagle3Head
    from specserve.models.layers import use_native_norms

    head = _random_eagle3_head().to(dtype).eval()
    head.init_rotary(256, "cpu")
    pack_linears_for_cpu(head)
    use_native_norms(head)
    kv_indices = torch.full((2, 100), PAD_SLOT, dtype=torch.int64)
    kv_indices[0, :33], kv_indices[1, :14] = torch.arange(100, 133), torch.arange(200, 214)
    meta = build_metadata([30, 12], [3, 2], kv_indices, torch.tensor([130, 131, 132, 212, 213]),
                          num_kv_groups=3, pad_slot=PAD_SLOT)
    ids, positions = torch.tensor([3, 9, 27, 81, 127]), torch.tensor([30, 31, 32, 12, 13])
    features = torch.randn(5, feature_width).to(dtype)
    outs, caches = [], []
    for one_call in (True, False):
        if not one_call:
            monkeypatch.setattr(Eagle3Head, "_one_call", lambda *args: None)
        cache = _cache(dtype)
        with torch.inference_mode():
            assert (head._one_call(ids, features, positions, meta) is not None) == one_call
            outs.append(head(ids, features, positions, cache, meta))
        caches.append(cache)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


def test_an_eagle3_head_takes_its_one_call_once_it_can_and_again_after_fc_changes():
    """The head's one call is not ruled out for good by a forward that could not take it (with
    gradients, as in training), and a replaced fc weight is read afresh, not through old pointers."""
    from specserve.models.layers import use_native_norms

    head = _random_eagle3_head().eval()
    head.init_rotary(256, "cpu")
    pack_linears_for_cpu(head)
    use_native_norms(head)
    kv_indices = torch.full((1, 100), PAD_SLOT, dtype=torch.int64)
    kv_indices[0, :3] = torch.arange(100, 103)
    meta = build_metadata([2], [1], kv_indices, torch.tensor([102]), num_kv_groups=3, pad_slot=PAD_SLOT)
    ids, positions, features = torch.tensor([3]), torch.tensor([2]), torch.randn(1, 3 * CFG.hidden_size)
    assert head._one_call(ids, features, positions, meta) is None           # gradients on
    with torch.inference_mode():
        call = head._one_call(ids, features, positions, meta)
        assert call is not None
        first = head(ids, features, positions, _cache(torch.float32), meta)
    with torch.no_grad():
        head.fc.weight.data = head.fc.weight.data * 2                       # a new tensor
    with torch.inference_mode():
        assert head._one_call(ids, features, positions, meta) is not call
        second = head(ids, features, positions, _cache(torch.float32), meta)
        head._one_call = lambda *args: None                                 # the separate calls
        separate = head(ids, features, positions, _cache(torch.float32), meta)
    assert not torch.equal(first, second) and torch.equal(second, separate)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quantization", [None, "w8a8_int8"])
@pytest.mark.parametrize("rows", [None, [4, 1]])
def test_a_draft_heads_logits_in_one_call_give_the_bits_of_its_separate_calls(dtype, quantization, rows,
                                                                                 monkeypatch):
    """``HeadRunner.logits`` in one native call (the logit rows, the final norm, the LM head on the
    skinny or integer kernel, each row's argmax) gives the bits of the head's separate calls;
    exact ties go to the first maximum and a NaN counts as the largest, as ``argmax_rows``."""
    from specserve.models.layers import use_native_norms
    from specserve.models.packed_linear import integer_quantization
    from specserve.runner import head_runner
    from specserve.runner.sampler import argmax_rows

    head = _random_eagle3_head()
    with torch.no_grad():
        head.lm_head.weight[3] = head.lm_head.weight[7] = 1.0       # rows 3 and 7 tie on every input,
    head = head.to(dtype).eval()
    pack_linears_for_cpu(head, integer_quantization(head, quantization))
    use_native_norms(head)
    runner = head_runner.HeadRunner(head, num_kv_slots=8, max_rows=1, max_row_len=8)
    out = torch.randn(5, head.hidden_size).to(dtype)
    out[4] = head.norm.weight.sign()                            # ... and lead on row 4 (normed: |weight|)
    out[2] = 0.0
    out[2, 0] = float("nan")                                    # row 2's logits are all NaN
    logit_rows = None if rows is None else torch.tensor(rows)
    results = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(head_runner, "_takes_native_logits", lambda *args: False)
        with torch.inference_mode():
            assert head_runner._takes_native_logits(out, head.norm, head.lm_head, 5) == native
            results.append(runner.logits(out, logit_rows))
    (hidden, logits, ids), (ref_hidden, ref_logits, ref_ids) = results
    assert _same_bits(hidden, ref_hidden) and _same_bits(logits, ref_logits)
    assert torch.equal(ids, ref_ids) and torch.equal(ids, argmax_rows(ref_logits))
    if rows is None:
        assert ids[2] == 0                                      # the first NaN
    assert ids[-1] == 3                                         # the tie goes to the first


def _random_eagle3_head():
    """A float32 EAGLE-3 head with its own embedding, weights drawn from seed 0."""
    from specserve.models.eagle3 import Eagle3Head

    cfg = ModelConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=6,
                      num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, vocab_size=128)
    torch.manual_seed(0)
    head = Eagle3Head(cfg, has_embedding=True)
    for param in head.parameters():
        torch.nn.init.normal_(param, std=0.2)
    return head


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16 if a.element_size() == 2
                                                                            else torch.int32),
                                                                     b.view(torch.int16 if b.element_size() == 2
                                                                            else torch.int32))
