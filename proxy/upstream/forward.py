"""The forwarder: a request sent upstream as bytes, its answer relayed back as bytes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from starlette.types import Scope, Send

from proxy.server.asgi import timing_of
from proxy.upstream.http import Upstream, response_headers
from proxy.upstream.relay import relay_buffered, relay_stream, sse_error_event
from proxy.upstream.thinking import Binding

__all__ = ["Forwarder"]

_BUFFER_LIMIT = 16 * 1024 * 1024
_SSE = "text/event-stream"


class Forwarder:
    """Forwards to one upstream (its base URL, its key rules) over its pooled client."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    async def forward(
        self,
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
        error_event: Callable[[str, str], bytes] = sse_error_event,
        binding: Binding | None = None,
    ) -> None:
        """Send the request upstream as bytes and relay the answer as bytes.

        SSE streams pass chunk by chunk; other bodies are buffered (a break then still gets a clean
        502) unless they are large or, with `buffer_unknown` off and a success, of unknown length.
        Taps see only successful answers. ``on_status`` runs once the status is known, before any
        of the body is relayed, and ``before_end`` before its last byte (held writes,
        :mod:`proxy.writes`). A stream that breaks ends with ``error_event`` (the wire
        format's own error event). An error body is the provider's and passes through, but the
        proxy's own `upstream.api_key`, should the provider echo it, is redacted: the client
        never had it. ``binding`` (Messages): a prefix-check 400 is sent again with drop_block,
        before anything reached the client (:mod:`proxy.upstream.thinking`).
        """
        up = self.upstream
        timing = timing_of(scope)
        timing.restart()
        url = up.url(subpath, scope.get("query_string", b""))
        request_headers = up.request_headers(scope["headers"])
        if binding is None:
            resp = await up.send(method, url, request_headers, body)
        else:
            resp = await binding.send(up, method, url, request_headers, body)
        timing.mark()
        async with resp:
            if on_status is not None:
                await on_status(resp.status)
            headers = [*response_headers(resp), *extra]
            if binding is not None:
                headers += binding.headers()
            ok = resp.status == 200
            failed = resp.status >= 400
            length = resp.content_length
            if resp.content_type == _SSE:
                await relay_stream(send, resp, headers, sse=True, tap=stream_tap if ok else None,
                                   before_end=before_end, error_event=error_event)
            elif (length is None and (buffer_unknown or failed)
                  or length is not None and length <= _BUFFER_LIMIT):
                secret = up.config.api_key if failed else None
                await relay_buffered(send, resp, headers, tap=whole_tap if ok else None, redact=secret,
                                     before_end=before_end)
            else:
                await relay_stream(send, resp, headers, sse=False, whole=whole_tap if ok else None,
                                   before_end=before_end)
