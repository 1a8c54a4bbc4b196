"""Routes chosen client model names to non-OpenAI providers through litellm.

Raw OpenAI-compatible upstreams are forwarded as bytes elsewhere; this module is only for the
`model_list` entries of the config, whose `litellm_params.model` names a litellm provider route
(`anthropic/claude-...`, `gemini/...`, ...).  litellm translates the OpenAI request for the
provider and the provider's answer back; we serialize that answer into the same bytes an
OpenAI upstream would have sent, so the rest of the proxy never knows the difference.

litellm costs seconds to import, so it is imported on the first request that needs it, in a
worker thread so the event loop keeps serving the other connections meanwhile.  Everything
that would make it reach the network on its own (model cost map, telemetry, callbacks) is
switched off before or right after the import.

What reaches litellm from the client's body is an allowlist (`PASSTHROUGH`).  Everything else
is dropped, on purpose: litellm's `acompletion(**kwargs)` mixes provider parameters with its own
control knobs (`api_base`, `base_url`, `mock_response`, `custom_llm_provider`, `extra_headers`,
`model_list`, ...), so forwarding unknown client fields would let a client send the route's
API key to a server of its choosing.  The route's `litellm_params` are trusted config and are
passed as they are, overriding the body.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import re
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

import orjson

from proxy.errors import (
    ConfigError,
    ProxyError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeout,
)

log = logging.getLogger("proxy.upstream.litellm")

# OpenAI chat-completions fields litellm's acompletion() takes as named parameters and maps
# per provider (with drop_params on, those a provider lacks are dropped rather than rejected).
# `thinking` (Anthropic extended thinking) and `top_k` are not OpenAI fields but are the
# common ones clients send through OpenAI SDKs' extra_body; litellm forwards them natively.
PASSTHROUGH: Final = frozenset(
    {
        "messages",
        "functions",
        "function_call",
        "temperature",
        "top_p",
        "top_k",
        "n",
        "stream",
        "stream_options",
        "stop",
        "max_tokens",
        "max_completion_tokens",
        "modalities",
        "prediction",
        "audio",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "user",
        "metadata",
        "response_format",
        "seed",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "logprobs",
        "top_logprobs",
        "reasoning_effort",
        "verbosity",
        "safety_identifier",
        "service_tier",
        "store",
        "prompt_cache_key",
        "prompt_cache_retention",
        "web_search_options",
        "thinking",
    }
)

# LiteLLM proxy configs put load-balancer settings into litellm_params; acompletion() would
# treat them as provider parameters and send them in the provider's request body.
_ROUTER_ONLY: Final = frozenset({"rpm", "tpm", "max_parallel_requests", "order", "weight"})

# Route params whose values are credentials; scrubbed from any message we pass on.
_SECRET_KEY = re.compile(r"key|token|secret|password|credential", re.IGNORECASE)

_LITELLM_PREFIX = re.compile(r"^(?:litellm\.\w+:\s*)+")
_HANDLE_WITH = re.compile(r"\.?\s*Handle with `litellm\.\w+`\.?\s*$")
_PROVIDER_PREFIX = re.compile(r"^\w*(?:Exception|Error)(?:\s+\w+Error)?\s+-\s+")

_CODE_BY_STATUS: Final[Mapping[int, str]] = MappingProxyType(
    {
        400: "invalid_request",
        401: "invalid_api_key",
        403: "permission_denied",
        404: "not_found",
        408: "upstream_timeout",
        422: "invalid_request",
        429: "rate_limit_exceeded",
        503: "service_unavailable",
        529: "overloaded",
    }
)

_DONE: Final = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class LitellmAnswer:
    """A provider's answer as OpenAI wire bytes.

    Exactly one of `body` (non-stream `chat.completion` JSON) and `chunks` (SSE events, each
    `b"data: ...\\n\\n"`, ending with `b"data: [DONE]\\n\\n"`) is set.  `chunks` is an async
    generator holding the provider connection open: iterate it to the end or `aclose()` it.
    A failure after the first chunk ends `chunks` with one `data: {"error": {...}}` event and
    no `[DONE]`, as OpenAI does; the OpenAI SDK raises APIError on that event.
    """

    body: bytes | None = None
    chunks: AsyncIterator[bytes] | None = None
    status: int = 200

    @property
    def is_stream(self) -> bool:
        return self.chunks is not None


class LitellmRouter:
    """The `model_list` routes; one instance per app, created in the lifespan."""

    def __init__(self, routes: Sequence[Mapping[str, Any]], *, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._routes: dict[str, Mapping[str, Any]] = {}
        for i, route in enumerate(routes):
            name = route.get("model_name")
            params = route.get("litellm_params")
            if not isinstance(name, str) or not name:
                raise ConfigError(f"model_list[{i}]: model_name must be a non-empty string")
            if not isinstance(params, Mapping) or not isinstance(params.get("model"), str):
                raise ConfigError(f"model_list[{i}] ({name}): litellm_params.model is required")
            if name in self._routes:
                # LiteLLM proxy load-balances duplicate names; we do not, and silently using
                # only the first deployment would surprise whoever wrote the config.
                raise ConfigError(
                    f"model_list[{i}]: model_name {name!r} appears twice; "
                    "load balancing across deployments is not supported"
                )
            # A read-only copy: the config object may be mutated later, and callers of
            # match() get a view they cannot change under us.
            self._routes[name] = MappingProxyType(dict(params))
        self._module: Any = None
        self._import_lock = asyncio.Lock()

    @property
    def model_names(self) -> frozenset[str]:
        return frozenset(self._routes)

    def match(self, model: str) -> Mapping[str, Any] | None:
        """The litellm_params of the route named exactly `model` (no wildcards)."""
        return self._routes.get(model)

    # -- litellm import ---------------------------------------------------------------------

    def _litellm(self) -> Any:
        """litellm, imported on first use and cached on this instance."""
        if self._module is not None:
            return self._module
        # Read at import time: the bundled model cost map instead of fetching it from GitHub,
        # and no other fetches litellm would do on its own.
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        os.environ.setdefault("LITELLM_OFFLINE_MODE", "true")
        module: Any = importlib.import_module("litellm")
        # litellm's "Give Feedback / Get Help" prints on every exception.
        module.suppress_debug_info = True
        # litellm's async calls default to an aiohttp transport; httpx is what respx intercepts
        # in tests and keeps litellm's connections out of our aiohttp session's accounting.
        module.disable_aiohttp_transport = True
        # No prompts or answers in litellm's logging objects.
        module.turn_off_message_logging = True
        # Callbacks are litellm's logging/telemetry hooks; none must be registered here.
        # (1.110 has no `litellm.telemetry` flag any more: that name is the subpackage of the
        # LiteLLM proxy's opt-in telemetry, off unless configured, so it is left alone.)
        for name in ("callbacks", "success_callback", "failure_callback", "input_callback"):
            setattr(module, name, [])
        self._module = module
        return module

    async def _load(self) -> Any:
        if self._module is None:
            async with self._import_lock:
                if self._module is None:
                    # Seconds of imports; in a thread so other requests keep flowing.
                    await asyncio.to_thread(self._litellm)
        return self._module

    # -- calls ------------------------------------------------------------------------------

    def _kwargs(self, params: Mapping[str, Any], body: Mapping[str, Any]) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            k: v for k, v in body.items() if k in PASSTHROUGH and v is not None
        }
        dropped = sorted(k for k in body if k not in PASSTHROUGH and k != "model")
        if dropped:
            log.debug("litellm route %s: dropped request fields %s", params.get("model"), dropped)
        if isinstance(kwargs.get("metadata"), Mapping):
            # litellm writes its timing data into the metadata dict it is given.
            kwargs["metadata"] = dict(kwargs["metadata"])
        kwargs.update({k: v for k, v in params.items() if k not in _ROUTER_ONLY})
        # complete() picks the answer shape from this, so litellm must see the same bool.
        kwargs["stream"] = kwargs.get("stream") is True
        if not kwargs["stream"]:
            kwargs.pop("stream_options", None)  # meaningless without a stream
        kwargs.setdefault("timeout", self._timeout_s)
        # Clients send OpenAI-only knobs (presence_penalty, n=1, logprobs...) routinely; a
        # route wanting them rejected instead can set drop_params: false.
        kwargs.setdefault("drop_params", True)
        return kwargs

    async def complete(
        self, params: Mapping[str, Any], body: dict[str, Any], *,
        on_usage: Callable[[Any], None] | None = None,
    ) -> LitellmAnswer:
        """Run one chat completion through litellm; raise ProxyError subclasses on failure.

        A streaming call's first chunk is awaited here, so errors the provider reports before
        any output still become an HTTP error status rather than a 200 with an error event.
        ``on_usage`` is told the answer's usage (the provider billed it) when the stream has
        ended, whether or not the client asked for a usage chunk (a whole answer carries it in
        its body).
        """
        litellm = await self._load()
        kwargs = self._kwargs(params, body)
        requested = body.get("model")
        client_model = requested if isinstance(requested, str) and requested else None
        secrets = _secrets(params)
        stream: bool = kwargs["stream"]
        options = kwargs.get("stream_options")
        # What the client asked to see; not what litellm is asked for.
        include_usage = isinstance(options, Mapping) and options.get("include_usage") is True
        if stream and on_usage is not None and not include_usage:
            # litellm hands a stream's usage over only when asked, and the provider bills the
            # call either way: asked for here, kept from the client by _sse.
            given = options if isinstance(options, Mapping) else {}
            kwargs["stream_options"] = {**given, "include_usage": True}
        try:
            response = await litellm.acompletion(**kwargs)
        except ProxyError:
            raise
        except Exception as exc:  # litellm raises openai, httpx and plain errors alike
            raise self._error(exc, secrets) from exc
        if not stream:
            data = _clean(response.model_dump(mode="json"))
            _fix_choices(data, stream=False)
            if client_model is not None:
                data["model"] = client_model
            if on_usage is not None and data.get("usage") is not None:
                on_usage(data["usage"])
            return LitellmAnswer(body=orjson.dumps(data))

        iterator = response.__aiter__()
        try:
            first = await iterator.__anext__()
        except StopAsyncIteration:
            first = None
        except BaseException as exc:
            await _aclose(response)
            if isinstance(exc, Exception):
                raise self._error(exc, secrets) from exc
            raise
        return LitellmAnswer(
            chunks=self._sse(response, iterator, first, client_model, include_usage, secrets,
                             on_usage)
        )

    async def _sse(
        self,
        response: Any,
        iterator: Any,
        first: Any,
        client_model: str | None,
        include_usage: bool,
        secrets: Sequence[str],
        on_usage: Callable[[Any], None] | None = None,
    ) -> AsyncIterator[bytes]:
        # Exactly one usage chunk (choices: []) goes out, last, and only when asked for:
        # litellm's own usage chunk is held back until the stream ends, and usage riding on
        # content chunks is stripped (remembered in case no usage chunk comes).
        usage_chunk: dict[str, Any] | None = None
        last_usage: Any = None
        last_chunk: dict[str, Any] | None = None
        chunk = first
        try:
            while chunk is not None:
                data = _clean(chunk.model_dump(mode="json"))
                if client_model is not None:
                    data["model"] = client_model
                usage = data.pop("usage", None)
                if not data.get("choices"):
                    if usage is not None:
                        usage_chunk = {**data, "choices": [], "usage": usage}
                else:
                    if usage is not None:
                        last_usage = usage
                    _fix_choices(data, stream=True)
                    last_chunk = data
                    yield b"data: " + orjson.dumps(data) + b"\n\n"
                try:
                    chunk = await iterator.__anext__()
                except StopAsyncIteration:
                    chunk = None
        except Exception as exc:  # noqa: BLE001 - any failure must end the stream cleanly
            # Status and headers are gone; the OpenAI way is an error event and no [DONE]
            # (the OpenAI SDK raises on the event; a raw SSE reader sees no [DONE] and knows
            # the answer is incomplete).
            error = self._error(exc, secrets)
            log.warning("litellm stream failed mid-answer: %s", error.message)
            yield b"data: " + orjson.dumps(error.envelope()) + b"\n\n"
            return
        finally:
            await _aclose(response)
        if on_usage is not None:
            billed = usage_chunk["usage"] if usage_chunk is not None else last_usage
            if billed is not None:
                on_usage(billed)
        if include_usage:
            if usage_chunk is None and last_usage is not None and last_chunk is not None:
                usage_chunk = {
                    k: last_chunk[k]
                    for k in ("id", "object", "created", "model")
                    if k in last_chunk
                }
                usage_chunk.update(choices=[], usage=last_usage)
            if usage_chunk is not None:
                yield b"data: " + orjson.dumps(usage_chunk) + b"\n\n"
        yield _DONE

    # -- errors -----------------------------------------------------------------------------

    def _error(self, exc: BaseException, secrets: Sequence[str]) -> ProxyError:
        """Map a litellm exception onto the proxy's error tree."""
        self._litellm()  # normally loaded already; never import it without the env set up
        errors = importlib.import_module("litellm.exceptions")
        import httpx  # litellm's own dependency, loaded with it

        if isinstance(exc, ProxyError):
            return exc
        if isinstance(exc, errors.MidStreamFallbackError):
            original = getattr(exc, "original_exception", None)
            if isinstance(original, BaseException) and original is not exc:
                return self._error(original, secrets)
        raw = _redact(str(getattr(exc, "message", None) or exc), secrets)
        message, code = _provider_message(raw)
        # Order matters: litellm.Timeout has status_code 408 and APIConnectionError 500, and a
        # refused connection arrives as InternalServerError(500) with the httpx error as cause.
        if isinstance(exc, errors.Timeout) or _caused_by(exc, httpx.TimeoutException):
            return UpstreamTimeout(f"provider timed out: {message}")
        if isinstance(exc, errors.APIConnectionError) or _caused_by(
            exc, (httpx.TransportError, OSError)
        ):
            return UpstreamError(f"provider unreachable: {message}")
        status = _status(getattr(exc, "provider_status_code", None)) or _status(
            getattr(exc, "status_code", None)
        )
        if status is not None:
            return UpstreamStatusError(
                message, status=status, code=code or _CODE_BY_STATUS.get(status, "upstream_error")
            )
        log.exception("litellm raised an unmapped exception", exc_info=exc)
        return UpstreamError(f"litellm failed: {type(exc).__name__}: {message}")


# -- helpers ---------------------------------------------------------------------------------


def _status(value: object) -> int | None:
    return value if isinstance(value, int) and 400 <= value <= 599 else None


def _caused_by(
    exc: BaseException, types: type[BaseException] | tuple[type[BaseException], ...]
) -> bool:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, types):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _secrets(params: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple(
        v for k, v in params.items() if _SECRET_KEY.search(k) and isinstance(v, str) and len(v) >= 4
    )


def _redact(text: str, secrets: Sequence[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "[redacted]")
    return text


def _provider_message(raw: str) -> tuple[str, str | None]:
    """The provider's own message and error type out of litellm's exception text.

    litellm formats them as `litellm.AuthenticationError: AnthropicException - {json body}`
    (sometimes the body is a bytes repr); the provider JSON usually follows one of the
    `{"error": {"message", "type"}}` shapes.
    """
    text = _HANDLE_WITH.sub("", _LITELLM_PREFIX.sub("", raw.strip()))
    text = _PROVIDER_PREFIX.sub("", text)
    start = text.find("{")
    if start != -1:
        try:
            parsed, _ = _raw_json(text[start:])
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            error = parsed.get("error", parsed)
            if isinstance(error, dict) and isinstance(error.get("message"), str):
                code = error.get("type") or error.get("code") or error.get("status")
                return error["message"], code if isinstance(code, str) else None
            if isinstance(error, str):
                return error, None
    return text or raw, None


def _raw_json(text: str) -> tuple[Any, int]:
    # orjson has no raw_decode; the provider body may be followed by litellm's trailing text.
    return json.JSONDecoder().raw_decode(text)


def _clean(value: Any) -> Any:
    """Drop None fields and litellm's empty provider_specific_fields, recursively.

    litellm's pydantic models dump every optional field as null; OpenAI omits most of them.
    Non-null litellm extras (reasoning_content, thinking_blocks, cache token counts) stay:
    OpenAI clients ignore unknown fields and some agents use them.
    """
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if v is None:
                continue
            v = _clean(v)
            if k == "provider_specific_fields" and not v:
                continue
            out[k] = v
        return out
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _fix_choices(data: dict[str, Any], *, stream: bool) -> None:
    # The nulls OpenAI always sends and clients index without .get().
    for choice in data.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        choice.setdefault("finish_reason", None)
        choice.setdefault("logprobs", None)
        if stream:
            choice.setdefault("delta", {})
        else:
            message = choice.setdefault("message", {})
            if isinstance(message, dict):
                message.setdefault("role", "assistant")
                message.setdefault("content", None)


async def _aclose(response: Any) -> None:
    close = getattr(response, "aclose", None)
    if close is None:
        return
    try:
        await close()
    except Exception:  # cleanup must not mask the answer or the original error
        log.debug("closing litellm stream failed", exc_info=True)
