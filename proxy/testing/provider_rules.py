"""Providers' refusals of the parameters and endpoints the proxy's own calls could get wrong,
as an ASGI gate in front of a fake upstream.

    gate = ProviderRules(FakeUpstream())
    with serve_in_thread(gate) as srv: ...
    assert not gate.refused

The rules, each answered with the provider's status and error shape before the fake sees the
request (so no scripted reply is consumed):

* OpenAI, chat completions and Responses: the reasoning models (GPT-5 family but
  ``gpt-5-chat*``, o-series) take only the default ``temperature`` and ``top_p`` (1): 400
  "Unsupported value: 'temperature' does not support 0 with this model. Only the default (1)
  value is supported.", ``code: unsupported_value``;
* OpenAI, chat completions: a model that is served on ``/v1/responses`` only (a ``-codex``
  model, or one the catalogue lists without chat completions) is a 404 "This model is only
  supported in v1/responses and not in v1/chat/completions.";
* Anthropic, Messages: ``temperature``, ``top_p`` or ``top_k`` on a model whose catalogue entry
  says it takes no sampling parameters, or with ``anthropic-version`` 2026-10-21 or later: 400
  ``invalid_request_error``.

The names are matched here on their own (the OpenAI rules) or read from litellm's map
(``Capabilities`` without the proxy's config): what the provider does, not what the proxy
believes, so a test of the proxy's catalogue against this gate can fail.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Final

import orjson

from ..catalog import Capabilities

__all__ = ["ProviderRules", "Refusal", "refusal"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

_SAMPLING: Final = ("temperature", "top_p", "top_k")
_REASONING: Final = re.compile(r"^(?:gpt-5(?!-chat)|o\d)")
_NO_SAMPLING_VERSION: Final = "2026-10-21"


@dataclass(frozen=True, slots=True)
class Refusal:
    path: str
    model: str
    status: int
    message: str
    body: bytes  # the error body as sent


def _bare(model: str) -> str:
    return model.strip().lower().rsplit("/", 1)[-1]


def _openai_error(status: int, message: str, param: str | None, code: str | None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": "invalid_request_error",
                                   "param": param, "code": code}})


def refusal(path: str, body: dict[str, Any], headers: dict[str, str],
            capabilities: Capabilities) -> tuple[int, bytes, str] | None:
    """The provider's answer refusing this request (status, body, message), or None."""
    model = body.get("model")
    if not isinstance(model, str):
        return None
    bare = _bare(model)
    if path.endswith(("/chat/completions", "/responses")):
        if path.endswith("/chat/completions") and (
                "-codex" in bare or not capabilities.chat_completions(model)):
            message = "This model is only supported in v1/responses and not in v1/chat/completions."
            return 404, _openai_error(404, message, "model", None), message
        if _REASONING.match(bare):
            for name in ("temperature", "top_p"):
                value = body.get(name)
                if value is not None and value != 1:
                    message = (f"Unsupported value: '{name}' does not support {value} with this "
                               "model. Only the default (1) value is supported.")
                    return 400, _openai_error(400, message, name, "unsupported_value"), message
        return None
    if path.endswith("/messages"):
        sent = [name for name in _SAMPLING if name in body]
        if not sent:
            return None
        version = headers.get("anthropic-version", "")
        if not capabilities.sampling_params(model) or version >= _NO_SAMPLING_VERSION:
            message = f"{sent[0]}: this model does not accept sampling parameters"
            error = {"type": "error",
                     "error": {"type": "invalid_request_error", "message": message}}
            return 400, orjson.dumps(error), message
    return None


class ProviderRules:
    """An ASGI gate answering what the providers refuse (see the module docstring); the rest
    goes on to ``app`` unchanged. ``refused``: every refusal, in order."""

    def __init__(self, app: App, capabilities: Capabilities | None = None) -> None:
        self.app = app
        self.capabilities = capabilities if capabilities is not None else Capabilities()
        self.refused: list[Refusal] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope["headers"]}
        found = (refusal(scope["path"], body, headers, self.capabilities)
                 if isinstance(body, dict) else None)
        if found is None:
            await self.app(scope, _replay([{"type": "http.request", "body": raw}], receive), send)
            return
        status, error, text = found
        self.refused.append(Refusal(scope["path"], str(body.get("model")), status, text, error))
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(error)).encode())]})
        await send({"type": "http.response.body", "body": error})


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` giving ``messages`` again, then the connection's own (a disconnect)."""
    queue = list(messages)

    async def replayed() -> Message:
        if queue:
            return queue.pop(0)
        return await receive()

    return replayed
