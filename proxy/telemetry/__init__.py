"""OpenTelemetry spans per conversation request, exported over OTLP/HTTP
(docs/observability.md#opentelemetry).

    telemetry = open_telemetry(config.telemetry)     # the lifespan; Services.telemetry
    span = telemetry.request(api, model, identity, stream=..., headers=..., base_url=...)
    send = span.watch(send)                          # the response's status, as sent
    span.set_pipeline(result)                        # after the pipeline: its figures
    span.end(error=..., disconnected=..., rounds=...)  # the response ended: its time is kept
    span.ledger(entry)  or  span.close()             # the span is finished and exported

A span's end time is when the response ended, but it is exported only once the ledger's figures
(provider usage, costs, why the cache broke), computed after the response, are on it:
:meth:`RequestSpan.ledger` finishes it, or :meth:`RequestSpan.close` when there will be none.
Each span is finished exactly once, whichever comes first; one still waiting at shutdown is
finished then (:mod:`proxy.telemetry.otel`).

Off (the default) the service is :class:`NullTelemetry`: ``opentelemetry`` is never imported
and a request's cost is a handful of calls that do nothing. On, the spans are batched and
exported by the SDK's own thread, never on the event loop, and no telemetry failure ever
reaches a request: every call logs and swallows its exceptions.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from starlette.types import Send

from proxy.config.telemetry import TelemetryConfig
from proxy.errors import ConfigError

if TYPE_CHECKING:
    from proxy.model import PipelineResult
    from proxy.session import Identity
    from proxy.store.ledger_entry import LedgerEntry

__all__ = [
    "NULL_SPAN",
    "NullSpan",
    "NullTelemetry",
    "RequestSpan",
    "Telemetry",
    "installation_problem",
    "open_telemetry",
]


class RequestSpan(Protocol):
    """One conversation request's span (see the module's docstring for the order of calls)."""

    def watch(self, send: Send) -> Send:
        """``send``, noting the status of the response it starts."""
        ...

    def set_pipeline(self, result: PipelineResult) -> None:
        """The pipeline's figures and time, and its run as a child span (``ctxproxy.pipeline``)
        when it changed the request or a stage failed."""
        ...

    def end(
        self, *, error: BaseException | None = None, disconnected: bool = False,
        rounds: int = 0, end_time_ns: int | None = None,
    ) -> None:
        """The response ended (now, or at ``end_time_ns``): its status or error and the read
        rounds are recorded; the span is finished by :meth:`ledger` or :meth:`close`."""
        ...

    def ledger(
        self, entry: LedgerEntry, rounds: Sequence[LedgerEntry] = (),
        response_model: str | None = None,
    ) -> None:
        """The ledger's figures of the request (``entry``) and its read-tool rounds; finishes
        the span (at the recorded end time once :meth:`end` was called)."""
        ...

    def close(self) -> None:
        """Finish the span without ledger figures (at once if it ended, else when it ends)."""
        ...


class Telemetry(Protocol):
    enabled: bool

    def request(
        self, api: str, model: str, identity: Identity, *, stream: bool,
        headers: Sequence[tuple[bytes, bytes]], base_url: str | None,
        route: Mapping[str, Any] | None = None,
    ) -> RequestSpan:
        """The span of a conversation request, started now. ``headers`` are the client's (a
        W3C ``traceparent`` makes the span its child); ``base_url`` is the upstream's and
        ``route`` a litellm route's parameters (``model``, ``api_base``), for the provider."""
        ...

    async def drain(self) -> None:
        """Export every finished span now (tests; shutdown does it too)."""
        ...

    async def close(self) -> None:
        """Finish the spans still waiting for the ledger, export everything, shut down."""
        ...


class NullSpan:
    """Telemetry off: every call does nothing."""

    __slots__ = ()

    def watch(self, send: Send) -> Send:
        return send

    def set_pipeline(self, result: PipelineResult) -> None:
        return None

    def end(
        self, *, error: BaseException | None = None, disconnected: bool = False,
        rounds: int = 0, end_time_ns: int | None = None,
    ) -> None:
        return None

    def ledger(
        self, entry: LedgerEntry, rounds: Sequence[LedgerEntry] = (),
        response_model: str | None = None,
    ) -> None:
        return None

    def close(self) -> None:
        return None


NULL_SPAN = NullSpan()


class NullTelemetry:
    """Telemetry off: no span, no import of ``opentelemetry``."""

    enabled = False

    def request(
        self, api: str, model: str, identity: Identity, *, stream: bool,
        headers: Sequence[tuple[bytes, bytes]], base_url: str | None,
        route: Mapping[str, Any] | None = None,
    ) -> RequestSpan:
        return NULL_SPAN

    async def drain(self) -> None:
        return None

    async def close(self) -> None:
        return None


_EXTRA = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")


def installation_problem(config: TelemetryConfig) -> str | None:
    """Why telemetry as configured cannot run here (the otel extra is missing), or None."""
    if not config.enabled:
        return None
    try:
        missing = [name for name in _EXTRA if importlib.util.find_spec(name) is None]
    except ImportError:  # a parent package missing
        missing = list(_EXTRA)
    if not missing:
        return None
    return (f"telemetry.enabled needs the otel extra (pip install 'ctxproxy[otel]'): "
            f"{missing[0]} is not installed")


def open_telemetry(config: TelemetryConfig) -> Telemetry:
    """The telemetry service ``config`` asks for; only this imports ``opentelemetry``, and only
    when it is enabled."""
    if not config.enabled:
        return NullTelemetry()
    try:
        from proxy.telemetry.otel import OtelTelemetry
    except ImportError as exc:
        raise ConfigError(
            f"telemetry.enabled needs the otel extra (pip install 'ctxproxy[otel]'): {exc}"
        ) from None
    return OtelTelemetry(config)
