"""A tiny random Llama (2 layers, hidden 64, vocab 32) as an HF directory, with a word-level
tokenizer ("t0" .. "t31"), for fast engine-level tests of speculative decoding."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from specserve.config import ModelConfig

VOCAB = 32


def tiny_config(num_layers: int = 2) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
                       tie_word_embeddings=False, bos_token_id=0, eos_token_ids=(VOCAB - 1,))


def random_weights(cfg: ModelConfig, seed: int, head_scale: float = 2.0) -> dict[str, torch.Tensor]:
    """Weights with enough spread that next-token distributions are neither flat nor one-hot."""
    g = torch.Generator().manual_seed(seed)
    h, inter, q = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim

    def rand(*shape, std):
        return torch.randn(*shape, generator=g) * std

    w = {"model.embed_tokens.weight": rand(cfg.vocab_size, h, std=1.0),
         "model.norm.weight": torch.ones(h),
         "lm_head.weight": rand(cfg.vocab_size, h, std=head_scale / h ** 0.5)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.update({p + "self_attn.q_proj.weight": rand(q, h, std=h ** -0.5),
                  p + "self_attn.k_proj.weight": rand(kv, h, std=h ** -0.5),
                  p + "self_attn.v_proj.weight": rand(kv, h, std=h ** -0.5),
                  p + "self_attn.o_proj.weight": rand(h, q, std=q ** -0.5),
                  p + "mlp.gate_proj.weight": rand(inter, h, std=h ** -0.5),
                  p + "mlp.up_proj.weight": rand(inter, h, std=h ** -0.5),
                  p + "mlp.down_proj.weight": rand(h, inter, std=inter ** -0.5),
                  p + "input_layernorm.weight": torch.ones(h),
                  p + "post_attention_layernorm.weight": torch.ones(h)})
    return w


def perturbed(weights: dict[str, torch.Tensor], seed: int, noise: float) -> dict[str, torch.Tensor]:
    """A "draft": the same weights plus relative Gaussian noise."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + noise * v.std() * torch.randn(v.shape, generator=g) if v.dim() > 1 else v.clone()
            for k, v in weights.items()}


def write_tiny_model(out: Path, weights: dict[str, torch.Tensor], cfg: ModelConfig | None = None) -> Path:
    cfg = cfg or tiny_config()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(dict(cfg.to_hf(), torch_dtype="float32")))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    _write_tokenizer(out)
    return out


def _write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t0", "eos_token": f"t{VOCAB - 1}"}))
