"""One access line and the request metrics per request: method, path, status, timings, bytes."""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from proxy.metrics import Metrics

log = logging.getLogger("proxy.server.access")


class AccessLog:
    """Pure ASGI middleware: cheaper than BaseHTTPMiddleware and it never buffers a stream."""

    def __init__(self, app: Any, metrics: Metrics | None = None) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 0
        sent = 0

        async def counting_send(message: Message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            timing = scope.get("state", {}).get("ctxproxy_timing")
            upstream_ms = timing.upstream_ms if timing is not None else None
            pipeline_ms = timing.pipeline_ms if timing is not None else None
            if self.metrics is not None:
                self.metrics.observe_request(scope["path"], status or 499, upstream_ms)
                if pipeline_ms is not None:
                    self.metrics.pipeline_seconds.observe(pipeline_ms / 1000)
            if log.isEnabledFor(logging.INFO):
                log.info(
                    "%s %s %d upstream_ms=%s pipeline_ms=%s bytes=%d total_ms=%.1f",
                    scope["method"],
                    scope["path"],
                    status or 499,
                    "-" if upstream_ms is None else f"{upstream_ms:.1f}",
                    "-" if pipeline_ms is None else f"{pipeline_ms:.2f}",
                    sent,
                    (time.perf_counter() - started) * 1000,
                )
