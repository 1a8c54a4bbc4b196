"""The summarizer's one network call: through the request's own route, or compaction.model's.

A Messages session (Claude Code, the anthropic SDK) is summarized by Anthropic: the Anthropic
upstream is asked in Messages format, with the client's own key (or ``anthropic.api_key``) and
``anthropic.summarizer_model`` (default: the request's model), so a Messages-only deployment
needs no OpenAI key. A ``compaction.model`` that names a ``model_list`` route is used instead.

Each HTTP call is billed by the provider on the session's behalf: a completer given ``on_call``
tells it of every call it makes, failed ones too (a :class:`~proxy.ledger.calls.Call` with the
answer's status and usage as it came; status 0 when no answer came: a timeout, a broken
connection), once the answer is in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

import orjson

from ..errors import ProxyError, SummarizerError, UpstreamError, UpstreamStatusError
from ..ledger.calls import Call
from ..upstream.http import Upstream
from ..upstream.litellm_route import LitellmRouter

log = logging.getLogger("proxy.pipeline")

Complete = Callable[[list[dict[str, Any]]], Awaitable[str]]
OnCall = Callable[[Call], None]


class _Report:
    """One call's report to ``on_call`` (None: nobody asked): made once, when its answer is
    in, or with status 0 when none will come to a request that was sent."""

    __slots__ = ("api", "done", "kind", "model", "on_call", "sent", "ts")

    def __init__(self, on_call: OnCall | None, kind: Literal["summarizer", "memory_fold"],
                 api: str, model: str) -> None:
        self.on_call, self.kind, self.api, self.model = on_call, kind, api, model
        self.ts = time.time()
        self.sent = self.done = False

    def sending(self) -> None:
        self.ts = time.time()
        self.sent = True

    def answered(self, status: int, payload: bytes | None) -> None:
        if self.done or not self.sent or self.on_call is None:
            return
        self.done = True
        try:
            self.on_call(Call(kind=self.kind, api=self.api, model=self.model,
                              usage=_usage(payload), ts=self.ts, status=status))
        except Exception:  # the ledger must never fail a compaction
            log.exception("reporting a %s call failed", self.kind)


def _usage(payload: bytes | None) -> Any:
    if not payload:
        return None
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    return data.get("usage") if isinstance(data, dict) else None


class SummarizerClient:
    """Makes summarizer calls with the credentials of the request that needed them."""

    def __init__(
        self, upstream: Upstream, router: LitellmRouter, *, model: str | None, timeout_s: float,
        anthropic: Upstream | None = None, anthropic_model: str | None = None,
    ) -> None:
        self.upstream = upstream
        self.router = router
        self.model = model
        self.anthropic = anthropic
        self.anthropic_model = anthropic_model
        self.timeout_s = timeout_s
        self.calls = 0
        self.failures = 0

    def _anthropic(self, api: str) -> Upstream | None:
        """The Anthropic upstream when a Messages session is summarized through it."""
        routed = self.model is not None and self.router.match(self.model) is not None
        return self.anthropic if api == "messages" and not routed else None

    def _model(self, request_model: str, api: str) -> str:
        if self._anthropic(api) is not None:
            return self.anthropic_model or request_model
        return self.model or request_model

    def judges_key(self, request_model: str, *, api: str = "chat") -> bool:
        """Whether a summarizer answer for this model came with the client's own key (its
        success then proves the provider accepts that key): no route, no upstream.api_key."""
        anthropic = self._anthropic(api)
        if anthropic is not None:
            return anthropic.config.api_key is None
        model = self._model(request_model, api)
        return self.router.match(model) is None and self.upstream.config.api_key is None

    def completer(
        self, request_model: str, headers: Sequence[tuple[bytes, bytes]], *, api: str = "chat",
        on_call: OnCall | None = None,
        kind: Literal["summarizer", "memory_fold"] = "summarizer",
    ) -> Complete:
        """Summarizer calls for a request in wire format ``api``; ``on_call`` is told of each
        HTTP call made (as ``kind``, see the module docstring)."""
        model = self._model(request_model, api)
        anthropic = self._anthropic(api)
        # Keep only what authenticates the caller: the summarizer call is the proxy's own.
        # (anthropic-beta too: an OAuth token is accepted only with its beta named.)
        kept = [(k, v) for k, v in headers if k in (b"authorization", b"x-api-key", b"api-key",
                                                      b"openai-organization", b"openai-project",
                                                      b"anthropic-version", b"anthropic-beta")]

        async def complete(prompt: list[dict[str, Any]]) -> str:
            self.calls += 1
            report = _Report(on_call, kind, "chat" if anthropic is None else "messages", model)
            call = (self._call(model, kept, prompt, report) if anthropic is None
                    else self._call_messages(anthropic, model, kept, prompt, report))
            try:
                return await asyncio.wait_for(call, self.timeout_s)
            except TimeoutError:
                self.failures += 1
                report.answered(0, None)
                raise SummarizerError(f"summarizer timed out after {self.timeout_s:g} s") from None
            except (ProxyError, SummarizerError) as exc:
                self.failures += 1
                report.answered(exc.status if isinstance(exc, UpstreamStatusError) else 0, None)
                raise SummarizerError(str(exc)) from None
            except asyncio.CancelledError:
                report.answered(0, None)  # the provider may be answering (and billing) anyway
                raise

        return complete

    async def _call(
        self, model: str, headers: list[tuple[bytes, bytes]], prompt: list[dict[str, Any]],
        report: _Report,
    ) -> str:
        body: dict[str, Any] = {"model": model, "messages": prompt, "temperature": 0}
        params = self.router.match(model)
        if params is not None:
            report.sending()
            answer = await self.router.complete(params, body)
            report.answered(answer.status, answer.body)  # litellm's translation has the usage
            return _content(answer.body or b"")
        return _content(await _post(self.upstream, "chat/completions", headers, body, report))


    async def _call_messages(
        self, up: Upstream, model: str, headers: list[tuple[bytes, bytes]],
        prompt: list[dict[str, Any]], report: _Report,
    ) -> str:
        """The summary from Anthropic's Messages API (the prompt's system messages as
        ``system``, the rest as user/assistant turns)."""
        system = "\n\n".join(str(m.get("content") or "") for m in prompt
                              if m.get("role") in ("system", "developer"))
        turns = [{"role": "assistant" if m.get("role") == "assistant" else "user",
                  "content": str(m.get("content") or "")}
                 for m in prompt if m.get("role") not in ("system", "developer")]
        body: dict[str, Any] = {"model": model, "max_tokens": _SUMMARY_MAX_TOKENS,
                                "messages": turns or [{"role": "user", "content": "Summarize."}]}
        if system:
            body["system"] = system
        if not any(k == b"anthropic-version" for k, _ in headers):
            headers = [*headers, (b"anthropic-version", b"2023-06-01")]
        payload = await _post(up, "v1/messages", headers, body, report)
        try:
            data = orjson.loads(payload)
            text = "".join(b["text"] for b in data["content"] if b.get("type") == "text")
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise SummarizerError("summarizer answer is not a Messages answer") from None
        if not text:
            raise SummarizerError("summarizer answer has no text")
        return text


# The summary's output budget on Anthropic (max_tokens is required there).
_SUMMARY_MAX_TOKENS = 8192


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


async def _post(
    up: Upstream, path: str, headers: list[tuple[bytes, bytes]], body: dict[str, Any],
    report: _Report,
) -> bytes:
    """The summarizer call's answer body; a :class:`SummarizerError` for any status but 200.
    ``report`` is told of the answer (status 0 when none came)."""
    out = up.request_headers(headers + [(b"content-type", b"application/json")])
    report.sending()
    try:
        resp = await up.send("POST", up.url(path), out, orjson.dumps(body))
    except ProxyError:
        report.answered(0, None)
        raise
    async with resp:
        try:
            payload = await resp.read()
        except Exception as exc:
            report.answered(0, None)  # no answer came whole: its usage is unknown
            raise UpstreamError(f"summarizer answer broke off: {type(exc).__name__}") from None
        report.answered(resp.status, payload)
        if resp.status != 200:
            # Status and the error's type/code only: error bodies may echo the caller's key
            # ("Incorrect API key provided: sk-..."), and this message is logged.
            raise SummarizerError(f"summarizer got HTTP {resp.status}{_error_code(payload)}")
    return payload
