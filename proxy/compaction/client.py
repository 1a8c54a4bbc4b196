"""The summarizer's one network call: through the request's own route, or compaction.model's."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson

from ..errors import ProxyError, SummarizerError, UpstreamError
from ..upstream.http import Upstream
from ..upstream.litellm_route import LitellmRouter

log = logging.getLogger("proxy.pipeline")

Complete = Callable[[list[dict[str, Any]]], Awaitable[str]]


class SummarizerClient:
    """Makes summarizer calls with the credentials of the request that needed them."""

    def __init__(
        self, upstream: Upstream, router: LitellmRouter, *, model: str | None, timeout_s: float
    ) -> None:
        self.upstream = upstream
        self.router = router
        self.model = model
        self.timeout_s = timeout_s
        self.calls = 0
        self.failures = 0

    def judges_key(self, request_model: str) -> bool:
        """Whether a summarizer answer for this model came with the client's own key (its
        success then proves the provider accepts that key): no route, no upstream.api_key."""
        model = self.model or request_model
        return self.router.match(model) is None and self.upstream.config.api_key is None

    def completer(self, request_model: str, headers: Sequence[tuple[bytes, bytes]]) -> Complete:
        model = self.model or request_model
        # Keep only what authenticates the caller: the summarizer call is the proxy's own.
        kept = [(k, v) for k, v in headers if k in (b"authorization", b"x-api-key", b"api-key",
                                                      b"openai-organization", b"openai-project")]

        async def complete(prompt: list[dict[str, Any]]) -> str:
            self.calls += 1
            try:
                return await asyncio.wait_for(self._call(model, kept, prompt), self.timeout_s)
            except TimeoutError:
                self.failures += 1
                raise SummarizerError(f"summarizer timed out after {self.timeout_s:g} s") from None
            except (ProxyError, SummarizerError) as exc:
                self.failures += 1
                raise SummarizerError(str(exc)) from None

        return complete

    async def _call(
        self, model: str, headers: list[tuple[bytes, bytes]], prompt: list[dict[str, Any]]
    ) -> str:
        body: dict[str, Any] = {"model": model, "messages": prompt, "temperature": 0}
        params = self.router.match(model)
        if params is not None:
            answer = await self.router.complete(params, body)
            return _content(answer.body or b"")
        up = self.upstream
        out = up.request_headers(headers + [(b"content-type", b"application/json")])
        resp = await up.send("POST", up.url("chat/completions"), out, orjson.dumps(body))
        async with resp:
            try:
                payload = await resp.read()
            except Exception as exc:
                raise UpstreamError(f"summarizer answer broke off: {type(exc).__name__}") from None
            if resp.status != 200:
                # Status and the error's type/code only: error bodies may echo the caller's key
                # ("Incorrect API key provided: sk-..."), and this message is logged.
                raise SummarizerError(f"summarizer got HTTP {resp.status}{_error_code(payload)}")
        return _content(payload)


def _error_code(payload: bytes) -> str:
    try:
        error = orjson.loads(payload).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return ""
    if not isinstance(error, dict):
        return ""
    parts = [f"{k}={error[k]}" for k in ("type", "code")
             if isinstance(error.get(k), str) and len(error[k]) <= 64]
    return f" ({', '.join(parts)})" if parts else ""


def _content(payload: bytes) -> str:
    try:
        data = orjson.loads(payload)
        content = data["choices"][0]["message"]["content"]
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        raise SummarizerError("summarizer answer is not a chat completion") from None
    if not isinstance(content, str):
        raise SummarizerError("summarizer answer has no text")
    return content
