"""llama.cpp (``llama-cpp-python``) as the peer the benches run beside specserve: the same GGUF,
the same prompt ids and threads, batch 1, greedy. Plain decoding, or with llama.cpp's own
speculation by prompt lookup (``LlamaPromptLookupDecoding``: the n-gram draft llama.cpp ships,
the peer of our NGRAM)."""
from __future__ import annotations

import time
from typing import Any

INSTALL_HINT = "llama-cpp-python is not installed (pip install llama-cpp-python)"


def skip_reason(model_path: Any) -> str | None:
    """Why llama.cpp cannot run beside this model, or None when it can."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return INSTALL_HINT
    if not str(model_path).endswith(".gguf"):
        return "the model is not a GGUF file"
    return None


def version() -> str | None:
    import llama_cpp

    return getattr(llama_cpp, "__version__", None)


def threads_for(args: Any) -> int:
    """The threads llama.cpp gets: the bench's --threads, else torch's (what our engines use)."""
    import torch

    return args.threads or torch.get_num_threads()


def load(model_path: Any, threads: int, context_length: int, lookup_tokens: int | None = None,
         logits_all: bool = False):
    """A ``Llama`` on ``model_path``; with ``lookup_tokens``, drafting that many tokens a step by
    prompt lookup (llama-cpp-python's default n-gram size, 2); with ``logits_all``, every
    evaluated token's logits (what a verify needs), else the last one's."""
    from llama_cpp import Llama

    draft = None
    if lookup_tokens:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens)
    return Llama(model_path=str(model_path), n_ctx=context_length, n_threads=threads, n_threads_batch=threads,
                 draft_model=draft, logits_all=logits_all, verbose=False)


def time_forward(llm, context_length: int, tokens: list[int]) -> float:
    """Seconds of one ``eval`` of ``tokens`` after the first ``context_length`` tokens already
    evaluated (``eval`` drops the KV cache past ``n_tokens`` first), logits copied out included."""
    llm.n_tokens = context_length
    start = time.perf_counter()
    llm.eval(tokens)
    return time.perf_counter() - start


def generate(llm, ids: list[int], max_new_tokens: int, stop_at_eos: bool = False) -> list[int]:
    """Greedy tokens after ``ids`` (the prompt re-read from scratch), at most ``max_new_tokens``;
    with ``stop_at_eos``, ending before the model's end-of-sequence token as specserve's requests do."""
    out: list[int] = []
    eos = llm.token_eos()
    for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        if stop_at_eos and token == eos:
            break
        out.append(token)
        if len(out) >= max_new_tokens:
            break
    return out
