"""Upstream faults on every forwarding route, through httpx and the real openai SDK.

Routes: chat (non-stream and stream), chat through the read-tool loop (a request carrying an
offload notice; non-stream and stream), ``GET /v1/models`` (passed through: no ``model_list``)
and ``POST /v1/embeddings`` (raw pass-through). Faults: connection refused, 429 with
``Retry-After``, a reset (RST) in the middle of a non-streaming body or of an SSE stream, a
first byte that never comes, a body that stalls half-way.

The upstream here is a raw socket server, so a fault hits every route alike and the test sees
what the proxy does with the connection afterwards. For each fault: a clean error for the client
(the envelope while no response was started, else a stream that ends with an error event), the
proxy's connections to the client and to the upstream closed, no task left running on the
proxy's loop, and the client's messages archived although the upstream failed.

(tests/test_faults.py and tests/test_failures.py cover the chat route against the fake upstream:
passing through 4xx/5xx, stalls between stream chunks, disconnects.)
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

import httpx
import openai
import orjson
import pytest

from proxy.app import create_app
from proxy.config import config_from_mapping
from proxy.testing.servers import ServerThread, serve_in_thread

from .conftest import closed_port

Mode = Literal["429", "reset_body", "reset_stream", "stall_first_byte", "stall_body", "big_reset",
               "read_call", "canned"]
TIMEOUT_S = 0.25  # the proxy's upstream.timeout_s
ROUTES = ["chat", "chat_stream", "read_loop", "read_loop_stream", "models", "embeddings"]
CHAT_ROUTES = {"chat", "chat_stream", "read_loop", "read_loop_stream"}
STREAM_ROUTES = {"chat_stream", "read_loop_stream"}
ENVELOPE_KEYS = {"message", "type", "param", "code"}
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


# --- the raw upstream ---------------------------------------------------------------------------


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


# --- the proxies --------------------------------------------------------------------------------


@dataclass
class Rig:
    srv: ServerThread
    data: Path
    upstream: FaultServer | None

    @property
    def url(self) -> str:
        return self.srv.url


def _proxy(base_url: str, data: Path) -> ServerThread:
    config = config_from_mapping({
        "upstream": {"base_url": base_url, "timeout_s": TIMEOUT_S, "connect_timeout_s": 2},
        "storage": {"data_dir": str(data)},
    })
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


# --- requests -----------------------------------------------------------------------------------


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
    return client.post(base + "/v1/chat/completions", content=orjson.dumps(chat_body(route, marker)),
                       headers=headers)


def assert_envelope(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text[:300]
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == ENVELOPE_KEYS and err["code"] == code and err["message"]


def sse_events(raw: bytes) -> list[Any]:
    return [orjson.loads(e[6:]) if e != b"data: [DONE]" else "[DONE]"
            for e in raw.strip().split(b"\n\n") if e.startswith(b"data: ")]


# --- what must hold after every fault -------------------------------------------------------------


def _on_loop(srv: ServerThread, make: Callable[[], Any]) -> Any:
    assert srv.loop is not None

    async def call() -> Any:
        return make()

    return asyncio.run_coroutine_threadsafe(call(), srv.loop).result(5)


def tasks(srv: ServerThread) -> set[asyncio.Task[Any]]:
    """The tasks running on the proxy's loop (this probe's own excepted)."""
    return _on_loop(srv, lambda: {  # type: ignore[no-any-return]
        t for t in asyncio.all_tasks() if not t.done() and t is not asyncio.current_task()})


def leaked(srv: ServerThread, before: set[asyncio.Task[Any]]) -> list[str]:
    return [repr(t.get_coro()) for t in tasks(srv) - before]


def eventually(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def archived(data: Path, marker: str) -> bool:
    for path in data.glob("*/*/dialog/*.jsonl"):
        for line in path.read_bytes().splitlines():
            with contextlib.suppress(orjson.JSONDecodeError):
                content = orjson.loads(line).get("message", {}).get("content")
                if isinstance(content, str) and marker in content:
                    return True
    return False


@contextlib.contextmanager
def settled(rig: Rig, route: str, marker: str) -> Iterator[None]:
    """Around one faulty exchange: afterwards no new task is left running on the proxy's loop,
    the proxy holds no connection from the client nor to the upstream, and a chat request's
    messages are in the archive."""
    before = tasks(rig.srv)
    first_conn = len(rig.upstream.conns) if rig.upstream is not None else 0
    started = time.monotonic()
    yield
    assert time.monotonic() - started < 5 * TIMEOUT_S + 3, "the fault took too long to surface"
    assert eventually(lambda: not leaked(rig.srv, before)), leaked(rig.srv, before)
    server = rig.srv.server
    assert server is not None
    assert eventually(lambda: not server.server_state.connections)
    if rig.upstream is not None:
        conns = rig.upstream.conns[first_conn:]
        assert conns, "the request never reached the upstream"
        assert all(c.peer_closed.wait(5) for c in conns), "the proxy kept an upstream connection"
    if route in CHAT_ROUTES:
        assert eventually(lambda: archived(rig.data, marker)), "the client's messages were not kept"


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


# --- the faults ---------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
def test_connection_refused_is_a_502_envelope(refused: Rig, route: str) -> None:
    r = fault(refused, route)
    assert_envelope(r, 502, "upstream_unavailable")
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
    assert_envelope(r, 502, "upstream_unavailable")
    assert "broke off" in r.json()["error"]["message"]


@pytest.mark.parametrize("route", ROUTES)
def test_reset_mid_stream_ends_the_stream_cleanly(faulty: Rig, route: str) -> None:
    """An SSE answer reset after two events: the client already has a 200, so its stream gets
    the events that came, then an error event, and ends (no torn chunked body, no [DONE])."""
    r = fault(faulty, route, "reset_stream")
    if route == "read_loop":  # the loop reads the whole answer before it answers
        assert_envelope(r, 502, "upstream_unavailable")
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
        assert TIMEOUT_S * 0.9 < time.monotonic() - t0 < TIMEOUT_S + 2
    assert_envelope(r, 504, "upstream_timeout")


@pytest.mark.parametrize("route", ROUTES)
def test_body_stalling_half_way_is_a_504(faulty: Rig, route: str) -> None:
    r = fault(faulty, route, "stall_body")
    assert_envelope(r, 504, "upstream_timeout")


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
