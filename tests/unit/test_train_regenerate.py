"""regenerate: every prompt from ``first_prompt`` on is answered once, under its index in the
full order; a second run resumes (answers nothing twice); the CLI rejects a negative start."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from specserve.train import cli
from specserve.train.regenerate import regenerate


class EchoEngine:
    """Answers each request with its prompt's first token, repeated ``len(prompt)`` times,
    finishing after one step (regenerate's view of LLMEngine)."""

    def __init__(self, width: int = 3) -> None:
        self.server_args = SimpleNamespace(max_running_requests=width)
        self.tokenizer = SimpleNamespace(apply_chat_template=lambda messages: messages[0]["content"],
                                         encode=lambda text: [ord(c) for c in text])
        self.waiting: dict[str, list[int]] = {}
        self.prompts_seen: list[list[int]] = []

    def add_request(self, rid, ids, params):
        rid = f"r{len(self.prompts_seen)}"
        self.prompts_seen.append(ids)
        self.waiting[rid] = ids
        return rid

    def step(self):
        done, self.waiting = self.waiting, {}
        return [SimpleNamespace(rid=rid, new_token_ids=[ids[0]] * len(ids), finished=True) for rid, ids in done.items()]


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_regenerate_starts_at_first_prompt_and_resumes(tmp_path):
    prompts = [("src", text) for text in ("ab", "cde", "f", "ghij", "kl", "m", "nop")]
    out = tmp_path / "answers.jsonl"
    engine = EchoEngine()
    assert regenerate(engine, prompts, out, first_prompt=3) == 4
    got = sorted(records(out), key=lambda r: r["index"])
    assert [r["index"] for r in got] == [3, 4, 5, 6]
    for r in got:
        text = prompts[r["index"]][1]
        assert r["input_ids"] == [ord(c) for c in text]
        assert r["output_ids"] == [ord(text[0])] * len(text)
    assert regenerate(engine, prompts, out, first_prompt=1) == 2      # 1 and 2: the rest are done
    assert sorted(r["index"] for r in records(out)) == [1, 2, 3, 4, 5, 6]
    assert len(engine.prompts_seen) == 6


def test_cli_rejects_a_negative_first_prompt(tmp_path, capsys):
    assert cli.main(["--stage", "regenerate", "--work-dir", str(tmp_path), "--first-prompt", "-1"]) == 2
    assert "--first-prompt must be >= 0" in capsys.readouterr().err
