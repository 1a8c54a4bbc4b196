"""The Anthropic Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) as
the fake upstream speaks it: the ``message`` object, the SSE events that stream it, and
Anthropic's error envelope, rendered from a :class:`Reply`.

Shapes follow the anthropic SDK's models (``Message``, ``RawMessageStreamEvent``,
``ErrorResponse``), so ``client.messages.create``, the ``client.messages.stream`` helper and
the SDK's typed exceptions all work against it.

Block order is what Claude produces: thinking, text, then tool_use blocks.

``input_transformations`` (what the prefix check dropped, :mod:`.prefix_check`) is a top-level
key of the message when given: of the whole message, or of ``message_start``'s when streaming
(where the API makes it final).
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.demo.fake.replies import ErrorDetail, Received, Reply, split_text
from proxy.demo.fake.wire import (
    ToolCall,
    Usage,
    WireFormat,
    model_of,
    reasoning_token,
    sse_event,
    tool_calls_of,
    usage_of,
)

__all__ = [
    "MESSAGES",
    "count_tokens_body",
    "message_body",
    "message_events",
    "message_usage",
    "messages_error_body",
]

# Anthropic's error type per status (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}

# finish_reason (chat's vocabulary) -> stop_reason; anything else is taken as Anthropic's own.
_STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}


def messages_error_body(status: int, detail: ErrorDetail | None, seq: int = 0) -> bytes:
    """Anthropic's envelope ``{"type": "error", "error": {type, message}, "request_id"}``."""
    d = detail or ErrorDetail()
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return orjson.dumps(
        {
            "type": "error",
            "error": {
                "type": d.type or kind,
                "message": d.message
                if d.message is not None
                else f"Fake upstream error (HTTP {status})",
            },
            "request_id": f"req_fake_{seq}",
        }
    )


def message_usage(usage: Usage, *, output_tokens: int | None = None) -> dict[str, Any]:
    """An Anthropic ``usage`` object: ``input_tokens`` leaves out the cached prompt."""
    return {
        "input_tokens": max(0, usage.input - usage.cached - usage.cache_write),
        "cache_creation_input_tokens": usage.cache_write,
        "cache_read_input_tokens": usage.cached,
        "cache_creation": {
            "ephemeral_5m_input_tokens": usage.cache_write - usage.cache_write_1h,
            "ephemeral_1h_input_tokens": usage.cache_write_1h,
        },
        "output_tokens": usage.output if output_tokens is None else output_tokens,
        "service_tier": "standard",
        **usage.extra,
    }


def _tool_input(call: ToolCall) -> Any:
    if call.custom:
        return {"input": call.arguments}  # Anthropic tools take objects only
    # A scripted string that is no JSON object is sent as given: a deliberately broken call.
    return call.parsed if isinstance(call.parsed, dict) else call.arguments


def _blocks(reply: Reply, seq: int, calls: list[ToolCall]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if reply.reasoning is not None:
        blocks.append(
            {"type": "thinking", "thinking": reply.reasoning, "signature": reasoning_token(reply)}
        )
    if reply.content is not None:
        blocks.append({"type": "text", "text": reply.content})
    for c in calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": c.id or f"toolu_fake_{seq}_{c.index}",
                "name": c.name,
                "input": _tool_input(c),
            }
        )
    return blocks


def _stop_reason(reply: Reply, calls: list[ToolCall]) -> str:
    if reply.finish_reason is None:
        return "tool_use" if calls else "end_turn"
    return _STOP_REASONS.get(reply.finish_reason, reply.finish_reason)


def _message(
    req: dict[str, Any],
    reply: Reply,
    seq: int,
    content: list[dict[str, Any]],
    stop_reason: str | None,
    usage: dict[str, Any],
    input_transformations: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    out = {
        "id": f"msg_fake_{seq}",
        "type": "message",
        "role": "assistant",
        "model": model_of(req, reply),
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": usage,
    }
    if input_transformations is not None:
        out["input_transformations"] = input_transformations
    return out


def message_body(
    rec: Received,
    req: dict[str, Any],
    reply: Reply,
    seq: int,
    *,
    input_transformations: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The ``message`` object answering ``req`` with ``reply`` (non-streaming)."""
    calls = tool_calls_of(reply)
    usage = message_usage(usage_of(rec, reply, calls))
    blocks = _blocks(reply, seq, calls)
    stop = _stop_reason(reply, calls)
    return _message(req, reply, seq, blocks, stop, usage, input_transformations)


def message_events(
    rec: Received,
    req: dict[str, Any],
    reply: Reply,
    seq: int,
    *,
    input_transformations: list[dict[str, Any]] | None = None,
) -> list[bytes]:
    """The SSE events streaming ``reply``: ``message_start`` (empty content), per block
    ``content_block_start`` / ``content_block_delta``... / ``content_block_stop``, then
    ``message_delta`` (stop reason, output tokens) and ``message_stop``. A ``ping`` follows
    the first block's start, where the real API sends one."""
    calls = tool_calls_of(reply)
    usage = usage_of(rec, reply, calls)
    pieces = reply.stream_pieces
    # The real message_start reports the prompt and a token or so of output.
    start_usage = message_usage(usage, output_tokens=min(1, usage.output))
    events = [
        sse_event(
            "message_start",
            {
                "type": "message_start",
                "message": _message(
                    req, reply, seq, [], None, start_usage, input_transformations
                ),
            },
        )
    ]

    def delta(index: int, body: dict[str, Any]) -> None:
        data = {"type": "content_block_delta", "index": index, "delta": body}
        events.append(sse_event("content_block_delta", data))

    blocks = _blocks(reply, seq, calls)
    for index, block in enumerate(blocks):
        kind = block["type"]
        if kind == "thinking":
            opening: dict[str, Any] = {"type": "thinking", "thinking": "", "signature": ""}
        elif kind == "text":
            opening = {"type": "text", "text": ""}
        else:
            opening = {**block, "input": {}}
        data = {"type": "content_block_start", "index": index, "content_block": opening}
        events.append(sse_event("content_block_start", data))
        if index == 0:
            events.append(sse_event("ping", {"type": "ping"}))
        if kind == "thinking":
            for piece in split_text(block["thinking"], pieces):
                delta(index, {"type": "thinking_delta", "thinking": piece})
            # The signature arrives whole, just before the block closes.
            delta(index, {"type": "signature_delta", "signature": block["signature"]})
        elif kind == "text":
            for piece in split_text(block["text"], pieces):
                delta(index, {"type": "text_delta", "text": piece})
        else:
            call = calls[index - (len(blocks) - len(calls))]  # tool_use blocks come last
            # The real API opens every tool input with an empty fragment.
            delta(index, {"type": "input_json_delta", "partial_json": ""})
            raw = call.arguments if not call.custom else orjson.dumps(block["input"]).decode()
            for piece in split_text(raw, pieces):
                delta(index, {"type": "input_json_delta", "partial_json": piece})
        events.append(
            sse_event("content_block_stop", {"type": "content_block_stop", "index": index})
        )
    if not blocks:
        events.append(sse_event("ping", {"type": "ping"}))
    events.append(
        sse_event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": _stop_reason(reply, calls), "stop_sequence": None},
                "usage": {"output_tokens": usage.output},
            },
        )
    )
    events.append(sse_event("message_stop", {"type": "message_stop"}))
    return events


def count_tokens_body(rec: Received) -> dict[str, Any]:
    """``POST /v1/messages/count_tokens``: the same estimate the usage of a message uses."""
    return {"input_tokens": max(1, len(rec.body) // 4)}


MESSAGES = WireFormat(
    "messages", message_body, message_events, messages_error_body, request_id_header=b"request-id"
)
