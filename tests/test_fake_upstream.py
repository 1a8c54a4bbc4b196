"""Tests of the fake OpenAI upstream and the loopback server helpers themselves."""

from __future__ import annotations

import asyncio
import base64
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import openai
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.demo.fake.upstream import FakeUpstream, Reply, error_body
from proxy.demo.servers import ServerThread, serve_async, serve_in_thread

from .conftest import examples

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]
TOOLS_REPLY = Reply(
    content=None,
    tool_calls=[
        {"name": "read_file", "arguments": {"path": "a.py", "lines": [1, 2]}, "id": "call_a"},
        {"name": "grep", "arguments": '{"pattern": "x"}'},
    ],
)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[ServerThread, FakeUpstream]]:
    # strict=False: the fake's own mechanics, driven with bare bodies ({"stream": true}) no
    # provider would take (strict mode has its own tests: test_provider_rules.py).
    fake = FakeUpstream(models=("fake-model", "other-model"), strict=False)
    with serve_in_thread(fake) as srv:
        yield srv, fake


@pytest.fixture
def fake(served: tuple[ServerThread, FakeUpstream]) -> FakeUpstream:
    served[1].reset()
    return served[1]


@pytest.fixture
def url(served: tuple[ServerThread, FakeUpstream], fake: FakeUpstream) -> str:
    return served[0].url


@pytest.fixture
def client(url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0, timeout=5) as c:
        yield c


@pytest.fixture
async def aclient(url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="sk-test", max_retries=0, timeout=5
    ) as c:
        yield c


def test_sdk_sync_non_stream(client: openai.OpenAI, fake: FakeUpstream) -> None:
    fake.script(Reply(content="hello there"))
    resp = client.chat.completions.create(model="gpt-x", messages=MESSAGES)
    assert resp.object == "chat.completion"
    assert resp.id.startswith("chatcmpl-fake-")
    assert resp.model == "gpt-x"
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == "hello there"
    assert choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    assert resp.usage is not None
    assert resp.usage.prompt_tokens >= 1 and resp.usage.completion_tokens >= 1
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    rec = fake.received[0]
    assert (rec.method, rec.path) == ("POST", "/v1/chat/completions")
    assert rec.headers["authorization"] == "Bearer sk-test"
    assert rec.json()["messages"] == MESSAGES
    assert rec.reply is not None and rec.reply.content == "hello there"
    assert fake.completed == [rec] and fake.cancelled == []
    # Queue exhausted -> default reply.
    assert (
        client.chat.completions.create(model="m", messages=MESSAGES).choices[0].message.content
        == "ok"
    )


async def test_sdk_async_non_stream(aclient: openai.AsyncOpenAI, fake: FakeUpstream) -> None:
    fake.script(
        "first",
        Reply(
            content="second", usage={"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
        ),
    )
    a = await aclient.chat.completions.create(model="m", messages=MESSAGES)
    b = await aclient.chat.completions.create(model="m", messages=MESSAGES)
    assert [a.choices[0].message.content, b.choices[0].message.content] == ["first", "second"]
    assert b.usage is not None and (b.usage.prompt_tokens, b.usage.total_tokens) == (7, 10)
    assert a.id != b.id
    assert fake.pending == 0


def test_sdk_stream_with_usage(client: openai.OpenAI, fake: FakeUpstream) -> None:
    text = "The quick brown fox jumps over the lazy dog"
    fake.script(Reply(content=text, stream_pieces=5))
    chunks = list(
        client.chat.completions.create(
            model="m", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
    )
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1
    assert usage_chunks[0].choices == [] and chunks[-1] is usage_chunks[0]
    assert usage_chunks[0].usage is not None and usage_chunks[0].usage.completion_tokens >= 1
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    pieces = [d.content for d in deltas if d.content]
    assert len(pieces) == 5 and "".join(pieces) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert all(c.object == "chat.completion.chunk" and c.model == "m" for c in chunks)


def test_stream_without_include_usage_has_no_usage_chunk(url: str, fake: FakeUpstream) -> None:
    r = httpx.post(url + "/chat/completions", json={"model": "m", "messages": [], "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    payloads = [orjson.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(p["choices"] and "usage" not in p for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == "stop"


def _expected_calls() -> list[tuple[str, str, dict[str, Any]]]:
    return [
        ("read_file", "call_a", {"path": "a.py", "lines": [1, 2]}),
        ("grep", "", {"pattern": "x"}),
    ]


def test_parallel_tool_calls_non_stream(client: openai.OpenAI, fake: FakeUpstream) -> None:
    fake.script(TOOLS_REPLY)
    resp = client.chat.completions.create(model="m", messages=MESSAGES)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 2
    got = [(c.function.name, orjson.loads(c.function.arguments)) for c in calls]  # type: ignore[union-attr]
    assert got == [(n, a) for n, _, a in _expected_calls()]
    assert calls[0].id == "call_a" and calls[1].id and calls[1].id != "call_a"
    assert all(c.type == "function" for c in calls)
    assert calls[1].function.arguments == '{"pattern": "x"}'  # type: ignore[union-attr]  # str args verbatim


async def test_parallel_tool_calls_stream(aclient: openai.AsyncOpenAI, fake: FakeUpstream) -> None:
    fake.script(TOOLS_REPLY)
    stream = await aclient.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    acc: dict[int, dict[str, str]] = {}
    finish = []
    fragments = 0
    async for chunk in stream:
        choice = chunk.choices[0]
        finish.append(choice.finish_reason)
        for tc in choice.delta.tool_calls or []:
            slot = acc.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            if tc.id:
                assert slot["id"] == "", "id sent once, in the first delta of a call"
                slot["id"] = tc.id
                assert tc.type == "function"
            if tc.function and tc.function.name:
                slot["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                slot["arguments"] += tc.function.arguments
                fragments += 1
    assert sorted(acc) == [0, 1]
    got = [(acc[i]["name"], orjson.loads(acc[i]["arguments"])) for i in (0, 1)]
    assert got == [(n, a) for n, _, a in _expected_calls()]
    assert acc[0]["id"] == "call_a" and acc[1]["id"]
    assert fragments > 2  # arguments really arrive in pieces
    assert finish[-1] == "tool_calls"


@pytest.mark.parametrize(
    ("reply", "exc_type", "status"),
    [
        (Reply.error(429, "slow down", headers={"Retry-After": "7"}), openai.RateLimitError, 429),
        (
            Reply.error(400, "too long", code="context_length_exceeded", param="messages"),
            openai.BadRequestError,
            400,
        ),
        (Reply(status=401), openai.AuthenticationError, 401),
        (Reply(status=503), openai.InternalServerError, 503),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_error_on_demand(
    client: openai.OpenAI,
    fake: FakeUpstream,
    reply: Reply,
    exc_type: type[openai.APIStatusError],
    status: int,
    stream: bool,
) -> None:
    fake.script(reply)
    with pytest.raises(exc_type) as info:
        client.chat.completions.create(model="m", messages=MESSAGES, stream=stream)
    err = info.value
    assert err.status_code == status
    assert isinstance(err.body, dict) and set(err.body) >= {"message", "type", "code", "param"}
    if status == 429:
        assert err.response.headers["retry-after"] == "7"
        assert err.body["code"] == "rate_limit_exceeded" and err.body["message"] == "slow down"
    if status == 400:
        assert err.code == "context_length_exceeded" and err.param == "messages"


def test_raw_body_and_bad_json(url: str, fake: FakeUpstream) -> None:
    fake.script(
        Reply(body=b"<html>bad gateway</html>", status=502, headers={"content-type": "text/html"}),
        Reply(body=b'{"choices": [', status=200),
        Reply(body=b"data: {not json\n\n", status=200),
    )
    r1 = httpx.post(url + "/v1/chat/completions", json={"model": "m"})
    assert (r1.status_code, r1.content, r1.headers["content-type"]) == (
        502,
        b"<html>bad gateway</html>",
        "text/html",
    )
    r2 = httpx.post(url + "/v1/chat/completions", json={"model": "m"})
    assert (r2.status_code, r2.content) == (200, b'{"choices": [')
    r3 = httpx.post(url + "/v1/chat/completions", json={"model": "m", "stream": True})
    assert r3.headers["content-type"].startswith("text/event-stream")
    assert r3.content == b"data: {not json\n\n"
    r4 = httpx.post(url + "/v1/chat/completions", content=b"{nope")
    assert r4.status_code == 400
    assert r4.json()["error"]["type"] == "invalid_request_error"
    assert fake.pending == 0 and len(fake.completed) == 4


def test_break_after_events_stream(client: openai.OpenAI, url: str, fake: FakeUpstream) -> None:
    fake.script(Reply(content="one two three four", break_after_events=3))
    got: list[Any] = []
    with pytest.raises(openai.APIConnectionError):
        got.extend(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))
    assert len(got) == 3  # exactly N events made it through before the drop
    # And at the raw HTTP level: an incomplete chunked body, not a clean EOF.
    fake.script(Reply(content="abc", break_after_events=1))
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream("POST", url + "/v1/chat/completions", json={"stream": True}) as r,
    ):
        assert r.status_code == 200
        r.read()
    assert len(fake.aborted) == 2 and fake.completed == [] and fake.cancelled == []


def test_break_non_stream(client: openai.OpenAI, fake: FakeUpstream) -> None:
    fake.script(Reply(content="x" * 1000, break_after_events=0))
    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(model="m", messages=MESSAGES)
    assert fake.aborted_count == 1


async def test_break_seen_by_aiohttp(url: str, fake: FakeUpstream) -> None:
    fake.script(Reply(content="abcdef", break_after_events=2))
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/chat/completions", json={"stream": True}) as r,
    ):
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.read()


def test_delay_and_client_timeout(url: str, fake: FakeUpstream) -> None:
    fake.script(Reply(content="late", delay_s=3))
    c = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0, timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(openai.APITimeoutError):
        c.chat.completions.create(model="m", messages=MESSAGES)
    assert time.monotonic() - t0 < 1.5
    c.close()
    # The timed-out client dropped the connection, which the fake notices mid-sleep.
    assert fake.wait_for(lambda f: len(f.cancelled) == 1, timeout=2)
    assert fake.completed == []
    # A short delay is honoured, not skipped.
    fake.script(Reply(content="soon", delay_s=0.2))
    t0 = time.monotonic()
    assert (
        httpx.post(url + "/v1/chat/completions", json={}).json()["choices"][0]["message"]["content"]
        == "soon"
    )
    assert time.monotonic() - t0 >= 0.2


async def test_cancel_recorded_mid_wait(url: str, fake: FakeUpstream) -> None:
    fake.script(Reply(delay_s=5))
    async with aiohttp.ClientSession() as s:

        async def call() -> None:
            async with s.post(url + "/v1/chat/completions", json={"model": "m"}) as r:
                await r.read()

        task = asyncio.create_task(call())
        assert await fake.wait_for_async(lambda f: len(f.received) == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await fake.wait_for_async(lambda f: len(f.cancelled) == 1, timeout=2)
    assert fake.cancelled[0] is fake.received[0] and fake.completed == []


async def test_cancel_recorded_mid_stream(url: str, fake: FakeUpstream) -> None:
    fake.script(Reply(content="a b c d e f g h", stream_pieces=8, chunk_delay_s=0.1))
    async with aiohttp.ClientSession() as s:
        r = await s.post(url + "/v1/chat/completions", json={"stream": True})
        first = await r.content.readuntil(b"\n\n")
        assert first.startswith(b"data: ")
        r.close()  # abort the connection mid-stream
        assert await fake.wait_for_async(lambda f: len(f.cancelled) == 1, timeout=2)
    assert fake.completed == [] and fake.aborted == []


def test_slow_drip(url: str, fake: FakeUpstream) -> None:
    fake.script(Reply(content="abcd", stream_pieces=4, chunk_delay_s=0.05))
    arrivals = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={"stream": True}) as r:
        for _ in r.iter_bytes():
            arrivals.append(time.monotonic())
    # role + 4 pieces + finish + [DONE] = 7 events, 6 gaps of 50 ms.
    assert arrivals[-1] - arrivals[0] >= 0.2


def test_records_exact_body_query_and_headers(url: str, fake: FakeUpstream) -> None:
    raw = b'{"model":  "m",\n "messages": [], "x": "\xc3\xa9"}'
    headers = [("Content-Type", "application/json"), ("X-Dup", "a"), ("X-Dup", "b")]
    r = httpx.post(url + "/v1/chat/completions?api-version=1&b=2", content=raw, headers=headers)
    assert r.status_code == 200
    rec = fake.received[-1]
    assert rec.body == raw
    assert rec.json()["x"] == "é"
    assert rec.query == "api-version=1&b=2"
    assert rec.headers["x-dup"] == "a, b"
    assert [v for k, v in rec.raw_headers if k == "x-dup"] == ["a", "b"]
    assert rec.headers["content-length"] == str(len(raw))


def test_echo_other_routes(url: str, fake: FakeUpstream) -> None:
    r = httpx.put(url + "/v1/files/abc?purpose=x", content=b"12345", headers={"X-Trace": "t1"})
    assert r.status_code == 200
    echo = r.json()
    assert echo["method"] == "PUT" and echo["path"] == "/v1/files/abc"
    assert echo["query"] == "purpose=x" and echo["body_len"] == 5
    assert echo["headers"]["x-trace"] == "t1"
    assert fake.received[-1].body == b"12345" and fake.completed_count == 1
    # GET on the chat path is not a chat request either.
    assert httpx.get(url + "/v1/chat/completions").json()["method"] == "GET"
    assert fake.pending == 0 and fake.received[-1].reply is None


def test_models_and_embeddings(client: openai.OpenAI, url: str, fake: FakeUpstream) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids == ["fake-model", "other-model"]
    assert client.models.retrieve("other-model").owned_by == "fake"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    e1 = client.embeddings.create(model="emb", input=["a", "b"], encoding_format="float")
    e2 = client.embeddings.create(model="emb", input="a", encoding_format="float")
    assert [d.index for d in e1.data] == [0, 1]
    assert len(e1.data[0].embedding) == 8
    assert e1.data[0].embedding == e2.data[0].embedding != e1.data[1].embedding
    r = httpx.post(
        url + "/v1/embeddings", json={"input": "a", "encoding_format": "base64", "dimensions": 4}
    )
    vec = struct.unpack("<4f", base64.b64decode(r.json()["data"][0]["embedding"]))
    assert vec == pytest.approx(e2.data[0].embedding[:4], abs=1e-6)


def test_responder_and_queue_precedence(client: openai.OpenAI, fake: FakeUpstream) -> None:
    def responder(body: dict[str, Any]) -> Reply | None:
        system = " ".join(m["content"] for m in body["messages"] if m["role"] == "system")
        return Reply(content="SUMMARY") if "summar" in system.lower() else None

    fake.responder = responder
    fake.default = Reply(content="model says hi")
    summarize: list[Any] = [{"role": "system", "content": "Summarize the conversation."}, *MESSAGES]
    fake.script("scripted")

    def ask(messages: list[Any]) -> str | None:
        return (
            client.chat.completions.create(model="m", messages=messages).choices[0].message.content
        )

    assert ask(summarize) == "scripted"  # queue wins over responder
    assert ask(summarize) == "SUMMARY"
    assert ask(MESSAGES) == "model says hi"  # responder returned None -> default
    fake.reset()
    assert fake.responder is None and ask(MESSAGES) == "ok" and len(fake.received) == 1


def test_wait_for_times_out(fake: FakeUpstream) -> None:
    t0 = time.monotonic()
    assert fake.wait_for(lambda f: len(f.cancelled) == 1, timeout=0.05) is False
    assert 0.05 <= time.monotonic() - t0 < 1


def test_error_body_envelope() -> None:
    env = orjson.loads(error_body(500))["error"]
    assert env == {
        "message": "Fake upstream error (HTTP 500)",
        "type": "server_error",
        "param": None,
        "code": None,
    }


@settings(
    max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(content=st.text(max_size=60), pieces=st.integers(1, 10))
def test_stream_reassembles_any_text(
    url: str, fake: FakeUpstream, content: str, pieces: int
) -> None:
    fake.script(Reply(content=content, stream_pieces=pieces))
    r = httpx.post(url + "/v1/chat/completions", json={"stream": True})
    deltas = [
        orjson.loads(e.removeprefix("data: "))["choices"][0]["delta"]
        for e in r.text.split("\n\n")
        if e and e != "data: [DONE]"
    ]
    texts = [d["content"] for d in deltas[1:] if d.get("content")]
    assert "".join(texts) == content and len(texts) <= pieces


# --- server helpers --------------------------------------------------------------------


def test_server_thread_port_known_and_stops() -> None:
    fake = FakeUpstream()
    srv = serve_in_thread(fake)
    with srv:
        assert srv.port != 0 and srv.url == f"http://127.0.0.1:{srv.port}"
        assert httpx.get(srv.url + "/v1/models").status_code == 200
    assert not srv.running
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/v1/models")


def test_server_thread_stops_with_hanging_request() -> None:
    fake = FakeUpstream(default=Reply(delay_s=30), strict=False)  # a bare {} body, to hang
    outcome: list[object] = []

    def call(url: str) -> None:
        try:
            outcome.append(
                httpx.post(url + "/v1/chat/completions", json={}, timeout=10).status_code
            )
        except httpx.HTTPError as exc:
            outcome.append(exc)

    srv = serve_in_thread(fake, graceful_timeout=0).start()
    caller = threading.Thread(target=call, args=(srv.url,))
    caller.start()
    assert fake.wait_for(lambda f: len(f.received) == 1)
    t0 = time.monotonic()
    srv.stop()  # must not wait out the 30 s delay
    assert time.monotonic() - t0 < 3
    assert not srv.running
    caller.join(5)
    # uvicorn cancels the hung task and answers 500 (or drops the connection).
    assert outcome and outcome[0] != 200


def test_server_thread_startup_failure() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.failed", "message": "boom"})

    with pytest.raises(RuntimeError, match="failed to start"), serve_in_thread(app, lifespan="on"):
        pass


async def test_serve_async_same_loop() -> None:
    fake = FakeUpstream(strict=False)  # the server helper, with a bare body
    fake.script(Reply(content="async hi", delay_s=0.05))
    async with serve_async(fake) as srv:
        assert srv.port != 0
        async with (
            aiohttp.ClientSession() as s,
            s.post(srv.url + "/v1/chat/completions", json={"model": "m"}) as r,
        ):
            body = await r.json()
        assert body["choices"][0]["message"]["content"] == "async hi"
        assert await fake.wait_for_async(lambda f: f.completed_count == 1)


def test_cli_subprocess() -> None:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proxy.demo.fake.upstream",
            "--port",
            "0",
            "--content",
            "from cli",
            "--no-strict",  # a bare body: the flag lets it through
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("READY http://127.0.0.1:")
        base = line.split()[1]
        r = httpx.post(base + "/v1/chat/completions", json={"model": "m"}, timeout=5)
        assert r.json()["choices"][0]["message"]["content"] == "from cli"
    finally:
        proc.terminate()
        proc.wait(timeout=5)
