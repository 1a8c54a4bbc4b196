"""ASGI plumbing of the proxy's own side: bounded body reads, disconnect watching, whole
responses, per-request timings. ASGI types are Starlette's (:mod:`starlette.types`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.types import Receive, Scope, Send

from proxy.errors import (
    ClientDisconnected,
    PayloadTooLarge,
    ProxyError,
    RequestTimeout,
    UpgradeRequired,
)
from proxy.server.encoding import decode_body, encodings

__all__ = [
    "JSON_CT",
    "Headers",
    "Timing",
    "read_body",
    "refuse_websocket",
    "run_until_disconnect",
    "run_watching",
    "send_error",
    "send_whole",
    "timing_of",
]

Headers = list[tuple[bytes, bytes]]
T = TypeVar("T")

JSON_CT = (b"content-type", b"application/json")
# Compressed bodies up to this size are decoded on the event loop (well under a millisecond).
_DECODE_ON_LOOP = 64 * 1024


async def read_body(scope: Scope, receive: Receive, limit: int, *,
                    idle_s: float | None = None) -> bytes:
    """Read the whole request body, refusing early once it passes ``limit`` bytes, and decode
    its ``Content-Encoding`` (:mod:`proxy.server.encoding`). ``idle_s``: the longest wait for the
    next part of the body (a 408 after it: a client that stalls holds a connection and a
    buffer)."""
    codings: list[str] = []
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                declared = 0
            if declared > limit:
                raise PayloadTooLarge(f"request body of {declared} bytes exceeds {limit} bytes")
        elif name == b"content-encoding":
            codings += encodings(value)
    chunks: list[bytes] = []
    size = 0
    while True:
        try:
            async with asyncio.timeout(idle_s):
                message = await receive()
        except TimeoutError:
            raise RequestTimeout(f"no part of the request body came for {idle_s:g} s") from None
        if message["type"] == "http.disconnect":
            raise ClientDisconnected("client disconnected while sending the body")
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body exceeds {limit} bytes")
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    if not codings:
        return body
    if len(body) > _DECODE_ON_LOOP:  # megabytes out of it: a worker thread's work
        return await asyncio.to_thread(decode_body, body, codings, limit)
    return decode_body(body, codings, limit)


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(receive: Receive, work: Awaitable[None]) -> bool:
    """Run `work`; cancel it if the client goes away first. True when it was cancelled.

    The request body has been read already, so the next `receive()` only ever yields the
    disconnect; watching it is what lets a non-streaming call be cancelled too. The work runs
    in the caller's task (one extra task per request, not two: this is the hot path).
    """
    current = asyncio.current_task()
    assert current is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        await _wait_disconnect(receive)
        gone = True
        current.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        await work
    except asyncio.CancelledError:
        if not gone:
            raise
        current.uncancel()
        return True
    finally:
        watcher.cancel()
    return False


async def run_watching(receive: Receive, work: Awaitable[T], on_gone: Callable[[], None]) -> T:
    """Await ``work``, calling ``on_gone`` if the client disconnects meanwhile (the body has
    been read: the next ``receive()`` only ever yields the disconnect). ``work`` is not
    cancelled: it is told (``on_gone`` sets its flag) and stops at its next check, so an
    effect it is carrying out (an original being written) is finished, not torn."""
    async def watch() -> None:
        await _wait_disconnect(receive)
        on_gone()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    finally:
        watcher.cancel()


class Timing:
    """Per-request figures the access log reads from `scope['state']`."""

    __slots__ = ("pipeline_ms", "started", "upstream_ms")

    def __init__(self) -> None:
        self.upstream_ms: float | None = None
        self.pipeline_ms: float | None = None
        self.started = time.perf_counter()

    def mark(self) -> None:
        """The upstream answered (headers arrived): time since the call was made."""
        self.upstream_ms = (time.perf_counter() - self.started) * 1000

    def restart(self) -> None:
        self.started = time.perf_counter()


def timing_of(scope: Scope) -> Timing:
    state = scope.setdefault("state", {})
    timing = state.get("ctxproxy_timing")
    if timing is None:
        timing = state["ctxproxy_timing"] = Timing()
    return timing  # type: ignore[no-any-return]


async def send_whole(send: Send, status: int, headers: Headers, body: bytes) -> None:
    """A complete response in two ASGI messages, with its content-length."""
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(
    send: Send, exc: ProxyError, extra: Headers | None = None, *, anthropic: bool = False
) -> None:
    """The error's envelope: OpenAI's, or Anthropic's for the clients of ``/v1/messages``."""
    body = exc.anthropic_body() if anthropic else exc.body()
    await send_whole(send, exc.status, [JSON_CT, *(extra or [])], body)


async def refuse_websocket(scope: Scope, receive: Receive, send: Send) -> None:
    """Answer a WebSocket upgrade with a plain 426 envelope before accepting it.

    Codex tries a WebSocket on ``/v1/responses`` first; a 426 makes it use HTTPS at once, while
    the 403 a server gives a refused handshake makes it retry five times with backoff first.
    Without the ASGI extension for an HTTP answer the handshake is closed (a 403 on the wire).
    """
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    exc = UpgradeRequired(f"WebSocket is not supported on {scope.get('path', '')}; use HTTPS")
    if "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": 1008, "reason": exc.message[:120]})
        return
    body = exc.body()
    await send({"type": "websocket.http.response.start", "status": exc.status,
                "headers": [JSON_CT, (b"content-length", str(len(body)).encode())]})
    await send({"type": "websocket.http.response.body", "body": body})
