"""``telemetry``: OpenTelemetry spans per request, exported over OTLP/HTTP.
"""

from __future__ import annotations

import os

from pydantic import Field, field_validator, model_validator

from proxy.config.section import _Section

__all__ = [
    "OTLP_ENDPOINT_VARS",
    "TelemetryConfig",
]


# The OpenTelemetry SDK's own variables, honoured when telemetry.endpoint is null.
OTLP_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


class TelemetryConfig(_Section):
    enabled: bool = Field(
        False,
        description="Send one OpenTelemetry span per conversation request (GenAI semantic "
        "conventions plus ctxproxy.* attributes: tokens sent and forwarded, offloads, "
        "compaction, cost, why the cache broke) over OTLP/HTTP. Needs the otel extra (pip "
        "install 'ctxproxy[otel]'). Off: opentelemetry is never imported.",
    )
    endpoint: str | None = Field(
        None,
        description="OTLP/HTTP traces URL, path included (http://127.0.0.1:4318/v1/traces); "
        "null: the SDK's OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT "
        "plus /v1/traces. Enabled with none of the three set is a configuration error.",
    )
    headers: dict[str, str] = Field(
        default_factory=dict,
        repr=False,
        description="Headers sent with every export, for collectors that need auth "
        "(authorization: os.environ/OTLP_TOKEN); added to OTEL_EXPORTER_OTLP_HEADERS. Never "
        "logged.",
    )
    service_name: str = Field(
        "ctxproxy", min_length=1, description="The resource's service.name."
    )
    timeout_s: float = Field(
        10, gt=0, description="Longest time one export (retries included) may take; exports "
        "run in the SDK's own thread, never on a request's path."
    )
    sample_ratio: float = Field(
        1.0, ge=0, le=1, description="Share of requests traced (by trace id); a request that "
        "carries a W3C traceparent follows its caller's sampling decision instead."
    )

    @field_validator("endpoint")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL (OTLP/HTTP)")
        return value

    @model_validator(mode="after")
    def _has_endpoint(self) -> TelemetryConfig:
        if self.enabled and self.endpoint is None and not any(
                os.environ.get(name) for name in OTLP_ENDPOINT_VARS):
            raise ValueError("enabled needs an endpoint: set telemetry.endpoint or "
                             "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT")
        return self
