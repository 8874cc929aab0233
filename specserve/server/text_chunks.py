"""A stream's plain text chunks as SSE events, without a response model per token.

Most chunks of a streamed completion carry only new text: no logprobs, no finish reason. For
those, the chunk's JSON is serialized once per stream and choice index around a placeholder
text, and each chunk splices its text's JSON string between the two halves. Building and
dumping a pydantic model per token cost a quarter of the front's CPU per streamed token, and on
a machine whose cores all run the model that CPU comes out of the model's time. The bytes are
the model's own dump with the chunk's text, except that ``created`` is the stream's first
chunk's second for every chunk (as OpenAI's streams do). Any other chunk (logprobs, the last
one, usage) goes through the model as before.
"""
from __future__ import annotations

import json
from typing import Callable

from pydantic import BaseModel

PLACEHOLDER = "\ue000specserve-chunk-text\ue000"    # private-use characters around a name
_QUOTED_PLACEHOLDER = json.dumps(PLACEHOLDER, ensure_ascii=False)


def sse_event(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


class TextChunkEvents:
    """``event(index, text)``: the SSE event of a text-only chunk for choice ``index``;
    ``make_chunk(index, text)`` builds that chunk as a response model."""

    def __init__(self, make_chunk: Callable[[int, str], BaseModel]) -> None:
        self._make_chunk = make_chunk
        self._halves: dict[int, tuple[str, str] | None] = {}

    def event(self, index: int, text: str) -> str:
        if index not in self._halves:
            self._halves[index] = self._split(index)
        halves = self._halves[index]
        if halves is None:          # the placeholder did not come out once, verbatim
            return sse_event(self._make_chunk(index, text))
        return f"data: {halves[0]}{json.dumps(text, ensure_ascii=False)}{halves[1]}\n\n"

    def _split(self, index: int) -> tuple[str, str] | None:
        parts = self._make_chunk(index, PLACEHOLDER).model_dump_json().split(_QUOTED_PLACEHOLDER)
        return (parts[0], parts[1]) if len(parts) == 2 else None
