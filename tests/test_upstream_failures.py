"""Failures: what the client gets when a request is bad or the upstream fails, that nothing
hangs or is left running, and that the client's messages are kept anyway.

* The proxy's own refusals (400, 413) and upstream answers and errors against the fake: the
  proxy in process. Every proxy-made error is OpenAI's envelope; upstream errors pass through
  byte for byte.
* On the wire (a real server): a client that walks away cancels the upstream call, a stream
  that breaks ends the client's stream cleanly, no task is left behind.
* Faults of a raw socket upstream on every forwarding route, through httpx and the openai SDK:
  chat (non-stream and stream), chat through the read-tool loop (a request carrying an offload
  notice; non-stream and stream), ``GET /v1/models`` (passed through: no ``model_list``) and
  ``POST /v1/embeddings`` (raw pass-through). Faults: connection refused, 429 with
  ``Retry-After``, a reset (RST) in the middle of a non-streaming body or of an SSE stream, a
  first byte that never comes, a body that stalls half-way. For each: a clean error for the
  client (the envelope while no response was started, else a stream that ends with an error
  event), the proxy's connections to the client and to the upstream closed, no task left
  running on the proxy's loop, and the client's messages archived although the upstream failed.
* A POST is never sent twice: an upstream that read the whole request and then dropped the
  connection may be generating (and billing) the answer, so the client gets a 502, not a retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp
import httpx
import openai
import orjson
import pytest

from harness.inprocess import InProcess
from proxy.app import create_app
from proxy.demo.fake.upstream import FakeUpstream, Reply, error_body
from proxy.demo.servers import ServerThread, serve_in_thread
from proxy.store.dialog import read
from proxy.truncation.notice import parse_notice

from .conftest import (
    InProcessFactory,
    ProxyFactory,
    assert_envelope,
    closed_port,
    proxy_config,
)
from .test_compaction import SYSTEM, Script, archived_lines, history, is_summarizer, model_calls
from .test_retrieval import big_output as read_output
from .test_retrieval import history as read_history

CHAT = "/v1/chat/completions"
GOOD = orjson.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
STREAM = orjson.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]})


def archived_messages(data: Path) -> list[dict[str, Any]]:
    return [rec["message"] for rec in archived_lines(data)]


# --- the proxy's own refusals (in process) ---------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{not json", None),
        (b"", None),
        (b"[1, 2]", None),
        (b'"just a string"', None),
        (b'{"messages": []}', "model"),
        (b'{"model": 5, "messages": []}', "model"),
        (b'{"model": "gpt-4o"}', "messages"),
        (b'{"model": "gpt-4o", "messages": {"role": "user"}}', "messages"),
        (b'{"model": "gpt-4o", "messages": [], "x": "\xff\xfe"}', None),
    ],
)
async def test_bad_requests_get_400(
    inproc: InProcess, fake: FakeUpstream, body: bytes, param: str | None
) -> None:
    r = await inproc.client.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert_envelope(r, 400, param)
    assert fake.received == []  # nothing reached the upstream


async def test_body_over_limit_gets_413(make_inproc: InProcessFactory, fake: FakeUpstream) -> None:
    app = await make_inproc({"server": {"max_body_mb": 0.01}})
    big = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 20000}]})
    assert_envelope(await app.client.post(CHAT, content=big), 413)

    async def chunked() -> Any:
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    # Without a content-length the limit is enforced while reading.
    assert_envelope(await app.client.post(CHAT, content=chunked()), 413)
    assert fake.received == []
    assert (await app.client.post(CHAT, content=GOOD)).status_code == 200


async def test_proxy_survives_failures(inproc: InProcess, fake: FakeUpstream) -> None:
    for _ in range(3):
        await inproc.client.post(CHAT, content=b"{bad")
    r = await inproc.client.post(CHAT, content=GOOD)
    assert r.json()["choices"][0]["message"]["content"] == "ok"


# --- upstream answers and errors (in process) --------------------------------------------------


async def test_upstream_unreachable_gets_502(make_inproc: InProcessFactory) -> None:
    app = await make_inproc({"upstream": {"base_url": f"http://127.0.0.1:{closed_port()}/v1"}})
    err = assert_envelope(await app.client.post(CHAT, content=GOOD), 502)
    assert err["code"] == "upstream_unavailable"
    assert_envelope(await app.client.get("/v1/models"), 502)


async def test_upstream_timeout_gets_504(make_inproc: InProcessFactory, fake: FakeUpstream) -> None:
    app = await make_inproc({"upstream": {"timeout_s": 0.3}})
    fake.script(Reply(delay_s=2))
    err = assert_envelope(await app.client.post(CHAT, content=GOOD), 504)
    assert err["code"] == "upstream_timeout"


@pytest.mark.parametrize("status", [400, 401, 404, 429, 500, 503])
async def test_upstream_errors_pass_through_unchanged(
    inproc: InProcess, fake: FakeUpstream, status: int
) -> None:
    body = error_body(status, f"upstream says {status}")
    fake.script(Reply(status=status, body=body, headers={"retry-after": "3"}))
    r = await inproc.client.post(CHAT, content=GOOD)
    assert r.status_code == status
    assert r.content == body
    assert r.headers["retry-after"] == "3"


async def test_non_json_upstream_body_passes_through(inproc: InProcess, fake: FakeUpstream) -> None:
    fake.script(Reply(status=502, body=b"<html>bad gateway</html>", headers={"content-type": "text/html"}))
    r = await inproc.client.post(CHAT, content=GOOD)
    assert r.status_code == 502 and r.content == b"<html>bad gateway</html>"


async def test_upstream_body_breaking_mid_way_gets_502(inproc: InProcess, fake: FakeUpstream) -> None:
    fake.script(Reply(content="x" * 5000, break_after_events=1))
    err = assert_envelope(await inproc.client.post(CHAT, content=GOOD), 502)
    assert "broke" in str(err["message"])


@pytest.mark.parametrize(
    "reply, status",
    [
        (Reply.error(429, "slow down", headers={"retry-after": "7"}), 429),
        (Reply.error(500, "boom"), 500),
        (Reply.error(503, "overloaded"), 503),
        (Reply(status=200, body=b'{"choices": [', headers={"content-type": "application/json"}), 200),
        (Reply(status=200, body=b"<html>not json</html>", headers={"content-type": "text/html"}), 200),
    ],
)
async def test_upstream_answers_pass_through_and_dialog_is_kept(
    inproc: InProcess, fake: FakeUpstream, data_dir: Path, reply: Reply, status: int
) -> None:
    fake.script(reply)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello there"}]
    r = await inproc.client.post(CHAT, content=orjson.dumps({"model": "gpt-4o", "messages": msgs}))
    assert r.status_code == status
    assert r.content == (reply.body if reply.body is not None else r.content)
    if status == 429:
        assert r.headers["retry-after"] == "7"
    await inproc.drain()
    assert archived_messages(data_dir)[:2] == msgs


async def test_slow_drip_stream_within_timeout_arrives_whole(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    """upstream.timeout_s bounds each wait for the next chunk, not the whole stream (9 events,
    0.2 s apart: 1.6 s in all)."""
    app = await make_inproc({"upstream": {"timeout_s": 1.0}})
    fake.script(Reply(content="one two three four five six", stream_pieces=6, chunk_delay_s=0.2))
    raw = (await app.client.post(CHAT, content=STREAM)).content
    text = "".join(
        (orjson.loads(e[6:])["choices"][0]["delta"].get("content") or "")
        for e in raw.split(b"\n\n") if e.startswith(b"data: {") and b'"choices":[{' in e)
    assert text == "one two three four five six" and raw.endswith(b"data: [DONE]\n\n")


async def test_stream_stalling_past_timeout_ends_cleanly(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    app = await make_inproc({"upstream": {"timeout_s": 0.4}})
    fake.script(Reply(content="a b c d", stream_pieces=4, chunk_delay_s=1.5))
    raw = (await app.client.post(CHAT, content=STREAM)).content
    assert b'"code":"upstream_timeout"' in raw.split(b"\n\n")[-2]


async def test_summarizer_timeout_serves_with_fallback(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    script = Script(fake, delay=3.0)
    app = await make_inproc({"compaction": {"context_windows": {"gpt-4o": 4000},
                                            "summarizer_timeout_s": 0.5}})
    r = await app.client.post(CHAT, content=orjson.dumps({"model": "gpt-4o", "messages": history(30)}),
                              headers={"x-session-id": "slow-summary"})
    assert r.status_code == 200
    assert r.headers["x-ctxproxy-compacted"] == "1"
    summary = model_calls(fake)[-1]["messages"][1]["content"]
    assert "## Goal" in summary and "request 0" in summary
    assert script.summaries >= 1 and any(is_summarizer(x.json()) for x in fake.received)


async def test_read_tool_cannot_reach_another_tenants_file(
    inproc: InProcess, fake: FakeUpstream
) -> None:
    # Tenant B offloads a file.
    await inproc.client.post(CHAT, headers={"authorization": "Bearer sk-b"},
                             content=orjson.dumps({"model": "gpt-4o", "messages": read_history(read_output())}))
    theirs = orjson.loads(fake.received[-1].body)["messages"][2]["content"]
    path = parse_notice(theirs).file_path  # type: ignore[union-attr]

    def responder(body: dict[str, Any]) -> Reply:
        if body["messages"][-1]["role"] == "tool":
            return Reply(content="done")
        return Reply(content=None, tool_calls=[{"name": "read_offloaded",
                                                "arguments": {"file_path": path, "start_line": 1}}])

    fake.responder = responder
    # Tenant A (same session name, other key) asks its model to read B's path.
    other = read_history("y\n" * 60000)
    await inproc.client.post(CHAT, headers={"authorization": "Bearer sk-a"},
                             content=orjson.dumps({"model": "gpt-4o", "messages": other}))
    result = fake.received[-1].json()["messages"][-1]["content"]
    assert result.startswith("error:") and "line 1:" not in result


# --- on the wire (a real server) ---------------------------------------------------------------


def unfinished(srv: ServerThread, before: set[asyncio.Task[Any]],
               match: Callable[[str], bool] = lambda _: True, timeout: float = 5.0) -> list[str]:
    """Tasks on the server's loop that are not in ``before`` and whose coroutine's repr
    ``match``es: each awaited (up to ``timeout`` in all); those still running are returned."""
    assert srv.loop is not None

    async def settle() -> list[str]:
        me = asyncio.current_task()
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            new = {t for t in asyncio.all_tasks() if t is not me and not t.done()
                   and t not in before and match(repr(t.get_coro()))}
            left = deadline - asyncio.get_running_loop().time()
            if not new or left <= 0:
                return [repr(t.get_coro()) for t in new]
            await asyncio.wait(new, timeout=left)

    return asyncio.run_coroutine_threadsafe(settle(), srv.loop).result(timeout + 5)


def tasks(srv: ServerThread) -> set[asyncio.Task[Any]]:
    """The tasks running on the server's loop (this probe's own excepted)."""
    assert srv.loop is not None

    async def running() -> set[asyncio.Task[Any]]:
        return {t for t in asyncio.all_tasks() if not t.done() and t is not asyncio.current_task()}

    return asyncio.run_coroutine_threadsafe(running(), srv.loop).result(5)


async def _abandon_mid_stream(url: str, body: bytes) -> None:
    """Read the first piece of a stream, then walk away."""
    async with aiohttp.ClientSession() as s, s.post(url, data=body) as r:
        await r.content.readany()
        r.close()


async def _abandon_once_forwarded(
    url: str, body: bytes, fake: FakeUpstream, headers: dict[str, str] | None = None
) -> None:
    """Post, and walk away as soon as the upstream has the request (the first request of a
    fresh proxy may still be loading its tokenizer, so no fixed delay would do)."""
    async with aiohttp.ClientSession() as s:
        task = asyncio.ensure_future(s.post(url, data=body, headers=headers))
        assert await fake.wait_for_async(lambda f: len(f.received) == 1, timeout=10)
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, aiohttp.ClientError):
            pass


def test_disconnect_cancels_non_streaming_upstream_call(
    module_proxy: ServerThread, fake: FakeUpstream
) -> None:
    fake.script(Reply(delay_s=20))
    asyncio.run(_abandon_once_forwarded(module_proxy.url + CHAT, GOOD, fake))
    assert fake.wait_for(lambda f: len(f.cancelled) == 1, timeout=10)
    assert fake.completed == []


def test_disconnect_cancels_streaming_upstream_call(
    module_proxy: ServerThread, fake: FakeUpstream
) -> None:
    # 20 s of stream, so that even a loaded machine sees the cancel long before it could end.
    fake.script(Reply(content="word " * 200, stream_pieces=200, chunk_delay_s=0.1))
    asyncio.run(_abandon_mid_stream(module_proxy.url + CHAT, STREAM))
    assert fake.wait_for(lambda f: len(f.cancelled) == 1, timeout=10)
    assert fake.completed == []


def test_stream_breaking_mid_way_ends_client_stream_cleanly(
    module_proxy: ServerThread, fake: FakeUpstream
) -> None:
    fake.script(Reply(content="abcdefgh" * 10, break_after_events=2))
    with httpx.stream("POST", module_proxy.url + CHAT, content=STREAM, timeout=10) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_raw())  # a torn chunked body would raise here
    events = [e for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    assert len(events) == 3
    last = orjson.loads(events[-1][len(b"data: ") :])
    assert last["error"]["code"] == "upstream_stream_broken"


def test_many_failures_leave_no_tasks_behind(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    srv = make_proxy({"upstream": {"timeout_s": 0.3}})
    before = tasks(srv)

    async def go() -> list[int]:
        async with httpx.AsyncClient(timeout=10) as c:
            for _ in range(20):
                fake.script(Reply(delay_s=1))
            body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]})
            rs = await asyncio.gather(*(c.post(srv.url + CHAT, content=body) for _ in range(20)))
            return [r.status_code for r in rs]

    assert asyncio.run(go()) == [504] * 20
    names = unfinished(srv, before, lambda r: "ChatCompletions" in r or
                       "run_until_disconnect" in r or "relay" in r)
    assert names == []


# --- faults of a raw upstream, every route --------------------------------------------------------


Mode = Literal["429", "reset_body", "reset_stream", "stall_first_byte", "stall_body", "big_reset",
               "read_call", "canned"]
TIMEOUT_S = 0.5  # the proxy's upstream.timeout_s: generous, so a loaded machine does not look like a stall
ROUTES = ["chat", "chat_stream", "read_loop", "read_loop_stream", "models", "embeddings"]
CHAT_ROUTES = {"chat", "chat_stream", "read_loop", "read_loop_stream"}
STREAM_ROUTES = {"chat_stream", "read_loop_stream"}
RETRY_AFTER = "17"
ERROR_429 = orjson.dumps({"error": {"message": "Rate limit reached for gpt-4o", "type": "requests",
                                    "param": None, "code": "rate_limit_exceeded"}})
COMPLETION = orjson.dumps({
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "gpt-4o",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * 4000},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


def _chunk(event: dict[str, Any]) -> bytes:
    data = b"data: " + orjson.dumps(event) + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def _delta(delta: dict[str, Any], finish: str | None = None) -> bytes:
    return _chunk({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o",
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


READ_CALL = [
    _delta({"tool_calls": [{"index": 0, "id": "r1", "type": "function", "function": {
        "name": "read_offloaded", "arguments": '{"file_path": "dialog/2020-01-01.jsonl"}'}}]}),
    _delta({}, "tool_calls"),
    b"%x\r\n%s\r\n" % (len(b"data: [DONE]\n\n"), b"data: [DONE]\n\n"),
]
SSE_EVENTS = [_chunk({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o",
                      "choices": [{"index": 0, "delta": {"role": "assistant", "content": piece},
                                   "finish_reason": None}]}) for piece in ("Hel", "lo ")]




@dataclass
class Conn:
    """One connection the proxy opened to the upstream."""

    head: bytes = b""
    peer_closed: threading.Event = field(default_factory=threading.Event)


class FaultServer:
    """A loopback HTTP/1.1 server that answers every request with the current ``mode``."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port: int = self.sock.getsockname()[1]
        self.mode: Mode = "429"
        #: modes for the next connections, before ``mode`` applies again
        self.script: deque[Mode] = deque()
        #: what mode ``canned`` answers: content type and body
        self.canned: tuple[bytes, bytes] = (b"application/json", b"{}")
        self.conns: list[Conn] = []
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        self._thread.join(5)
        self.sock.close()

    def _accept(self) -> None:
        while True:
            sock, _ = self.sock.accept()
            if self._stop:
                sock.close()
                return
            conn = Conn()
            self.conns.append(conn)
            mode = self.script.popleft() if self.script else self.mode
            threading.Thread(target=self._serve, args=(sock, conn, mode), daemon=True).start()

    def _serve(self, sock: socket.socket, conn: Conn, mode: Mode) -> None:
        sock.settimeout(10)
        try:
            conn.head = _read_request(sock)
            self._answer(sock, mode)
            if mode in ("reset_body", "reset_stream", "big_reset"):
                # RST instead of FIN: the proxy sees a connection reset mid-body.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.peer_closed.set()
                return
            # Hold the connection until the proxy lets go of it: that it does is under test.
            while sock.recv(65536):
                pass
            conn.peer_closed.set()
        except OSError:
            conn.peer_closed.set()
        finally:
            sock.close()

    def _answer(self, sock: socket.socket, mode: Mode) -> None:
        if mode == "canned":
            kind, body = self.canned
            sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\nconnection: close\r\n"
                         b"content-length: %d\r\n\r\n%s" % (kind, len(body), body))
        elif mode == "read_call":  # a complete stream: the model calls the proxy's read tool
            sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"connection: close\r\ntransfer-encoding: chunked\r\n\r\n"
                         + b"".join([*SSE_EVENTS, *READ_CALL]) + b"0\r\n\r\n")
        elif mode == "429":
            sock.sendall(b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
                         b"retry-after: " + RETRY_AFTER.encode() + b"\r\n"
                         b"x-ratelimit-remaining-requests: 0\r\nconnection: close\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(ERROR_429), ERROR_429))
        elif mode in ("reset_body", "stall_body"):
            sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(COMPLETION), COMPLETION[:1500]))
        elif mode == "big_reset":  # over the proxy's buffering limit: relayed as it comes
            size = 20 * 1024 * 1024
            sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
                         b"content-length: %d\r\n\r\n" % size)
            sock.sendall(b"z" * (1024 * 1024))
            time.sleep(0.05)  # let the proxy relay what came before the reset
        elif mode == "reset_stream":
            sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n" + b"".join(SSE_EVENTS))
            time.sleep(0.05)
        # stall_first_byte: nothing at all


def _read_request(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head




@dataclass
class Rig:
    srv: ServerThread
    data: Path
    upstream: FaultServer | None

    @property
    def url(self) -> str:
        return self.srv.url


def _proxy(base_url: str, data: Path) -> ServerThread:
    config = proxy_config(base_url, data, {"upstream": {"timeout_s": TIMEOUT_S,
                                                        "connect_timeout_s": 2}})
    return serve_in_thread(create_app(config), lifespan="on").start()


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    upstream = FaultServer()
    data = tmp_path_factory.mktemp("faulty") / "data"
    srv = _proxy(upstream.url, data)
    try:
        yield Rig(srv, data, upstream)
    finally:
        srv.stop()
        upstream.close()


@pytest.fixture(scope="module")
def refused(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    data = tmp_path_factory.mktemp("refused") / "data"
    srv = _proxy(f"http://127.0.0.1:{closed_port()}/v1", data)
    try:
        yield Rig(srv, data, None)
    finally:
        srv.stop()


def big_output() -> str:
    return "".join(f"line {i}: " + "x" * 50 + "\n" for i in range(1, 3001))


def chat_body(route: str, marker: str) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"please help {marker}"}]
    if route.startswith("read_loop"):  # an offloaded output: the proxy offers its read tool
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": big_output()},
            {"role": "user", "content": "what failed?"},
        ]
    return {"model": "gpt-4o", "messages": messages, "stream": route in STREAM_ROUTES}


def send(client: httpx.Client, base: str, route: str, marker: str) -> httpx.Response:
    """One request on ``route``; the body is read whole (a torn one raises)."""
    if route == "models":
        return client.get(base + "/v1/models")
    if route == "embeddings":
        return client.post(base + "/v1/embeddings", json={"model": "e", "input": marker})
    headers = {"x-session-id": f"faults-{marker}"}
    return client.post(base + CHAT, content=orjson.dumps(chat_body(route, marker)),
                       headers=headers)


def sse_events(raw: bytes) -> list[Any]:
    return [orjson.loads(e[6:]) if e != b"data: [DONE]" else "[DONE]"
            for e in raw.strip().split(b"\n\n") if e.startswith(b"data: ")]


def let_go(srv: ServerThread, timeout: float = 5.0) -> bool:
    """True once uvicorn holds no connection: it drops one when its loop sees it close, which
    no event announces, so this polls (bounded; it fails only for a connection kept open)."""
    server = srv.server
    assert server is not None
    deadline = time.monotonic() + timeout
    while server.server_state.connections:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def archived(data: Path, marker: str) -> bool:
    return any(isinstance(m.get("content"), str) and marker in m["content"]
               for m in archived_messages(data))


@contextlib.contextmanager
def settled(rig: Rig, route: str, marker: str) -> Iterator[None]:
    """Around one faulty exchange: afterwards no new task is left running on the proxy's loop,
    the proxy holds no connection from the client nor to the upstream, and a chat request's
    messages are in the archive."""
    before = tasks(rig.srv)
    first_conn = len(rig.upstream.conns) if rig.upstream is not None else 0
    yield
    left = unfinished(rig.srv, before)
    assert not left, left
    assert let_go(rig.srv), "the proxy kept the client's connection"
    if rig.upstream is not None:
        conns = rig.upstream.conns[first_conn:]
        assert conns, "the request never reached the upstream"
        assert all(c.peer_closed.wait(5) for c in conns), "the proxy kept an upstream connection"
    if route in CHAT_ROUTES:
        rig.srv.drain()
        assert archived(rig.data, marker), "the client's messages were not kept"


def marker() -> str:
    return "m" + uuid.uuid4().hex[:12]


def fault(rig: Rig, route: str, mode: Mode | None = None) -> httpx.Response:
    """One request on `route` with the upstream in `mode`; `settled` checks what it left."""
    if mode is not None:
        assert rig.upstream is not None
        rig.upstream.mode = mode
    mark = marker()
    with settled(rig, route, mark), httpx.Client(timeout=10) as client:
        return send(client, rig.url, route, mark)


@pytest.mark.parametrize("route", ROUTES)
def test_connection_refused_is_a_502_envelope(refused: Rig, route: str) -> None:
    r = fault(refused, route)
    assert_envelope(r, 502, code="upstream_unavailable")
    assert "unreachable" in r.json()["error"]["message"]


@pytest.mark.parametrize("route", ROUTES)
def test_429_passes_through_with_retry_after(faulty: Rig, route: str) -> None:
    r = fault(faulty, route, "429")
    assert r.status_code == 429 and r.content == ERROR_429
    assert r.headers["retry-after"] == RETRY_AFTER
    assert r.headers["x-ratelimit-remaining-requests"] == "0"


@pytest.mark.parametrize("route", ROUTES)
def test_reset_mid_body_is_a_502_envelope(faulty: Rig, route: str) -> None:
    """Headers and part of a non-streaming body, then a reset: nothing was sent to the client
    yet, so it gets a clean 502 (stream requests too: the upstream answered JSON)."""
    r = fault(faulty, route, "reset_body")
    assert_envelope(r, 502, code="upstream_unavailable")
    assert "broke off" in r.json()["error"]["message"]


@pytest.mark.parametrize("route", ROUTES)
def test_reset_mid_stream_ends_the_stream_cleanly(faulty: Rig, route: str) -> None:
    """An SSE answer reset after two events: the client already has a 200, so its stream gets
    the events that came, then an error event, and ends (no torn chunked body, no [DONE])."""
    r = fault(faulty, route, "reset_stream")
    if route == "read_loop":  # the loop reads the whole answer before it answers
        assert_envelope(r, 502, code="upstream_unavailable")
        return
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.content)
    text = "".join(e["choices"][0]["delta"].get("content") or ""
                   for e in events if isinstance(e, dict) and e.get("choices"))
    assert text == "Hello "
    assert isinstance(events[-1], dict) and events[-1]["error"]["code"] == "upstream_stream_broken"


@pytest.mark.parametrize("route", ROUTES)
def test_no_first_byte_within_the_timeout_is_a_504(faulty: Rig, route: str) -> None:
    assert faulty.upstream is not None
    faulty.upstream.mode = "stall_first_byte"
    mark = marker()
    with settled(faulty, route, mark), httpx.Client(timeout=10) as client:
        t0 = time.monotonic()
        r = send(client, faulty.url, route, mark)
        assert time.monotonic() - t0 > TIMEOUT_S * 0.9  # not before the timeout
    assert_envelope(r, 504, code="upstream_timeout")


@pytest.mark.parametrize("route", ROUTES)
def test_body_stalling_half_way_is_a_504(faulty: Rig, route: str) -> None:
    r = fault(faulty, route, "stall_body")
    assert_envelope(r, 504, code="upstream_timeout")


@pytest.mark.parametrize("route", ["embeddings", "models"])
def test_reset_of_a_relayed_big_body_tears_the_clients_body(faulty: Rig, route: str) -> None:
    """A body too big to buffer is relayed as it comes; a reset then must not look like a
    complete answer: the client's body is torn (its read fails), and nothing hangs."""
    assert faulty.upstream is not None
    faulty.upstream.mode = "big_reset"
    mark = marker()
    with settled(faulty, route, mark), httpx.Client(timeout=10) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            send(client, faulty.url, route, mark)


# --- through the openai SDK ---------------------------------------------------------------------


def sdk(rig: Rig) -> openai.OpenAI:
    return openai.OpenAI(base_url=rig.url + "/v1", api_key="sk-faults", max_retries=0, timeout=10)


def sdk_call(client: openai.OpenAI, route: str, mark: str) -> Any:
    if route == "models":
        return client.models.list()
    if route == "embeddings":
        return client.embeddings.create(model="e", input=mark)
    body = chat_body(route, mark)
    if body["stream"]:
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="gpt-4o", messages=body["messages"], stream=True) if c.choices)
    return client.chat.completions.create(model="gpt-4o", messages=body["messages"])


@pytest.mark.parametrize("route", ROUTES)
def test_sdk_sees_typed_errors_for_every_fault(faulty: Rig, refused: Rig, route: str) -> None:
    """What an agent built on the openai SDK gets: a typed API error with the proxy's code,
    never a hang or a connection error (except for a refused proxy, which is not tested)."""
    assert faulty.upstream is not None
    cases: list[tuple[Rig, Mode | None, type[openai.APIError], str | None]] = [
        (faulty, "429", openai.RateLimitError, "rate_limit_exceeded"),
        (faulty, "reset_body", openai.InternalServerError, "upstream_unavailable"),
    ]
    if route in STREAM_ROUTES:
        cases.append((faulty, "reset_stream", openai.APIError, "upstream_stream_broken"))
    if route.startswith("chat"):  # the same proxy-made errors on every route, checked above
        cases += [(refused, None, openai.InternalServerError, "upstream_unavailable"),
                  (faulty, "stall_first_byte", openai.InternalServerError, "upstream_timeout")]
    for rig, mode, error, code in cases:
        if mode is not None:
            faulty.upstream.mode = mode
        mark = marker()
        with settled(rig, route, mark), sdk(rig) as client, pytest.raises(error) as info:
            sdk_call(client, route, mark)
        assert not isinstance(info.value, openai.APIConnectionError), (mode, info.value)
        body = info.value.body
        got = body.get("code") if isinstance(body, dict) else None
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            got = body["error"].get("code")
        assert got == code, (mode, body)
        if mode == "429":
            assert isinstance(info.value, openai.APIStatusError)
            assert info.value.response.headers["retry-after"] == RETRY_AFTER


# --- the read-tool loop: a later round fails, the model answers nonsense ----------------------------


@pytest.mark.parametrize("fault", ["stall_first_byte", "reset_body", "reset_stream", "429"])
def test_a_later_read_round_failing_ends_the_stream_cleanly(faulty: Rig, fault: Mode) -> None:
    """Round one streams text and a read call (the client has its 200 and the text); round two
    fails: the stream ends with an error event and no [DONE], never a torn body."""
    assert faulty.upstream is not None
    faulty.upstream.script.extend(["read_call", fault])
    mark = marker()
    with settled(faulty, "read_loop_stream", mark), httpx.Client(timeout=10) as client:
        r = send(client, faulty.url, "read_loop_stream", mark)
    assert not faulty.upstream.script
    assert r.status_code == 200
    events = sse_events(r.content)
    assert "".join(e["choices"][0]["delta"].get("content") or ""
                   for e in events if isinstance(e, dict) and e.get("choices")).startswith("Hello ")
    assert not any(isinstance(e, dict) and e.get("choices") and e["choices"][0]["delta"].get(
        "tool_calls") for e in events), "the proxy's own read call reached the client"
    assert isinstance(events[-1], dict) and "error" in events[-1], events[-1]
    code = {"stall_first_byte": "upstream_timeout", "reset_body": "upstream_unavailable",
            "reset_stream": "upstream_stream_broken", "429": "upstream_error"}[fault]
    assert events[-1]["error"]["code"] == code


def _completion(message: Any) -> bytes:
    return orjson.dumps({"id": "x", "object": "chat.completion", "choices": [
        {"index": 0, "message": message, "finish_reason": "stop"}]})


ODD_COMPLETIONS = [
    b"[]", b"null", b'{"choices": "x"}', b'{"choices": [1]}', _completion("text"),
    _completion({"role": "assistant", "tool_calls": 5}),
    _completion({"role": "assistant", "tool_calls": [{"function": "read_offloaded"}]}),
    _completion({"role": "assistant", "tool_calls": [
        {"id": "r", "type": "function", "function": {"name": "read_offloaded",
                                                     "arguments": {"file_path": 1}}}]}),
]
ODD_STREAMS = [
    b'data: {"choices": [{"index": 0, "delta": "text"}]}\n\n',
    b'data: {"choices": [{"index": 0, "delta": {"tool_calls": 5}}]}\n\n',
    b'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": "a"}]}}]}\n\n',
    b'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": [0]}]}}]}\n\n',
    b'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": "x"}]}}]}\n\n',
    b'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": '
    b'{"name": "read_offloaded", "arguments": {"a": 1}}}]}}]}\n\ndata: [DONE]\n\n',
    b'data: {"choices": [1, null, "x"]}\n\ndata: not json\n\n',
]


@pytest.mark.parametrize("body", ODD_COMPLETIONS + ODD_STREAMS)
def test_malformed_answers_in_the_read_loop_never_crash_it(faulty: Rig, body: bytes) -> None:
    """What the loop cannot read passes through as it came; a stream still ends."""
    assert faulty.upstream is not None
    stream = body.startswith(b"data:")
    faulty.upstream.mode = "canned"
    faulty.upstream.canned = (b"text/event-stream" if stream else b"application/json", body)
    route = "read_loop_stream" if stream else "read_loop"
    r = fault(faulty, route)
    assert r.status_code == 200, r.text[:300]
    if not stream:
        assert r.content == body or orjson.loads(r.content)["choices"]
    else:
        assert r.content.endswith(b"data: [DONE]\n\n"), r.content[-300:]


# --- a POST is never sent twice (in process) ---------------------------------------------------

ANSWER = orjson.dumps({"id": "x", "object": "chat.completion", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]})


class DroppingUpstream:
    """Raw HTTP/1.1 on loopback: the first `drops` requests are read whole and then the
    connection is closed without a byte of answer; later requests get a 200."""

    def __init__(self, drops: int) -> None:
        self.drops = drops
        self.requests = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            buf = b""
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(buf) < length:
                    buf += conn.recv(65536)
                buf = buf[length:]
                with self._lock:
                    self.requests += 1
                    drop = self.requests <= self.drops
                if drop:
                    return
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER))

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def up() -> Iterator[DroppingUpstream]:
    """An upstream that drops the first request it reads."""
    upstream = DroppingUpstream(drops=1)
    yield upstream
    upstream.close()


async def test_a_post_the_upstream_received_is_never_retried(
    up: DroppingUpstream, tmp_path: Path
) -> None:
    async with InProcess(create_app(proxy_config(up.url, tmp_path / "data"))) as proxy:
        r = await proxy.client.post(CHAT, json={
            "model": "m", "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 502
    error = r.json()["error"]
    assert error["type"] == "upstream_error" and "not retried" in error["message"]
    assert up.requests == 1  # exactly one receipt: nothing billed twice


async def test_the_next_request_gets_its_answer(up: DroppingUpstream, tmp_path: Path) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    async with InProcess(create_app(proxy_config(up.url, tmp_path / "data"))) as proxy:
        first = await proxy.client.post(CHAT, json=body)
        second = await proxy.client.post(CHAT, json=body)
    assert (first.status_code, second.status_code) == (502, 200)
    assert second.content == ANSWER and up.requests == 2


# --- a stream the upstream breaks off, in each format ---------------------------------------


_BROKEN = {
    "chat": ("/v1/chat/completions", {"model": "m", "stream": True,
                                      "messages": [{"role": "user", "content": "hi"}]}),
    "responses": ("/v1/responses", {"model": "m", "stream": True, "input": "hi"}),
    "messages": ("/v1/messages", {"model": "m", "stream": True, "max_tokens": 64,
                                  "messages": [{"role": "user", "content": "hi"}]}),
}


@pytest.mark.parametrize("fmt", list(_BROKEN))
def test_a_broken_stream_ends_with_the_formats_error_and_is_archived_incomplete(
    make_proxy: ProxyFactory, fake: FakeUpstream, data_dir: Path, fmt: str
) -> None:
    srv = make_proxy()
    path, body = _BROKEN[fmt]
    fake.script(Reply(content="partial answer " * 20, stream_pieces=8, break_after_events=6))
    with httpx.stream("POST", srv.url + path, content=orjson.dumps(body), timeout=10,
                      headers={"x-session-id": f"broken-{fmt}", "x-api-key": "sk-ant-x",
                               "authorization": "Bearer sk-x"}) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_raw())
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    last = events[-1]
    if fmt == "chat":
        assert orjson.loads(last.removeprefix(b"data: "))["error"]["code"] == \
            "upstream_stream_broken"
    else:
        name, data = last.split(b"\n", 1)
        assert name == b"event: error"
        error = orjson.loads(data.removeprefix(b"data: "))
        assert error["type"] == "error"
        if fmt == "responses":  # numbered after the six events relayed, as the API numbers
            assert error["sequence_number"] == 6 and error["code"] == "upstream_stream_broken"
    srv.drain()
    [dialog] = list(data_dir.glob(f"*/broken-{fmt}/dialog/*.jsonl"))
    records = list(read(dialog))
    answers = [r for r in records if r["role"] != "user"]
    assert answers and all(r.get("incomplete") is True for r in answers)  # once, marked
    assert len({r["chain"] for r in answers}) == len(answers)
    assert "partial answer" in str(answers[-1]["message"])
    assert not any(r.get("incomplete") for r in records if r["role"] == "user")
