"""HTTP API against the fake engine: shapes, streaming, errors, aborts, n > 1, auth."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any

import httpx
import openai
import pytest

from specserve.core import SamplingParams
from specserve.server.async_engine import AsyncEngine, EngineError

from .conftest import RunningServer, serve_fake, wait_until
from .fake_engine import EOS_ID, FAKE_CONTEXT_LEN, FakeLLMEngine, FakeTokenizer

USER_HI = [{"role": "user", "content": "hi"}]
CHAT_PROMPT_TEXT = FakeTokenizer().apply_chat_template(USER_HI)  # what the fake echoes back


def sse_events(response: httpx.Response) -> list[Any]:
    """Parse an SSE body into JSON events; the final event must be [DONE]."""
    events = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events and events[-1] == "[DONE]"
    return events[:-1]


def assert_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    return error


# ---------------------------------------------------------------------------------------
# endpoint shapes
# ---------------------------------------------------------------------------------------
def test_health_and_models(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "fake-model" and models["data"][0]["object"] == "model"
    assert models["data"][0]["max_model_len"] == FAKE_CONTEXT_LEN


def test_server_and_model_info(client: httpx.Client) -> None:
    info = client.get("/get_server_info").json()
    assert info["model_path"] == "fake-model" and info["avg_spec_accept_length"] == 2.0
    assert "version" in info and "speculative_algorithm" in info
    model_info = client.get("/get_model_info").json()
    assert model_info["model_path"] == "fake-model" and model_info["is_generation"] is True


def test_chat_completion_shape(client: httpx.Client) -> None:
    body = client.post("/v1/chat/completions", json={"model": "m", "messages": USER_HI}).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "m"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": CHAT_PROMPT_TEXT}
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == EOS_ID
    usage = body["usage"]
    prompt_len = len(CHAT_PROMPT_TEXT.encode())
    assert usage["prompt_tokens"] == prompt_len
    assert usage["completion_tokens"] == prompt_len + 1  # the echo plus EOS
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "cached_tokens" in usage["prompt_tokens_details"]


def test_chat_content_parts_and_length_finish(client: httpx.Client) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    body = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5}).json()
    assert body["choices"][0]["message"]["content"] == CHAT_PROMPT_TEXT[:5]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5


def test_chat_stream_matches_non_stream(client: httpx.Client) -> None:
    request = {"messages": USER_HI, "max_tokens": 11}
    full = client.post("/v1/chat/completions", json=request).json()
    response = client.post("/v1/chat/completions",
                           json={**request, "stream": True, "stream_options": {"include_usage": True}})
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = sse_events(response)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == full["choices"][0]["message"]["content"]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 11


def test_completion_shape_and_stream(client: httpx.Client) -> None:
    request = {"prompt": "hello world", "max_tokens": 7}
    full = client.post("/v1/completions", json=request).json()
    assert full["object"] == "text_completion"
    assert full["choices"][0]["text"] == "hello w" and full["choices"][0]["finish_reason"] == "length"
    chunks = sse_events(client.post("/v1/completions", json={**request, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == "hello w"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_completion_stop_string_cut_in_both_modes(client: httpx.Client) -> None:
    request = {"prompt": "abcdefgh", "max_tokens": 20, "stop": ["ef"]}
    full = client.post("/v1/completions", json=request).json()
    assert full["choices"][0]["text"] == "abcd"
    assert full["choices"][0]["finish_reason"] == "stop" and full["choices"][0]["matched_stop"] == "ef"
    chunks = sse_events(client.post("/v1/completions", json={**request, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abcd"


def test_completion_prompt_forms(client: httpx.Client) -> None:
    batch = client.post("/v1/completions", json={"prompt": ["ab", "cd"], "max_tokens": 2}).json()
    assert [c["text"] for c in batch["choices"]] == ["ab", "cd"]
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert batch["usage"]["prompt_tokens"] == 4
    ids = client.post("/v1/completions", json={"prompt": [104, 105], "max_tokens": 2}).json()
    assert ids["choices"][0]["text"] == "hi"
    nested = client.post("/v1/completions", json={"prompt": [[104], [105]], "max_tokens": 1}).json()
    assert [c["text"] for c in nested["choices"]] == ["h", "i"]


def test_cached_tokens_reported(client: httpx.Client) -> None:
    request = {"prompt": "a shared prefix of some length", "max_tokens": 1}
    client.post("/v1/completions", json=request)
    again = client.post("/v1/completions", json=request).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_chat_logprobs_shape(client: httpx.Client) -> None:
    body = client.post("/v1/chat/completions", json={
        "messages": USER_HI, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert content[0]["token"] == "<" and content[0]["logprob"] == -0.5
    assert content[0]["bytes"] == [ord("<")]
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["<", "="]


def test_completion_logprobs_shape(client: httpx.Client) -> None:
    body = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "logprobs": 1}).json()
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["a", "b", "c"] and logprobs["token_logprobs"] == [-0.5] * 3
    assert logprobs["top_logprobs"] == [{"a": -0.5}, {"b": -0.5}, {"c": -0.5}]
    assert logprobs["text_offset"] == [0, 1, 2]
    chunks = sse_events(client.post("/v1/completions", json={
        "prompt": "abc", "max_tokens": 3, "logprobs": 1, "stream": True}))
    offsets = [o for c in chunks if c["choices"][0]["logprobs"] for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [0, 1, 2]


def test_extra_fields_are_ignored(client: httpx.Client) -> None:
    response = client.post("/v1/chat/completions", json={
        "messages": USER_HI, "max_tokens": 2, "some_vendor_extension": {"x": 1}, "parallel_tool_calls": False})
    assert response.status_code == 200


# ---------------------------------------------------------------------------------------
# SGLang native
# ---------------------------------------------------------------------------------------
def test_generate_native(client: httpx.Client) -> None:
    body = client.post("/generate", json={"text": "abcdef", "sampling_params": {"max_new_tokens": 4},
                                          "return_logprob": True, "rid": "native-1"}).json()
    assert body["text"] == "abcd" and body["output_ids"] == list(b"abcd")
    meta = body["meta_info"]
    assert meta["id"] == "native-1" and meta["finish_reason"]["type"] == "length"
    assert meta["prompt_tokens"] == 6 and meta["completion_tokens"] == 4
    assert meta["spec_verify_ct"] == 2 and meta["spec_accept_length"] == 2.0
    assert {"cached_tokens", "e2e_latency"} <= set(meta)
    assert meta["output_token_logprobs"][0] == [-0.5, ord("a"), None]


def test_generate_default_max_new_tokens_is_128(client: httpx.Client) -> None:
    body = client.post("/generate", json={"text": "xy", "sampling_params": {"ignore_eos": True}}).json()
    assert body["meta_info"]["completion_tokens"] == 128


def test_generate_stream_is_cumulative(client: httpx.Client) -> None:
    request = {"input_ids": list(b"hello"), "sampling_params": {"max_new_tokens": 5}}
    full = client.post("/generate", json=request).json()
    events = sse_events(client.post("/generate", json={**request, "stream": True}))
    assert len(events) >= 2
    assert events[-1]["text"] == full["text"] == "hello"
    assert events[-1]["output_ids"] == full["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_generate_batch(client: httpx.Client) -> None:
    body = client.post("/generate", json={"text": ["ab", "cd"], "sampling_params": {"max_new_tokens": 2}}).json()
    assert [item["text"] for item in body] == ["ab", "cd"]


# ---------------------------------------------------------------------------------------
# n > 1
# ---------------------------------------------------------------------------------------
def test_n_equals_2_with_seed_offsets(client: httpx.Client) -> None:
    body = client.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 2, "n": 2, "seed": 1}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    # the fake starts its echo at seed % len: seeds 1 and 2
    assert [c["text"] for c in body["choices"]] == ["bc", "cd"]
    assert body["usage"]["prompt_tokens"] == 4 and body["usage"]["completion_tokens"] == 4


def test_n_equals_2_chat_stream(client: httpx.Client) -> None:
    chunks = sse_events(client.post("/v1/chat/completions", json={
        "messages": USER_HI, "max_tokens": 4, "n": 2, "stream": True}))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
    assert texts == {0: CHAT_PROMPT_TEXT[:4], 1: CHAT_PROMPT_TEXT[:4]}


# ---------------------------------------------------------------------------------------
# OpenAI client over a real socket
# ---------------------------------------------------------------------------------------
def test_openai_client(fake_server: RunningServer) -> None:
    oai = openai.OpenAI(base_url=fake_server.base_url + "/v1", api_key="x", max_retries=0)
    chat = oai.chat.completions.create(model="fake-model", messages=USER_HI, max_tokens=6)
    assert chat.choices[0].message.content == CHAT_PROMPT_TEXT[:6]
    assert chat.usage.completion_tokens == 6
    stream = oai.chat.completions.create(model="fake-model", messages=USER_HI, max_tokens=6, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == CHAT_PROMPT_TEXT[:6]
    completion = oai.completions.create(model="fake-model", prompt="openai", max_tokens=4)
    assert completion.choices[0].text == "open"
    stream = oai.completions.create(model="fake-model", prompt="openai", max_tokens=4, stream=True)
    assert "".join(c.choices[0].text for c in stream) == "open"
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model="fake-model", prompt="x", max_tokens=4, temperature=-1)


# ---------------------------------------------------------------------------------------
# bad input -> 400, then the server keeps serving
# ---------------------------------------------------------------------------------------
BAD_REQUESTS = [
    ("/v1/chat/completions", b"{not json", None),
    ("/v1/chat/completions", b"[1, 2]", None),
    ("/v1/chat/completions", {"model": "m"}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": USER_HI, "max_tokens": "many"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": USER_HI, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": USER_HI, "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"messages": USER_HI, "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"messages": USER_HI, "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": USER_HI, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER_HI, "logprobs": True, "top_logprobs": 30}, None),
    ("/v1/chat/completions", {"messages": USER_HI, "stop_token_ids": [10**6]}, None),
    ("/v1/chat/completions", {"messages": USER_HI, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": USER_HI, "max_tokens": FAKE_CONTEXT_LEN}, None),
    ("/v1/completions", {"prompt": "x" * FAKE_CONTEXT_LEN}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [10**6]}, None),
    ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/generate", {"sampling_params": {"max_new_tokens": 3}}, "text"),
    ("/generate", {"text": "x", "input_ids": [1]}, "text"),
    ("/generate", {"text": "x", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "a+"}}, "sampling_params.regex"),
    ("/generate", {"text": "x", "sampling_params": {"top_k": 0}}, None),
]


@pytest.mark.parametrize("path,payload,param", BAD_REQUESTS)
def test_bad_request_is_400_and_server_keeps_serving(client: httpx.Client, path: str, payload: Any,
                                                     param: str | None) -> None:
    if isinstance(payload, bytes):
        response = client.post(path, content=payload, headers={"content-type": "application/json"})
    else:
        response = client.post(path, json=payload)
    error = assert_error(response, 400)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    ok = client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "ok"


def test_bad_streaming_request_is_400_not_a_stream(client: httpx.Client) -> None:
    response = client.post("/v1/chat/completions", json={"messages": USER_HI, "stream": True, "temperature": -3})
    assert_error(response, 400)


def test_unknown_route_and_method(client: httpx.Client) -> None:
    error = assert_error(client.get("/v1/nothing-here"), 404)
    assert error["type"] == "not_found_error"
    assert_error(client.get("/v1/chat/completions"), 405)


# ---------------------------------------------------------------------------------------
# engine failure, disconnects, aborts
# ---------------------------------------------------------------------------------------
def test_engine_crash_is_500_and_server_keeps_serving(client: httpx.Client) -> None:
    error = assert_error(client.post("/v1/completions", json={"prompt": "CRASH now", "max_tokens": 4}), 500)
    assert "simulated engine failure" in error["message"]
    events = sse_events(client.post("/v1/completions", json={"prompt": "CRASH", "max_tokens": 4, "stream": True}))
    assert events[-1]["error"]["code"] == 500
    ok = client.post("/v1/completions", json={"prompt": "fine", "max_tokens": 4}).json()
    assert ok["choices"][0]["text"] == "fine"


def test_client_disconnect_mid_stream_aborts(fake_server: RunningServer) -> None:
    fake = fake_server.fake
    fake.step_delay_s = 0.02
    try:
        with fake_server.client() as http, http.stream("POST", "/v1/completions", json={
                "prompt": "long", "max_tokens": 200, "ignore_eos": True, "stream": True,
                "rid": "disconnect-me"}) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
        assert wait_until(lambda: "disconnect-me" in fake.aborted)
        assert wait_until(lambda: not fake.has_unfinished())
    finally:
        fake.step_delay_s = 0.0


def test_client_disconnect_non_streaming_aborts(fake_server: RunningServer) -> None:
    fake = fake_server.fake
    fake.step_delay_s = 0.02
    try:
        with fake_server.client() as http, pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", timeout=0.3, json={
                "prompt": "long", "max_tokens": 200, "ignore_eos": True, "rid": "gone-away"})
        assert wait_until(lambda: "gone-away" in fake.aborted)
    finally:
        fake.step_delay_s = 0.0


def test_engine_thread_sleeps_when_idle(fake_server: RunningServer, client: httpx.Client) -> None:
    client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    steps = fake_server.fake.num_steps
    time.sleep(0.2)
    assert fake_server.fake.num_steps == steps


def test_async_engine_generate_close_aborts_and_n_seeds() -> None:
    async def scenario(engine: AsyncEngine, fake: FakeLLMEngine) -> None:
        stream = engine.generate(list(b"abc"), SamplingParams(max_new_tokens=100, ignore_eos=True), rid="r1")
        first = await stream.__anext__()
        assert first.rid == "r1" and first.new_token_ids == list(b"ab")
        await stream.aclose()
        seeded = [o async for o in engine.generate(list(b"abcd"), SamplingParams(max_new_tokens=1, n=2, seed=5))]
        seeds = sorted(s.seed for _, _, s in fake.added[-2:])
        assert seeds == [5, 6] and len(seeded) == 2
        with pytest.raises(ValueError):
            async for _ in engine.generate([], SamplingParams()):
                pass
        fake.crash_next_step = True
        with pytest.raises(EngineError):
            async for _ in engine.generate(list(b"x"), SamplingParams(max_new_tokens=5)):
                pass
        for _ in range(100):  # the aborts after the crash drain in the next step
            if await engine.call(lambda e: e.flush_cache()):
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail("flush_cache never succeeded after the crash")
        assert fake.requests == {}

    fake = FakeLLMEngine()
    fake.step_delay_s = 0.005
    engine = AsyncEngine(fake)
    try:
        asyncio.run(scenario(engine, fake))
        assert wait_until(lambda: "r1" in fake.aborted)
    finally:
        engine.shutdown()


# ---------------------------------------------------------------------------------------
# metrics, cache, auth
# ---------------------------------------------------------------------------------------
def test_metrics(client: httpx.Client) -> None:
    client.post("/v1/completions", json={"prompt": "metrics", "max_tokens": 4})
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in ("specserve:num_requests_total", "specserve:prompt_tokens_total",
                 "specserve:generation_tokens_total", "specserve:time_to_first_token_seconds_bucket",
                 "specserve:e2e_request_latency_seconds_bucket", "specserve:num_running_reqs",
                 "specserve:num_queue_reqs", "specserve:token_usage", "specserve:spec_accept_length",
                 "specserve:spec_accept_length_per_request_bucket", "specserve:http_requests_total"):
        assert name in text, name
    assert 'specserve:spec_accept_length{model_name="fake-model"} 2.0' in text


def test_flush_cache(client: httpx.Client) -> None:
    assert client.post("/flush_cache").status_code == 200
    assert client.get("/flush_cache").status_code == 200


def test_api_key() -> None:
    with serve_fake(api_key="sekret") as running, running.client() as http:
        request = {"prompt": "k", "max_tokens": 1}
        assert_error(http.post("/v1/completions", json=request), 401)
        wrong = {"Authorization": "Bearer nope"}
        assert_error(http.post("/v1/completions", json=request, headers=wrong), 401)
        good = {"Authorization": "Bearer sekret"}
        assert http.post("/v1/completions", json=request, headers=good).status_code == 200
        assert http.get("/health").status_code == 200
        assert http.get("/get_server_info", headers=good).json()["api_key"] == "***"
        oai = openai.OpenAI(base_url=running.base_url + "/v1", api_key="sekret", max_retries=0)
        assert oai.completions.create(model="m", prompt="ab", max_tokens=2).choices[0].text == "ab"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=running.base_url + "/v1", api_key="bad", max_retries=0).models.list()


# ---------------------------------------------------------------------------------------
# launcher and CLI
# ---------------------------------------------------------------------------------------
def test_launch_server_bad_flag_exits_2() -> None:
    result = subprocess.run([sys.executable, "-m", "specserve.launch_server", "--tp-size", "2"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "error: --tp-size" in result.stderr


def test_cli_lazy_hooks_report_missing_modules(capsys: pytest.CaptureFixture[str]) -> None:
    from specserve import cli

    for command, module in cli.LAZY_SUBCOMMANDS.items():
        try:
            __import__(module)
        except ModuleNotFoundError:
            assert cli.main([command]) == 2
            assert "not available yet" in capsys.readouterr().err
    assert cli.main(["no-such-command"]) == 2
