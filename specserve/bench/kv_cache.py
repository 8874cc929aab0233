"""``specserve bench kv-cache``: plain decoding after prompts of a given length with a float32
and a bfloat16 KV cache, the two engines taking turns prompt by prompt in one process (so the
machine's drift hits both alike). Prints decode tokens/s (after the first token) per prompt length,
their ratio, how many greedy outputs agree, and the perplexity each cache gives the same long
texts (teacher-forced, one prefill with every position's logits): speed and what it costs.
"""
from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

from tqdm import tqdm

from specserve.bench import prompts as P
from specserve.bench import serving

CACHE_DTYPES = ("auto", "bf16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-tokens", default="128,1024,1800",
                        help="prompt lengths in tokens, comma-separated (default %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts per length (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", default=None,
                        help="prompt files whose texts are joined into the long prompts, comma-separated "
                             "(default: all eval files)")
    parser.add_argument("--quantization", default="gguf", choices=serving.QUANTIZATION_CHOICES,
                        help="both engines' linear path (default %(default)s, what `make serve` runs)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    lengths = sorted(set(serving.parse_int_list(args.prompt_tokens)))
    if not lengths or lengths[0] < 16 or lengths[-1] + args.max_new_tokens > args.context_length:
        raise ValueError(f"--prompt-tokens must lie in [16, --context-length - --max-new-tokens] "
                         f"({args.context_length - args.max_new_tokens})")
    engines = {kv: serving.make_engine(serving.engine_kwargs(
        args, "float32", disable_radix_cache=True, quantization=args.quantization, kv_cache_dtype=kv))
        for kv in CACHE_DTYPES}                     # float32 activations: "auto" is a float32 cache
    try:
        texts = _long_texts(args.num_prompts, P.resolve_prompt_files(args.prompts))
        rows = [_decode_row(engines, texts, n, args.max_new_tokens) for n in lengths]
        nll = {kv: _mean_nll(engine, texts, lengths[-1]) for kv, engine in engines.items()}
    finally:
        for engine in engines.values():
            serving.close_engine(engine)
    result = {"benchmark": "kv-cache", "quantization": args.quantization, "dtype": "float32",
              "max_new_tokens": args.max_new_tokens, "rows": rows,
              "perplexity": {kv: math.exp(v) for kv, v in nll.items()}}
    _print(result)
    return result


def _long_texts(count: int, files: list) -> list[str]:
    """``count`` long user texts, each the files' prompts joined from a different starting point."""
    prompts = [p.text for p in P.load_mixed_prompts(80, files)]
    step = max(len(prompts) // max(count, 1), 1)
    return ["\n\n".join(prompts[i * step:] + prompts[:i * step]) for i in range(count)]


def _prompt_ids(tokenizer: Any, text: str, num_tokens: int) -> list[int]:
    """The chat-templated ids of the longest start of ``text`` that fits ``num_tokens``."""
    low, high = 1, len(text)
    while low < high:                               # the most characters whose prompt fits
        mid = (low + high + 1) // 2
        if len(P.chat_ids(tokenizer, text[:mid])) <= num_tokens:
            low = mid
        else:
            high = mid - 1
    return P.chat_ids(tokenizer, text[:low])


def _decode_row(engines: dict[str, Any], texts: list[str], num_tokens: int, max_new: int) -> dict[str, Any]:
    """Decode tokens/s per cache dtype after ~num_tokens-token prompts (from the first token on,
    as ``bench plain`` times it), and how many greedy outputs agree."""
    speeds: dict[str, list[float]] = {kv: [] for kv in engines}
    agree = 0
    tokenizer = next(iter(engines.values())).tokenizer
    for i, text in enumerate(tqdm(texts, desc=f"{num_tokens}-token prompts", leave=False)):
        ids = _prompt_ids(tokenizer, text, num_tokens)
        order = list(engines) if i % 2 == 0 else list(engines)[::-1]
        outputs = {}
        for kv in order:
            records, _ = serving.run_requests(engines[kv].engine, [ids],
                                              lambda: serving.sampling_params(max_new, True), 1)
            speeds[kv].append(records[0].decode_rate)
            outputs[kv] = records[0].output_ids
        agree += outputs["auto"] == outputs["bf16"]
    medians = {kv: statistics.median(v) for kv, v in speeds.items()}
    return {"prompt_tokens": num_tokens, "decode_tok_s": medians, "ratio": medians["bf16"] / medians["auto"],
            "identical": agree, "compared": len(texts)}


def _mean_nll(engine: Any, texts: list[str], num_tokens: int) -> float:
    """Mean negative log-likelihood of the texts' tokens (teacher-forced, on the idle engine) under it."""
    import torch

    from specserve.runner.model_runner import forward_on_free_slots

    total, count = 0.0, 0
    for text in texts:
        ids = engine.tokenizer.encode(text)[:num_tokens]
        logits = forward_on_free_slots(engine.engine.runner, engine.engine.pool, ids, is_prefill=True).float()
        logprobs = torch.log_softmax(logits[:-1], dim=-1)
        total -= logprobs.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
        count += len(ids) - 1
    return total / count


def _print(result: dict[str, Any]) -> None:
    print(f"plain decoding, float32 vs bfloat16 KV cache ({result['quantization']}, {result['dtype']} activations, "
          f"{result['max_new_tokens']} new tokens, engines taking turns)")
    print(f"{'prompt tokens':>13} {'float32 tok/s':>14} {'bfloat16 tok/s':>15} {'ratio':>6} {'same output':>12}")
    for row in result["rows"]:
        speeds = row["decode_tok_s"]
        print(f"{row['prompt_tokens']:>13} {speeds['auto']:>14.1f} {speeds['bf16']:>15.1f} {row['ratio']:>5.2f}x "
              f"{row['identical']:>6}/{row['compared']}")
    ppl = result["perplexity"]
    print(f"perplexity of the long texts: float32 cache {ppl['auto']:.4f}, bfloat16 cache {ppl['bf16']:.4f}")
