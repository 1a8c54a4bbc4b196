"""create_app(config): routes, the services built by the lifespan, one error handler."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Sequence,
)

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from proxy.auth import Gate, key_headers
from proxy.config import Config
from proxy.conversation import Conversation
from proxy.errors import AuthRequired, BadRequest, ProxyError, envelope
from proxy.formats.chat.request import CHAT
from proxy.formats.messages.request import MESSAGES
from proxy.formats.responses.request import RESPONSES
from proxy.metrics import Metrics
from proxy.model import Stage
from proxy.routes import Health, MetricsPage, Models, PassThrough, Ready
from proxy.server.access import AccessLog
from proxy.server.asgi import refuse_websocket, send_error
from proxy.services import Services, open_services
from proxy.web.routes import FilesApp

log = logging.getLogger("proxy")

# /v1/ routes Starlette serves itself; every other /v1/ request is the passthrough's.
_ROUTED = frozenset({("GET", "/v1/models")})


def _json(status: int, payload: object) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


async def _proxy_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ProxyError)
    if exc.status >= 500:
        log.warning("%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
    return _json(exc.status, exc.envelope())


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "invalid_request_error"
    code = "not_found" if exc.status_code == 404 else "method_not_allowed"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return _json(exc.status_code, envelope(message, kind, None, code))


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return _json(500, envelope("internal proxy error", "server_error", None, "internal_error"))


Endpoint = Callable[[Scope, Receive, Send], Awaitable[None]]


class Proxy:
    """The ASGI app: hot routes dispatched directly, everything else through Starlette.

    The chat route is hit by every agent turn; a dict lookup instead of Starlette's middleware
    stack and regex router is a measurable share of the per-request overhead.
    """

    def __init__(
        self,
        starlette: Starlette,
        fast: dict[tuple[str, str], Endpoint],
        passthrough: Endpoint,
        gate: Gate,
        metrics: Metrics,
    ) -> None:
        self.starlette = starlette
        self._fast = fast
        self._passthrough = passthrough
        self._gate = gate
        self._metrics = metrics

    def _endpoint(self, scope: Scope) -> Endpoint | None:
        path: str = scope.get("path", "")
        endpoint = self._fast.get((scope.get("method", ""), path))
        if endpoint is None and path.startswith("/v1/") and (scope.get("method"), path) not in _ROUTED:
            # Every other /v1/ path, whatever it decodes to (Starlette's path pattern does not
            # match a decoded newline): the passthrough refuses what it must not forward.
            return self._passthrough
        return endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await refuse_websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.starlette(scope, receive, send)
            return
        path: str = scope["path"]
        # Anthropic's clients read Anthropic's error envelope.
        anthropic = path == "/v1/messages" or path.startswith("/v1/messages/")
        if path.startswith("/v1/") or path in ("/chat/completions", "/responses"):
            # The gate, before a byte of the body is read (/files asks it itself, to answer
            # browsers with a login prompt).
            try:
                caller = self._gate.caller(key_headers(scope["headers"]))
            except AuthRequired as exc:
                self._metrics.auth_failures.inc()
                await send_error(send, exc, anthropic=anthropic)
                return
            except BadRequest as exc:
                await send_error(send, exc, anthropic=anthropic)
                return
            scope.setdefault("state", {})["caller"] = caller
        endpoint = self._endpoint(scope)
        if endpoint is None:
            await self.starlette(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await endpoint(scope, receive, tracking_send)
        except ProxyError as exc:
            if started:
                raise
            if exc.status >= 500:
                log.warning("%s %s -> %d: %s", scope["method"], scope["path"], exc.status, exc.message)
            await send_error(send, exc, anthropic=anthropic)
        except Exception:
            if started:
                raise
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            await send_error(send, ProxyError("internal proxy error"), anthropic=anthropic)


class App(AccessLog):
    """What :func:`create_app` returns: the ASGI app, and its services while it runs (for a
    test to :meth:`~proxy.services.Services.drain`)."""

    services: Services | None = None


def create_app(config: Config, *, stages: Sequence[Stage] | None = None) -> App:
    """The proxy. ``stages``: pure stages to run instead of the default pipeline (tests)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[dict[str, object]]:
        services = await open_services(config, stages=stages, metrics=metrics, gate=gate)
        outer.services = services
        try:
            yield {"services": services}
        finally:
            outer.services = None
            await services.close()

    metrics = Metrics()
    gate = Gate(config.auth)
    chat = Conversation(CHAT)
    responses = Conversation(RESPONSES)
    messages = Conversation(MESSAGES)
    passthrough = PassThrough()
    files = FilesApp()
    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", Models(), methods=["GET"]),
        Route("/healthz", Health(), methods=["GET"]),
        # Claude Code checks the base URL with HEAD / before its first request.
        Route("/", Health(), methods=["GET"]),
        Route("/readyz", Ready(), methods=["GET"]),
        Route("/metrics", MetricsPage(), methods=["GET"]),
        Route("/files", files, methods=["GET"]),
        Route("/files/{rest:path}", files, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            ProxyError: _proxy_error,
            HTTPException: _http_error,
            Exception: _unexpected,
        },
    )
    fast: dict[tuple[str, str], Endpoint] = {
        ("POST", "/v1/chat/completions"): chat,
        ("POST", "/chat/completions"): chat,
        ("POST", "/v1/responses"): responses,
        ("POST", "/responses"): responses,
        ("POST", "/v1/messages"): messages,
    }
    outer = App(Proxy(app, fast, passthrough, gate, metrics), metrics)
    return outer
