"""An in-process OTLP/HTTP trace collector (raw ASGI): what the proxy's telemetry exports.

    collector = OtlpCollector()
    with serve_in_thread(collector) as srv:
        ... telemetry: {enabled: true, endpoint: srv.url + "/v1/traces"} ...
        services.drain()                      # the proxy's spans are flushed, then:
    [span] = collector.named("chat gpt-4o")
    assert span.attributes["ctxproxy.tokens.sent"] == 12

It accepts ``POST /v1/traces`` with a protobuf ``ExportTraceServiceRequest`` (the body
opentelemetry-exporter-otlp-proto-http sends), decodes every span into a :class:`Collected`
(attributes as plain Python values) and answers an empty ``ExportTraceServiceResponse``; the
headers of each export are kept (``exports``). ``status`` makes it refuse exports instead.

Standalone (benchmarks: a sink that counts what it gets without decoding)::

    python -m harness.otlp --port 0      # prints "READY http://127.0.0.1:PORT"

Threading: the app runs on its server's loop while tests read ``spans`` from theirs; only list
appends cross threads. Decoding needs opentelemetry-proto (the otel extra), imported on the
first export.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.types import Receive, Scope, Send

__all__ = ["Collected", "OtlpCollector", "main"]

# opentelemetry.proto's enums, as numbers (the module is imported only to decode).
KIND_INTERNAL = 1
KIND_CLIENT = 3
STATUS_UNSET = 0
STATUS_ERROR = 2


@dataclass(frozen=True, slots=True)
class Collected:
    """One span as the collector got it."""

    name: str
    kind: int  # KIND_CLIENT, KIND_INTERNAL, ...
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root span
    start_ns: int
    end_ns: int
    status: int  # STATUS_UNSET, STATUS_ERROR, ...
    status_message: str
    attributes: Mapping[str, Any]
    resource: Mapping[str, Any]
    scope: str  # the instrumentation scope's name


def _value(any_value: Any) -> Any:
    which = any_value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in any_value.kvlist_value.values}
    return getattr(any_value, which)


def _attributes(pairs: Sequence[Any]) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


def decode(body: bytes) -> list[Collected]:
    """The spans of one ``ExportTraceServiceRequest``."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    out: list[Collected] = []
    for rs in request.resource_spans:
        resource = _attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(Collected(
                    name=s.name, kind=s.kind, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                    parent_span_id=s.parent_span_id.hex(), start_ns=s.start_time_unix_nano,
                    end_ns=s.end_time_unix_nano, status=s.status.code,
                    status_message=s.status.message, attributes=_attributes(s.attributes),
                    resource=resource, scope=ss.scope.name,
                ))
    return out


class OtlpCollector:
    """The collector app (see the module's docstring)."""

    def __init__(self, *, status: int = 200, decode: bool = True) -> None:
        self.status = status
        self.decode = decode
        self.spans: list[Collected] = []
        self.exports: list[dict[str, str]] = []  # each export's headers (lower-case names)
        self.received_bytes = 0

    def named(self, name: str) -> list[Collected]:
        return [s for s in self.spans if s.name == name]

    def reset(self) -> None:
        self.spans.clear()
        self.exports.clear()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if scope["method"] != "POST" or scope["path"] != "/v1/traces":
            await self._answer(send, 404)
            return
        self.received_bytes += len(body)
        self.exports.append({k.decode("latin-1").lower(): v.decode("latin-1")
                             for k, v in scope["headers"]})
        if self.status != 200:
            await self._answer(send, self.status)
            return
        if self.decode:
            self.spans.extend(decode(body))
        await self._answer(send, 200)

    @staticmethod
    async def _answer(send: Send, status: int) -> None:
        # An empty ExportTraceServiceResponse is zero protobuf bytes.
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/x-protobuf"),
                                (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m harness.otlp --port N``; prints ``READY <url>`` once listening."""
    import uvicorn

    from proxy.demo.servers import bind_socket, format_url

    p = argparse.ArgumentParser(prog="python -m harness.otlp", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=4318, help="0 = pick a free port")
    p.add_argument("--decode", action="store_true", help="decode the spans (costs CPU)")
    args = p.parse_args(argv)
    sock = bind_socket(args.host, args.port)
    config = uvicorn.Config(OtlpCollector(decode=args.decode), log_level="warning",
                            access_log=False, lifespan="on")
    print(f"READY {format_url(args.host, sock.getsockname()[1])}", flush=True)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
