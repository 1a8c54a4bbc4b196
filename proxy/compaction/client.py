"""The network call of the proxy's own model calls (the compaction summarizer, the memory fold),
made for a request in its own wire format, on that format's upstream, with its credentials.

Where a call goes (:meth:`SummarizerClient.route`):

* a model (``compaction.model`` / ``memory.model``, else the one below) that names a
  ``model_list`` route: through litellm, with the route's own credentials, in any format;
* a Messages session (Claude Code, the anthropic SDK): Anthropic's ``/v1/messages`` with
  ``anthropic.summarizer_model`` (default: the request's model) and the client's Anthropic
  credentials, so a Messages-only deployment needs no OpenAI key;
* a Responses session (Codex): ``/v1/responses`` (the ``-codex`` models exist only there);
* a chat-completions session: ``/chat/completions``, or ``/v1/responses`` when the catalogue
  says the model is not served on chat completions (same upstream, same key: a
  ``compaction.model`` of ``gpt-5.1-codex`` works for a chat client too).

The upstream and the headers are both chosen by the request's format
(:class:`~proxy.upstream.providers.Upstreams`): a credential never reaches another provider.

No sampling parameter is sent unless ``compaction.temperature`` is set, and then only to a model
the catalogue (:mod:`proxy.catalog`) says accepts one, and not with ``anthropic-version``
2026-10-21 or later (which refuses ``temperature``, ``top_p``, ``top_k``); a value left out is
logged once per model.

A failed call raises :class:`~proxy.errors.SummarizerError` saying why (``summarizer HTTP 400:
<the provider's message, redacted>``): its caller logs it once and keeps it with the fallback it
uses. Failures are counted per status (``on_failure``; status 0: no answer).

Each HTTP call is billed by the provider on the session's behalf: a completer given ``on_call``
tells it of every call it makes, failed ones too (a :class:`~proxy.ledger.calls.Call` with the
answer's status and usage as it came; status 0 when no answer came: a timeout, a broken
connection), once the answer is in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson

from proxy.catalog import Capabilities
from proxy.errors import ProxyError, SummarizerError, UpstreamError, UpstreamStatusError
from proxy.upstream.calls import Call
from proxy.upstream.http import Upstream
from proxy.upstream.litellm_route import LitellmRouter
from proxy.upstream.providers import Upstreams
from proxy.upstream.redact import error_summary, redact

log = logging.getLogger("proxy.pipeline")

Complete = Callable[[list[dict[str, Any]]], Awaitable[str]]
OnCall = Callable[[Call], None]
CallKind = Literal["summarizer", "memory_fold"]
#: Told of each failed call: its kind and the provider's status (0: no answer came).
OnFailure = Callable[[CallKind, int], None]

# The summary's output budget on Anthropic (max_tokens is required there).
_SUMMARY_MAX_TOKENS: Final = 8192
# Anthropic's API version from which temperature, top_p and top_k are refused.
_NO_SAMPLING_VERSION: Final = "2026-10-21"
_DEFAULT_VERSION: Final = b"2023-06-01"
_SKIP_LOG_LIMIT: Final = 256  # models whose skipped temperature was logged (bounded: client names)


@dataclass(frozen=True, slots=True)
class Route:
    """Where one call goes: ``api`` is the wire format of the call itself."""

    api: Literal["chat", "responses", "messages", "litellm"]
    model: str
    upstream: Upstream | None = None  # None: litellm
    params: Mapping[str, Any] | None = None  # the model_list route's litellm_params


class _Report:
    """One call's report to ``on_call`` (None: nobody asked): made once, when its answer is
    in, or with status 0 when none will come to a request that was sent."""

    __slots__ = ("api", "done", "kind", "model", "on_call", "sent", "ts")

    def __init__(self, on_call: OnCall | None, kind: CallKind, api: str, model: str) -> None:
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
    """Makes the proxy's own model calls of one ``kind`` with the credentials of the request
    that needed them."""

    def __init__(
        self, upstreams: Upstreams, router: LitellmRouter, capabilities: Capabilities, *,
        model: str | None, timeout_s: float, anthropic_model: str | None = None,
        temperature: float | None = None, kind: CallKind = "summarizer",
        on_failure: OnFailure | None = None,
    ) -> None:
        self.upstreams = upstreams
        self.router = router
        self.capabilities = capabilities
        self.model = model
        self.anthropic_model = anthropic_model
        self.temperature = temperature
        self.kind: CallKind = kind
        self.on_failure = on_failure
        self.timeout_s = timeout_s
        self.calls = 0
        self.failures = 0
        self._skipped: set[str] = set()

    def route(self, request_model: str, api: str) -> Route:
        """Where a call for a request of ``request_model`` in wire format ``api`` goes (see
        the module docstring)."""
        routed = self.model is not None and self.router.match(self.model) is not None
        if api == "messages" and not routed:
            model = self.anthropic_model or request_model
        else:
            model = self.model or request_model
        params = self.router.match(model)
        if params is not None:
            return Route("litellm", model, params=params)
        upstream = self.upstreams.of(api)
        if api == "messages":
            return Route("messages", model, upstream)
        if api == "responses" or not self.capabilities.chat_completions(model):
            return Route("responses", model, upstream)
        return Route("chat", model, upstream)

    def judges_key(self, request_model: str, *, api: str) -> bool:
        """Whether a call's answer for this model came with the client's own key (its success
        then proves the provider accepts that key): no route, no configured key."""
        route = self.route(request_model, api)
        return route.upstream is not None and route.upstream.config.api_key is None

    def completer(
        self, request_model: str, headers: Sequence[tuple[bytes, bytes]], *, api: str,
        on_call: OnCall | None = None,
    ) -> Complete:
        """Calls for a request in wire format ``api`` (which decides the upstream and the
        credentials sent); ``on_call`` is told of each HTTP call made (see the module
        docstring)."""
        route = self.route(request_model, api)
        # Only what authenticates the caller to this format's provider: the call is the proxy's.
        kept = [] if route.upstream is None else Upstreams.credentials(api, headers)
        if route.api == "messages" and not any(k == b"anthropic-version" for k, _ in kept):
            kept.append((b"anthropic-version", _DEFAULT_VERSION))
        secrets = _secrets(kept, route.upstream)
        sampling = self._sampling(route, kept)
        kind = self.kind

        async def complete(prompt: list[dict[str, Any]]) -> str:
            self.calls += 1
            report = _Report(on_call, kind, "chat" if route.api == "litellm" else route.api,
                             route.model)
            try:
                return await asyncio.wait_for(
                    self._call(route, kept, prompt, sampling, report, secrets), self.timeout_s)
            except TimeoutError:
                self._failed(0)
                report.answered(0, None)
                raise SummarizerError(f"summarizer timed out after {self.timeout_s:g} s") from None
            except SummarizerError as exc:
                self._failed(exc.provider_status)
                report.answered(exc.provider_status, None)
                raise
            except ProxyError as exc:  # transport failures, litellm's translated errors
                status = exc.status if isinstance(exc, UpstreamStatusError) else 0
                self._failed(status)
                report.answered(status, None)
                label = f"summarizer HTTP {status}: " if status else "summarizer: "
                raise SummarizerError(label + redact(str(exc), secrets),
                                      provider_status=status) from None
            except asyncio.CancelledError:
                report.answered(0, None)  # the provider may be answering (and billing) anyway
                raise

        return complete

    def _failed(self, status: int) -> None:
        self.failures += 1
        if self.on_failure is not None:
            self.on_failure(self.kind, status)

    def _sampling(self, route: Route, headers: Sequence[tuple[bytes, bytes]]) -> dict[str, Any]:
        """``{"temperature": t}`` when one is configured and the route's model takes it."""
        temperature = self.temperature
        if temperature is None:
            return {}
        why = None
        target = route.params.get("model") if route.params is not None else None
        for name in (route.model, target):
            if isinstance(name, str) and not self.capabilities.sampling_params(name):
                why = f"the catalogue says {name} accepts no sampling parameters"
                break
        if why is None and route.api == "messages":
            version = next((v.decode("latin-1") for k, v in headers if k == b"anthropic-version"),
                           "")
            if version >= _NO_SAMPLING_VERSION:
                why = f"anthropic-version {version} refuses sampling parameters"
        if why is None:
            return {"temperature": temperature}
        if route.model not in self._skipped:
            if len(self._skipped) >= _SKIP_LOG_LIMIT:
                self._skipped.clear()
            self._skipped.add(route.model)
            log.info("compaction.temperature not sent to %s for the %s: %s", route.model,
                     self.kind.replace("_", " "), why)
        return {}

    async def _call(
        self, route: Route, headers: list[tuple[bytes, bytes]], prompt: list[dict[str, Any]],
        sampling: dict[str, Any], report: _Report, secrets: Sequence[str],
    ) -> str:
        if route.params is not None:
            body = {"model": route.model, "messages": prompt, **sampling}
            report.sending()
            answer = await self.router.complete(route.params, body)
            report.answered(answer.status, answer.body)  # litellm's translation has the usage
            return _chat_text(answer.body or b"")
        up = route.upstream
        assert up is not None
        if route.api == "messages":
            system, turns = _split(prompt)
            body = {"model": route.model, "max_tokens": _SUMMARY_MAX_TOKENS,
                    "messages": turns or [{"role": "user", "content": "Summarize."}], **sampling}
            if system:
                body["system"] = system
            return _messages_text(await _post(up, "v1/messages", headers, body, report, secrets))
        if route.api == "responses":
            system, turns = _split(prompt)
            # store: false: the proxy's call is not kept on the provider's side for later use.
            body = {"model": route.model, "input": turns, "store": False, **sampling}
            if system:
                body["instructions"] = system
            return _responses_text(await _post(up, "responses", headers, body, report, secrets))
        body = {"model": route.model, "messages": prompt, **sampling}
        return _chat_text(await _post(up, "chat/completions", headers, body, report, secrets))


def _secrets(headers: Sequence[tuple[bytes, bytes]], up: Upstream | None) -> list[str]:
    """The credentials a call is sent with, to take out of any error text it gets back."""
    out = [up.config.api_key] if up is not None and up.config.api_key else []
    for name, value in headers:
        if name in (b"authorization", b"x-api-key", b"api-key"):
            text = value.decode("latin-1").strip()
            out.append(text)
            out.append(text.split(" ", 1)[-1])  # a bearer token without its scheme
    return out


def _split(prompt: Sequence[Mapping[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """The prompt's system messages as one instruction text, the rest as user/assistant
    turns (the shape both Messages and Responses take)."""
    system = "\n\n".join(str(m.get("content") or "") for m in prompt
                         if m.get("role") in ("system", "developer"))
    turns = [{"role": "assistant" if m.get("role") == "assistant" else "user",
              "content": str(m.get("content") or "")}
             for m in prompt if m.get("role") not in ("system", "developer")]
    return system, turns


def _chat_text(payload: bytes) -> str:
    try:
        content = orjson.loads(payload)["choices"][0]["message"]["content"]
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        raise SummarizerError("summarizer answer is not a chat completion", provider_status=200) from None
    if not isinstance(content, str):
        raise SummarizerError("summarizer answer has no text", provider_status=200)
    return content


def _messages_text(payload: bytes) -> str:
    try:
        data = orjson.loads(payload)
        text = "".join(b["text"] for b in data["content"] if b.get("type") == "text")
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise SummarizerError("summarizer answer is not a Messages answer", provider_status=200) from None
    if not text:
        raise SummarizerError("summarizer answer has no text", provider_status=200)
    return text


def _responses_text(payload: bytes) -> str:
    """The output text of a Responses answer: its message items' ``output_text`` parts
    (reasoning items and the rest carry none)."""
    try:
        output = orjson.loads(payload)["output"]
        text = "".join(part["text"] for item in output if item.get("type") == "message"
                       for part in item.get("content") or () if part.get("type") == "output_text")
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise SummarizerError("summarizer answer is not a Responses answer", provider_status=200) from None
    if not text:
        raise SummarizerError("summarizer answer has no text", provider_status=200)
    return text


async def _post(
    up: Upstream, path: str, headers: list[tuple[bytes, bytes]], body: dict[str, Any],
    report: _Report, secrets: Sequence[str],
) -> bytes:
    """The call's answer body; a :class:`SummarizerError` for any status but 200, with the
    provider's error message redacted (error bodies may echo the caller's key, and this
    message is logged and stored). ``report`` is told of the answer (status 0: none came)."""
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
            why = error_summary(payload, secrets)
            raise SummarizerError(f"summarizer HTTP {resp.status}" + (f": {why}" if why else ""),
                                  provider_status=resp.status)
    return payload
