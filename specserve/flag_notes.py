"""One startup line for every SGLang flag or environment switch that does not apply to this
build, saying what it does here instead (nothing is ignored silently).

``startup_notes(args, device)`` returns the lines; ``engine_setup`` logs them.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from specserve.config import ServerArgs

NO_CUDA_GRAPHS = "this build never captures CUDA graphs (decode runs eagerly, on CPU through native kernels)"
ENV_TRUE = ("1", "true", "yes", "on")


def _cuda_graph_max_bs(args: "ServerArgs") -> str | None:
    if args.cuda_graph_max_bs is None:
        return None
    return f"--cuda-graph-max-bs {args.cuda_graph_max_bs}: no effect, {NO_CUDA_GRAPHS}"


def _disable_cuda_graph(args: "ServerArgs") -> str | None:
    return f"--disable-cuda-graph: nothing to disable, {NO_CUDA_GRAPHS}" if args.disable_cuda_graph else None


def _torch_compile(args: "ServerArgs") -> str | None:
    if not args.enable_torch_compile and args.torch_compile_max_bs is None:
        return None
    given = "--enable-torch-compile" if args.enable_torch_compile else ""
    if args.torch_compile_max_bs is not None:
        given = f"{given} --torch-compile-max-bs {args.torch_compile_max_bs}".strip()
    return (f"{given}: torch.compile is not applied in this build; the CPU decode path runs fused native "
            f"kernels (one call per decoder layer) that it cannot improve")


def _overlap(args: "ServerArgs") -> str | None:
    if not args.disable_overlap_schedule:
        return None
    return "--disable-overlap-schedule: no effect, the scheduler here never overlaps steps (it runs them in turn)"


def _data_parallel(args: "ServerArgs") -> str | None:
    if args.dp_size == 1 and not args.enable_dp_attention:
        return None
    given = " ".join(x for x in (f"--dp-size {args.dp_size}" if args.dp_size != 1 else "",
                                 "--enable-dp-attention" if args.enable_dp_attention else "") if x)
    return (f"{given}: one replica serves here (no data parallelism in this build); run several servers "
            f"behind a load balancer for more")


APPLIED_QUANTIZATIONS = (None, "unquant", "gguf", "w8a8_int8")    # integer kernels on CPU (packed_linear.py)


def _quantization(args: "ServerArgs") -> str | None:
    method = args.quantization
    if method in APPLIED_QUANTIZATIONS:
        return None
    return (f"--quantization {method}: not applied, weights load as the checkpoint stores them "
            f"(gguf and w8a8_int8, integer kernels over GGUF or Q8_0 blocks on CPU, are available here)")


def _draft_quantization(args: "ServerArgs") -> str | None:
    method = args.speculative_draft_model_quantization
    if method in APPLIED_QUANTIZATIONS:
        return None
    return (f"--speculative-draft-model-quantization {method}: not applied, the draft runs unquantized in "
            f"the server's dtype")


def _attention(args: "ServerArgs") -> str | None:
    from specserve.flags import LOCAL_ATTENTION_BACKENDS

    lines = []
    for flag, value in (("--attention-backend", args.attention_backend),
                        ("--speculative-draft-attention-backend", args.speculative_draft_attention_backend)):
        if value is not None and value not in LOCAL_ATTENTION_BACKENDS + ("torch_native",):
            lines.append(f"{flag} {value}: not available on this device; the paged torch SDPA attention "
                         f"(native CPU kernels where built) runs instead")
    return "; ".join(lines) or None


def _moe(args: "ServerArgs") -> str | None:
    given = [f"{flag} {value}" for flag, value in (
        ("--speculative-moe-runner-backend", args.speculative_moe_runner_backend),
        ("--speculative-moe-a2a-backend", args.speculative_moe_a2a_backend)) if value is not None]
    if not given:
        return None
    return f"{', '.join(given)}: no effect, no MoE draft models in this build"


def _multi_layer_eagle(args: "ServerArgs") -> str | None:
    if not args.enable_multi_layer_eagle:
        return None
    return ("--enable-multi-layer-eagle: not available; NEXTN runs the checkpoint's first MTP layer "
            "for every draft step")


def _attention_mode(args: "ServerArgs") -> str | None:
    if args.speculative_attention_mode != "decode":
        return None
    return ("--speculative-attention-mode decode: verification and draft extension run the same paged tree "
            "attention as in prefill mode here (same results)")


def _trust_remote_code(args: "ServerArgs") -> str | None:
    if not args.trust_remote_code:
        return None
    return ("--trust-remote-code: no model code is downloaded or run; the architectures are built in "
            "(Llama, Mistral, Qwen2, Qwen3, SmolLM and their EAGLE/EAGLE3/MTP drafts)")


def _spec_v2(args: "ServerArgs") -> str | None:
    value = os.environ.get("SGLANG_ENABLE_SPEC_V2")
    if value is None:
        return None
    return (f"SGLANG_ENABLE_SPEC_V2={value}: no overlap scheduler in this build; speculative steps run "
            f"one after another either way")


def _ngram_greedy(args: "ServerArgs") -> str | None:
    value = os.environ.get("SGLANG_NGRAM_FORCE_GREEDY_VERIFY")
    if value is None or value.lower() not in ENV_TRUE:
        return None
    return (f"SGLANG_NGRAM_FORCE_GREEDY_VERIFY={value}: not applied; NGRAM drafts are verified by the "
            f"request's own sampling (greedy requests greedily), which keeps the target distribution")


NOTES: tuple[Callable[["ServerArgs"], str | None], ...] = (
    _cuda_graph_max_bs, _disable_cuda_graph, _torch_compile, _overlap, _data_parallel, _quantization,
    _draft_quantization, _attention, _moe, _multi_layer_eagle, _attention_mode, _trust_remote_code,
    _spec_v2, _ngram_greedy)


def startup_notes(args: "ServerArgs") -> list[str]:
    """What each inapplicable flag or environment switch given does in this build, one line each."""
    return [line for note in NOTES if (line := note(args))]
