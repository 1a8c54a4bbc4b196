"""ASGI plumbing of the fake upstream: reading a request, sending a response, noticing a
client disconnect, and deliberately breaking a connection mid-body.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from proxy.demo.fake.replies import Received

__all__ = [
    "AbortConnection",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "quiet_abort_logs",
    "read_request",
    "send_bytes",
    "sleep_or_disconnect",
    "until_disconnect",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class AbortConnection(Exception):
    """Raised after response start: uvicorn then closes the transport mid-body."""


class _DropAbortLogs(logging.Filter):
    # The deliberate abort is logged by uvicorn as "Exception in ASGI application"; that
    # traceback is noise in test output, any other exception still gets logged.
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info
        return not (exc is not None and isinstance(exc[1], AbortConnection))


_DROP_ABORT_LOGS = _DropAbortLogs()


def quiet_abort_logs() -> None:
    # Installed lazily (not at import) because uvicorn reconfigures its loggers per Config.
    logger = logging.getLogger("uvicorn.error")
    if _DROP_ABORT_LOGS not in logger.filters:
        logger.addFilter(_DROP_ABORT_LOGS)


async def read_request(scope: Scope, receive: Receive) -> tuple[Received, bool]:
    """The request in ``scope`` with its body read in full, and whether the client
    disconnected before sending all of it."""
    chunks: list[bytes] = []
    disconnected = False
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            disconnected = True
            break
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body", False):
            break
    raw_headers = [
        (k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope["headers"]
    ]
    headers: dict[str, str] = {}
    for k, v in raw_headers:
        headers[k] = headers[k] + ", " + v if k in headers else v
    rec = Received(
        method=scope["method"],
        path=scope["path"],
        query=scope.get("query_string", b"").decode("latin-1"),
        headers=headers,
        raw_headers=raw_headers,
        body=b"".join(chunks),
        at=time.monotonic(),
        raw_path=(scope.get("raw_path") or b"").decode("latin-1"),
    )
    return rec, disconnected


async def until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def sleep_or_disconnect(watcher: asyncio.Task[None], delay: float) -> bool:
    """Sleep ``delay``; True if the client disconnected meanwhile."""
    if watcher.done():
        return True
    done, _ = await asyncio.wait((watcher,), timeout=delay)
    return bool(done)


async def send_bytes(
    send: Send, status: int, body: bytes, headers: Sequence[tuple[bytes, bytes]]
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
