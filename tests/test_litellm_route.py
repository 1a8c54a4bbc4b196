"""LitellmRouter against a respx-mocked Anthropic Messages API.

litellm is imported once for the module (a few seconds); every call after that is ~10 ms.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import respx

from proxy.errors import ConfigError, UpstreamError, UpstreamStatusError, UpstreamTimeout
from proxy.upstream.litellm_route import LitellmAnswer, LitellmRouter

ANTHROPIC = "https://api.anthropic.com/v1/messages"
KEY = "sk-ant-test"
PARAMS = {"model": "anthropic/claude-3-5-sonnet-20241022", "api_key": KEY}
ROUTES = [{"model_name": "claude", "litellm_params": PARAMS}]
ROOT = Path(__file__).resolve().parents[1]

# litellm's own pydantic models warn about ReadOnly TypedDict items on first use.
pytestmark = pytest.mark.filterwarnings("ignore:Item .* is using the `ReadOnly` qualifier")

TEXT_MESSAGE = {
    "id": "msg_01",
    "type": "message",
    "role": "assistant",
    "model": "claude-3-5-sonnet-20241022",
    "content": [{"type": "text", "text": "Hello there"}],
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "usage": {"input_tokens": 12, "output_tokens": 5},
}

TOOL_MESSAGE = {
    **TEXT_MESSAGE,
    "id": "msg_02",
    "content": [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}},
    ],
    "stop_reason": "tool_use",
    "usage": {"input_tokens": 50, "output_tokens": 20},
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

MESSAGE_START = {
    "type": "message_start",
    "message": {
        "id": "msg_03",
        "type": "message",
        "role": "assistant",
        "model": "claude-3-5-sonnet-20241022",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 25, "output_tokens": 1},
    },
}


def text_events(*pieces: str) -> list[dict[str, Any]]:
    return [
        MESSAGE_START,
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "ping"},
        *(
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": p}}
            for p in pieces
        ),
        {"type": "content_block_stop", "index": 0},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {"output_tokens": 15},
        },
        {"type": "message_stop"},
    ]


def sse(events: list[dict[str, Any]]) -> bytes:
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


def sse_response(events: list[dict[str, Any]]) -> httpx.Response:
    return httpx.Response(200, content=sse(events), headers={"content-type": "text/event-stream"})


def anthropic_error(status: int, type_: str, message: str) -> httpx.Response:
    return httpx.Response(
        status, json={"type": "error", "error": {"type": type_, "message": message}}
    )


def request_body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "claude",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say hello"},
        ],
        "max_tokens": 100,
        **extra,
    }


async def collect(answer: LitellmAnswer) -> list[bytes]:
    assert answer.chunks is not None and answer.body is None
    return [chunk async for chunk in answer.chunks]


def events_of(chunks: list[bytes]) -> list[Any]:
    """Parse our SSE output strictly: every chunk is exactly one `data: ...\\n\\n` event."""
    out: list[Any] = []
    for chunk in chunks:
        assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n"), chunk
        payload = chunk[len(b"data: ") : -2]
        assert b"\n" not in payload
        out.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return out


@pytest.fixture(scope="module")
def router() -> LitellmRouter:
    r = LitellmRouter(ROUTES, timeout_s=5)
    r._litellm()  # the slow import, once for the whole module
    return r


@pytest.fixture
def anthropic() -> Iterator[respx.MockRouter]:
    # assert_all_mocked: a request anywhere but the mocked URL fails the test.
    with respx.mock(assert_all_mocked=True, assert_all_called=False) as mock:
        yield mock


# -- no litellm needed -------------------------------------------------------------------------


def test_import_and_construction_do_not_import_litellm() -> None:
    code = (
        "import sys\n"
        "from proxy.upstream.litellm_route import LitellmRouter\n"
        f"r = LitellmRouter({ROUTES!r}, timeout_s=1)\n"
        "assert r.match('claude') is not None\n"
        "assert 'litellm' not in sys.modules, 'litellm imported eagerly'\n"
        "print('lazy')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "lazy"


def test_match_exact_name_only() -> None:
    r = LitellmRouter(ROUTES, timeout_s=1)
    assert r.match("claude") == PARAMS
    assert r.match("claude-2") is None
    assert r.match("anthropic/claude-3-5-sonnet-20241022") is None
    assert r.model_names == {"claude"}


@pytest.mark.parametrize(
    "routes",
    [
        [{"model_name": "", "litellm_params": PARAMS}],
        [{"model_name": "x", "litellm_params": {"api_key": KEY}}],
        [{"model_name": "x"}],
        ROUTES + ROUTES,
    ],
)
def test_bad_routes_are_config_errors(routes: list[dict[str, Any]]) -> None:
    with pytest.raises(ConfigError):
        LitellmRouter(routes, timeout_s=1)


def test_kwargs_allowlist_and_overrides() -> None:
    r = LitellmRouter(ROUTES, timeout_s=7)
    metadata = {"user_id": "u1"}
    kwargs = r._kwargs(
        {**PARAMS, "temperature": 0.0, "rpm": 100},
        request_body(
            temperature=0.9,
            top_k=5,
            metadata=metadata,
            seed=None,
            # litellm control knobs a client must not reach:
            api_base="http://attacker.example",
            base_url="http://attacker.example",
            mock_response="pwned",
            extra_headers={"x": "y"},
            custom_llm_provider="openai",
        ),
    )
    assert kwargs["model"] == PARAMS["model"] and kwargs["api_key"] == KEY
    assert kwargs["temperature"] == 0.0  # route params override the body
    assert kwargs["top_k"] == 5 and kwargs["max_tokens"] == 100
    assert kwargs["metadata"] == metadata and kwargs["metadata"] is not metadata
    assert kwargs["timeout"] == 7 and kwargs["drop_params"] is True
    assert kwargs["stream"] is False
    streaming = r._kwargs(PARAMS, request_body(stream=True, stream_options={"include_usage": True}))
    assert streaming["stream"] is True and streaming["stream_options"] == {"include_usage": True}
    assert "stream_options" not in r._kwargs(PARAMS, request_body(stream_options={}))
    for dropped in ("api_base", "base_url", "mock_response", "extra_headers", "rpm", "seed"):
        assert dropped not in kwargs
    assert "custom_llm_provider" not in kwargs


# -- through litellm ---------------------------------------------------------------------------


async def test_text_answer(router: LitellmRouter, anthropic: respx.MockRouter) -> None:
    anthropic.post(ANTHROPIC).mock(return_value=httpx.Response(200, json=TEXT_MESSAGE))
    answer = await router.complete(PARAMS, request_body())
    assert answer.status == 200 and answer.chunks is None and answer.body is not None
    data = orjson.loads(answer.body)
    assert data["object"] == "chat.completion"
    assert data["model"] == "claude"  # the client's name, not the provider's
    assert data["id"]
    [choice] = data["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hello there"}
    assert choice["finish_reason"] == "stop" and choice["index"] == 0
    usage = data["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        12,
        5,
        17,
    )


async def test_request_translation(router: LitellmRouter, anthropic: respx.MockRouter) -> None:
    route = anthropic.post(ANTHROPIC).mock(return_value=httpx.Response(200, json=TEXT_MESSAGE))
    await router.complete(
        PARAMS,
        request_body(temperature=0.3, stop=["END"], api_base="http://attacker.example"),
    )
    request = route.calls.last.request
    assert request.headers["x-api-key"] == KEY
    assert request.headers["anthropic-version"]
    assert "authorization" not in request.headers
    sent = orjson.loads(request.content)
    assert sent["model"] == "claude-3-5-sonnet-20241022"
    system = sent["system"]
    texts = [system] if isinstance(system, str) else [b["text"] for b in system]
    assert texts == ["You are terse."]
    assert [m["role"] for m in sent["messages"]] == ["user"]
    content = sent["messages"][0]["content"]
    assert content == "Say hello" or content == [{"type": "text", "text": "Say hello"}]
    assert sent["max_tokens"] == 100 and sent["temperature"] == 0.3
    assert sent["stop_sequences"] == ["END"]
    assert "api_base" not in sent


async def test_tool_use_answer(router: LitellmRouter, anthropic: respx.MockRouter) -> None:
    route = anthropic.post(ANTHROPIC).mock(return_value=httpx.Response(200, json=TOOL_MESSAGE))
    answer = await router.complete(PARAMS, request_body(tools=[WEATHER_TOOL], tool_choice="auto"))
    assert answer.body is not None
    [choice] = orjson.loads(answer.body)["choices"]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["id"] == "toolu_01" and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    sent = orjson.loads(route.calls.last.request.content)
    [tool] = sent["tools"]
    assert tool["name"] == "get_weather"
    assert tool["input_schema"] == WEATHER_TOOL["function"]["parameters"]  # type: ignore[index]
    assert sent["tool_choice"] == {"type": "auto"}


async def test_stream_with_usage(router: LitellmRouter, anthropic: respx.MockRouter) -> None:
    route = anthropic.post(ANTHROPIC).mock(
        return_value=sse_response(text_events("Hel", "lo, ", "world"))
    )
    answer = await router.complete(
        PARAMS, request_body(stream=True, stream_options={"include_usage": True})
    )
    assert answer.is_stream and answer.status == 200
    events = events_of(await collect(answer))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "claude" for c in chunks)
    text = "".join(choice["delta"].get("content") or "" for c in chunks for choice in c["choices"])
    assert text == "Hello, world"
    with_usage = [c for c in chunks if "usage" in c]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1]
    assert with_usage[0]["choices"] == []
    usage = with_usage[0]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        25,
        15,
        40,
    )
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == ["stop"]
    assert orjson.loads(route.calls.last.request.content)["stream"] is True


async def test_stream_without_usage(router: LitellmRouter, anthropic: respx.MockRouter) -> None:
    anthropic.post(ANTHROPIC).mock(return_value=sse_response(text_events("Hi")))
    events = events_of(await collect(await router.complete(PARAMS, request_body(stream=True))))
    assert events[-1] == "[DONE]"
    assert all("usage" not in c and c["choices"] for c in events[:-1])


@pytest.mark.parametrize("asked", [False, True])
async def test_stream_usage_is_told_whether_or_not_the_client_asked(
    router: LitellmRouter, anthropic: respx.MockRouter, asked: bool
) -> None:
    """The provider bills the call either way: ``on_usage`` gets its usage, and the client's
    stream has a usage chunk only when it asked for one."""
    anthropic.post(ANTHROPIC).mock(return_value=sse_response(text_events("Hi")))
    told: list[Any] = []
    extra = {"stream_options": {"include_usage": True}} if asked else {}
    answer = await router.complete(PARAMS, request_body(stream=True, **extra),
                                   on_usage=told.append)
    events = events_of(await collect(answer))
    with_usage = [c for c in events[:-1] if "usage" in c]
    assert len(with_usage) == (1 if asked else 0)
    [usage] = told
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (25, 15)
    if asked:
        assert with_usage[0]["usage"] == usage


async def test_whole_answer_usage_is_told(router: LitellmRouter,
                                          anthropic: respx.MockRouter) -> None:
    anthropic.post(ANTHROPIC).mock(return_value=httpx.Response(200, json=TEXT_MESSAGE))
    told: list[Any] = []
    answer = await router.complete(PARAMS, request_body(), on_usage=told.append)
    assert answer.body is not None
    assert told == [orjson.loads(answer.body)["usage"]] and told[0]["prompt_tokens"] == 12


async def test_stream_tool_call(router: LitellmRouter, anthropic: respx.MockRouter) -> None:
    events: list[dict[str, Any]] = [
        MESSAGE_START,
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {
                "type": "tool_use",
                "id": "toolu_09",
                "name": "get_weather",
                "input": {},
            },
        },
        *(
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "input_json_delta", "partial_json": p},
            }
            for p in ('{"ci', 'ty": "Pa', 'ris"}')
        ),
        {"type": "content_block_stop", "index": 0},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use"},
            "usage": {"output_tokens": 9},
        },
        {"type": "message_stop"},
    ]
    anthropic.post(ANTHROPIC).mock(return_value=sse_response(events))
    answer = await router.complete(PARAMS, request_body(stream=True, tools=[WEATHER_TOOL]))
    chunks = events_of(await collect(answer))[:-1]
    calls = [
        tc for c in chunks for ch in c["choices"] for tc in ch["delta"].get("tool_calls") or ()
    ]
    assert {tc.get("id") for tc in calls} - {None} == {"toolu_09"}
    assert calls[0]["function"]["name"] == "get_weather"
    arguments = "".join(tc["function"].get("arguments") or "" for tc in calls)
    assert json.loads(arguments) == {"city": "Paris"}
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]] == [
        "tool_calls"
    ]


@pytest.mark.parametrize(
    ("status", "type_", "message"),
    [
        (401, "authentication_error", f"invalid x-api-key {KEY}"),
        (
            429,
            "rate_limit_error",
            "Number of request tokens has exceeded your per-minute rate limit",
        ),
        (500, "api_error", "Internal server error"),
        (529, "overloaded_error", "Overloaded"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_provider_errors(
    router: LitellmRouter,
    anthropic: respx.MockRouter,
    status: int,
    type_: str,
    message: str,
    stream: bool,
) -> None:
    anthropic.post(ANTHROPIC).mock(return_value=anthropic_error(status, type_, message))
    with pytest.raises(UpstreamStatusError) as info:
        await router.complete(PARAMS, request_body(stream=stream))
    error = info.value
    assert error.status == status
    assert error.code == type_
    assert error.message == message.replace(KEY, "[redacted]")
    body = orjson.loads(error.body())
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert KEY not in error.body().decode() and KEY not in str(error)


async def test_error_event_mid_stream(router: LitellmRouter, anthropic: respx.MockRouter) -> None:
    events = text_events("partial")[:4] + [
        {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    ]
    anthropic.post(ANTHROPIC).mock(return_value=sse_response(events))
    answer = await router.complete(PARAMS, request_body(stream=True))
    out = events_of(await collect(answer))
    assert out[0]["choices"][0]["delta"]["content"] == "partial"
    last = out[-1]
    assert "[DONE]" not in out  # an error ends the stream without the success marker
    assert set(last) == {"error"} and last["error"]["message"] == "Overloaded"
    # litellm keeps only the message of an Anthropic error event, not its type.
    assert set(last["error"]) == {"message", "type", "param", "code"}


async def test_connection_dropped_mid_stream(
    router: LitellmRouter, anthropic: respx.MockRouter
) -> None:
    class Broken(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            yield sse(text_events("partial")[:4])
            raise httpx.ReadError("connection reset by peer")

    anthropic.post(ANTHROPIC).mock(
        return_value=httpx.Response(
            200, stream=Broken(), headers={"content-type": "text/event-stream"}
        )
    )
    answer = await router.complete(PARAMS, request_body(stream=True))
    out = events_of(await collect(answer))
    assert out[0]["choices"][0]["delta"]["content"] == "partial"
    assert out[-1]["error"]["code"] == UpstreamError.code
    assert "[DONE]" not in out


async def test_connection_refused(router: LitellmRouter, anthropic: respx.MockRouter) -> None:
    anthropic.post(ANTHROPIC).mock(side_effect=httpx.ConnectError("Connection refused"))
    with pytest.raises(UpstreamError) as info:
        await router.complete(PARAMS, request_body())
    assert type(info.value) is UpstreamError and info.value.status == 502


async def test_timeout(router: LitellmRouter, anthropic: respx.MockRouter) -> None:
    anthropic.post(ANTHROPIC).mock(side_effect=httpx.ReadTimeout("timed out"))
    with pytest.raises(UpstreamTimeout) as info:
        await router.complete(PARAMS, request_body())
    assert info.value.status == 504


async def test_error_before_first_chunk_raises(
    router: LitellmRouter, anthropic: respx.MockRouter
) -> None:
    # Anthropic can accept a stream and fail at once; the client still gets an HTTP status.
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    anthropic.post(ANTHROPIC).mock(return_value=sse_response([MESSAGE_START, overloaded]))
    with pytest.raises(UpstreamStatusError) as info:
        await router.complete(PARAMS, request_body(stream=True))
    assert info.value.status == 529 and info.value.message == "Overloaded"


async def test_import_settings_and_concurrent_first_use(
    router: LitellmRouter, anthropic: respx.MockRouter
) -> None:
    litellm = router._litellm()
    assert litellm is router._litellm()  # cached on the instance
    assert litellm.disable_aiohttp_transport is True
    assert litellm.suppress_debug_info is True
    assert litellm.callbacks == [] and litellm.success_callback == []
    assert os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] and os.environ["LITELLM_OFFLINE_MODE"]
    anthropic.post(ANTHROPIC).mock(return_value=httpx.Response(200, json=TEXT_MESSAGE))
    fresh = LitellmRouter(ROUTES, timeout_s=5)
    answers = await asyncio.gather(*(fresh.complete(PARAMS, request_body()) for _ in range(3)))
    assert all(a.body is not None and b"Hello there" in a.body for a in answers)
