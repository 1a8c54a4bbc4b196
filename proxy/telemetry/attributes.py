"""What a request's span says, as plain dicts (pure: no OpenTelemetry import).

The names follow the OpenTelemetry GenAI semantic conventions for a client inference span
(``gen_ai.*``, ``server.*``, ``error.type``; development status, so where the conventions are
mid-rename both names are sent: ``gen_ai.provider.name`` and the older ``gen_ai.system``, and
``gen_ai.usage.cache_creation.input_tokens`` and the newer ``cache_write``); what only ctxproxy
knows is under ``ctxproxy.*``. Nothing here ever carries message content or keys: counts, names
and the session and tenant ids (docs/observability.md#the-span).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final
from urllib.parse import urlsplit

from proxy.errors import ProxyError
from proxy.store.ledger_entry import LedgerEntry
from proxy.usage import Usage

__all__ = [
    "OPERATION",
    "Attributes",
    "end_attributes",
    "ledger_attributes",
    "pipeline_attributes",
    "provider_of",
    "request_attributes",
    "server_of",
    "span_name",
]

Attributes = dict[str, Any]

# Every wire format the pipeline serves is a chat: a conversation in, the next message out.
OPERATION: Final = "chat"

# litellm's provider prefix (model_list routes) -> the conventions' well-known provider name.
_LITELLM_PROVIDERS: Final[Mapping[str, str]] = {
    "openai": "openai", "anthropic": "anthropic", "bedrock": "aws.bedrock",
    "vertex_ai": "gcp.vertex_ai", "gemini": "gcp.gemini", "azure": "azure.ai.openai",
    "azure_ai": "azure.ai.inference", "mistral": "mistral_ai", "cohere": "cohere",
    "groq": "groq", "deepseek": "deepseek", "perplexity": "perplexity", "xai": "x_ai",
    "watsonx": "ibm.watsonx.ai",
}
_DEFAULT_PORTS: Final[Mapping[str, int]] = {"http": 80, "https": 443}


def span_name(model: str) -> str:
    """``{gen_ai.operation.name} {gen_ai.request.model}``, as the conventions name the span."""
    return f"{OPERATION} {model}" if model else OPERATION


def provider_of(api: str, route: Mapping[str, Any] | None = None) -> str:
    """The provider as the proxy best knows it: a litellm route's prefix, else the wire format's
    (Anthropic's Messages, OpenAI's chat completions and Responses, whatever server speaks
    them)."""
    if route is not None:
        model = route.get("model")
        prefix, slash, _ = model.partition("/") if isinstance(model, str) else ("", "", "")
        if not slash:
            return "openai"
        return _LITELLM_PROVIDERS.get(prefix, prefix)
    return "anthropic" if api == "messages" else "openai"


def server_of(base_url: str | None) -> tuple[str, int] | None:
    """``server.address`` and ``server.port`` of an upstream's base URL (None: none known)."""
    if not base_url:
        return None
    try:
        parts = urlsplit(base_url)
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        return None
    if not parts.hostname or port is None:
        return None
    return parts.hostname, port


def request_attributes(
    api: str, model: str, session: str, tenant: str, *, provider: str,
    server: tuple[str, int] | None, stream: bool,
) -> Attributes:
    """What is known when the span starts: after the request is parsed."""
    attrs: Attributes = {
        "gen_ai.operation.name": OPERATION,
        "gen_ai.provider.name": provider,
        "gen_ai.system": provider,
        "gen_ai.request.model": model,
        "gen_ai.conversation.id": session,
        "ctxproxy.api": api,
        "ctxproxy.session": session,
        "ctxproxy.tenant": tenant,
    }
    if stream:
        attrs["gen_ai.request.stream"] = True
    if server is not None:
        attrs["server.address"], attrs["server.port"] = server
    return attrs


def pipeline_attributes(stats: Mapping[str, int], elapsed_ms: float) -> Attributes:
    """The pipeline's figures (the ones the x-ctxproxy-* headers carry, and its time)."""
    attrs: Attributes = {"ctxproxy.pipeline.duration_s": elapsed_ms / 1000}
    if "tokens_in" in stats:
        attrs["ctxproxy.tokens.sent"] = int(stats["tokens_in"])
    if "tokens_out" in stats:
        attrs["ctxproxy.tokens.forwarded"] = int(stats["tokens_out"])
    attrs["ctxproxy.offloaded"] = int(stats.get("offloaded", 0))
    compacted = bool(stats.get("compacted", 0))
    attrs["ctxproxy.compacted"] = compacted
    attrs["ctxproxy.compaction"] = bool(stats.get("compactions", 0))
    if compacted:
        # The conventions' own flag is set only when true ("SHOULD NOT set it to false").
        attrs["gen_ai.conversation.compacted"] = True
    return attrs


def end_attributes(
    status: int | None, error: BaseException | None, disconnected: bool, rounds: int,
) -> tuple[Attributes, str | None]:
    """The attributes known when the response ends, and the span's error type (None: it
    succeeded). An exception's status is the one the proxy answers it with."""
    attrs: Attributes = {"ctxproxy.read_rounds": rounds}
    error_type: str | None = None
    if disconnected:
        error_type = "client_disconnected"
    elif error is not None:
        error_type = type(error).__qualname__
        if status is None and isinstance(error, Exception):
            # What the app's error handlers answer it with; a cancelled task answers nothing.
            status = error.status if isinstance(error, ProxyError) else 500
    elif status is not None and status >= 400:
        error_type = str(status)
    if status is not None:
        attrs["http.response.status_code"] = status
    if error_type is not None:
        attrs["error.type"] = error_type
    return attrs, error_type


def ledger_attributes(
    entry: LedgerEntry, rounds: Sequence[LedgerEntry] = (), response_model: str | None = None,
) -> Attributes:
    """The provider's usage and the costs: of the request's first call and of its read-tool
    rounds, summed (the span covers the client's whole request); the counterfactual and why the
    cache broke are the request's own."""
    billed = entry.billed
    for extra in rounds:
        billed = billed + extra.billed
    attrs: Attributes = usage_attributes(billed)
    costs = [e.cost for e in (entry, *rounds) if e.cost is not None]
    if costs:
        attrs["ctxproxy.cost.usd"] = sum(costs)
    if entry.direct_cost is not None:
        attrs["ctxproxy.cost.direct_usd"] = entry.direct_cost
    if entry.cache_reason:
        attrs["ctxproxy.cache.reason"] = entry.cache_reason
    attrs["ctxproxy.usage.estimated"] = entry.estimated or any(e.estimated for e in rounds)
    if response_model:
        attrs["gen_ai.response.model"] = response_model
    return attrs


def usage_attributes(usage: Usage) -> Attributes:
    """``gen_ai.usage.*``: input tokens count every prompt token, cached or written included."""
    attrs: Attributes = {
        "gen_ai.usage.input_tokens": usage.prompt,
        "gen_ai.usage.output_tokens": usage.output,
        "gen_ai.usage.cache_read.input_tokens": usage.cache_read,
        "gen_ai.usage.cache_creation.input_tokens": usage.cache_write,
        "gen_ai.usage.cache_write.input_tokens": usage.cache_write,
    }
    if usage.reasoning:
        attrs["gen_ai.usage.reasoning.output_tokens"] = usage.reasoning
    return attrs
