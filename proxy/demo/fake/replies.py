"""What the fake upstream sends: :class:`Reply` scripts, :class:`Received` records, and the
bodies built from them (OpenAI-shaped completions, SSE chunk events, models, embeddings and
error envelopes; the echo of other routes).

Pure data and rendering, no I/O; :mod:`proxy.demo.fake.upstream` serves them. The other
wire formats a Reply can be rendered in live next door: :mod:`.fake_responses` (OpenAI
Responses API) and :mod:`.fake_messages` (Anthropic Messages API), on the shared pieces of
:mod:`.fake_wire`.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.demo.fake.prompt_cache import Prompt

__all__ = [
    "CREATED",
    "DONE",
    "JSON_CT",
    "ErrorDetail",
    "SSE_HEADERS",
    "Received",
    "Reply",
    "completion_body",
    "echo_body",
    "embeddings_body",
    "error_body",
    "model_object",
    "reply_error_body",
    "reply_headers",
    "reply_tool_calls",
    "reply_usage",
    "split_text",
    "stream_events",
]

CREATED = 1_700_000_000  # fixed so responses are reproducible

JSON_CT = (b"content-type", b"application/json")
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]
DONE = b"data: [DONE]\n\n"

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


@dataclass(frozen=True, slots=True)
class ErrorDetail:
    """What :meth:`Reply.error` was asked to say; each wire format renders it in its own
    envelope (``code`` and ``param`` exist in OpenAI's only)."""

    message: str | None = None
    type: str | None = None
    code: str | None = None
    param: str | None = None


def reply_error_body(status: int, detail: ErrorDetail | None, seq: int = 0) -> bytes:
    """The OpenAI error envelope for ``status`` saying ``detail`` (chat and Responses).
    ``seq`` is unused: OpenAI's envelope names no request (it is a :class:`.fake_wire.WireFormat`
    error function's signature)."""
    d = detail or ErrorDetail()
    return error_body(status, d.message, type=d.type, code=d.code, param=d.param)


@dataclass
class Reply:
    """How the fake answers one model request, in whichever wire format it arrived (chat
    completions, Responses, Anthropic Messages).

    ``tool_calls``: ``[{"name": str, "arguments": str | dict, "id": str (optional)}]``;
    several = parallel calls; dict arguments are JSON-encoded, strings sent verbatim.
    ``"input"`` is read where ``"arguments"`` is missing. ``"type": "custom"`` marks a call
    of a custom (free-form) tool, its raw text the arguments: a Responses
    ``custom_tool_call``; chat sends it as a function call with that text as arguments,
    Anthropic as a ``tool_use`` whose input is ``{"input": text}`` (neither API has
    free-form tool calls).
    ``reasoning``: the model's reasoning (None = none): a Responses ``reasoning`` item (its
    summary; ``encrypted_content`` when the request's ``include`` asks) or an Anthropic
    ``thinking`` block (with its signature); the chat format has no place for it.
    ``reasoning_signature``: the opaque token sent as that ``encrypted_content`` /
    ``signature``; default: derived from ``reasoning`` (see :func:`.fake_wire.reasoning_token`).
    ``body``: raw response body sent as-is with ``status`` (content-type defaults to
    application/json, or text/event-stream for a streaming request with status < 400;
    override via ``headers``). ``status >= 400`` without ``body`` sends the format's error
    envelope (also for streaming requests, as the real APIs do), saying ``error_detail``
    (set by :meth:`error`, whose OpenAI-shaped ``body`` other formats replace by their own).
    ``delay_s``: wait before the first byte. ``chunk_delay_s``: wait between SSE events.
    ``break_after_events``: streaming -- send N SSE events, then drop the connection
    without terminating the chunked body; non-streaming (or raw ``body``) -- any value
    sends the headers and half the body, then drops the connection.
    ``usage``: default is computed (prompt ~ request bytes // 4, completion ~ output
    chars // 4, reasoning included; with the fake's ``prompt_cache`` on, the prompt and its
    cached part as the provider's prompt cache would bill them, :mod:`.prompt_cache`). Chat
    sends it verbatim; the other formats read its counts from any of the three shapes (see
    :func:`.fake_wire.usage_of`) and estimate the rest.
    ``finish_reason``: chat's vocabulary, default "tool_calls" if tool_calls else "stop";
    "length" / "content_filter" make a Responses answer ``incomplete`` and become Anthropic's
    "max_tokens" / "refusal" (any other Anthropic stop_reason passes verbatim).
    ``stream_pieces``: content, reasoning and each tool call's arguments are split into at
    most this many deltas. ``model``: overrides the echoed request model.
    ``compaction``: the ``encrypted_content`` of a Responses ``compaction`` output item (the
    provider's remote compaction, what Codex asks for with a ``compaction_trigger`` item), sent
    first; chat and Messages ignore it.
    ``done_marker``: a Responses or Messages stream ends with ``data: [DONE]`` too, as
    OpenAI-compatible gateways end every stream (chat streams always do).
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
    reasoning: str | None = None
    reasoning_signature: str | None = None
    error_detail: ErrorDetail | None = None
    compaction: str | None = None
    done_marker: bool = False

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
        """An error reply, e.g. ``Reply.error(400, "too long", code="context_length_exceeded")``.

        ``body`` is OpenAI's envelope (what chat and Responses send; callers read it), and
        ``error_detail`` says the same, for a format with another envelope (Anthropic's)."""
        detail = ErrorDetail(message=message, type=type, code=code, param=param)
        body = reply_error_body(status, detail)
        return cls(status=status, body=body, error_detail=detail, **kwargs)


@dataclass(slots=True)
class Received:
    """One request as it arrived.

    ``headers``: lower-cased names; repeated headers joined with ", " (HTTP list
    semantics); ``raw_headers`` keeps them all, in order. ``query``: raw query string
    (no "?"). ``raw_path``: the path before percent-decoding. ``at``: ``time.monotonic()``
    on arrival. ``reply``: the Reply chosen (model requests only: chat completions, responses,
    messages). ``prompt``: what the fake's prompt cache billed of it (``prompt_cache`` on, and
    the reply's usage not scripted), which the answer's default usage reports.
    """

    method: str
    path: str
    query: str
    headers: dict[str, str]
    raw_headers: list[tuple[str, str]]
    body: bytes
    at: float
    reply: Reply | None = None
    raw_path: str = ""  # the path as sent, still percent-encoded
    prompt: Prompt | None = None

    def json(self) -> Any:
        return orjson.loads(self.body)


def split_text(text: str, pieces: int) -> list[str]:
    """``text`` in at most ``pieces`` near-equal parts (none for an empty text)."""
    if not text:
        return []
    n = max(1, min(pieces, len(text)))
    size = -(-len(text) // n)
    return [text[i : i + size] for i in range(0, len(text), size)]


def reply_headers(
    reply: Reply, default: Sequence[tuple[bytes, bytes]]
) -> list[tuple[bytes, bytes]]:
    """``default`` response headers with ``reply.headers`` overriding same-named ones."""
    if not reply.headers:
        return list(default)
    extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers.items()]
    names = {k for k, _ in extra}
    return [h for h in default if h[0] not in names] + extra


def reply_tool_calls(reply: Reply, seq: int) -> list[tuple[str, str, str]]:
    """``(id, name, arguments)`` of each tool call in ``reply``, arguments JSON-encoded."""
    out = []
    for i, tc in enumerate(reply.tool_calls or ()):
        fn = tc.get("function", tc)  # also accept OpenAI-shaped entries
        # "input" (a custom tool's raw text, or Anthropic's word) stands in for arguments.
        args = fn.get("arguments", fn.get("input", ""))
        if not isinstance(args, str):
            args = orjson.dumps(args).decode()
        out.append((str(tc.get("id") or f"call_fake_{seq}_{i}"), str(fn["name"]), args))
    return out


def reply_usage(rec: Received, reply: Reply, calls: list[tuple[str, str, str]]) -> dict[str, Any]:
    """``reply.usage``, or estimated from the request and output sizes (with the cached
    prompt in ``prompt_tokens_details`` when the prompt cache billed it: ``rec.prompt``)."""
    if reply.usage is not None:
        return reply.usage
    prompt = max(1, len(rec.body) // 4) if rec.prompt is None else rec.prompt.tokens
    out_chars = len(reply.content or "") + sum(len(n) + len(a) for _, n, a in calls)
    completion = max(1, out_chars // 4)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if rec.prompt is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": rec.prompt.read, "audio_tokens": 0}
        usage["completion_tokens_details"] = {"reasoning_tokens": 0, "audio_tokens": 0}
    return usage


def completion_body(rec: Received, req: dict[str, Any], reply: Reply, seq: int) -> dict[str, Any]:
    """The ``chat.completion`` object answering ``req`` with ``reply``."""
    calls = reply_tool_calls(reply, seq)
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
        "usage": reply_usage(rec, reply, calls),
    }


def stream_events(rec: Received, req: dict[str, Any], reply: Reply, seq: int) -> list[bytes]:
    """The SSE events (``data: ...`` frames, ``[DONE]`` last) streaming ``reply``."""
    calls = reply_tool_calls(reply, seq)
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
    events += [chunk({"content": p}) for p in split_text(reply.content or "", reply.stream_pieces)]
    for idx, (cid, name, args) in enumerate(calls):
        head = {
            "index": idx,
            "id": cid,
            "type": "function",
            "function": {"name": name, "arguments": ""},
        }
        events.append(chunk({"tool_calls": [head]}))
        for frag in split_text(args, reply.stream_pieces):
            events.append(
                chunk({"tool_calls": [{"index": idx, "function": {"arguments": frag}}]})
            )
    events.append(chunk({}, reply.finish_reason or ("tool_calls" if calls else "stop")))
    if include_usage:
        usage_chunk = {**base, "choices": [], "usage": reply_usage(rec, reply, calls)}
        events.append(b"data: " + orjson.dumps(usage_chunk) + b"\n\n")
    events.append(DONE)
    return events


def model_object(model_id: str) -> dict[str, Any]:
    """A ``model`` object, as ``GET /v1/models`` lists it."""
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "fake"}


def echo_body(rec: Received) -> dict[str, Any]:
    """The answer to a request for any other route: what arrived, in short."""
    return {
        "method": rec.method,
        "path": rec.path,
        "query": rec.query,
        "body_len": len(rec.body),
        "headers": rec.headers,
    }


def _embedding(value: Any, dim: int) -> list[float]:
    digest = hashlib.sha256(orjson.dumps(value)).digest()
    raw = (digest * (dim // len(digest) + 1))[:dim]
    return [round(b / 127.5 - 1.0, 6) for b in raw]


def embeddings_body(
    req: dict[str, Any], request_bytes: int, default_dim: int, default_model: str
) -> dict[str, Any]:
    """The embeddings ``list`` object answering ``req`` (``request_bytes``: its body size):
    deterministic vectors derived from each input, base64 if ``encoding_format`` asks."""
    inputs = req.get("input", "")
    # A str, or a flat token list, is one input; any other list is a batch.
    if isinstance(inputs, str) or (
        isinstance(inputs, list) and inputs and isinstance(inputs[0], int)
    ):
        inputs = [inputs]
    if not isinstance(inputs, list):
        inputs = [inputs]
    dim = req.get("dimensions") or default_dim
    b64 = req.get("encoding_format") == "base64"
    data = []
    for i, value in enumerate(inputs):
        vec = _embedding(value, int(dim))
        emb: Any = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode() if b64 else vec
        data.append({"object": "embedding", "index": i, "embedding": emb})
    tokens = max(1, request_bytes // 4)
    return {
        "object": "list",
        "data": data,
        "model": req.get("model", default_model),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
