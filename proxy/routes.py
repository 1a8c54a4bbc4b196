"""Route handlers: they orchestrate parse -> session -> pipeline -> forward, nothing more."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any
from urllib.parse import quote, unquote

import orjson

from .auth import Caller
from .errors import BadRequest, ProxyError
from .pipeline import PipelineResult
from .relay import (
    JSON_CT,
    Headers,
    Receive,
    Scope,
    Send,
    read_body,
    relay_buffered,
    relay_stream,
    run_until_disconnect,
    send_error,
    send_whole,
    timing_of,
)
from .runtime import Runtime
from .session import Identity
from .upstream.http import response_headers

log = logging.getLogger("proxy.access")

_BUFFER_LIMIT = 16 * 1024 * 1024
_SSE = "text/event-stream"
# Deepest JSON nesting a chat body may have. orjson parses up to 1024 levels but serializes only
# 254, and the proxy re-serializes the body (and each message, for the archive and the hashes):
# deeper bodies are refused up front instead of failing half-way through the pipeline.
MAX_DEPTH = 128
_JSON_TYPES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
               list: "an array", type(None): "null"}


def runtime_of(scope: Scope) -> Runtime:
    rt = scope.get("state", {}).get("runtime")
    if rt is None:
        raise ProxyError("proxy is not started (lifespan did not run)")
    return rt  # type: ignore[no-any-return]


def caller_of(scope: Scope) -> Caller:
    """Who is calling: decided by the gate (:class:`proxy.app.Proxy`) before the body is read."""
    caller = scope.get("state", {}).get("caller")
    if caller is None:
        raise ProxyError("request did not pass the gate")
    return caller  # type: ignore[no-any-return]


def header_map(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}


def parse_chat(raw: bytes, max_messages: int = 100_000) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise BadRequest("'messages' is required and must be an array", param="messages")
    if len(messages) > max_messages:
        raise BadRequest(
            f"'messages' has {len(messages)} entries; this proxy accepts at most {max_messages}",
            param="messages",
        )
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            got = _JSON_TYPES.get(type(message), "a value")
            raise BadRequest(
                f"Invalid type for 'messages[{i}]': expected an object, but got {got} instead.",
                param=f"messages[{i}]",
            )
        # The fields the pipeline dispatches on (anything else is the upstream's to judge).
        for name, kind, expected in (("role", str, "a string"), ("tool_calls", list, "an array")):
            value = message.get(name)
            if value is not None and not isinstance(value, kind):
                got = _JSON_TYPES.get(type(value), "an object")
                raise BadRequest(
                    f"Invalid type for 'messages[{i}].{name}': expected {expected}, "
                    f"but got {got} instead.",
                    param=f"messages[{i}].{name}",
                )
    if _deeper_than(body, MAX_DEPTH):
        raise BadRequest(f"request body is nested more than {MAX_DEPTH} levels deep")
    return body


def _deeper_than(value: dict[str, Any] | list[Any], budget: int) -> bool:
    """Whether `value` nests more than `budget` objects/arrays (itself counted). Only
    containers are visited (a few ms for a 7 MB, 9,000-message body)."""
    if budget <= 0:
        return True
    items: Iterable[Any] = value.values() if isinstance(value, dict) else value
    for item in items:
        kind = type(item)
        if (kind is dict or kind is list) and _deeper_than(item, budget - 1):
            return True
    return False


def ctx_headers(identity: Identity, result: PipelineResult, raw: bytes, out: bytes) -> Headers:
    stats = result.stats
    tokens_in = stats.get("tokens_in", len(raw) // 4)
    tokens_out = stats.get("tokens_out", len(out) // 4)
    return [
        (b"x-ctxproxy-session", identity.session.encode()),
        (b"x-ctxproxy-tokens-in", str(tokens_in).encode()),
        (b"x-ctxproxy-tokens-out", str(tokens_out).encode()),
        (b"x-ctxproxy-offloaded", str(stats.get("offloaded", 0)).encode()),
        (b"x-ctxproxy-compacted", b"1" if stats.get("compacted", 0) else b"0"),
    ]


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


class PassThrough:
    """Every other /v1/* route: forwarded raw, answered raw."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rt = runtime_of(scope)
        subpath = passthrough_subpath(scope)  # before reading the body: a refusal costs nothing
        raw = await read_body(scope, receive, rt.max_body)
        work = forward_raw(rt, scope, send, scope["method"], subpath, raw, buffer_unknown=False)
        if await run_until_disconnect(receive, work):
            log.info("client disconnected; upstream call cancelled (%s)", scope["path"])


async def forward_raw(
    rt: Runtime,
    scope: Scope,
    send: Send,
    method: str,
    subpath: str,
    body: bytes,
    *,
    extra: Sequence[tuple[bytes, bytes]] = (),
    stream_tap: Callable[[bytes], None] | None = None,
    whole_tap: Callable[[bytes], None] | None = None,
    on_status: Callable[[int], Awaitable[None]] | None = None,
    before_end: Callable[[], Awaitable[None]] | None = None,
    buffer_unknown: bool,
) -> None:
    """Send the request upstream as bytes and relay the answer as bytes.

    SSE streams pass chunk by chunk; other bodies are buffered (a break then still gets a clean
    502) unless they are large or, with `buffer_unknown` off and a success, of unknown length.
    Taps see only successful answers. ``on_status`` runs once the status is known, before any
    of the body is relayed, and ``before_end`` before its last byte (held writes,
    :mod:`proxy.writes`). An error body is the provider's
    and passes through, but
    the proxy's own `upstream.api_key`, should the provider echo it, is redacted: the client
    never had it.
    """
    up = rt.upstream
    timing = timing_of(scope)
    timing.restart()
    resp = await up.send(
        method, up.url(subpath, scope.get("query_string", b"")),
        up.request_headers(scope["headers"]), body,
    )
    timing.mark()
    async with resp:
        if on_status is not None:
            await on_status(resp.status)
        headers = [*response_headers(resp), *extra]
        ok = resp.status == 200
        failed = resp.status >= 400
        length = resp.content_length
        if resp.content_type == _SSE:
            await relay_stream(send, resp, headers, sse=True, tap=stream_tap if ok else None,
                               before_end=before_end)
        elif (length is None and (buffer_unknown or failed)
              or length is not None and length <= _BUFFER_LIMIT):
            secret = up.config.api_key if failed else None
            await relay_buffered(send, resp, headers, tap=whole_tap if ok else None, redact=secret,
                                 before_end=before_end)
        else:
            await relay_stream(send, resp, headers, sse=False, whole=whole_tap if ok else None,
                               before_end=before_end)


class Models:
    """GET /v1/models: the configured routes, else the upstream's own list."""

    def __init__(self) -> None:
        self._passthrough = PassThrough()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rt = runtime_of(scope)
        if not rt.config.model_list:
            await self._passthrough(scope, receive, send)
            return
        data = [
            {"id": r.model_name, "object": "model", "created": 0, "owned_by": "ctxproxy"}
            for r in rt.config.model_list
        ]
        await send_whole(send, 200, [JSON_CT], orjson.dumps({"object": "list", "data": data}))


class MetricsPage:
    """GET /metrics: Prometheus text format."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ct = (b"content-type", b"text/plain; version=0.0.4; charset=utf-8")
        await send_whole(send, 200, [ct], runtime_of(scope).metrics.render())


class Health:
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_whole(send, 200, [JSON_CT], b'{"status":"ok"}')


__all__ = ["Health", "MetricsPage", "Models", "PassThrough", "ctx_headers", "parse_chat", "send_error"]
