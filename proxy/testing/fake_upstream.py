"""A scriptable fake OpenAI-compatible upstream (raw ASGI, fast enough for benchmarks).

    fake = FakeUpstream()
    fake.script(Reply(content="hi"), Reply(tool_calls=[{"name": "ls", "arguments": {}}]))
    with serve_in_thread(fake) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-test")
        ...
    assert fake.received[0].json()["model"] == "gpt-x"

Standalone (benchmarks in another process)::

    python -m proxy.testing.fake_upstream --port 0   # prints "READY http://127.0.0.1:PORT"

Threading: the app runs on the server's loop/thread while tests read ``received`` etc.
from theirs; only appends/atomic deque ops cross threads, so no locks are needed.
Serve one FakeUpstream from one server (loop) at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import hashlib
import logging
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

__all__ = [
    "CHAT_PATHS",
    "FakeUpstream",
    "Received",
    "Reply",
    "error_body",
    "main",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Responder = Callable[[dict[str, Any]], "Reply | str | None"]

CHAT_PATHS = frozenset({"/v1/chat/completions", "/chat/completions"})
_MODELS_PATHS = frozenset({"/v1/models", "/models"})
_EMBEDDINGS_PATHS = frozenset({"/v1/embeddings", "/embeddings"})
CREATED = 1_700_000_000  # fixed so responses are reproducible

_JSON_CT = (b"content-type", b"application/json")
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]
_DONE = b"data: [DONE]\n\n"

# OpenAI's (type, code) per status, so SDK error mapping and proxy retry logic see real shapes.
_ERROR_KINDS: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("permission_error", None),
    404: ("invalid_request_error", "not_found"),
    408: ("timeout", None),
    409: ("conflict_error", None),
    422: ("invalid_request_error", None),
    429: ("requests", "rate_limit_exceeded"),
}


def error_body(
    status: int,
    message: str | None = None,
    *,
    type: str | None = None,
    code: str | None = None,
    param: str | None = None,
) -> bytes:
    """An OpenAI error envelope ``{"error": {message, type, param, code}}`` as bytes."""
    kind, default_code = _ERROR_KINDS.get(status, ("server_error", None))
    return orjson.dumps(
        {
            "error": {
                "message": message
                if message is not None
                else f"Fake upstream error (HTTP {status})",
                "type": type if type is not None else kind,
                "param": param,
                "code": code if code is not None else default_code,
            }
        }
    )


@dataclass
class Reply:
    """How the fake answers one chat-completion request.

    ``tool_calls``: ``[{"name": str, "arguments": str | dict, "id": str (optional)}]``;
    several = parallel calls; dict arguments are JSON-encoded, strings sent verbatim.
    ``body``: raw response body sent as-is with ``status`` (content-type defaults to
    application/json, or text/event-stream for a streaming request with status < 400;
    override via ``headers``). ``status >= 400`` without ``body`` sends an OpenAI error
    envelope (also for streaming requests, like OpenAI does).
    ``delay_s``: wait before the first byte. ``chunk_delay_s``: wait between SSE events.
    ``break_after_events``: streaming -- send N SSE events, then drop the connection
    without terminating the chunked body; non-streaming (or raw ``body``) -- any value
    sends the headers and half the body, then drops the connection.
    ``usage``: default is computed (prompt ~ request bytes // 4, completion ~ output
    chars // 4). ``finish_reason``: default "tool_calls" if tool_calls else "stop".
    ``stream_pieces``: content and each tool call's arguments are split into at most this
    many deltas. ``model``: overrides the echoed request model.
    """

    content: str | None = "ok"
    tool_calls: list[dict[str, Any]] | None = None
    status: int = 200
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    chunk_delay_s: float = 0.0
    break_after_events: int | None = None
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    stream_pieces: int = 4
    model: str | None = None

    @classmethod
    def error(
        cls,
        status: int,
        message: str | None = None,
        *,
        type: str | None = None,
        code: str | None = None,
        param: str | None = None,
        **kwargs: Any,
    ) -> Reply:
        """An error reply, e.g. ``Reply.error(400, "too long", code="context_length_exceeded")``."""
        body = error_body(status, message, type=type, code=code, param=param)
        return cls(status=status, body=body, **kwargs)


@dataclass(slots=True)
class Received:
    """One request as it arrived.

    ``headers``: lower-cased names; repeated headers joined with ", " (HTTP list
    semantics); ``raw_headers`` keeps them all, in order. ``query``: raw query string
    (no "?"). ``at``: ``time.monotonic()`` on arrival. ``reply``: the Reply chosen
    (chat requests only).
    """

    method: str
    path: str
    query: str
    headers: dict[str, str]
    raw_headers: list[tuple[str, str]]
    body: bytes
    at: float
    reply: Reply | None = None

    def json(self) -> Any:
        return orjson.loads(self.body)


class _AbortConnection(Exception):
    """Raised after response start: uvicorn then closes the transport mid-body."""


class _DropAbortLogs(logging.Filter):
    # The deliberate abort is logged by uvicorn as "Exception in ASGI application"; that
    # traceback is noise in test output, any other exception still gets logged.
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info
        return not (exc is not None and isinstance(exc[1], _AbortConnection))


_DROP_ABORT_LOGS = _DropAbortLogs()


def _quiet_abort_logs() -> None:
    # Installed lazily (not at import) because uvicorn reconfigures its loggers per Config.
    logger = logging.getLogger("uvicorn.error")
    if _DROP_ABORT_LOGS not in logger.filters:
        logger.addFilter(_DROP_ABORT_LOGS)


def _split(text: str, pieces: int) -> list[str]:
    if not text:
        return []
    n = max(1, min(pieces, len(text)))
    size = -(-len(text) // n)
    return [text[i : i + size] for i in range(0, len(text), size)]


def _headers(reply: Reply, default: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    if not reply.headers:
        return list(default)
    extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers.items()]
    names = {k for k, _ in extra}
    return [h for h in default if h[0] not in names] + extra


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _sleep_or_disconnect(watcher: asyncio.Task[None], delay: float) -> bool:
    """Sleep ``delay``; True if the client disconnected meanwhile."""
    if watcher.done():
        return True
    done, _ = await asyncio.wait((watcher,), timeout=delay)
    return bool(done)


def _embedding(value: Any, dim: int) -> list[float]:
    digest = hashlib.sha256(orjson.dumps(value)).digest()
    raw = (digest * (dim // len(digest) + 1))[:dim]
    return [round(b / 127.5 - 1.0, 6) for b in raw]


class FakeUpstream:
    """ASGI3 app faking an OpenAI-compatible API; see the module docstring and :class:`Reply`.

    Routes: POST /v1/chat/completions and /chat/completions (scripted replies),
    GET /v1/models[/ID], POST /v1/embeddings; anything else -> 200 JSON echo
    ``{method, path, query, body_len, headers}``. Every request is recorded.
    Reply choice per chat request: ``script()`` queue (FIFO) > ``responder(body)`` if it
    returns non-None > ``default``. A ``str`` anywhere means ``Reply(content=str)``.
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
    ) -> None:
        self._initial = (
            dataclasses.replace(default) if default is not None else Reply(),
            responder,
        )
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
        self._chat_seq = 0

    # --- configuration -------------------------------------------------------------------

    @property
    def models(self) -> tuple[str, ...]:
        return self._models

    @models.setter
    def models(self, ids: Sequence[str]) -> None:
        self._models = tuple(ids)
        self._model_objs = {
            m: {"id": m, "object": "model", "created": 0, "owned_by": "fake"} for m in self._models
        }
        self._models_body = orjson.dumps(
            {"object": "list", "data": list(self._model_objs.values())}
        )

    def script(self, *replies: Reply | str) -> None:
        """Queue replies for the next chat requests, consumed first-in first-out."""
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
        self.request_count = self.completed_count = self.cancelled_count = 0
        self.aborted_count = self._chat_seq = 0
        self.default = dataclasses.replace(self._initial[0])
        self.responder = self._initial[1]

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

    def _abort(self, rec: Received) -> _AbortConnection:
        self.aborted_count += 1
        if self.record:
            self.aborted.append(rec)
        _quiet_abort_logs()
        return _AbortConnection()

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
        chunks: list[bytes] = []
        disconnected = False
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                disconnected = True
                break
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        raw_headers = [
            (k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope["headers"]
        ]
        headers: dict[str, str] = {}
        for k, v in raw_headers:
            headers[k] = headers[k] + ", " + v if k in headers else v
        rec = Received(
            method=scope["method"],
            path=scope["path"],
            query=scope.get("query_string", b"").decode("latin-1"),
            headers=headers,
            raw_headers=raw_headers,
            body=b"".join(chunks),
            at=time.monotonic(),
        )
        self.request_count += 1
        if self.record:
            self.received.append(rec)
        if disconnected:
            self._cancel(rec)
            return

        method, path = rec.method, rec.path
        if method == "POST" and path in CHAT_PATHS:
            await self._chat(rec, receive, send)
            return
        if method == "GET" and path in _MODELS_PATHS:
            await _send_bytes(send, 200, self._models_body, (_JSON_CT,))
        elif method == "GET" and path.startswith("/v1/models/"):
            obj = self._model_objs.get(path[len("/v1/models/") :])
            if obj is None:
                await _send_bytes(send, 404, error_body(404, "model not found"), (_JSON_CT,))
            else:
                await _send_bytes(send, 200, orjson.dumps(obj), (_JSON_CT,))
        elif method == "POST" and path in _EMBEDDINGS_PATHS:
            await self._embeddings(rec, send)
        else:
            echo = {
                "method": method,
                "path": path,
                "query": rec.query,
                "body_len": len(rec.body),
                "headers": headers,
            }
            await _send_bytes(send, 200, orjson.dumps(echo), (_JSON_CT,))
        self._done(rec)

    async def _embeddings(self, rec: Received, send: Send) -> None:
        try:
            req = orjson.loads(rec.body)
            if not isinstance(req, dict):
                raise TypeError("body must be a JSON object")
        except (ValueError, TypeError) as exc:  # orjson.JSONDecodeError is a ValueError
            await _send_bytes(send, 400, error_body(400, f"Invalid JSON body: {exc}"), (_JSON_CT,))
            return
        inputs = req.get("input", "")
        # A str, or a flat token list, is one input; any other list is a batch.
        if isinstance(inputs, str) or (
            isinstance(inputs, list) and inputs and isinstance(inputs[0], int)
        ):
            inputs = [inputs]
        if not isinstance(inputs, list):
            inputs = [inputs]
        dim = req.get("dimensions") or self.embedding_dim
        b64 = req.get("encoding_format") == "base64"
        data = []
        for i, value in enumerate(inputs):
            vec = _embedding(value, int(dim))
            emb: Any = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode() if b64 else vec
            data.append({"object": "embedding", "index": i, "embedding": emb})
        tokens = max(1, len(rec.body) // 4)
        out = {
            "object": "list",
            "data": data,
            "model": req.get("model", self._models[0] if self._models else "fake-model"),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        await _send_bytes(send, 200, orjson.dumps(out), (_JSON_CT,))

    async def _chat(self, rec: Received, receive: Receive, send: Send) -> None:
        try:
            req = orjson.loads(rec.body)
            if not isinstance(req, dict):
                raise TypeError("body must be a JSON object")
        except (ValueError, TypeError) as exc:
            await _send_bytes(send, 400, error_body(400, f"Invalid JSON body: {exc}"), (_JSON_CT,))
            self._done(rec)
            return
        reply = self._next_reply(req)
        rec.reply = reply
        self._chat_seq += 1
        seq = self._chat_seq
        stream = req.get("stream") is True
        # The watcher is what notices a client disconnect: uvicorn's send() silently no-ops
        # once the peer is gone, so without it a dropped stream would look "completed".
        watcher: asyncio.Task[None] | None = None
        if reply.delay_s > 0 or stream:
            watcher = asyncio.ensure_future(_until_disconnect(receive))
        try:
            if (
                watcher is not None
                and reply.delay_s > 0
                and await _sleep_or_disconnect(watcher, reply.delay_s)
            ):
                self._cancel(rec)
                return
            if reply.body is not None or reply.status >= 400:
                body = reply.body if reply.body is not None else error_body(reply.status)
                ct = (
                    _SSE_HEADERS[0]
                    if stream and reply.body is not None and reply.status < 400
                    else _JSON_CT
                )
                await self._send_once(rec, reply, send, body, _headers(reply, (ct,)))
            elif stream:
                assert watcher is not None
                await self._stream(rec, req, reply, seq, send, watcher)
            else:
                out = orjson.dumps(self._completion(rec, req, reply, seq))
                hdrs = _headers(reply, (_JSON_CT, (b"x-request-id", b"req_fake_%d" % seq)))
                await self._send_once(rec, reply, send, out, hdrs)
        finally:
            if watcher is not None:
                watcher.cancel()

    async def _send_once(
        self,
        rec: Received,
        reply: Reply,
        send: Send,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        if reply.break_after_events is None:
            await _send_bytes(send, reply.status, body, headers)
            self._done(rec)
            return
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        await send(
            {"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True}
        )
        raise self._abort(rec)

    # --- response bodies -----------------------------------------------------------------

    def _tool_calls(self, reply: Reply, seq: int) -> list[tuple[str, str, str]]:
        out = []
        for i, tc in enumerate(reply.tool_calls or ()):
            fn = tc.get("function", tc)  # also accept OpenAI-shaped entries
            args = fn.get("arguments", "")
            if not isinstance(args, str):
                args = orjson.dumps(args).decode()
            out.append((str(tc.get("id") or f"call_fake_{seq}_{i}"), str(fn["name"]), args))
        return out

    def _usage(
        self, rec: Received, reply: Reply, calls: list[tuple[str, str, str]]
    ) -> dict[str, Any]:
        if reply.usage is not None:
            return reply.usage
        prompt = max(1, len(rec.body) // 4)
        out_chars = len(reply.content or "") + sum(len(n) + len(a) for _, n, a in calls)
        completion = max(1, out_chars // 4)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def _completion(
        self, rec: Received, req: dict[str, Any], reply: Reply, seq: int
    ) -> dict[str, Any]:
        calls = self._tool_calls(reply, seq)
        message: dict[str, Any] = {"role": "assistant", "content": reply.content, "refusal": None}
        if calls:
            message["tool_calls"] = [
                {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                for cid, name, args in calls
            ]
        return {
            "id": f"chatcmpl-fake-{seq}",
            "object": "chat.completion",
            "created": CREATED,
            "model": reply.model or req.get("model") or "fake-model",
            "system_fingerprint": "fp_fake",
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": reply.finish_reason or ("tool_calls" if calls else "stop"),
                }
            ],
            "usage": self._usage(rec, reply, calls),
        }

    def _events(self, rec: Received, req: dict[str, Any], reply: Reply, seq: int) -> list[bytes]:
        calls = self._tool_calls(reply, seq)
        opts = req.get("stream_options")
        include_usage = isinstance(opts, dict) and opts.get("include_usage") is True
        base: dict[str, Any] = {
            "id": f"chatcmpl-fake-{seq}",
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": reply.model or req.get("model") or "fake-model",
            "system_fingerprint": "fp_fake",
        }
        if include_usage:
            base["usage"] = None  # OpenAI sends usage: null on every chunk but the last

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return b"data: " + orjson.dumps({**base, "choices": [choice]}) + b"\n\n"

        first_content = "" if reply.content is not None else None
        events = [chunk({"role": "assistant", "content": first_content, "refusal": None})]
        events += [chunk({"content": p}) for p in _split(reply.content or "", reply.stream_pieces)]
        for idx, (cid, name, args) in enumerate(calls):
            head = {
                "index": idx,
                "id": cid,
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
            events.append(chunk({"tool_calls": [head]}))
            for frag in _split(args, reply.stream_pieces):
                events.append(
                    chunk({"tool_calls": [{"index": idx, "function": {"arguments": frag}}]})
                )
        events.append(chunk({}, reply.finish_reason or ("tool_calls" if calls else "stop")))
        if include_usage:
            usage_chunk = {**base, "choices": [], "usage": self._usage(rec, reply, calls)}
            events.append(b"data: " + orjson.dumps(usage_chunk) + b"\n\n")
        events.append(_DONE)
        return events

    async def _stream(
        self,
        rec: Received,
        req: dict[str, Any],
        reply: Reply,
        seq: int,
        send: Send,
        watcher: asyncio.Task[None],
    ) -> None:
        events = self._events(rec, req, reply, seq)
        headers = _headers(reply, [*_SSE_HEADERS, (b"x-request-id", b"req_fake_%d" % seq)])
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        brk = reply.break_after_events
        for i, event in enumerate(events):
            if brk is not None and i >= brk:
                raise self._abort(rec)
            if i and reply.chunk_delay_s > 0:
                if await _sleep_or_disconnect(watcher, reply.chunk_delay_s):
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


async def _send_bytes(
    send: Send, status: int, body: bytes, headers: Sequence[tuple[bytes, bytes]]
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m proxy.testing.fake_upstream --port N``; prints ``READY <url>`` once listening."""
    import uvicorn

    from proxy.testing.servers import bind_socket, format_url

    p = argparse.ArgumentParser(prog="python -m proxy.testing.fake_upstream", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8900, help="0 = pick a free port")
    p.add_argument("--content", default="ok", help="default reply content")
    p.add_argument("--delay", type=float, default=0.0, help="default delay_s")
    p.add_argument("--chunk-delay", type=float, default=0.0, help="default chunk_delay_s")
    p.add_argument("--stream-pieces", type=int, default=4)
    p.add_argument("--record", action="store_true", help="keep request records (grows memory)")
    p.add_argument("--loop", default="auto", help="uvicorn loop: auto|uvloop|asyncio")
    p.add_argument("--http", default="auto", help="uvicorn http: auto|httptools|h11")
    args = p.parse_args(argv)

    default = Reply(
        content=args.content,
        delay_s=args.delay,
        chunk_delay_s=args.chunk_delay,
        stream_pieces=args.stream_pieces,
    )
    fake = FakeUpstream(default=default, record=args.record)
    sock = bind_socket(args.host, args.port)
    config = uvicorn.Config(
        fake, log_level="warning", access_log=False, lifespan="on", loop=args.loop, http=args.http
    )
    # The socket already listens, so connections made right after READY just queue.
    print(f"READY {format_url(args.host, sock.getsockname()[1])}", flush=True)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
