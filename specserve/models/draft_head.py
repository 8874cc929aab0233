"""Draft heads for EAGLE-family speculative decoding, in the published checkpoint formats.

A draft head predicts the target's next tokens from the target's features: EAGLE
(``eagle.py``) and NEXTN/MTP (``mtp.py``) take the target's final normed hidden
states, EAGLE-3 (``eagle3.py``) the inputs of three target layers. Every head
runs its decoder layer through the same attention backend as the target, on its
own KV cache (``config.num_hidden_layers`` layers), and shares the target's
embedding / lm_head when its checkpoint does not carry them.

This module defines what the head formats import (the base class, checkpoint readers);
``draft_heads.py`` imports the formats and picks one (``load_draft_head``): no module here
imports a format.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.models.attention import AttentionMetadata, KVCache, TorchSDPABackend
from specserve.models.layers import RotaryEmbedding
from specserve.models.llama import add_fused_decoder_weights
from specserve.models.packed_linear import Linear
from specserve.models.weights import StrictLoader

if TYPE_CHECKING:
    from specserve.models.llama import LlamaForCausalLM


DRAFT_PATH_FLAG = "--speculative-draft-model-path"


class DraftHead(nn.Module):
    """Base class: shared-module binding, rotary, FR-Spec token map, logits."""

    feature_kind: str = "final"          # "final": target's final normed hidden; "aux": EAGLE-3 layer inputs

    def __init__(self, config: ModelConfig, feature_size: int, draft_vocab_size: int) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.feature_size = feature_size
        self.draft_vocab_size = draft_vocab_size
        self.aux_layer_ids: tuple[int, ...] = ()
        self.backend = TorchSDPABackend()
        self.rotary: RotaryEmbedding | None = None
        self.register_buffer("token_map", None, persistent=False)   # FR-Spec: draft id -> target id
        self.restricted_head: Linear | None = None        # lm_head rows of the token map
        self._shared: dict[str, nn.Module] = {}           # the target's modules: not registered (not ours)

    # ---- what a format provides ------------------------------------------------------------
    def own_embedding(self) -> nn.Embedding | None:
        return None

    def own_lm_head(self) -> Linear | None:
        return None

    def final_norm(self) -> nn.Module | None:
        return None

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    # ---- shared behaviour --------------------------------------------------------------------
    def bind_target(self, target: "LlamaForCausalLM") -> None:
        """Share the target's embedding and lm_head where this head has none of its own."""
        if target.config.hidden_size != self.hidden_size:
            raise ValueError(f"draft head hidden_size {self.hidden_size} != target hidden_size "
                             f"{target.config.hidden_size}")
        self._shared = {"embed_tokens": target.model.embed_tokens, "lm_head": target.lm_head}
        if self.own_lm_head() is None and self.token_map is None:
            self.draft_vocab_size = target.config.vocab_size
        if self.token_map is not None:
            self._restrict_head()

    def init_rotary(self, max_position: int, device) -> None:
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling).to(device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        module = self.own_embedding()
        if module is None:
            module = self._shared_module("embed_tokens")
        return module(input_ids)                                            # [T, H]

    def lm_head_module(self) -> Linear:
        if self.restricted_head is not None:
            return self.restricted_head
        own = self.own_lm_head()
        return own if own is not None else self._shared_module("lm_head")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        norm = self.final_norm()
        if norm is not None:
            hidden = norm(hidden)
        return self.lm_head_module()(hidden)                               # [T, draft_vocab]

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.token_map is None else self.token_map[ids]

    def set_token_map(self, token_map) -> None:
        """FR-Spec: restrict the head to these target ids (draft id i <-> target id token_map[i]).
        Takes effect at ``bind_target``."""
        ids = torch.as_tensor(token_map, dtype=torch.int64).flatten()
        vocab = self.config.vocab_size
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"token map must hold target ids in [0, {vocab}); got {ids.tolist()[:8]} ...")
        device = next(self.parameters()).device
        self.token_map = ids.to(device)
        self.draft_vocab_size = ids.numel()
        self.restricted_head = None

    def _restrict_head(self) -> None:
        full = self.own_lm_head()
        if full is None:
            full = self._shared_module("lm_head")
        weight = full.weight.detach()[self.token_map.to(full.weight.device)]    # [K, H]
        head = Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        head.weight.data.copy_(weight)
        head.weight.requires_grad_(False)
        self.restricted_head = head

    def _shared_module(self, name: str) -> nn.Module:
        module = self._shared.get(name)
        if module is None:
            raise RuntimeError(f"draft head has no {name} of its own: call bind_target(target) first")
        return module

    def train(self, mode: bool = True) -> "DraftHead":
        """Training mode drops the CPU-prepacked weight copies (they would go stale and carry no
        gradient); ``pack_linears_for_cpu`` packs again for serving."""
        if mode:
            for module in self.modules():
                if isinstance(module, Linear):
                    module.unpack()
        return super().train(mode)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """This head's own weights in its published key layout (q/k/v and gate/up split again)."""
        tensors = {name: p.detach() for name, p in self.named_parameters()
                   if not name.startswith("restricted_head.")}
        return split_fused_tensors(tensors, self.config)

    def _new_loader(self) -> StrictLoader:
        """A strict loader for this head's parameters, with the fused q/k/v and gate/up mapping."""
        self.restricted_head = None          # rebuilt from the loaded head at bind_target
        loader = StrictLoader(self)
        add_fused_decoder_weights(loader, self.config)
        loader.ignore_suffix("rotary_emb.inv_freq")
        return loader


def strip_model_prefix(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def split_fused_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names for fused parameters: ``qkv_proj`` -> q/k/v_proj, ``gate_up_proj`` -> gate/up_proj."""
    q, kv, inter = (cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim,
                    cfg.intermediate_size)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if ".qkv_proj." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.split((q, kv, kv))):
                out[name.replace(".qkv_proj.", f".{part}.")] = piece.contiguous()
        elif ".gate_up_proj." in name:
            for part, piece in zip(("gate_proj", "up_proj"), tensor.split((inter, inter))):
                out[name.replace(".gate_up_proj.", f".{part}.")] = piece.contiguous()
        else:
            out[name] = tensor.contiguous()
    return out


# ---- finding and reading a draft checkpoint ------------------------------------------------------

@dataclass
class DraftCheckpoint:
    kind: str                              # "eagle", "eagle3", "nextn_deepseek" or "nextn_mimo"
    path: str
    raw_config: dict
    tensors: dict[str, torch.Tensor]


def load_token_map(path: str) -> torch.Tensor:
    """An FR-Spec token map: a ``torch.save``d list or tensor of target ids."""
    return torch.as_tensor(torch.load(path, map_location="cpu", weights_only=True), dtype=torch.int64).flatten()


DRAFT_VOCAB_TENSOR = "d2t"         # a draft's own vocabulary: draft id i <-> target id i + d2t[i] (EAGLE-3's rule)


def draft_vocab_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Target ids of a draft vocabulary given as EAGLE-3's ``d2t`` (draft id i <-> target id
    i + d2t[i]), int64, in draft id order."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t.to(torch.int64)


def read_hf_dir(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config.json as a dict, every tensor)`` of an HF-style directory (draft heads are small)."""
    directory = _hf_dir(path)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in _iter_tensors(directory, lambda name: True):
        tensors[name] = tensor
    return json.loads((directory / "config.json").read_text()), tensors


def read_mtp_checkpoint(path: str | None) -> DraftCheckpoint | None:
    """The first MTP/NEXTN layer inside a full model's HF directory, or None when it has none
    (or is not an HF directory, e.g. a GGUF file). Reads only that layer's tensors."""
    if path is None or not (Path(path) / "config.json").is_file():
        return None
    directory = Path(path)
    raw_config = json.loads((directory / "config.json").read_text())
    if not raw_config.get("num_nextn_predict_layers"):
        return None
    num_layers = raw_config.get("num_hidden_layers")
    layouts = {"nextn_mimo": "model.mtp_layers.0.", "nextn_deepseek": f"model.layers.{num_layers}."}
    names = _tensor_names(directory)
    for kind, prefix in layouts.items():
        if any(n.startswith(prefix) for n in names):
            tensors = dict(_iter_tensors(directory, lambda name, p=prefix: name.startswith(p)))
            return DraftCheckpoint(kind, str(path), raw_config, tensors)
    return None


def _hf_dir(path: str) -> Path:
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise ValueError(f"{DRAFT_PATH_FLAG} {path}: expected an HF-style directory with config.json "
                         f"and *.safetensors")
    return directory


def _weight_files(directory: Path) -> list[Path]:
    """``*.safetensors`` (those of the shard index when there is one), else ``pytorch_model*.bin``
    (the original EAGLE releases)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return [directory / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(directory.glob("*.safetensors")) or sorted(directory.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors (or pytorch_model*.bin) files in {directory}")
    return files


def _tensor_names(directory: Path) -> list[str]:
    return [name for file in _weight_files(directory) for name, _ in _file_tensors(file, lambda n: True, False)]


def _iter_tensors(directory: Path, wanted):
    for file in _weight_files(directory):
        yield from _file_tensors(file, wanted, True)


def _file_tensors(file: Path, wanted, load: bool):
    """``(name, tensor or None)`` of one weight file; tensors only when ``load`` (safetensors: lazily)."""
    if file.suffix == ".bin":
        state = torch.load(file, map_location="cpu", weights_only=True)
        yield from ((name, tensor) for name, tensor in state.items() if wanted(name))
        return
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as handle:
        for name in handle.keys():
            if wanted(name):
                yield name, handle.get_tensor(name) if load else None
