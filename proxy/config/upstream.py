"""``upstream``, ``anthropic`` and ``model_list``: the providers requests are forwarded to
(OpenAI-compatible, Anthropic natively, others through litellm).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from proxy.config.section import _Section

__all__ = [
    "AnthropicConfig",
    "ModelRoute",
    "UpstreamConfig",
]


class UpstreamConfig(_Section):
    base_url: str = Field(
        "https://api.openai.com/v1",
        description="OpenAI-compatible base URL requests are forwarded to (including /v1).",
    )
    api_key: str | None = Field(
        None,
        description="Key sent upstream; null forwards the client's own Authorization header.",
    )
    timeout_s: float = Field(
        600,
        gt=0,
        description="Longest wait for the upstream's next byte (connect, first byte, or between "
        "stream chunks) before the request fails with 504.",
    )
    connect_timeout_s: float = Field(
        10, gt=0, description="Longest wait to open a connection to the upstream."
    )
    max_connections: int = Field(
        512, ge=1, description="Concurrent connections the pooled upstream client may open."
    )
    keepalive_s: float = Field(
        4,
        gt=0,
        description="Idle pooled connections are closed after this many seconds. Keep it below "
        "the upstream's own idle timeout (uvicorn, vLLM: 5 s): a connection the upstream closes "
        "while the proxy reuses it fails after the request was sent, and a POST is never "
        "retried (it may have been billed). Raise it for providers that keep connections for "
        "minutes (OpenAI, Anthropic) to save TLS handshakes.",
    )


class AnthropicConfig(UpstreamConfig):
    """The Anthropic upstream ``/v1/messages`` is forwarded to, natively (no translation)."""

    base_url: str = Field(
        "https://api.anthropic.com",
        description="Anthropic Messages API base URL, without /v1 (as ANTHROPIC_BASE_URL is "
        "written): /v1/messages and its sub-paths are forwarded below it.",
    )
    api_key: str | None = Field(
        None,
        description="Key sent upstream as x-api-key; null forwards the client's own x-api-key "
        "(or Authorization) header.",
    )
    summarizer_model: str | None = Field(
        None,
        description="Model that summarizes (and folds the memory of) Messages sessions, asked "
        "through this upstream in Messages format with the client's key; null: the request's "
        "own model. A compaction.model (memory.model for the fold) that names a model_list "
        "route takes precedence.",
    )


class ModelRoute(_Section):
    model_name: str = Field(description="Model name clients send that selects this route.")
    litellm_params: dict[str, Any] = Field(
        description="Parameters for litellm (model: 'anthropic/...', api_key, api_base, ...)."
    )
