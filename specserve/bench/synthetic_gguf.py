"""GGUF files of a real model's shape with random blocks (``specserve bench load-memory
--synthetic``): what loading a model this machine was never given costs. Every matrix is Q4_0
blocks of random codes and small float16 scales; norms are ones. The weights mean nothing; the
sizes, the tensor names and the loading path are those of a llama.cpp conversion."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int


SHAPES = {
    "llama-1b": Shape(layers=22, hidden=2048, ffn=5632, heads=32, kv_heads=4, vocab=32000),    # TinyLlama-1.1B
    "llama-7b": Shape(layers=32, hidden=4096, ffn=11008, heads=32, kv_heads=32, vocab=32000),  # Llama-2-7B
}
Q4_0_BLOCK_BYTES = 18           # a float16 scale and 16 bytes of 4-bit codes per 32 weights


def write_random_gguf(path: Path, shape: Shape, seed: int = 0) -> Path:
    """A Q4_0 GGUF of ``shape`` at ``path`` (written once: an existing file is reused)."""
    import gguf

    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path.with_suffix(".part")), "llama")
    _add_metadata(writer, shape)
    for name, rows, cols in tqdm(_matrices(shape), desc=f"writing {path.name}", unit="matrix", leave=False):
        writer.add_tensor(name, _random_q4_0(rng, rows, cols), raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    for name in ["output_norm.weight"] + [f"blk.{i}.{n}.weight" for i in range(shape.layers)
                                          for n in ("attn_norm", "ffn_norm")]:
        writer.add_tensor(name, np.ones(shape.hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.with_suffix(".part").rename(path)
    return path


def _add_metadata(writer, shape: Shape) -> None:
    writer.add_block_count(shape.layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(shape.vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "</s>"])
    writer.add_token_types([1, 1, 3])
    writer.add_eos_token_id(2)


def _matrices(shape: Shape) -> list[tuple[str, int, int]]:
    head_dim = shape.hidden // shape.heads
    per_layer = [("attn_q", shape.hidden, shape.hidden), ("attn_k", shape.kv_heads * head_dim, shape.hidden),
                 ("attn_v", shape.kv_heads * head_dim, shape.hidden), ("attn_output", shape.hidden, shape.hidden),
                 ("ffn_gate", shape.ffn, shape.hidden), ("ffn_up", shape.ffn, shape.hidden),
                 ("ffn_down", shape.hidden, shape.ffn)]
    return ([("token_embd.weight", shape.vocab, shape.hidden), ("output.weight", shape.vocab, shape.hidden)]
            + [(f"blk.{i}.{name}.weight", rows, cols) for i in range(shape.layers) for name, rows, cols in per_layer])


def _random_q4_0(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """uint8 [rows, cols / 32 * 18]: blocks of random codes, scales ~N(0, 0.02) / 8 in float16."""
    blocks = rng.integers(0, 256, size=(rows, cols // 32, Q4_0_BLOCK_BYTES), dtype=np.uint8)
    scales = (np.abs(rng.standard_normal((rows, cols // 32))) * 0.0025 + 1e-4).astype(np.float16)
    blocks[..., :2] = scales.view(np.uint8).reshape(rows, cols // 32, 2)
    return blocks.reshape(rows, -1)
