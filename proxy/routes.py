"""The small route handlers (passthrough, models, health, metrics) and what every handler reads
from the request's scope: its services, and its caller as the gate decided."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote

import orjson
from starlette.types import Receive, Scope, Send

from proxy.auth import Caller
from proxy.errors import BadRequest, ProxyError
from proxy.server.asgi import JSON_CT, read_body, run_until_disconnect, send_whole

if TYPE_CHECKING:
    from proxy.services import Services

log = logging.getLogger("proxy.server.access")


def services_of(scope: Scope) -> Services:
    services = scope.get("state", {}).get("services")
    if services is None:
        raise ProxyError("proxy is not started (lifespan did not run)")
    return services  # type: ignore[no-any-return]


def caller_of(scope: Scope) -> Caller:
    """Who is calling: decided by the gate (:class:`proxy.app.Proxy`) before the body is read."""
    caller = scope.get("state", {}).get("caller")
    if caller is None:
        raise ProxyError("request did not pass the gate")
    return caller  # type: ignore[no-any-return]


def header_map(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}


_MAX_DECODES = 3  # %25 nesting the check unwraps; a path still encoded after that is refused


def passthrough_subpath(scope: Scope, prefix: bytes = b"/v1/") -> str:
    """The client's path below ``prefix``, still percent-encoded exactly as sent, or a 400.

    The passthrough must never leave ``upstream.base_url``'s path, yet yarl (like most URL
    libraries) resolves ``..`` and even ``%2e%2e`` on the way out. So every segment of the raw
    path is decoded (repeatedly, for ``%252e``) and refused when it is empty, ``.`` or ``..``
    (also as ``..;x``, which some servers treat as ``..``), or holds a slash, a backslash, NUL,
    a control character, invalid UTF-8 (overlong ``%c0%ae``) or ``%u`` once decoded. What
    passes is forwarded without re-encoding.
    """
    raw = scope.get("raw_path") or quote(scope["path"]).encode("ascii")
    if not raw.startswith(prefix):
        raise BadRequest("path is outside the API", code="invalid_path")
    rest = raw[len(prefix) :].decode("latin-1")
    for segment in rest.split("/"):
        decoded = segment
        for _ in range(_MAX_DECODES):
            once = unquote(decoded, errors="surrogateescape") if "%" in decoded else decoded
            if once == decoded:
                break
            decoded = once
        else:
            raise BadRequest("path is percent-encoded more than twice", code="invalid_path")
        if (
            not decoded
            or decoded.split(";", 1)[0] in (".", "..")
            or "%u" in decoded.lower()  # IIS-style %u002e
            or any(c in "/\\" or ord(c) < 0x20 or c == "\x7f" or 0xD800 <= ord(c) < 0xE000
                   for c in decoded)  # surrogates: invalid UTF-8 such as overlong %c0%ae
        ):
            raise BadRequest(
                "path has an empty, '.' or '..' segment, or an encoded slash, backslash or "
                "control character; the proxy forwards only plain paths below the API",
                code="invalid_path",
            )
    return rest


def is_anthropic(scope: Scope, subpath: str) -> bool:
    """Whether a passthrough request is for the Anthropic upstream: below /v1/messages
    (count_tokens, batches), or sent by an Anthropic client (its SDKs send anthropic-version
    with every request, /v1/models included)."""
    if subpath == "messages" or subpath.startswith(("messages/", "messages?")):
        return True
    return any(k.lower() == b"anthropic-version" for k, _ in scope["headers"])


class PassThrough:
    """Every other /v1/* route: forwarded raw, answered raw, to the OpenAI-compatible upstream
    or, for Anthropic's routes (:func:`is_anthropic`), to the Anthropic one."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        svc = services_of(scope)
        subpath = passthrough_subpath(scope)  # before reading the body: a refusal costs nothing
        raw = await read_body(scope, receive, svc.max_body,
                              idle_s=svc.config.server.body_timeout_s)
        # The format decides the upstream (and so where the client's credentials go).
        fmt = "messages" if is_anthropic(scope, subpath) else "chat"
        _, forwarder = svc.upstream_of(fmt)
        if fmt == "messages":
            # anthropic.base_url is written without /v1, as the Anthropic SDKs take it.
            subpath = "v1/" + subpath
        work = forwarder.forward(scope, send, scope["method"], subpath, raw,
                                 buffer_unknown=False)
        if await run_until_disconnect(receive, work):
            log.info("client disconnected; upstream call cancelled (%s)", scope["path"])


class Models:
    """GET /v1/models: the configured routes, else the upstream's own list."""

    def __init__(self) -> None:
        self._passthrough = PassThrough()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        config = services_of(scope).config
        if not config.model_list:
            await self._passthrough(scope, receive, send)
            return
        data = [
            {"id": r.model_name, "object": "model", "created": 0, "owned_by": "ctxproxy"}
            for r in config.model_list
        ]
        await send_whole(send, 200, [JSON_CT], orjson.dumps({"object": "list", "data": data}))


class MetricsPage:
    """GET /metrics: Prometheus text format."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ct = (b"content-type", b"text/plain; version=0.0.4; charset=utf-8")
        await send_whole(send, 200, [ct], services_of(scope).metrics.render())


class Health:
    """GET /healthz: the process is alive (whatever the store's state: a balancer must not
    restart replicas because the database is away)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_whole(send, 200, [JSON_CT], b'{"status":"ok"}')


class Ready:
    """GET /readyz: 200 when the store answers, 503 with ``"store": "down"`` when it does not
    (requests are still served then, without the store)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        store = services_of(scope).store
        up = await asyncio.to_thread(store.ready)
        body = {"status": "ok" if up else "degraded", "store": "up" if up else "down",
                "backend": store.name}
        await send_whole(send, 200 if up else 503, [JSON_CT], orjson.dumps(body))


__all__ = [
    "Health",
    "MetricsPage",
    "Models",
    "PassThrough",
    "Ready",
    "caller_of",
    "header_map",
    "is_anthropic",
    "passthrough_subpath",
    "services_of",
]
