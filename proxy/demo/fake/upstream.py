"""A scriptable fake model upstream (raw ASGI, fast enough for benchmarks): OpenAI chat
completions and Responses, and Anthropic Messages, each answered from the same :class:`Reply`
scripts.

    fake = FakeUpstream()
    fake.script(Reply(content="hi"), Reply(tool_calls=[{"name": "ls", "arguments": {}}]))
    with serve_in_thread(fake) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-test")
        ...
    assert fake.received[0].json()["model"] == "gpt-x"

Standalone (benchmarks in another process)::

    python -m proxy.demo.fake.upstream --port 0   # prints "READY http://127.0.0.1:PORT"

Preserved thinking: ``FakeUpstream(prefix_check=True)`` (or the attribute) checks the thinking
blocks of every Messages request as the newer Claude models do (:mod:`.prefix_check`): a block
whose prefix changed since the fake signed it, or whose signature it never issued, gets
Anthropic's 400 (before any SSE event on a streaming request), counted in ``refused``; with the
``thinking-binding-controls-2026-08-01`` beta and ``"drop_block"`` as
``thinking.block_binding.prefix_mismatch_behavior`` the blocks are dropped instead
(``dropped``) and the answer lists them in ``input_transformations``. Its answers' thinking blocks carry signatures
bound to the request as received.

Prompt caching: ``FakeUpstream(prompt_cache=True)`` (or the attribute; ``--prompt-cache``
standalone) reports every model request's usage, where its reply scripts none, as the
provider would bill it under prompt caching (:mod:`.prompt_cache`): Anthropic's explicit
``cache_control`` caching (reads, and writes split 5m / 1h) and OpenAI's automatic one (prompts
of 1024+ tokens, reads in 128-token steps), per API key and model, expiring after 5 minutes
unused (1 hour with a ``"ttl": "1h"`` marker) on ``fake.clock`` (``time.monotonic``; a test
moves it on). Each request's share is in ``received[i].prompt``.

Strict mode (on by default; ``FakeUpstream(strict=False)``, the attribute, or ``--no-strict``
standalone, to turn it off): every model request is checked against the provider's documented
validation rules (:mod:`.provider_rules`: roles, tool call pairing, mid-conversation system
messages, cache breakpoints, per-model parameters...) before it is answered; an invalid one
gets the provider's refusal (HTTP 400, or 404 for a Responses-only model on chat completions,
in the format's own envelope, with the provider's message), consumes no scripted reply and is
recorded in ``invalid`` (:class:`RuleVerdict`). ``model_rules`` (:class:`.ModelRules`) says which
models take what; a name it does not know gets the permissive defaults.

Threading: the app runs on the server's loop/thread while tests read ``received`` etc.
from theirs; only appends/atomic deque ops cross threads, so no locks are needed.
Serve one FakeUpstream from one server (loop) at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import orjson

from proxy.demo.fake.asgi import (
    AbortConnection,
    Receive,
    Scope,
    Send,
    quiet_abort_logs,
    read_request,
    send_bytes,
    sleep_or_disconnect,
    until_disconnect,
)
from proxy.demo.fake.asgi import Message as Message
from proxy.demo.fake.messages import (
    MESSAGES,
    count_tokens_body,
    message_body,
    message_events,
    messages_error_body,
)
from proxy.demo.fake.prefix_check import (
    HEADER_REQUIRED_MESSAGE,
    Binder,
    Failure,
    beta_enabled,
    block_binding_of,
)
from proxy.demo.fake.prompt_cache import PromptCache, cache_key
from proxy.demo.fake.replies import CREATED as CREATED
from proxy.demo.fake.replies import (
    DONE,
    JSON_CT,
    SSE_HEADERS,
    ErrorDetail,
    Received,
    Reply,
    echo_body,
    embeddings_body,
    error_body,
    model_object,
    reply_headers,
)
from proxy.demo.fake.responses import RESPONSES
from proxy.demo.fake.rules import (
    DEFAULT_MODEL_RULES,
    ModelRules,
    Violation,
    check_chat,
    check_messages,
    check_responses,
)
from proxy.demo.fake.wire import CHAT, WireFormat, whole_body

__all__ = [
    "CHAT_PATHS",
    "COUNT_TOKENS_PATHS",
    "MESSAGES_PATHS",
    "RESPONSES_PATHS",
    "FakeUpstream",
    "PrefixVerdict",
    "Received",
    "Reply",
    "RuleVerdict",
    "error_body",
    "main",
]

log = logging.getLogger(__name__)

Responder = Callable[[dict[str, Any]], "Reply | str | None"]

CHAT_PATHS = frozenset({"/v1/chat/completions", "/chat/completions"})
RESPONSES_PATHS = frozenset({"/v1/responses", "/responses"})
MESSAGES_PATHS = frozenset({"/v1/messages", "/messages"})
COUNT_TOKENS_PATHS = frozenset({"/v1/messages/count_tokens", "/messages/count_tokens"})
_MODELS_PATHS = frozenset({"/v1/models", "/models"})
_EMBEDDINGS_PATHS = frozenset({"/v1/embeddings", "/embeddings"})
# POST routes answered from a Reply, and the wire format each answers in
_MODEL_ROUTES: dict[str, WireFormat] = {
    **dict.fromkeys(CHAT_PATHS, CHAT),
    **dict.fromkeys(RESPONSES_PATHS, RESPONSES),
    **dict.fromkeys(MESSAGES_PATHS, MESSAGES),
}


@dataclass(frozen=True, slots=True)
class PrefixVerdict:
    """A Messages request the prefix check refused (``message``: the 400's) or dropped blocks
    of (``message`` empty); ``failures``: the failing thinking blocks, first one first."""

    received: Received
    message: str
    failures: tuple[Failure, ...]
    #: a dropped request as the model was shown it: without the failing blocks
    shown: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class RuleVerdict:
    """A model request strict mode refused: the request as received, the rule it broke
    (:attr:`.Violation.rule`) and the provider's message; ``violation`` has the rest."""

    received: Received
    rule: str
    message: str
    violation: Violation


def _violation_body(fmt: WireFormat, violation: Violation, seq: int) -> bytes:
    """The refusal in ``fmt``'s envelope, ``param`` and ``code`` as the provider sends them
    (null included: OpenAI's 404 for a Responses-only model has no code)."""
    if fmt.name == MESSAGES.name:
        return messages_error_body(
            violation.status, ErrorDetail(violation.message, "invalid_request_error"), seq)
    return orjson.dumps({"error": {"message": violation.message, "type": "invalid_request_error",
                                   "param": violation.param, "code": violation.code}})


class FakeUpstream:
    """ASGI3 app faking OpenAI- and Anthropic-compatible APIs; see the module docstring and
    :class:`Reply`.

    Routes answered from scripted replies (the "model requests"), each with or without
    ``/v1``: POST /chat/completions (OpenAI chat), POST /responses (OpenAI Responses),
    POST /messages (Anthropic Messages; any query string, e.g. ``?beta=true``). Also
    POST /v1/messages/count_tokens (an estimate from the request size), GET /v1/models[/ID],
    POST /v1/embeddings; anything else -> 200 JSON echo
    ``{method, path, query, body_len, headers}``. Every request is recorded.
    Reply choice per model request, whatever its format: ``script()`` queue (FIFO) >
    ``responder(body)`` if it returns non-None > ``default``. A ``str`` anywhere means
    ``Reply(content=str)``.
    ``record=False`` keeps only the counters (for long benchmarks: lists grow unbounded).
    """

    def __init__(
        self,
        *,
        default: Reply | None = None,
        responder: Responder | None = None,
        models: Sequence[str] = ("fake-model",),
        embedding_dim: int = 8,
        record: bool = True,
        prefix_check: bool = False,
        prompt_cache: bool = False,
        strict: bool = True,
        model_rules: ModelRules = DEFAULT_MODEL_RULES,
    ) -> None:
        self._initial = (
            dataclasses.replace(default) if default is not None else Reply(),
            responder,
            prefix_check,
            prompt_cache,
            strict,
            model_rules,
        )
        #: refuse model requests the provider would refuse (see the module docstring)
        self.strict = strict
        #: which models take what, for strict mode's model-specific rules
        self.model_rules = model_rules
        #: model requests strict mode refused (always recorded)
        self.invalid: list[RuleVerdict] = []
        #: report usage as under the provider's prompt cache (see the module docstring)
        self.prompt_cache = prompt_cache
        #: the prompts cached so far, per (credential, model)
        self.cache = PromptCache()
        #: the prompt cache's time (seconds); a test replaces it to make entries expire
        self.clock: Callable[[], float] = time.monotonic
        #: check thinking blocks' prefixes on Messages requests (see the module docstring)
        self.prefix_check = prefix_check
        #: the signatures the prefix check issued, and the checker
        self.binder = Binder()
        #: Messages requests the prefix check answered 400 (always recorded)
        self.refused: list[PrefixVerdict] = []
        #: Messages requests whose failing blocks were dropped (``drop_block``)
        self.dropped: list[PrefixVerdict] = []
        self.default: Reply = default if default is not None else Reply()
        self.responder: Responder | None = responder
        self.embedding_dim = embedding_dim
        self.record = record
        self.models = tuple(models)
        self._queue: deque[Reply] = deque()
        self.received: list[Received] = []
        #: requests the fake answered completely
        self.completed: list[Received] = []
        #: requests whose client went away before the fake finished answering
        self.cancelled: list[Received] = []
        #: requests the fake deliberately broke (``break_after_events``)
        self.aborted: list[Received] = []
        self.request_count = 0
        self.completed_count = 0
        self.cancelled_count = 0
        self.aborted_count = 0
        self._seq = 0  # numbers the model requests: ids, request-id headers

    # --- configuration -------------------------------------------------------------------

    @property
    def models(self) -> tuple[str, ...]:
        return self._models

    @models.setter
    def models(self, ids: Sequence[str]) -> None:
        self._models = tuple(ids)
        self._model_objs = {m: model_object(m) for m in self._models}
        data = list(self._model_objs.values())
        self._models_body = orjson.dumps({"object": "list", "data": data})

    def script(self, *replies: Reply | str) -> None:
        """Queue replies for the next model requests (any format), consumed first-in first-out."""
        self._queue.extend(Reply(content=r) if isinstance(r, str) else r for r in replies)

    @property
    def pending(self) -> int:
        """Scripted replies not consumed yet."""
        return len(self._queue)

    def reset(self) -> None:
        """Forget records, counters and the script; restore constructor default/responder."""
        self._queue.clear()
        for lst in (self.received, self.completed, self.cancelled, self.aborted):
            lst.clear()
        self.refused.clear()
        self.dropped.clear()
        self.invalid.clear()
        self.binder.clear()
        self.request_count = self.completed_count = self.cancelled_count = 0
        self.aborted_count = self._seq = 0
        self.default = dataclasses.replace(self._initial[0])
        self.responder = self._initial[1]
        self.prefix_check = self._initial[2]
        self.prompt_cache = self._initial[3]
        self.strict = self._initial[4]
        self.model_rules = self._initial[5]
        self.cache.clear()
        self.clock = time.monotonic

    def wait_for(
        self,
        predicate: Callable[[FakeUpstream], bool],
        timeout: float = 5.0,
        interval: float = 0.005,
    ) -> bool:
        """Poll ``predicate(self)`` (blocking; the server runs in another thread) until true."""
        deadline = time.monotonic() + timeout
        while not predicate(self):
            if time.monotonic() >= deadline:
                return False
            time.sleep(interval)
        return True

    async def wait_for_async(
        self,
        predicate: Callable[[FakeUpstream], bool],
        timeout: float = 5.0,
        interval: float = 0.005,
    ) -> bool:
        """Like :meth:`wait_for` without blocking the loop (for ``serve_async``)."""
        deadline = time.monotonic() + timeout
        while not predicate(self):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(interval)
        return True

    def _next_reply(self, body: dict[str, Any]) -> Reply:
        try:
            return self._queue.popleft()
        except IndexError:
            pass
        if self.responder is not None:
            r = self.responder(body)
            if r is not None:
                return Reply(content=r) if isinstance(r, str) else r
        return self.default

    # --- bookkeeping ---------------------------------------------------------------------

    def _done(self, rec: Received) -> None:
        self.completed_count += 1
        if self.record:
            self.completed.append(rec)

    def _cancel(self, rec: Received) -> None:
        self.cancelled_count += 1
        if self.record:
            self.cancelled.append(rec)

    def _abort(self, rec: Received) -> AbortConnection:
        self.aborted_count += 1
        if self.record:
            self.aborted.append(rec)
        quiet_abort_logs()
        return AbortConnection()

    # --- ASGI ----------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        elif kind == "websocket":
            await send({"type": "websocket.close", "code": 1000})

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        rec, disconnected = await read_request(scope, receive)
        self.request_count += 1
        if self.record:
            self.received.append(rec)
        if disconnected:
            self._cancel(rec)
            return

        method, path = rec.method, rec.path
        fmt = _MODEL_ROUTES.get(path) if method == "POST" else None
        if fmt is not None:
            await self._model(rec, receive, send, fmt)
            return
        if method == "POST" and path in COUNT_TOKENS_PATHS:
            await self._count_tokens(rec, send)
        elif method == "GET" and path in _MODELS_PATHS:
            await send_bytes(send, 200, self._models_body, (JSON_CT,))
        elif method == "GET" and path.startswith("/v1/models/"):
            obj = self._model_objs.get(path[len("/v1/models/") :])
            if obj is None:
                await send_bytes(send, 404, error_body(404, "model not found"), (JSON_CT,))
            else:
                await send_bytes(send, 200, orjson.dumps(obj), (JSON_CT,))
        elif method == "POST" and path in _EMBEDDINGS_PATHS:
            await self._embeddings(rec, send)
        else:
            await send_bytes(send, 200, orjson.dumps(echo_body(rec)), (JSON_CT,))
        self._done(rec)

    async def _embeddings(self, rec: Received, send: Send) -> None:
        try:
            req = orjson.loads(rec.body)
            if not isinstance(req, dict):
                raise TypeError("body must be a JSON object")
        except (ValueError, TypeError) as exc:  # orjson.JSONDecodeError is a ValueError
            await send_bytes(send, 400, error_body(400, f"Invalid JSON body: {exc}"), (JSON_CT,))
            return
        model = self._models[0] if self._models else "fake-model"
        out = embeddings_body(req, len(rec.body), self.embedding_dim, model)
        await send_bytes(send, 200, orjson.dumps(out), (JSON_CT,))

    async def _count_tokens(self, rec: Received, send: Send) -> None:
        try:
            if not isinstance(orjson.loads(rec.body), dict):
                raise TypeError("body must be a JSON object")
        except (ValueError, TypeError) as exc:
            body = messages_error_body(400, ErrorDetail(f"Invalid JSON body: {exc}"))
            await send_bytes(send, 400, body, (JSON_CT,))
            return
        await send_bytes(send, 200, orjson.dumps(count_tokens_body(rec)), (JSON_CT,))

    async def _model(self, rec: Received, receive: Receive, send: Send, fmt: WireFormat) -> None:
        """Answer a model request in ``fmt``; the scripting (delays, errors, breaks, client
        disconnects) works the same whatever the format."""
        try:
            req = orjson.loads(rec.body)
            if not isinstance(req, dict):
                raise TypeError("body must be a JSON object")
        except (ValueError, TypeError) as exc:
            body = fmt.error(400, ErrorDetail(f"Invalid JSON body: {exc}"), self._seq)
            await send_bytes(send, 400, body, (JSON_CT,))
            self._done(rec)
            return
        violation = self._check_rules(rec, req, fmt) if self.strict else None
        if violation is not None:
            # Refused before any output, as the API does: no reply is consumed.
            self.invalid.append(RuleVerdict(rec, violation.rule, violation.message, violation))
            # Said where a failing test shows it: the request the provider would refuse.
            log.warning("strict: %s %s refused (%s): %s", rec.method, rec.path, violation.rule,
                        violation.message)
            self._seq += 1
            body = _violation_body(fmt, violation, self._seq)
            rid = (fmt.request_id_header, b"req_fake_%d" % self._seq)
            await send_bytes(send, violation.status, body, (JSON_CT, rid))
            self._done(rec)
            return
        if fmt is MESSAGES and self.prefix_check:
            verdict = self._check_prefix(rec, req)
            if isinstance(verdict, str):
                # Decided before any output, as the API does: no reply is consumed.
                self._seq += 1
                body = fmt.error(400, ErrorDetail(verdict, "invalid_request_error"), self._seq)
                rid = (fmt.request_id_header, b"req_fake_%d" % self._seq)
                await send_bytes(send, 400, body, (JSON_CT, rid))
                self._done(rec)
                return
            if verdict is not None:
                fmt = dataclasses.replace(
                    fmt,
                    body=partial(message_body, input_transformations=verdict),
                    events=partial(message_events, input_transformations=verdict),
                )
        reply = self._next_reply(req)
        if (
            fmt.name == MESSAGES.name
            and self.prefix_check
            and reply.reasoning is not None
            and reply.reasoning_signature is None
        ):
            # Bound to the request as it arrived (dropped blocks included): what the
            # model answered after. Thinking is an answer's first block.
            signature = self.binder.sign(req, reply.reasoning)
            reply = dataclasses.replace(reply, reasoning_signature=signature)
        rec.reply = reply
        if self.prompt_cache and reply.usage is None and reply.body is None and reply.status < 400:
            # Only a prompt the model reads is cached; an error or a raw body reports no usage.
            key = cache_key(rec.headers, req.get("model"))
            rec.prompt = self.cache.account(fmt.name, key, req, self.clock())
        self._seq += 1
        seq = self._seq
        stream = req.get("stream") is True
        # The watcher is what notices a client disconnect: uvicorn's send() silently no-ops
        # once the peer is gone, so without it a dropped stream would look "completed".
        watcher: asyncio.Task[None] | None = None
        if reply.delay_s > 0 or stream:
            watcher = asyncio.ensure_future(until_disconnect(receive))
        try:
            if (
                watcher is not None
                and reply.delay_s > 0
                and await sleep_or_disconnect(watcher, reply.delay_s)
            ):
                self._cancel(rec)
                return
            if reply.body is not None or reply.status >= 400:
                body = whole_body(fmt, reply, seq)
                ct = (
                    SSE_HEADERS[0]
                    if stream and reply.body is not None and reply.status < 400
                    else JSON_CT
                )
                await self._send_once(rec, reply, send, body, reply_headers(reply, (ct,)))
            elif stream:
                assert watcher is not None
                events = fmt.events(rec, req, reply, seq)
                if reply.done_marker and not events[-1:] == [DONE]:
                    events = [*events, DONE]
                await self._stream(rec, reply, events, fmt.request_id_header, seq, send, watcher)
            else:
                out = orjson.dumps(fmt.body(rec, req, reply, seq))
                rid = (fmt.request_id_header, b"req_fake_%d" % seq)
                await self._send_once(rec, reply, send, out, reply_headers(reply, (JSON_CT, rid)))
        finally:
            if watcher is not None:
                watcher.cancel()

    def _check_rules(self, rec: Received, req: dict[str, Any], fmt: WireFormat) -> Violation | None:
        """The first provider rule ``req`` breaks (:mod:`.provider_rules`), or None."""
        if fmt.name == MESSAGES.name:
            version = rec.headers.get("anthropic-version")
            return check_messages(req, self.model_rules, api_version=version)
        if fmt.name == RESPONSES.name:
            return check_responses(req, self.model_rules)
        return check_chat(req, self.model_rules)

    def _check_prefix(self, rec: Received, req: dict[str, Any]) -> str | list[Any] | None:
        """The prefix check of one Messages request: the 400's message (str), or the
        ``input_transformations`` to report (the beta is on), or None (nothing to report)."""
        beta = beta_enabled(rec.headers)
        binding = block_binding_of(req)
        if not beta and binding is not None:  # a null block_binding means the defaults
            self.refused.append(PrefixVerdict(rec, HEADER_REQUIRED_MESSAGE, ()))
            return HEADER_REQUIRED_MESSAGE
        behavior = (binding or {}).get("prefix_mismatch_behavior") or "error"
        if behavior not in ("error", "drop_block"):
            message = (
                "thinking.block_binding.prefix_mismatch_behavior: Input should be 'error' or "
                "'drop_block'"
            )
            self.refused.append(PrefixVerdict(rec, message, ()))
            return message
        failures = self.binder.check(req)
        if failures and behavior == "error":
            self.refused.append(PrefixVerdict(rec, failures[0].message, tuple(failures)))
            return failures[0].message
        transformations: list[Any] = []
        if failures:
            # The fake's answer does not depend on what the model is shown; it is kept for
            # assertions, and the answer is bound to the request as received all the same.
            shown, transformations = self.binder.drop(req, failures)
            self.dropped.append(PrefixVerdict(rec, "", tuple(failures), shown))
        return transformations if beta else None

    @property
    def refused_count(self) -> int:
        return len(self.refused)

    @property
    def dropped_count(self) -> int:
        return len(self.dropped)

    async def _send_once(
        self,
        rec: Received,
        reply: Reply,
        send: Send,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        if reply.break_after_events is None:
            await send_bytes(send, reply.status, body, headers)
            self._done(rec)
            return
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        await send(
            {"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True}
        )
        raise self._abort(rec)

    async def _stream(
        self,
        rec: Received,
        reply: Reply,
        events: list[bytes],
        request_id_header: bytes,
        seq: int,
        send: Send,
        watcher: asyncio.Task[None],
    ) -> None:
        headers = reply_headers(reply, [*SSE_HEADERS, (request_id_header, b"req_fake_%d" % seq)])
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        brk = reply.break_after_events
        for i, event in enumerate(events):
            if brk is not None and i >= brk:
                raise self._abort(rec)
            if i and reply.chunk_delay_s > 0:
                if await sleep_or_disconnect(watcher, reply.chunk_delay_s):
                    self._cancel(rec)
                    return
            elif watcher.done():
                self._cancel(rec)
                return
            await send({"type": "http.response.body", "body": event, "more_body": True})
        if brk is not None:
            raise self._abort(rec)
        # Let the watcher run once: a disconnect during a fast stream is only seen here.
        await asyncio.sleep(0)
        if watcher.done():
            self._cancel(rec)
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self._done(rec)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m proxy.demo.fake.upstream --port N``; prints ``READY <url>`` once listening."""
    import uvicorn

    from proxy.demo.servers import bind_socket, format_url

    p = argparse.ArgumentParser(prog="python -m proxy.demo.fake.upstream", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8900, help="0 = pick a free port")
    p.add_argument("--content", default="ok", help="default reply content")
    p.add_argument("--delay", type=float, default=0.0, help="default delay_s")
    p.add_argument("--chunk-delay", type=float, default=0.0, help="default chunk_delay_s")
    p.add_argument("--stream-pieces", type=int, default=4)
    p.add_argument("--record", action="store_true", help="keep request records (grows memory)")
    p.add_argument(
        "--prefix-check", action="store_true", help="refuse thinking blocks whose prefix changed"
    )
    p.add_argument(
        "--prompt-cache", action="store_true",
        help="report usage as under the provider's prompt cache",
    )
    p.add_argument(
        "--no-strict", action="store_true",
        help="answer requests the provider would refuse (no validation)",
    )
    p.add_argument("--loop", default="auto", help="uvicorn loop: auto|uvloop|asyncio")
    p.add_argument("--http", default="auto", help="uvicorn http: auto|httptools|h11")
    args = p.parse_args(argv)

    default = Reply(
        content=args.content,
        delay_s=args.delay,
        chunk_delay_s=args.chunk_delay,
        stream_pieces=args.stream_pieces,
    )
    fake = FakeUpstream(default=default, record=args.record, prefix_check=args.prefix_check,
                        prompt_cache=args.prompt_cache, strict=not args.no_strict)
    sock = bind_socket(args.host, args.port)
    config = uvicorn.Config(
        fake, log_level="warning", access_log=False, lifespan="on", loop=args.loop, http=args.http
    )
    # The socket already listens, so connections made right after READY just queue.
    print(f"READY {format_url(args.host, sock.getsockname()[1])}", flush=True)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
