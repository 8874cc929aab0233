"""Evaluation prompts for the benchmarks: FastChat-format JSONL files (``question_id``,
``category``, ``turns``), one category per file (the file stem), chat-templated on use.

The default files live in ``../shared/data/eval`` next to the project root (see that
folder's README); ``$SPECSERVE_EVAL_DIR`` overrides the folder. ``copy_heavy`` names
a built-in set of rewrite/extract prompts (output that copies the prompt: NGRAM's case).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_EVAL_FILES = ("vicuna_bench.jsonl", "eagle_alpaca.jsonl", "eagle_gsm8k.jsonl",
                      "eagle_humaneval.jsonl")
COPY_HEAVY_NAME = "copy_heavy"
_COPY_PARAGRAPH = ("The committee met on Tuesday to review the budget for the new library. After a long "
                   "discussion, the members agreed to increase funding for children's books and to extend "
                   "opening hours on weekends.")
_COPY_CODE = ("def add_numbers(a, b):\n    result = a + b\n    return result\n\n"
              "def multiply_numbers(a, b):\n    result = a * b\n    return result\n")
COPY_HEAVY = (
    "Repeat the following paragraph exactly, word for word:\n\n" + _COPY_PARAGRAPH,
    "Copy this Python code exactly and add a docstring to each function:\n\n" + _COPY_CODE,
    "Rewrite this list with each item on its own line, keeping the words unchanged: apples, bananas, "
    "cherries, dates, elderberries, figs, grapes, honeydew melons.",
    "Repeat this sentence three times: The quick brown fox jumps over the lazy dog.",
)


@dataclass(frozen=True)
class Prompt:
    category: str          # the file stem, e.g. "eagle_gsm8k"
    question_id: Any
    text: str              # the user message (turns[0])


def default_eval_dir() -> Path:
    """``$SPECSERVE_EVAL_DIR``, else ``<project root>/../shared/data/eval``, else ``./../shared/data/eval``."""
    env = os.environ.get("SPECSERVE_EVAL_DIR")
    if env:
        return Path(env)
    project_root = Path(__file__).resolve().parents[2]
    candidates = [project_root.parent / "shared" / "data" / "eval", Path.cwd().parent / "shared" / "data" / "eval"]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    return candidates[0]


def default_prompt_files() -> list[Path]:
    """The four eval files, in a fixed order (missing ones included: loading them says so)."""
    folder = default_eval_dir()
    return [folder / name for name in DEFAULT_EVAL_FILES]


def resolve_prompt_files(spec: str | None) -> list[Path]:
    """``"a.jsonl,b.jsonl"`` -> paths; a bare name is looked up in the eval folder; None -> defaults."""
    if not spec:
        return default_prompt_files()
    paths = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        path = Path(item)
        if item == COPY_HEAVY_NAME:
            paths.append(path)
            continue
        if not path.exists() and not path.is_absolute() and (default_eval_dir() / item).exists():
            path = default_eval_dir() / item
        paths.append(path)
    if not paths:
        raise ValueError("no prompt files given")
    return paths


def load_prompt_file(path: str | os.PathLike, limit: int | None = None) -> list[Prompt]:
    """The first ``limit`` records of one FastChat-format JSONL file (all when None)."""
    path = Path(path)
    if str(path) == COPY_HEAVY_NAME:
        return [Prompt(COPY_HEAVY_NAME, i, text) for i, text in enumerate(COPY_HEAVY[:limit])]
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path} (eval prompts live in ../shared/data/eval; "
                                f"set SPECSERVE_EVAL_DIR or pass paths)")
    category = path.stem
    prompts: list[Prompt] = []
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, 1):
            if limit is not None and len(prompts) >= limit:
                break
            if not line.strip():
                continue
            prompts.append(_parse_record(json.loads(line), category, path, line_no))
    return prompts


def _parse_record(record: dict[str, Any], category: str, path: Path, line_no: int) -> Prompt:
    turns = record.get("turns")
    if not turns or not isinstance(turns[0], str):
        raise ValueError(f"{path}:{line_no}: expected a FastChat record with a non-empty 'turns' list")
    return Prompt(category=category, question_id=record.get("question_id", line_no - 1), text=turns[0])


def load_prompts(files: list[Path], num_per_file: int | None) -> list[Prompt]:
    """``num_per_file`` prompts from each file, grouped by file in the given order."""
    prompts: list[Prompt] = []
    for path in files:
        prompts.extend(load_prompt_file(path, num_per_file))
    return prompts


def load_mixed_prompts(num_prompts: int, files: list[Path] | None = None) -> list[Prompt]:
    """``num_prompts`` prompts taken round-robin across the files (so a few prompts cover all categories)."""
    files = files or default_prompt_files()
    per_file = [load_prompt_file(path, -(-num_prompts // len(files))) for path in files]
    mixed: list[Prompt] = []
    for i in range(max((len(p) for p in per_file), default=0)):
        mixed.extend(p[i] for p in per_file if i < len(p))
    return mixed[:num_prompts]


def categories(prompts: list[Prompt]) -> list[str]:
    """The distinct categories in first-seen order."""
    return list(dict.fromkeys(p.category for p in prompts))


def chat_text(tokenizer: Any, text: str) -> str:
    """The user message wrapped in the model's chat template, with the generation prompt."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def chat_ids(tokenizer: Any, text: str, max_len: int | None = None) -> list[int]:
    """Token ids of the chat-templated prompt. If they exceed ``max_len``, the user text is
    shortened (its first words kept) until they fit, so long prompts still fit a small context."""
    ids = tokenizer.encode(chat_text(tokenizer, text))
    if max_len is None or len(ids) <= max_len:
        return ids
    words = text.split()
    while len(ids) > max_len and len(words) > 1:
        words = words[: max(1, len(words) * 3 // 4)]
        ids = tokenizer.encode(chat_text(tokenizer, " ".join(words)))
    return ids[-max_len:] if len(ids) > max_len else ids
