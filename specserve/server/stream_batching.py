"""``--stream-interval N`` (SGLang's flag): a streamed request's tokens go to the front every N
tokens instead of every step, so each SSE chunk carries up to N tokens. The first token (time
to first token) and the last (finished) always go at once. Fewer messages, detokenizer calls and
SSE chunks per token: on a machine whose cores all run the model, that CPU comes out of the
model's time (measured in README's figures). A request the front does not stream (``stream``
false) is held until it finishes, whatever the interval: only its first token and its end go."""
from __future__ import annotations

from specserve.core import StepOutput


class StreamBatcher:
    """Holds each request's outputs until it has ``interval`` new tokens (or finishes)."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._held: dict[str, StepOutput] = {}
        self._sent_first: set[str] = set()
        self._whole: set[str] = set()        # not streamed: held until finished

    def hold_until_finished(self, rid: str) -> None:
        self._whole.add(rid)

    def take(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """The outputs to send now: each request's held tokens merged with its new ones."""
        if self.interval <= 1 and not self._whole:
            return outputs
        ready = []
        for output in outputs:
            merged = self._merge(self._held.pop(output.rid, None), output)
            rid = merged.rid
            interval = float("inf") if rid in self._whole else self.interval
            if merged.finished or rid not in self._sent_first or len(merged.new_token_ids) >= interval:
                ready.append(merged)
                self._sent_first.add(rid)
                if merged.finished:
                    self.forget(rid)
            else:
                self._held[rid] = merged
        return ready

    def forget(self, rid: str) -> None:
        """A request that ended (finished, or aborted without a finished output): drop its state."""
        self._held.pop(rid, None)
        self._sent_first.discard(rid)
        self._whole.discard(rid)

    @staticmethod
    def _merge(held: StepOutput | None, new: StepOutput) -> StepOutput:
        if held is None:
            return new
        held.new_token_ids = held.new_token_ids + new.new_token_ids
        held.new_logprobs = held.new_logprobs + new.new_logprobs
        held.new_top_logprobs = held.new_top_logprobs + new.new_top_logprobs
        held.text_delta += new.text_delta
        held.finished, held.finish_reason, held.meta_info = new.finished, new.finish_reason, new.meta_info
        return held
