"""HTTP API: OpenAI chat/completions, SGLang's native endpoints, health and metrics.

``create_app(async_engine, server_args)`` builds the FastAPI app. Request bodies
are parsed by hand (not by FastAPI's validation) so that every client mistake is
a 400 in OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve import __version__
from specserve.config import ServerArgs
from specserve.core import SamplingParams, StepOutput
from specserve.server.async_engine import (
    AsyncEngine, EngineError, EngineUnavailable, IndexedOutput, RequestGroup,
)
from specserve.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from specserve.server.text_chunks import TextChunkEvents, sse_event
from specserve.server.protocol import (
    ChatChunkChoice, ChatCompletionChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatLogprobs, ChatResponseMessage, ChatTokenLogprob, CompletionChoice,
    CompletionLogprobs, CompletionRequest, CompletionResponse, ErrorInfo, ErrorResponse,
    GenerateRequest, ModelCard, ModelList, PromptTokensDetails, RequestError, TopLogprob, UsageInfo,
    completion_id,
)

logger = logging.getLogger(__name__)
ModelT = TypeVar("ModelT", bound=BaseModel)

PUBLIC_PATHS = frozenset({"/health", "/health_generate", "/metrics"})
HEALTH_GENERATE_TIMEOUT_S = 30.0
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 500: "internal_server_error", 503: "service_unavailable"}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientDisconnected(Exception):
    """The client went away before its non-streamed response was ready."""


@dataclass
class ServerState:
    async_engine: AsyncEngine    # or EngineClient (server/engine_client.py): the same methods
    server_args: ServerArgs

    @property
    def model_name(self) -> str:
        return self.metrics.model_name

    @property
    def model_path(self) -> str | None:
        """The path the engine resolved (the default model when --model-path is absent)."""
        return self.async_engine.model_path or self.server_args.model_path

    @property
    def metrics(self) -> ServerMetrics:
        return self.async_engine.metrics

    @property
    def tokenizer(self) -> Any:
        return self.async_engine.tokenizer

    @property
    def vocab_size(self) -> int | None:
        size = getattr(self.tokenizer, "vocab_size", None)
        return size if size is not None else self.async_engine.vocab_size


def _state(request: Request) -> ServerState:
    return request.app.state.server


# ======================================================================================
# errors
# ======================================================================================
def error_response(status: int, message: str, param: str | None = None,
                   error_type: str | None = None) -> JSONResponse:
    info = ErrorInfo(message=message, type=error_type or ERROR_TYPES.get(status, "error"),
                     param=param, code=status)
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status)


def _error_event(status: int, message: str) -> str:
    info = ErrorInfo(message=message, type=ERROR_TYPES.get(status, "error"), code=status)
    return _sse(ErrorResponse(error=info))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        return error_response(400, str(exc), exc.param)

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc), getattr(exc, "param", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(EngineUnavailable)
    async def _engine_unavailable(_: Request, exc: EngineUnavailable) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, exc: EngineError) -> JSONResponse:
        return error_response(500, str(exc))

    @app.exception_handler(Exception)
    async def _unexpected_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _param_of(loc: tuple[Any, ...]) -> str | None:
    """``('prompt', 'list[int]', 0)`` -> ``'prompt.0'``: drop pydantic's union-member tags."""
    parts = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p.lower() in _TYPE_TAGS))]
    return ".".join(parts) or None


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    param = _param_of(errors[0].get("loc", ()))
    details = []
    for error in errors[:3]:
        where = _param_of(error.get("loc", ()))
        details.append(f"{where}: {error.get('msg')}" if where else str(error.get("msg")))
    return "; ".join(dict.fromkeys(details)), (param.split(".")[0] if param and "." in param
                                              and param.split(".")[1].isdigit() else param)


async def parse_body(request: Request, model: type[ModelT]) -> ModelT:
    raw = await request.body()
    try:
        payload = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"malformed JSON body: {exc}") from None
    if not isinstance(payload, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        message, param = _validation_message(exc)
        raise RequestError(message, param) from None


async def check_api_key(request: Request) -> None:
    api_key = _state(request).server_args.api_key
    if not api_key or request.url.path in PUBLIC_PATHS:
        return
    supplied = request.headers.get("authorization", "")
    if not secrets.compare_digest(supplied.encode(), f"Bearer {api_key}".encode()):
        raise StarletteHTTPException(401, "invalid or missing API key (expected 'Authorization: Bearer <key>')")


class HttpMetricsMiddleware:
    """Pure ASGI middleware counting requests by route and status (streaming-safe)."""

    def __init__(self, app: Any, metrics: ServerMetrics, known_paths: frozenset[str]) -> None:
        self.app, self.metrics, self.known_paths = app, metrics, known_paths

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_and_record_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record_status)
        finally:
            path = scope.get("path", "")
            self.metrics.observe_http(path if path in self.known_paths else "other", status)


# ======================================================================================
# prompts and sampling
# ======================================================================================
def encode_prompts(state: ServerState, batch: list[str] | list[list[int]], param: str) -> list[list[int]]:
    prompts = [state.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in batch]
    for ids in prompts:
        if not ids:
            raise RequestError("the prompt is empty", param)
        if len(ids) >= state.async_engine.context_len:
            raise RequestError(f"the prompt is too long: {len(ids)} tokens, the context length is "
                               f"{state.async_engine.context_len}", param)
    return prompts


def encode_chat(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    messages = body.chat_messages()
    try:
        text = state.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - template errors are the client's messages
        raise RequestError(f"cannot apply the chat template: {exc}", "messages") from None
    return encode_prompts(state, [text], "messages")[0]


def remaining_context(state: ServerState, prompts: list[list[int]]) -> int:
    return state.async_engine.context_len - max(len(p) for p in prompts)


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) | {"top_logprobs"}


def validated(state: ServerState, sampling: SamplingParams) -> SamplingParams:
    """SamplingParams.validate, with the field its message starts with as the error's param."""
    try:
        sampling.validate(state.vocab_size)
    except ValueError as exc:
        first_word = str(exc).split(" ", 1)[0]
        raise RequestError(str(exc), first_word if first_word in _SAMPLING_FIELDS else None) from None
    return sampling


# ======================================================================================
# collecting outputs
# ======================================================================================
@dataclass
class ChoiceState:
    """Everything one sub-request (one choice) has produced so far."""

    index: int
    prompt_len: int
    text_parts: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    meta_info: dict[str, Any] = field(default_factory=dict)
    start_time: float = field(default_factory=time.perf_counter)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def add(self, output: StepOutput) -> None:
        self.text_parts.append(output.text_delta)
        self.output_ids.extend(output.new_token_ids)
        self.logprobs.extend(output.new_logprobs)
        self.top_logprobs.extend(output.new_top_logprobs)
        self.meta_info.update(output.meta_info or {})
        if output.finished:
            self.finish_reason = output.finish_reason or {"type": "stop"}

    @property
    def completion_tokens(self) -> int:
        return int(self.meta_info.get("completion_tokens", len(self.output_ids)))

    @property
    def cached_tokens(self) -> int:
        return int(self.meta_info.get("cached_tokens", 0))


def new_choices(prompts: list[list[int]], n: int) -> list[ChoiceState]:
    return [ChoiceState(i * n + j, len(ids)) for i, ids in enumerate(prompts) for j in range(n)]


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _drain(group: RequestGroup, choices: list[ChoiceState]) -> None:
    async for item in group:
        choices[item.index].add(item.output)


async def collect(request: Request, group: RequestGroup, choices: list[ChoiceState]) -> list[ChoiceState]:
    """Wait for every sub-request to finish; abort them all if the client disconnects."""
    drain = asyncio.ensure_future(_drain(group, choices))
    disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({drain, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if drain in done:
            drain.result()
            return choices
        raise ClientDisconnected()
    finally:
        for task in (drain, disconnect):
            task.cancel()
        group.abort()


async def stream_outputs(group: RequestGroup) -> AsyncIterator[IndexedOutput]:
    """Outputs as they come; leaving early (client disconnect) aborts the sub-requests."""
    try:
        async for item in group:
            yield item
    finally:
        group.abort()


def _sse(payload: Any) -> str:
    if isinstance(payload, BaseModel):
        return sse_event(payload)            # pydantic's own encoder: a third of model_dump + json.dumps
    if isinstance(payload, str):
        text = payload
    else:
        text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"


class EventStreamResponse(StreamingResponse):
    """SSE response that aborts its request group however the response ends
    (even when the client leaves before the first event)."""

    def __init__(self, events: AsyncIterator[str], group: RequestGroup) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self.group = group

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.group.abort()


def sse_response(events: AsyncIterator[str], group: RequestGroup) -> EventStreamResponse:
    return EventStreamResponse(_with_error_event(events), group)


async def _with_error_event(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """An engine failure mid-stream becomes an error event, then [DONE]."""
    try:
        async for event in events:
            yield event
    except EngineError as exc:
        yield _error_event(503 if isinstance(exc, EngineUnavailable) else 500, str(exc))
    yield _sse("[DONE]")


# ======================================================================================
# OpenAI shapes
# ======================================================================================
def finish_fields(finish_reason: dict[str, Any] | None) -> tuple[str | None, Any]:
    if finish_reason is None:
        return None, None
    return finish_reason.get("type", "stop"), finish_reason.get("matched")


def usage_of(choices: list[ChoiceState], n: int) -> UsageInfo:
    """Prompt tokens count once per prompt (not per sample), as OpenAI does."""
    per_prompt = [choices[i:i + n] for i in range(0, len(choices), n)]
    prompt_tokens = sum(group[0].prompt_len for group in per_prompt)
    cached = sum(min(max(c.cached_tokens for c in group), group[0].prompt_len) for group in per_prompt)
    completion_tokens = sum(c.completion_tokens for c in choices)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class TokenText:
    """Token id -> text, for logprobs."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def chat_logprobs(token_text: TokenText, ids: list[int], logprobs: list[float],
                  top: list[list[tuple[int, float]]]) -> ChatLogprobs:
    content = []
    for position, (token_id, logprob) in enumerate(zip(ids, logprobs)):
        text = token_text(token_id)
        alternatives = [TopLogprob(token=token_text(t), logprob=lp, bytes=list(token_text(t).encode()))
                        for t, lp in (top[position] if position < len(top) else [])]
        content.append(ChatTokenLogprob(token=text, logprob=logprob, bytes=list(text.encode()),
                                        top_logprobs=alternatives))
    return ChatLogprobs(content=content)


def completion_logprobs(token_text: TokenText, ids: list[int], logprobs: list[float],
                        top: list[list[tuple[int, float]]], text_offset: int,
                        with_top: bool) -> CompletionLogprobs:
    tokens = [token_text(t) for t in ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    top_dicts = None
    if with_top:
        top_dicts = [{token_text(t): lp for t, lp in alternatives} for alternatives in top[:len(ids)]]
    return CompletionLogprobs(tokens=tokens, token_logprobs=list(logprobs[:len(ids)]),
                              top_logprobs=top_dicts, text_offset=offsets)


def response_model_name(state: ServerState, requested: str | None) -> str:
    return requested or state.model_name


# ======================================================================================
# /v1/chat/completions
# ======================================================================================
async def chat_completions(request: Request) -> Response:
    state = _state(request)
    body = await parse_body(request, ChatCompletionRequest)
    prompt_ids = encode_chat(state, body)
    sampling = validated(state, body.to_sampling_params(remaining_context(state, [prompt_ids])))
    group = await state.async_engine.submit([prompt_ids], sampling, body.rid, stream=bool(body.stream))
    choices = new_choices([prompt_ids], sampling.n)
    response_id = completion_id("chatcmpl")
    model = response_model_name(state, body.model)
    if body.is_stream:
        return sse_response(chat_stream(state, body, group, choices, response_id, model), group)
    await collect(request, group, choices)
    return JSONResponse(chat_response(state, body, choices, response_id, model).model_dump())


def chat_response(state: ServerState, body: ChatCompletionRequest, choices: list[ChoiceState],
                  response_id: str, model: str) -> ChatCompletionResponse:
    token_text = TokenText(state.tokenizer)
    out = []
    for c in choices:
        reason, matched = finish_fields(c.finish_reason)
        logprobs = chat_logprobs(token_text, c.output_ids, c.logprobs, c.top_logprobs) if body.logprobs else None
        out.append(ChatCompletionChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                                        logprobs=logprobs, finish_reason=reason, matched_stop=matched))
    return ChatCompletionResponse(id=response_id, model=model, choices=out,
                                  usage=usage_of(choices, _n(body)))


def _n(body: Any) -> int:
    return body.n or 1


async def chat_stream(state: ServerState, body: ChatCompletionRequest, group: RequestGroup,
                      choices: list[ChoiceState], response_id: str, model: str) -> AsyncIterator[str]:
    token_text = TokenText(state.tokenizer)

    def chunk(choice: ChatChunkChoice) -> str:
        return _sse(ChatCompletionChunk(id=response_id, model=model, choices=[choice]))

    text_events = TextChunkEvents(lambda index, text: ChatCompletionChunk(
        id=response_id, model=model, choices=[ChatChunkChoice(index=index, delta={"content": text})]))
    for c in choices:
        yield chunk(ChatChunkChoice(index=c.index, delta={"role": "assistant", "content": ""}))
    async for item in stream_outputs(group):
        out = item.output
        choices[item.index].add(out)
        logprobs = (chat_logprobs(token_text, out.new_token_ids, out.new_logprobs, out.new_top_logprobs)
                    if body.logprobs and out.new_token_ids else None)
        if not (out.text_delta or logprobs or out.finished):
            continue
        if logprobs is None and not out.finished:
            yield text_events.event(item.index, out.text_delta)
            continue
        reason, matched = finish_fields(out.finish_reason if out.finished else None)
        delta = {"content": out.text_delta} if out.text_delta else {}
        yield chunk(ChatChunkChoice(index=item.index, delta=delta, logprobs=logprobs,
                                    finish_reason=reason, matched_stop=matched))
    if body.include_usage_in_stream:
        usage = usage_of(choices, _n(body))
        yield _sse(ChatCompletionChunk(id=response_id, model=model, choices=[], usage=usage))


# ======================================================================================
# /v1/completions
# ======================================================================================
async def completions(request: Request) -> Response:
    state = _state(request)
    body = await parse_body(request, CompletionRequest)
    prompts = encode_prompts(state, body.prompt_batch(), "prompt")
    sampling = validated(state, body.to_sampling_params(remaining_context(state, prompts)))
    group = await state.async_engine.submit(prompts, sampling, body.rid, stream=bool(body.stream))
    choices = new_choices(prompts, sampling.n)
    response_id = completion_id("cmpl")
    model = response_model_name(state, body.model)
    if body.is_stream:
        return sse_response(completion_stream(state, body, group, choices, response_id, model), group)
    await collect(request, group, choices)
    return JSONResponse(completion_response(state, body, choices, response_id, model).model_dump())


def _completion_logprobs_of(state: ServerState, body: CompletionRequest, ids: list[int],
                            logprobs: list[float], top: list[list[tuple[int, float]]],
                            text_offset: int) -> CompletionLogprobs | None:
    if body.logprobs is None:
        return None
    return completion_logprobs(TokenText(state.tokenizer), ids, logprobs, top, text_offset,
                               with_top=body.logprobs > 0)


def completion_response(state: ServerState, body: CompletionRequest, choices: list[ChoiceState],
                        response_id: str, model: str) -> CompletionResponse:
    out = []
    for c in choices:
        reason, matched = finish_fields(c.finish_reason)
        logprobs = _completion_logprobs_of(state, body, c.output_ids, c.logprobs, c.top_logprobs, 0)
        out.append(CompletionChoice(index=c.index, text=c.text, logprobs=logprobs,
                                    finish_reason=reason, matched_stop=matched))
    return CompletionResponse(id=response_id, model=model, choices=out, usage=usage_of(choices, _n(body)))


async def completion_stream(state: ServerState, body: CompletionRequest, group: RequestGroup,
                            choices: list[ChoiceState], response_id: str, model: str) -> AsyncIterator[str]:
    text_events = TextChunkEvents(lambda index, text: CompletionResponse(
        id=response_id, model=model, choices=[CompletionChoice(index=index, text=text)]))
    async for item in stream_outputs(group):
        out, choice = item.output, choices[item.index]
        text_offset = len(choice.text) if body.logprobs is not None else 0   # joins every part so far
        choice.add(out)
        logprobs = (_completion_logprobs_of(state, body, out.new_token_ids, out.new_logprobs,
                                            out.new_top_logprobs, text_offset)
                    if out.new_token_ids else None)
        if not (out.text_delta or logprobs or out.finished):
            continue
        if logprobs is None and not out.finished:
            yield text_events.event(item.index, out.text_delta)
            continue
        reason, matched = finish_fields(out.finish_reason if out.finished else None)
        chunk_choice = CompletionChoice(index=item.index, text=out.text_delta, logprobs=logprobs,
                                        finish_reason=reason, matched_stop=matched)
        yield _sse(CompletionResponse(id=response_id, model=model, choices=[chunk_choice]))
    if body.include_usage_in_stream:
        usage = usage_of(choices, _n(body))
        yield _sse(CompletionResponse(id=response_id, model=model, choices=[], usage=usage))


# ======================================================================================
# SGLang native /generate
# ======================================================================================
async def generate(request: Request) -> Response:
    state = _state(request)
    body = await parse_body(request, GenerateRequest)
    prompts = encode_prompts(state, body.prompt_batch(), "text" if body.text is not None else "input_ids")
    sampling = validated(state, body.to_sampling_params(remaining_context(state, prompts)))
    group = await state.async_engine.submit(prompts, sampling, body.rid, stream=bool(body.stream))
    choices = new_choices(prompts, sampling.n)
    is_list = body.is_batch or sampling.n > 1
    if body.stream:
        return sse_response(generate_stream(state, body, group, choices, is_list), group)
    await collect(request, group, choices)
    results = [generate_result(state, body, c, group.rids[c.index]) for c in choices]
    return JSONResponse(results if is_list else results[0])


def generate_result(state: ServerState, body: GenerateRequest, choice: ChoiceState, rid: str) -> dict[str, Any]:
    meta = dict(choice.meta_info)
    meta.update(id=rid, finish_reason=choice.finish_reason, prompt_tokens=choice.prompt_len,
                completion_tokens=choice.completion_tokens, cached_tokens=choice.cached_tokens)
    meta.setdefault("e2e_latency", time.perf_counter() - choice.start_time)
    meta.setdefault("spec_verify_ct", 0)
    meta.setdefault("spec_accept_length", 1.0)  # without speculation: one token per forward
    if body.return_logprob:
        text_of = TokenText(state.tokenizer) if body.return_text_in_logprobs else None
        meta["output_token_logprobs"] = [
            [lp, t, text_of(t) if text_of else None] for t, lp in zip(choice.output_ids, choice.logprobs)]
        meta["output_top_logprobs"] = [
            [[lp, t, text_of(t) if text_of else None] for t, lp in alternatives]
            for alternatives in choice.top_logprobs]
    return {"text": choice.text, "output_ids": list(choice.output_ids), "meta_info": meta}


async def generate_stream(state: ServerState, body: GenerateRequest, group: RequestGroup,
                          choices: list[ChoiceState], is_list: bool) -> AsyncIterator[str]:
    """SGLang streams cumulative text and output_ids in each event."""
    async for item in stream_outputs(group):
        choice = choices[item.index]
        choice.add(item.output)
        if not (item.output.new_token_ids or item.output.finished):
            continue
        result = generate_result(state, body, choice, group.rids[item.index])
        if is_list:
            result["index"] = item.index
        yield _sse(result)


# ======================================================================================
# models, health, server info, cache, metrics
# ======================================================================================
async def list_models(request: Request) -> JSONResponse:
    state = _state(request)
    card = ModelCard(id=state.model_name, root=state.model_path,
                     max_model_len=state.async_engine.context_len)
    return JSONResponse(ModelList(data=[card]).model_dump())


async def health(request: Request) -> Response:
    problem = _state(request).async_engine.health_error
    if problem is not None:
        return error_response(503, problem)
    return Response(status_code=200)


async def health_generate(request: Request) -> Response:
    """Healthy when the engine can generate one token."""
    state = _state(request)
    prompt_ids = state.tokenizer.encode("Hello") or [0]
    sampling = SamplingParams(max_new_tokens=1, temperature=0.0)
    try:
        group = await state.async_engine.submit([prompt_ids], sampling)
        choices = new_choices([prompt_ids], 1)
        await asyncio.wait_for(_drain(group, choices), HEALTH_GENERATE_TIMEOUT_S)
    except (EngineError, ValueError, asyncio.TimeoutError) as exc:
        return error_response(503, f"health check generation failed: {type(exc).__name__}: {exc}")
    return Response(status_code=200)


def public_server_args(server_args: ServerArgs) -> dict[str, Any]:
    args = dataclasses.asdict(server_args)
    if args.get("api_key"):
        args["api_key"] = "***"
    return args


async def get_server_info(request: Request) -> JSONResponse:
    state = _state(request)
    engine_info = await state.async_engine.query("get_server_info")
    info = {**public_server_args(state.server_args), **(engine_info or {}), "version": __version__,
            "model_process_pid": state.async_engine.model_pid}
    return JSONResponse(jsonable(info))


def jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


async def get_model_info(request: Request) -> JSONResponse:
    state = _state(request)
    args = state.server_args
    return JSONResponse({
        "model_path": state.model_path, "tokenizer_path": args.tokenizer_path or state.model_path,
        "served_model_name": state.model_name, "is_generation": True,
        "context_length": state.async_engine.context_len, "vocab_size": state.vocab_size,
        "preferred_sampling_params": None,
    })


async def flush_cache(request: Request) -> Response:
    flushed = await _state(request).async_engine.query("flush_cache")
    if not flushed:
        return error_response(400, "Cache not flushed: requests are still running; retry when idle.")
    return PlainTextResponse("Cache flushed.\n")


async def metrics(request: Request) -> Response:
    state = _state(request)
    info = await state.async_engine.query("get_server_info") or {}
    kv_usage = info.get("kv_usage") or await state.async_engine.query("kv_usage") or {}
    running = info.get("num_running_reqs", state.async_engine.num_active_requests)
    waiting = info.get("num_waiting_reqs", info.get("num_queue_reqs", 0))
    state.metrics.set_engine_state(int(running or 0), int(waiting or 0), kv_usage,
                                   info.get("avg_spec_accept_length"), info.get("spec_accept_histogram"))
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


# ======================================================================================
# app
# ======================================================================================
ROUTES: list[tuple[str, Callable[[Request], Awaitable[Response]], list[str]]] = [
    ("/v1/chat/completions", chat_completions, ["POST"]),
    ("/v1/completions", completions, ["POST"]),
    ("/v1/models", list_models, ["GET"]),
    ("/generate", generate, ["POST"]),
    ("/health", health, ["GET"]),
    ("/health_generate", health_generate, ["GET"]),
    ("/get_server_info", get_server_info, ["GET"]),
    ("/get_model_info", get_model_info, ["GET"]),
    ("/flush_cache", flush_cache, ["GET", "POST"]),
    ("/metrics", metrics, ["GET"]),
]


def _disconnect_as_499(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ClientDisconnected:
            return Response(status_code=499)

    wrapped.__name__ = handler.__name__
    wrapped.__doc__ = handler.__doc__
    return wrapped


def create_app(async_engine: AsyncEngine, server_args: ServerArgs) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        async_engine.shutdown()

    app = FastAPI(title="specserve", version=__version__, lifespan=lifespan)
    app.state.server = ServerState(async_engine, server_args)
    install_error_handlers(app)
    router = APIRouter(dependencies=[Depends(check_api_key)])
    for path, handler, methods in ROUTES:
        router.add_api_route(path, _disconnect_as_499(handler), methods=methods)
    app.include_router(router)
    app.add_middleware(HttpMetricsMiddleware, metrics=async_engine.metrics,
                       known_paths=frozenset(path for path, _, _ in ROUTES))
    return app
