"""Training prompts from ../shared/data/train: one user message per record, mixed
across the sources with a fixed seed (chat, code, role-play, math, instructions)."""
from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

SOURCES = {   # file -> how to turn one record into a user message
    "sharegpt_first_prompts.jsonl.gz": lambda r: r.get("prompt"),
    "gpteacher_codegen.json": lambda r: _with_input(r.get("instruction"), r.get("input")),
    "gpteacher_roleplay.json": lambda r: _with_input(r.get("instruction"), r.get("input")),
    "gsm8k_train.jsonl": lambda r: r.get("question"),
    "self_instruct_seed_tasks.jsonl": lambda r: _with_input(r.get("instruction"),
                                                           (r.get("instances") or [{}])[0].get("input")),
}
MAX_PROMPT_CHARS = 2000


def default_train_dir() -> Path:
    return Path(__file__).resolve().parents[2].parent / "shared" / "data" / "train"


def _with_input(instruction: str | None, extra: str | None) -> str | None:
    if not instruction:
        return None
    return f"{instruction}\n\n{extra}" if extra else instruction


def _records(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        if path.name.endswith(".json"):
            return json.load(f)
        return [json.loads(line) for line in f if line.strip()]


def load_training_prompts(folder: Path | None = None, limit: int | None = None,
                          seed: int = 0) -> list[tuple[str, str]]:
    """[(source, user message)], round-robin over the sources (shuffled each) so any
    prefix of the list is a balanced mix."""
    folder = Path(folder) if folder else default_train_dir()
    if not folder.is_dir():
        raise FileNotFoundError(f"training prompt folder not found: {folder} (see ../shared/data/README.md)")
    rng = random.Random(seed)
    per_source = []
    for name, extract in SOURCES.items():
        path = folder / name
        if not path.exists():
            continue
        texts = [t for t in (extract(r) for r in _records(path)) if t and len(t) <= MAX_PROMPT_CHARS]
        rng.shuffle(texts)
        per_source.append([(path.name.split(".")[0], t) for t in texts])
    mixed = []
    for i in range(max(len(s) for s in per_source)):
        mixed.extend(s[i] for s in per_source if i < len(s))
    return mixed[:limit] if limit else mixed


REFERENCE_ANSWERS = {   # file -> (user message, reference answer) of one record
    "gpteacher_codegen.json": lambda r: (_with_input(r.get("instruction"), r.get("input")), r.get("response")),
    "gpteacher_roleplay.json": lambda r: (_with_input(r.get("instruction"), r.get("input")), r.get("response")),
    "gsm8k_train.jsonl": lambda r: (r.get("question"), r.get("answer")),
}


def load_reference_answers(folder: Path | None = None, limit: int | None = None,
                           seed: int = 0) -> list[tuple[str, str, str]]:
    """[(source, user message, the dataset's own answer)], mixed like ``load_training_prompts``.
    Teacher-forced with the target's soft labels, these add contexts the regenerated answers
    (slow to produce on a CPU) cannot cover."""
    folder = Path(folder) if folder else default_train_dir()
    rng = random.Random(seed + 1)
    per_source = []
    for name, extract in REFERENCE_ANSWERS.items():
        path = folder / name
        if not path.exists():
            continue
        pairs = [p for p in (extract(r) for r in _records(path)) if p[0] and p[1]
                 and len(p[0]) + len(p[1]) <= 2 * MAX_PROMPT_CHARS]
        rng.shuffle(pairs)
        per_source.append([(path.name.split(".")[0] + "_reference", q, a) for q, a in pairs])
    mixed = []
    for i in range(max((len(s) for s in per_source), default=0)):
        mixed.extend(s[i] for s in per_source if i < len(s))
    return mixed[:limit] if limit else mixed
