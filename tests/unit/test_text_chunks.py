"""Spliced text-chunk SSE events carry the same JSON as the response model's own dump."""
import json

import pytest

from specserve.server.protocol import ChatChunkChoice, ChatCompletionChunk, CompletionChoice, CompletionResponse
from specserve.server.text_chunks import PLACEHOLDER, TextChunkEvents, sse_event

TEXTS = ["Hello", " world", 'a "quoted" \\ back\\slash', "line\nbreak\ttab", "\x00\x1b\x7f controls",
         "héllo wörld ✓ 日本語 🙂", "\u2028\u2029", "", "</script>", "{\"json\": [1, 2]}"]


def _completion(index: int, text: str) -> CompletionResponse:
    return CompletionResponse(id="cmpl-1", model="m", created=1_700_000_000,
                              choices=[CompletionChoice(index=index, text=text)])


def _chat(index: int, text: str) -> ChatCompletionChunk:
    return ChatCompletionChunk(id="chat-1", model="m", created=1_700_000_000,
                               choices=[ChatChunkChoice(index=index, delta={"content": text})])


@pytest.mark.parametrize("make", [_completion, _chat])
@pytest.mark.parametrize("text", TEXTS)
def test_spliced_event_is_the_models_dump(make, text):
    events = TextChunkEvents(make)
    for index in (0, 3):
        spliced = events.event(index, text)
        expected = sse_event(make(index, text))
        assert spliced == expected                       # byte for byte
        assert json.loads(spliced[len("data: "):]) == json.loads(expected[len("data: "):])


def test_a_model_that_repeats_the_placeholder_falls_back_to_its_dump():
    def twice(index: int, text: str) -> CompletionResponse:    # the placeholder also in the id
        return CompletionResponse(id=text, model="m", created=1, choices=[CompletionChoice(index=index, text=text)])

    events = TextChunkEvents(twice)
    assert PLACEHOLDER not in events.event(0, "abc")
    assert events.event(0, "abc") == sse_event(twice(0, "abc"))
