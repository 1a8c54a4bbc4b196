"""Telemetry on: the OpenTelemetry SDK, owned by the service (never the global provider).

Imported only when ``telemetry.enabled`` (:func:`proxy.telemetry.open_telemetry`). One
``TracerProvider`` per app with a ``BatchSpanProcessor`` in front of the OTLP/HTTP exporter: a
finished span is queued (a deque append) and the processor's own thread exports batches, so no
export ever runs on the event loop; a collector that is down or slow costs dropped spans,
never a request. :meth:`OtelTelemetry.close` (``Services.close``) finishes the spans still
waiting for their ledger figures and flushes, in a worker thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, ParamSpec, TypeVar

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import Message, Send

from proxy import __version__
from proxy.config.telemetry import TelemetryConfig
from proxy.telemetry import NULL_SPAN, RequestSpan
from proxy.telemetry.attributes import (
    end_attributes,
    ledger_attributes,
    pipeline_attributes,
    provider_of,
    request_attributes,
    server_of,
    span_name,
)

if TYPE_CHECKING:
    from proxy.model import PipelineResult
    from proxy.session import Identity
    from proxy.store.ledger_entry import LedgerEntry

__all__ = ["OtelSpan", "OtelTelemetry"]

log = logging.getLogger("proxy.telemetry")

P = ParamSpec("P")
R = TypeVar("R")

# Spans that ended and wait for their ledger figures: past this many, the oldest is finished
# without them (a ledger that never calls back must not grow memory without bound).
MAX_WAITING: Final = 10_000
_TRACEPARENT: Final = b"traceparent"


class _Headers(Getter[Sequence[tuple[bytes, bytes]]]):
    """The client's ASGI headers as a W3C trace-context carrier."""

    def get(self, carrier: Sequence[tuple[bytes, bytes]], key: str) -> list[str] | None:
        name = key.encode("latin-1")
        values = [v.decode("latin-1") for k, v in carrier if k == name]
        return values or None

    def keys(self, carrier: Sequence[tuple[bytes, bytes]]) -> list[str]:
        return [k.decode("latin-1") for k, _ in carrier]


_HEADERS: Final = _Headers()


class _Failures:
    """A telemetry call that raised: logged (the first of each kind with its traceback), never
    raised to the request."""

    def __init__(self) -> None:
        self.count = 0
        self._seen: set[str] = set()

    def __call__(self, what: str) -> None:
        self.count += 1
        if what in self._seen:
            log.debug("telemetry: %s failed again (%d failures)", what, self.count, exc_info=True)
            return
        self._seen.add(what)
        log.exception("telemetry: %s failed; the request goes on without it", what)


def _guarded(fn: Callable[P, None]) -> Callable[P, None]:
    """A span method whose exceptions are logged and swallowed."""

    def call(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except Exception:
            span = args[0]
            assert isinstance(span, OtelSpan)
            span.owner.failures(fn.__name__)

    call.__name__ = fn.__name__
    call.__doc__ = fn.__doc__
    return call


class OtelSpan:
    """One request's span: started, ended with the response, finished exactly once (by the
    ledger's figures, by :meth:`close`, or by the service at shutdown)."""

    __slots__ = ("_end_ns", "_finish_at_end", "_finished", "_lock", "_span", "_status", "owner")

    def __init__(self, span: trace.Span, owner: OtelTelemetry) -> None:
        self._span = span
        self.owner = owner
        self._lock = threading.Lock()  # the ledger may call back from a worker thread
        self._end_ns: int | None = None
        self._status: int | None = None
        self._finish_at_end = False
        self._finished = False

    def watch(self, send: Send) -> Send:
        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                self._status = message.get("status")
            await send(message)

        return watched

    @_guarded
    def set_pipeline(self, result: PipelineResult) -> None:
        self._span.set_attributes(pipeline_attributes(result.stats, result.elapsed_ms))
        if not (result.changed or result.failed):
            # A child span costs as much as the request's own (made, encoded, sent): only a
            # pipeline that did something gets one; the duration is on the request's span.
            return
        # The pipeline has just returned: its child span is placed by its own elapsed time.
        end = time.time_ns()
        child = self.owner.tracer.start_span(
            "ctxproxy.pipeline", trace.set_span_in_context(self._span), kind=SpanKind.INTERNAL,
            start_time=end - int(result.elapsed_ms * 1_000_000),
        )
        child.set_attribute("ctxproxy.pipeline.changed", result.changed)
        if result.failed:
            child.set_attribute("ctxproxy.pipeline.failed", list(result.failed))
        child.end(end_time=end)

    @_guarded
    def end(
        self, *, error: BaseException | None = None, disconnected: bool = False,
        rounds: int = 0, end_time_ns: int | None = None,
    ) -> None:
        waits = False
        try:
            with self._lock:
                if self._end_ns is not None or self._finished:
                    return
                self._end_ns = end_time_ns if end_time_ns is not None else time.time_ns()
                waits = not self._finish_at_end
                try:
                    attrs, error_type = end_attributes(self._status, error, disconnected, rounds)
                    self._span.set_attributes(attrs)
                    if error_type is not None:
                        self._span.set_status(Status(StatusCode.ERROR, error_type))
                finally:  # whatever failed above, the span is still finished once
                    if not waits:
                        self._finish()
        finally:
            if waits:  # outside the span's lock: the service may close older spans meanwhile
                self.owner.wait(self)

    @_guarded
    def ledger(
        self, entry: LedgerEntry, rounds: Sequence[LedgerEntry] = (),
        response_model: str | None = None,
    ) -> None:
        with self._lock:
            if self._finished or self._finish_at_end:
                return
            try:
                self._span.set_attributes(ledger_attributes(entry, rounds, response_model))
            finally:
                self._finish_or_defer()

    @_guarded
    def close(self) -> None:
        with self._lock:
            if not self._finished:
                self._finish_or_defer()

    @property
    def finished(self) -> bool:
        return self._finished

    def _finish_or_defer(self) -> None:
        if self._end_ns is None:
            self._finish_at_end = True
        else:
            self._finish()

    def _finish(self) -> None:
        self._finished = True
        self._span.end(end_time=self._end_ns)
        self.owner.done(self)


class OtelTelemetry:
    """The telemetry service with the SDK behind it (see the module's docstring)."""

    enabled = True

    def __init__(self, config: TelemetryConfig) -> None:
        self.config = config
        resource = Resource.create({"service.name": config.service_name,
                                    "service.version": __version__})
        self.provider = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)), resource=resource,
            shutdown_on_exit=False,  # Services.close shuts it down; atexit would pin it
        )
        exporter = OTLPSpanExporter(endpoint=config.endpoint, headers=config.headers or None,
                                    timeout=config.timeout_s)
        self.provider.add_span_processor(
            BatchSpanProcessor(exporter, export_timeout_millis=config.timeout_s * 1000))
        self.tracer = self.provider.get_tracer("ctxproxy", __version__)
        self.propagator = TraceContextTextMapPropagator()
        self.failures = _Failures()
        self._servers: dict[str, tuple[str, int] | None] = {}
        self._waiting: dict[int, OtelSpan] = {}  # by id(), oldest first
        self._lock = threading.Lock()

    def request(
        self, api: str, model: str, identity: Identity, *, stream: bool,
        headers: Sequence[tuple[bytes, bytes]], base_url: str | None,
        route: Mapping[str, Any] | None = None,
    ) -> RequestSpan:
        try:
            return self._start(api, model, identity, stream, headers, base_url, route)
        except Exception:
            self.failures("request")
            return NULL_SPAN

    def _start(
        self, api: str, model: str, identity: Identity, stream: bool,
        headers: Sequence[tuple[bytes, bytes]], base_url: str | None,
        route: Mapping[str, Any] | None,
    ) -> RequestSpan:
        if route is not None:
            base = route.get("api_base")
            base_url = base if isinstance(base, str) else None
        attrs = request_attributes(
            api, model, identity.session, identity.tenant, provider=provider_of(api, route),
            server=self._server(base_url), stream=stream)
        parent: Context | None = None
        if any(k == _TRACEPARENT for k, _ in headers):
            parent = self.propagator.extract(headers, getter=_HEADERS)
        span = self.tracer.start_span(span_name(model), parent, kind=SpanKind.CLIENT,
                                      attributes=attrs)
        if not span.is_recording():  # not sampled: nothing to record, nothing to finish
            return NULL_SPAN
        return OtelSpan(span, self)

    def _server(self, base_url: str | None) -> tuple[str, int] | None:
        if base_url is None:
            return None
        if base_url not in self._servers:  # one entry per upstream or route: a few
            self._servers[base_url] = server_of(base_url)
        return self._servers[base_url]

    # -- spans waiting for their ledger figures ------------------------------------------------

    def wait(self, span: OtelSpan) -> None:
        with self._lock:
            if span.finished:  # the ledger was quicker than this call
                return
            self._waiting[id(span)] = span
            over = len(self._waiting) - MAX_WAITING
            oldest = list(itertools.islice(self._waiting.values(), over)) if over > 0 else []
        for stale in oldest:  # outside the lock: closing calls done()
            stale.close()

    def done(self, span: OtelSpan) -> None:
        with self._lock:
            self._waiting.pop(id(span), None)

    def flush(self) -> bool:
        """Export every finished span now (blocking: a worker thread's call)."""
        return self.provider.force_flush(int(self.config.timeout_s * 1000))

    async def drain(self) -> None:
        try:
            await asyncio.to_thread(self.flush)
        except Exception:
            self.failures("drain")

    async def close(self) -> None:
        with self._lock:
            waiting = list(self._waiting.values())
        for span in waiting:
            span.close()
        try:
            await asyncio.to_thread(self.provider.shutdown)
        except Exception:
            self.failures("close")
