"""--stream-interval: each request's tokens leave the model process every N tokens, its first
and last at once, nothing lost or reordered."""
from __future__ import annotations

from specserve.core import StepOutput
from specserve.server.stream_batching import StreamBatcher


def _step(rid: str, tokens: list[int], finished: bool = False) -> StepOutput:
    return StepOutput(rid, tokens, finished, {"type": "length"} if finished else None,
                      meta_info={"completion_tokens": tokens[-1]}, new_logprobs=[-0.5] * len(tokens))


def test_interval_one_sends_every_step():
    batcher = StreamBatcher(1)
    outputs = [_step("a", [1]), _step("b", [2])]
    assert batcher.take(outputs) == outputs


def test_tokens_go_in_groups_of_the_interval_first_and_last_at_once():
    batcher = StreamBatcher(3)
    sent = []
    for i, tokens in enumerate([[1], [2], [3, 4], [5], [6], [7], [8]]):
        sent += batcher.take([_step("a", tokens, finished=i == 6)])
    assert [o.new_token_ids for o in sent] == [[1], [2, 3, 4], [5, 6, 7], [8]]
    assert [o.finished for o in sent] == [False, False, False, True]
    assert sent[1].new_logprobs == [-0.5] * 3 and sent[1].meta_info == {"completion_tokens": 4}
    assert sent[-1].finish_reason == {"type": "length"}


def test_requests_are_held_apart_and_an_abort_drops_what_is_held():
    batcher = StreamBatcher(4)
    assert [o.rid for o in batcher.take([_step("a", [1]), _step("b", [9])])] == ["a", "b"]   # first tokens
    assert batcher.take([_step("a", [2]), _step("b", [10])]) == []
    batcher.forget("a")
    out = batcher.take([_step("a", [3], finished=True), _step("b", [11, 12, 13])])
    assert [(o.rid, o.new_token_ids) for o in out] == [("a", [3]), ("b", [10, 11, 12, 13])]


def test_a_request_not_streamed_sends_its_first_token_then_only_its_end():
    batcher = StreamBatcher(1)
    batcher.hold_until_finished("a")
    sent = []
    for i, tokens in enumerate([[1], [2], [3, 4], [5]]):
        sent += batcher.take([_step("a", tokens, finished=i == 3), _step("b", [10 + i])])
    assert [(o.rid, o.new_token_ids) for o in sent if o.rid == "a"] == [("a", [1]), ("a", [2, 3, 4, 5])]
    assert [o.new_token_ids for o in sent if o.rid == "b"] == [[10], [11], [12], [13]]
    assert sent[-2].finished
