"""ASGI plumbing for forwarding: bounded body reads, disconnect watching, byte relays."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import aiohttp
import orjson

from .errors import (
    ClientDisconnected,
    PayloadTooLarge,
    ProxyError,
    UpstreamError,
    UpstreamTimeout,
    envelope,
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

log = logging.getLogger("proxy.upstream")

JSON_CT = (b"content-type", b"application/json")


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """Read the whole request body, refusing early once it passes `limit` bytes."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                declared = 0
            if declared > limit:
                raise PayloadTooLarge(f"request body of {declared} bytes exceeds {limit} bytes")
            break
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
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
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


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


def sse_error_event(message: str, code: str) -> bytes:
    return b"data: " + orjson.dumps(envelope(message, "upstream_error", None, code)) + b"\n\n"


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


Tap = Callable[[bytes], None]
BeforeEnd = Callable[[], Awaitable[None]]  # awaited before the last byte of an answer


async def read_whole(resp: aiohttp.ClientResponse) -> bytes:
    """The upstream body; a stall or a break becomes the proxy's 504 / 502."""
    try:
        return await resp.read()
    except TimeoutError:
        raise UpstreamTimeout("upstream stopped sending its answer") from None
    except aiohttp.ClientError as exc:
        raise UpstreamError(f"upstream answer broke off: {type(exc).__name__}") from None


def redact_secret(body: bytes, secret: str | None) -> bytes:
    """`body` with `secret` (the proxy's own upstream key) replaced by ``[redacted]``."""
    if not secret:
        return body
    raw = secret.encode("utf-8", "surrogatepass")
    return body.replace(raw, b"[redacted]") if raw in body else body


async def relay_buffered(
    send: Send, resp: aiohttp.ClientResponse, headers: Headers, tap: Tap | None = None,
    redact: str | None = None, before_end: BeforeEnd | None = None,
) -> None:
    """Read the whole upstream body, then answer: a broken body still gets a clean 502.
    `redact`: a secret to take out of the body first."""
    body = redact_secret(await read_whole(resp), redact)
    if tap is not None:
        tap(body)
    if before_end is not None:
        await before_end()
    await send_whole(send, resp.status, headers, body)


async def send_whole(send: Send, status: int, headers: Headers, body: bytes) -> None:
    """A complete response in two ASGI messages, with its content-length."""
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def relay_stream(
    send: Send,
    resp: aiohttp.ClientResponse,
    headers: Headers,
    *,
    sse: bool,
    tap: Tap | None = None,
    whole: Tap | None = None,
    before_end: BeforeEnd | None = None,
) -> None:
    """Pass the upstream body through chunk by chunk, exactly as it arrives. ``tap`` sees each
    chunk; ``whole`` gets the complete body once it has all arrived (a JSON answer too large to
    buffer before relaying is still archived)."""
    await send({"type": "http.response.start", "status": resp.status, "headers": headers})
    kept: list[bytes] | None = [] if whole is not None else None
    try:
        async for chunk in resp.content.iter_any():
            if tap is not None:
                tap(chunk)
            if kept is not None:
                kept.append(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except (TimeoutError, aiohttp.ClientError) as exc:
        timeout = isinstance(exc, asyncio.TimeoutError)
        log.warning("upstream stream broke off: %s", type(exc).__name__)
        if not sse:
            raise  # the client must see a torn body, not a falsely complete one
        msg = "upstream stream stalled" if timeout else "upstream stream broke off"
        code = "upstream_timeout" if timeout else "upstream_stream_broken"
        await send(
            {"type": "http.response.body", "body": sse_error_event(msg, code), "more_body": True}
        )
    else:
        if whole is not None and kept is not None:
            whole(b"".join(kept))
    if before_end is not None:
        await before_end()
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def send_error(send: Send, exc: ProxyError, extra: Headers | None = None) -> None:
    await send_whole(send, exc.status, [JSON_CT, *(extra or [])], exc.body())
