"""What the fake upstream's wire formats share: the :class:`WireFormat` each one is served
through, a :class:`Reply`'s tool calls, usage and reasoning token normalised once, and SSE
framing with named events.

Pure data and rendering, no I/O. The chat format's own rendering stays in
:mod:`.fake_replies` (older, imported by tests); :mod:`.fake_responses` and
:mod:`.fake_messages` render the others.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.demo.fake.replies import (
    ErrorDetail,
    Received,
    Reply,
    completion_body,
    reply_error_body,
    stream_events,
)

__all__ = [
    "CHAT",
    "bound_reasoning_token",
    "whole_body",
    "ToolCall",
    "Usage",
    "WireFormat",
    "model_of",
    "reasoning_of_token",
    "reasoning_token",
    "sse_event",
    "tool_calls_of",
    "usage_of",
]

#: ``(rec, req, reply, seq)`` -> the answer's JSON object
BodyFn = Callable[[Received, dict[str, Any], Reply, int], dict[str, Any]]
#: ``(rec, req, reply, seq)`` -> the SSE events (bytes each, as sent)
EventsFn = Callable[[Received, dict[str, Any], Reply, int], list[bytes]]
#: ``(status, detail, seq)`` -> the error envelope's bytes
ErrorFn = Callable[[int, ErrorDetail | None, int], bytes]


@dataclass(frozen=True, slots=True)
class WireFormat:
    """One API's way of answering a model request; the server side (delays, breaks,
    disconnects) is the same for all and lives in :mod:`.fake_upstream`."""

    name: str
    body: BodyFn
    events: EventsFn
    error: ErrorFn
    #: the response header carrying the request id (OpenAI: x-request-id, Anthropic: request-id)
    request_id_header: bytes = b"x-request-id"


CHAT = WireFormat("chat", completion_body, stream_events, reply_error_body)


def whole_body(fmt: WireFormat, reply: Reply, seq: int) -> bytes:
    """What a reply sent whole (a raw ``body`` or an error) sends in ``fmt``: ``body`` as
    given, but :meth:`Reply.error`'s OpenAI-shaped one becomes ``fmt``'s envelope."""
    detail = reply.error_detail
    if reply.body is None:
        return fmt.error(reply.status, detail, seq)
    if (
        detail is not None
        and fmt.error is not reply_error_body
        and reply.body == reply_error_body(reply.status, detail)
    ):
        return fmt.error(reply.status, detail, seq)
    return reply.body


def model_of(req: dict[str, Any], reply: Reply) -> Any:
    """The model an answer names: the Reply's, else the one asked for."""
    return reply.model or req.get("model") or "fake-model"


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    """One SSE event with an ``event:`` line, as the Responses and Messages APIs send them."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


# --- tool calls --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One scripted tool call, whatever shape it was written in."""

    index: int
    id: str | None  # the scripted id; each format makes its own when None
    name: str
    arguments: str  # JSON text as sent (or a custom tool's raw input)
    custom: bool
    #: the arguments as an object: the scripted dict, or the string parsed (None if not JSON)
    parsed: Any


def tool_calls_of(reply: Reply) -> list[ToolCall]:
    """``reply.tool_calls`` normalised: dict arguments JSON-encoded, strings kept verbatim."""
    out = []
    for i, tc in enumerate(reply.tool_calls or ()):
        fn = tc.get("function", tc)  # also accept OpenAI chat-shaped entries
        # "input" is accepted too: a custom tool's raw text, or Anthropic's word for arguments.
        raw = fn.get("arguments", fn.get("input", ""))
        custom = tc.get("type") == "custom"
        if isinstance(raw, str):
            text = raw
            try:
                parsed = orjson.loads(raw) if raw else None
            except orjson.JSONDecodeError:
                parsed = None
        else:
            text, parsed = orjson.dumps(raw).decode(), raw
        cid = tc.get("id")
        out.append(ToolCall(i, str(cid) if cid else None, str(fn["name"]), text, custom, parsed))
    return out


# --- usage -------------------------------------------------------------------------------

# Names a usage dict may carry, across the chat, Responses and Anthropic shapes.
_KNOWN_USAGE = frozenset(
    {
        "input_tokens",
        "prompt_tokens",
        "output_tokens",
        "completion_tokens",
        "total_tokens",
        "cached_tokens",
        "cache_read_input_tokens",
        "cache_creation_input_tokens",
        "cache_write_tokens",
        "cache_creation",
        "reasoning_tokens",
        "input_tokens_details",
        "prompt_tokens_details",
        "output_tokens_details",
        "completion_tokens_details",
    }
)


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts, format-neutral. ``input`` counts every prompt token, cached ones
    included (OpenAI's counting; Anthropic's ``input_tokens`` is ``input - cached -
    cache_write``); ``output`` includes ``reasoning``."""

    input: int
    output: int
    cached: int = 0
    cache_write: int = 0
    cache_write_1h: int = 0  # of cache_write, written with the 1-hour TTL (Anthropic)
    reasoning: int = 0
    total: int | None = None  # None: input + output
    extra: dict[str, Any] = field(default_factory=dict)  # unrecognised keys, sent as given

    @property
    def total_tokens(self) -> int:
        return self.total if self.total is not None else self.input + self.output


def _count(*sources: tuple[dict[str, Any], str]) -> int | None:
    for src, key in sources:
        value = src.get(key)
        if isinstance(value, int):
            return value
    return None


def usage_of(rec: Received, reply: Reply, calls: list[ToolCall]) -> Usage:
    """``reply.usage`` read in any of the three shapes (chat's ``prompt_tokens``, Responses'
    ``input_tokens`` + ``*_details``, Anthropic's ``cache_*_input_tokens``; the flat names
    ``cached_tokens`` / ``reasoning_tokens`` too), counts it lacks estimated as for chat; not
    scripted, the prompt as the prompt cache billed it when it did (``rec.prompt``)."""
    out_chars = len(reply.content or "") + len(reply.reasoning or "")
    out_chars += sum(len(c.name) + len(c.arguments) for c in calls)
    if reply.usage is None and rec.prompt is not None:
        p = rec.prompt
        return Usage(input=p.tokens, output=max(1, out_chars // 4), cached=p.read,
                     cache_write=p.write, cache_write_1h=p.write_1h,
                     reasoning=len(reply.reasoning or "") // 4)
    u = reply.usage or {}
    ind = u.get("input_tokens_details") or u.get("prompt_tokens_details") or {}
    outd = u.get("output_tokens_details") or u.get("completion_tokens_details") or {}
    cached = _count((u, "cached_tokens"), (u, "cache_read_input_tokens"), (ind, "cached_tokens"))
    write = _count(
        (u, "cache_creation_input_tokens"), (u, "cache_write_tokens"), (ind, "cache_write_tokens")
    )
    reasoning = _count((u, "reasoning_tokens"), (outd, "reasoning_tokens"))
    inp = _count((u, "input_tokens"), (u, "prompt_tokens"))
    if inp is None:
        inp = max(1, len(rec.body) // 4)
    elif "cache_read_input_tokens" in u or "cache_creation_input_tokens" in u:
        # Anthropic-shaped: its input_tokens leaves the cached prompt out.
        inp += (cached or 0) + (write or 0)
    out = _count((u, "output_tokens"), (u, "completion_tokens"))
    creation = u.get("cache_creation")
    hour = creation.get("ephemeral_1h_input_tokens") if isinstance(creation, dict) else None
    return Usage(
        input=inp,
        output=out if out is not None else max(1, out_chars // 4),
        cached=cached or 0,
        cache_write=write or 0,
        cache_write_1h=min(hour, write or 0) if isinstance(hour, int) else 0,
        reasoning=reasoning if reasoning is not None else len(reply.reasoning or "") // 4,
        total=_count((u, "total_tokens")),
        extra={k: v for k, v in u.items() if k not in _KNOWN_USAGE},
    )


# --- reasoning ---------------------------------------------------------------------------

_TOKEN_MAGIC = b"fake-reasoning:"
# A signature bound to a prefix (:mod:`.prefix_check`): the magic, the prefix's SHA-256, the text.
_BOUND_MAGIC = b"fake-bound-reasoning:"
_DIGEST_SIZE = 32


def reasoning_token(reply: Reply) -> str:
    """The opaque token standing for ``reply.reasoning`` (Responses ``encrypted_content``,
    Anthropic ``signature``): base64 like the real ones, and decodable by
    :func:`reasoning_of_token` so a test can check a client sent it back intact."""
    if reply.reasoning_signature is not None:
        return reply.reasoning_signature
    return base64.b64encode(_TOKEN_MAGIC + (reply.reasoning or "").encode()).decode()


def bound_reasoning_token(digest: bytes, reasoning: str) -> str:
    """A signature bound to the prefix whose SHA-256 is ``digest`` (what the prefix-checking
    fake issues), still decodable by :func:`reasoning_of_token`."""
    if len(digest) != _DIGEST_SIZE:
        raise ValueError(f"digest must be {_DIGEST_SIZE} bytes")
    return base64.b64encode(_BOUND_MAGIC + digest + reasoning.encode()).decode()


def reasoning_of_token(token: str) -> str | None:
    """The reasoning a :func:`reasoning_token` (or :func:`bound_reasoning_token`) stands for;
    None if it is not one."""
    try:
        raw = base64.b64decode(token, validate=True)
    except ValueError:  # binascii.Error is a ValueError
        return None
    if raw.startswith(_BOUND_MAGIC) and len(raw) >= len(_BOUND_MAGIC) + _DIGEST_SIZE:
        text = raw[len(_BOUND_MAGIC) + _DIGEST_SIZE :]
    elif raw.startswith(_TOKEN_MAGIC):
        text = raw[len(_TOKEN_MAGIC) :]
    else:
        return None
    try:
        return text.decode()
    except UnicodeDecodeError:
        return None
