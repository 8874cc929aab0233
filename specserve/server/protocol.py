"""Request and response schemas: OpenAI chat/completions and SGLang's native /generate.

Requests ignore unknown fields (OpenAI clients send extras) and convert to
``specserve.core.SamplingParams``. Conversion problems raise ``RequestError``
(a ValueError naming the offending parameter), which the API turns into a 400.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specserve.core import SamplingParams

GENERATE_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's /generate default
UNSUPPORTED_CONSTRAINTS = ("json_schema", "regex", "ebnf", "structural_tag")


class RequestError(ValueError):
    """A request that cannot be served as asked (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


def _default(value: Any, fallback: Any) -> Any:
    return fallback if value is None else value


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


# ======================================================================================
# OpenAI requests
# ======================================================================================
class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class OpenAISamplingRequest(_Request):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    rid: str | None = None  # SGLang extension: caller-chosen request id

    @property
    def is_stream(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def _logprob_settings(self) -> tuple[bool, int]:
        return False, 0

    def _check_unsupported(self) -> None:
        if self.logit_bias:
            raise RequestError("logit_bias is not supported", "logit_bias")

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """``default_max_tokens`` applies when the request sets none (the rest of the context)."""
        self._check_unsupported()
        max_tokens = self._requested_max_tokens()
        if max_tokens is not None and max_tokens < 1:
            raise RequestError("max_tokens must be >= 1", "max_tokens")
        return_logprob, top_logprobs_num = self._logprob_settings()
        return SamplingParams(
            max_new_tokens=_default(max_tokens, default_max_tokens),
            min_new_tokens=_default(self.min_tokens, 0),
            temperature=_default(self.temperature, 1.0),
            top_p=_default(self.top_p, 1.0),
            top_k=_default(self.top_k, -1),
            min_p=_default(self.min_p, 0.0),
            frequency_penalty=_default(self.frequency_penalty, 0.0),
            presence_penalty=_default(self.presence_penalty, 0.0),
            repetition_penalty=_default(self.repetition_penalty, 1.0),
            stop=_stop_list(self.stop),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=_default(self.ignore_eos, False),
            skip_special_tokens=_default(self.skip_special_tokens, True),
            seed=self.seed,
            n=_default(self.n, 1),
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num,
        )


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text_content(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type != "text":
                raise RequestError(f"content part type {part.type!r} is not supported (text only)",
                                   "messages")
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(OpenAISamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text_content()} for m in self.messages]

    def _requested_max_tokens(self) -> int | None:
        return _default(self.max_completion_tokens, self.max_tokens)

    def _logprob_settings(self) -> tuple[bool, int]:
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs requires logprobs=true", "top_logprobs")
        return bool(self.logprobs), int(self.top_logprobs or 0)

    def _check_unsupported(self) -> None:
        super()._check_unsupported()
        if self.tools:
            raise RequestError("tools are not supported", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise RequestError("only response_format type 'text' is supported", "response_format")


PromptType = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(OpenAISamplingRequest):
    prompt: PromptType
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    def _logprob_settings(self) -> tuple[bool, int]:
        if self.logprobs is None:
            return False, 0
        return True, int(self.logprobs)

    def _check_unsupported(self) -> None:
        super()._check_unsupported()
        if self.echo:
            raise RequestError("echo is not supported", "echo")
        if self.suffix:
            raise RequestError("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != _default(self.n, 1):
            raise RequestError("best_of other than n is not supported", "best_of")

    def prompt_batch(self) -> list[str] | list[list[int]]:
        """The prompt as a non-empty batch: a list of strings or a list of token-id lists."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise RequestError("prompt must not be empty", "prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[return-value]


# ======================================================================================
# OpenAI responses
# ======================================================================================
def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = Field(default_factory=list)


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = ""


class ChatCompletionChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class ChatChunkChoice(_Response):
    index: int
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


CompletionChunk = CompletionResponse  # same shape; streamed chunks carry deltas


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "specserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(_Response):
    error: ErrorInfo


# ======================================================================================
# SGLang native /generate
# ======================================================================================
class GenerateSamplingParams(_Request):
    """SGLang's ``sampling_params`` dict (native names)."""

    max_new_tokens: int | None = GENERATE_DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int | None = 0
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = -1
    min_p: float | None = 0.0
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    n: int | None = 1
    seed: int | None = None
    sampling_seed: int | None = None
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    structural_tag: Any = None

    def to_sampling_params(self, default_max_new_tokens: int, return_logprob: bool,
                           top_logprobs_num: int) -> SamplingParams:
        for name in UNSUPPORTED_CONSTRAINTS:
            if getattr(self, name) is not None:
                raise RequestError(f"sampling_params.{name} (constrained decoding) is not supported",
                                   f"sampling_params.{name}")
        return SamplingParams(
            max_new_tokens=_default(self.max_new_tokens, default_max_new_tokens),
            min_new_tokens=_default(self.min_new_tokens, 0),
            temperature=_default(self.temperature, 1.0),
            top_p=_default(self.top_p, 1.0),
            top_k=_default(self.top_k, -1),
            min_p=_default(self.min_p, 0.0),
            frequency_penalty=_default(self.frequency_penalty, 0.0),
            presence_penalty=_default(self.presence_penalty, 0.0),
            repetition_penalty=_default(self.repetition_penalty, 1.0),
            stop=_stop_list(self.stop),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=_default(self.ignore_eos, False),
            skip_special_tokens=_default(self.skip_special_tokens, True),
            seed=_default(self.seed, self.sampling_seed),
            n=_default(self.n, 1),
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num,
        )


class GenerateRequest(_Request):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool | None = False
    return_logprob: bool | None = False
    top_logprobs_num: int | None = 0
    return_text_in_logprobs: bool | None = False
    rid: str | None = None

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    def prompt_batch(self) -> list[str] | list[list[int]]:
        if (self.text is None) == (self.input_ids is None):
            raise RequestError("exactly one of 'text' or 'input_ids' is required", "text")
        if self.text is not None:
            batch: list[Any] = self.text if isinstance(self.text, list) else [self.text]
        else:
            batch = self.input_ids if self.is_batch else [self.input_ids]  # type: ignore[list-item]
        if not batch:
            raise RequestError("the prompt batch must not be empty", "text")
        return batch

    def to_sampling_params(self, default_max_new_tokens: int) -> SamplingParams:
        return self.sampling_params.to_sampling_params(
            default_max_new_tokens, bool(self.return_logprob), int(self.top_logprobs_num or 0))
