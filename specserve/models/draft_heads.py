"""Which draft head a checkpoint holds, and loading it: the registry of head formats.

``load_draft_head`` finds the format (a draft directory, or MTP layers inside the target
checkpoint), builds the head, loads it strictly and binds it to the target. The formats
(``eagle.py``, ``eagle3.py``, ``mtp.py``) import ``draft_head.py``; only this module imports them.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from specserve.models.draft_head import (DRAFT_PATH_FLAG, DraftCheckpoint, DraftHead, load_token_map,
                                         read_hf_dir, read_mtp_checkpoint, strip_model_prefix)
from specserve.models.eagle import EagleHead
from specserve.models.eagle3 import Eagle3Head
from specserve.models.layers import use_native_norms
from specserve.models.mtp import NextNHead
from specserve.models.packed_linear import integer_quantization, pack_linears_for_cpu, runs_integer
from specserve.models.weights import built_on_meta

if TYPE_CHECKING:
    from specserve.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

HEAD_CLASSES: dict[str, type[DraftHead]] = {
    "eagle": EagleHead, "eagle3": Eagle3Head, "nextn_deepseek": NextNHead, "nextn_mimo": NextNHead}


def load_draft_head(algorithm: str, draft_path: str | None, target: "LlamaForCausalLM", target_path: str, *,
                    dtype: torch.dtype, device, max_position: int,
                    token_map_path: str | None = None, quantization: str | None = None) -> DraftHead:
    """Build, strictly load and bind the draft head for ``algorithm`` ("EAGLE", "NEXTN" or "EAGLE3");
    ``quantization`` as ``build_model``'s (the head's own linears; shared target parts keep theirs)."""
    algorithm = algorithm.upper()
    if algorithm not in ("EAGLE", "EAGLE3", "NEXTN"):
        raise ValueError(f"no draft head for --speculative-algorithm {algorithm} (EAGLE, EAGLE3, NEXTN)")
    checkpoint = find_draft_checkpoint(algorithm, draft_path, target, target_path)
    head_class = HEAD_CLASSES[checkpoint.kind]
    with built_on_meta():
        head = head_class.for_checkpoint(checkpoint, target.config)
    head = head.to_empty(device=device).to(dtype)
    if token_map_path is not None:
        if checkpoint.kind == "eagle3":
            logger.warning("--speculative-token-map is ignored for EAGLE3: the head carries its own "
                           "draft vocabulary (d2t)")
        else:
            head.set_token_map(load_token_map(token_map_path))
    head.load_weights(checkpoint.tensors.items())
    head.bind_target(target)
    head.init_rotary(max_position, device)
    pack_linears_for_cpu(head, integer_quantization(head, quantization))
    if runs_integer(head):
        use_native_norms(head)
    logger.info("draft head %s from %s: %d layer(s), draft vocab %d", checkpoint.kind, checkpoint.path,
                head.config.num_hidden_layers, head.draft_vocab_size)
    return head.eval()


def find_draft_checkpoint(algorithm: str, draft_path: str | None, target: "LlamaForCausalLM",
                          target_path: str) -> DraftCheckpoint:
    if draft_path is None:
        if algorithm == "EAGLE3":
            raise ValueError(f"EAGLE3 needs {DRAFT_PATH_FLAG} (an EAGLE-3 draft head directory)")
        checkpoint = read_mtp_checkpoint(target_path)
        if checkpoint is None:
            raise ValueError(f"{algorithm} needs {DRAFT_PATH_FLAG}: the target checkpoint {target_path} carries "
                             f"no MTP/NEXTN layers")
        return checkpoint
    if algorithm != "EAGLE3":
        checkpoint = read_mtp_checkpoint(draft_path)     # NEXTN from a full model given as the draft
        if checkpoint is not None:
            return checkpoint
    raw_config, tensors = read_hf_dir(draft_path)
    kind = _eagle_kind(raw_config, tensors)
    wanted = "eagle3" if algorithm == "EAGLE3" else "eagle"
    if kind != wanted:
        raise ValueError(f"{DRAFT_PATH_FLAG} {draft_path} holds an {kind.upper()} head, but "
                         f"--speculative-algorithm is {algorithm}")
    return DraftCheckpoint(kind, str(draft_path), raw_config, tensors)


def _eagle_kind(raw_config: dict, tensors: dict[str, torch.Tensor]) -> str:
    names = {strip_model_prefix(n) for n in tensors}
    if any(n.startswith("midlayer.") for n in names):
        return "eagle3"
    if any(n.startswith("layers.") for n in names):
        return "eagle"
    arch = (raw_config.get("architectures") or [""])[0]
    return "eagle3" if arch.endswith("Eagle3") else "eagle"
