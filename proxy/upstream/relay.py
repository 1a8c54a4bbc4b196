"""Relaying an upstream answer to the client as bytes: buffered (so a break still gets a clean
502) or chunk by chunk (SSE streams, large bodies), with taps that watch the bytes for the
archive."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import aiohttp
import orjson
from starlette.types import Send

from proxy.errors import UpstreamError, UpstreamTimeout, envelope
from proxy.server.asgi import Headers, send_whole

__all__ = [
    "BeforeEnd",
    "Tap",
    "read_whole",
    "redact_secret",
    "relay_buffered",
    "relay_stream",
    "anthropic_error_event",
    "sse_error_event",
]

log = logging.getLogger("proxy.upstream")

Tap = Callable[[bytes], None]
BeforeEnd = Callable[[], Awaitable[None]]  # awaited before the last byte of an answer


def sse_error_event(message: str, code: str) -> bytes:
    return b"data: " + orjson.dumps(envelope(message, "upstream_error", None, code)) + b"\n\n"


def anthropic_error_event(message: str, code: str) -> bytes:
    """A broken stream's last event, as Anthropic ends a stream with an error."""
    data = orjson.dumps({"type": "error", "error": {"type": "api_error", "message": message}})
    return b"event: error\ndata: " + data + b"\n\n"


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


async def relay_stream(
    send: Send,
    resp: aiohttp.ClientResponse,
    headers: Headers,
    *,
    sse: bool,
    tap: Tap | None = None,
    whole: Tap | None = None,
    before_end: BeforeEnd | None = None,
    error_event: Callable[[str, str], bytes] = sse_error_event,
) -> None:
    """Pass the upstream body through chunk by chunk, exactly as it arrives. ``tap`` sees each
    chunk; ``whole`` gets the complete body once it has all arrived (a JSON answer too large to
    buffer before relaying is still archived). A stream that breaks ends with ``error_event``."""
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
            {"type": "http.response.body", "body": error_event(msg, code), "more_body": True}
        )
    else:
        if whole is not None and kept is not None:
            whole(b"".join(kept))
    if before_end is not None:
        await before_end()
    await send({"type": "http.response.body", "body": b"", "more_body": False})


