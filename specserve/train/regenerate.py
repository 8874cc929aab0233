"""Step (a) of draft training: the target answers the training prompts itself.

The prompts go through the engine with continuous batching; every finished answer
is appended to a JSONL file at once (``{"index", "source", "input_ids",
"output_ids"}``), so an interrupted run resumes where it stopped.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from tqdm import tqdm

from specserve.core import SamplingParams
from specserve.engine import LLMEngine

logger = logging.getLogger(__name__)


def done_indices(path: Path) -> set[int]:
    if not path.exists():
        return set()
    with open(path, encoding="utf-8") as f:
        return {json.loads(line)["index"] for line in f if line.strip()}


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def regenerate(engine: LLMEngine, prompts: list[tuple[str, str]], out_path: Path, *,
               max_new_tokens: int = 256, temperature: float = 0.0, seed: int = 0,
               max_prompt_tokens: int = 512, first_prompt: int = 0) -> int:
    """Answer ``prompts`` ([(source, user message)]) with the target, from index ``first_prompt``
    on (the earlier ones: answered elsewhere, e.g. by an earlier session on another machine);
    returns answers written."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    skip = done_indices(out_path)
    todo = [(i, s, t) for i, (s, t) in enumerate(prompts) if i >= first_prompt and i not in skip]
    width = engine.server_args.max_running_requests or 32
    pending: dict[str, tuple[int, str, list[int]]] = {}
    outputs: dict[str, list[int]] = {}
    queue = iter(todo)
    written = 0
    with open(out_path, "a", encoding="utf-8") as out, tqdm(total=len(todo), desc="regenerate", unit="answer") as bar:
        while True:
            while len(pending) < width:
                item = next(queue, None)
                if item is None:
                    break
                index, source, text = item
                ids = chat_prompt_ids(engine.tokenizer, text)
                if len(ids) > max_prompt_tokens:
                    bar.update(1)
                    continue
                params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                        seed=seed + index if temperature > 0 else None)
                rid = engine.add_request(None, ids, params)
                pending[rid], outputs[rid] = (index, source, ids), []
            if not pending:
                break
            for step_out in engine.step():
                if step_out.rid not in pending:
                    continue
                outputs[step_out.rid].extend(step_out.new_token_ids)
                if step_out.finished:
                    index, source, ids = pending.pop(step_out.rid)
                    record = {"index": index, "source": source, "input_ids": ids,
                              "output_ids": outputs.pop(step_out.rid)}
                    out.write(json.dumps(record) + "\n")
                    out.flush()
                    written += 1
                    bar.update(1)
    return written


def write_reference_records(tokenizer, pairs: list[tuple[str, str, str]], out_path: Path,
                            first_index: int = 1_000_000, max_tokens: int = 768) -> int:
    """Records in the regenerated-answer format for (source, question, reference answer)
    triples, so capture and training treat them alike (indices from ``first_index``)."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with open(out_path, "w", encoding="utf-8") as out:
        for offset, (source, question, answer) in enumerate(tqdm(pairs, desc="reference answers")):
            ids = chat_prompt_ids(tokenizer, question)
            answer_ids = tokenizer.encode(answer) + list(tokenizer.eos_token_ids[:1])
            if len(ids) + len(answer_ids) > max_tokens:
                continue
            out.write(json.dumps({"index": first_index + offset, "source": source, "input_ids": ids,
                                  "output_ids": answer_ids}) + "\n")
            written += 1
    return written
