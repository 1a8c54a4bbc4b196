"""The OpenAI Responses API (``POST /v1/responses``) as the fake upstream speaks it: the
``response`` object and the SSE event sequence that streams it, rendered from a :class:`Reply`.

Shapes follow the openai SDK's ``openai.types.responses`` models (``Response``,
``ResponseOutputItem``, ``ResponseStreamEvent``): every field they require is sent, so both
``client.responses.create`` and the SDK's stricter ``client.responses.stream`` accumulator
accept the answers. Errors use OpenAI's envelope, as for chat.

Output order is what reasoning models produce: reasoning item, message, then tool calls.
"""

from __future__ import annotations

from typing import Any

from proxy.demo.fake.replies import CREATED, Received, Reply, reply_error_body, split_text
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

__all__ = ["RESPONSES", "response_body", "response_events", "response_usage"]

ENCRYPTED_REASONING = "reasoning.encrypted_content"

# finish_reason (chat's vocabulary) -> incomplete_details.reason of an incomplete response
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def response_usage(usage: Usage) -> dict[str, Any]:
    """A Responses ``usage`` object; the SDK requires every detail field present."""
    return {
        "input_tokens": usage.input,
        "input_tokens_details": {
            "cached_tokens": usage.cached,
            "cache_write_tokens": usage.cache_write,
        },
        "output_tokens": usage.output,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning},
        "total_tokens": usage.total_tokens,
        **usage.extra,
    }


def _encrypted(req: dict[str, Any]) -> bool:
    include = req.get("include")
    return isinstance(include, list) and ENCRYPTED_REASONING in include


def _call_item(call: ToolCall, seq: int, status: str) -> dict[str, Any]:
    call_id = call.id or f"call_fake_{seq}_{call.index}"
    if call.custom:
        return {
            "id": f"ctc_fake_{seq}_{call.index}",
            "type": "custom_tool_call",
            "status": status,
            "call_id": call_id,
            "input": call.arguments,
            "name": call.name,
        }
    return {
        "id": f"fc_fake_{seq}_{call.index}",
        "type": "function_call",
        "status": status,
        "arguments": call.arguments,
        "call_id": call_id,
        "name": call.name,
    }


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}


def _items(
    req: dict[str, Any], reply: Reply, seq: int, calls: list[ToolCall]
) -> list[dict[str, Any]]:
    """The output items as they stand when done."""
    items: list[dict[str, Any]] = []
    if reply.compaction is not None:
        items.append({"id": f"cmp_fake_{seq}", "type": "compaction",
                      "encrypted_content": reply.compaction})
    if reply.reasoning is not None:
        item: dict[str, Any] = {
            "id": f"rs_fake_{seq}",
            "type": "reasoning",
            "summary": [{"type": "summary_text", "text": reply.reasoning}]
            if reply.reasoning
            else [],
        }
        # Only on request, as the real API: the client opts in to carry it to the next turn.
        if _encrypted(req):
            item["encrypted_content"] = reasoning_token(reply)
        items.append(item)
    if reply.content is not None:
        items.append(
            {
                "id": f"msg_fake_{seq}",
                "type": "message",
                "status": "completed",
                "content": [_output_text(reply.content)],
                "role": "assistant",
            }
        )
    items += [_call_item(c, seq, "completed") for c in calls]
    incomplete = _INCOMPLETE.get(reply.finish_reason or "")
    if incomplete and items and "status" in items[-1]:
        items[-1]["status"] = "incomplete"  # the item the cut-off interrupted
    return items


def _response(
    req: dict[str, Any],
    reply: Reply,
    seq: int,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """The ``response`` object; request parameters are echoed back as the real API does."""
    reason = _INCOMPLETE.get(reply.finish_reason or "") if status == "incomplete" else None
    reasoning = req.get("reasoning")
    return {
        "id": f"resp_fake_{seq}",
        "object": "response",
        "created_at": CREATED,
        "status": status,
        "background": bool(req.get("background", False)),
        "completed_at": CREATED if status == "completed" else None,
        "error": None,
        "incomplete_details": {"reason": reason} if reason else None,
        "instructions": req.get("instructions"),
        "max_output_tokens": req.get("max_output_tokens"),
        "max_tool_calls": req.get("max_tool_calls"),
        "model": model_of(req, reply),
        "output": output,
        "parallel_tool_calls": req.get("parallel_tool_calls", True),
        "previous_response_id": req.get("previous_response_id"),
        "prompt_cache_key": req.get("prompt_cache_key"),
        "reasoning": {
            "effort": reasoning.get("effort"),
            "summary": reasoning.get("summary"),
        }
        if isinstance(reasoning, dict)
        else {"effort": None, "summary": None},
        "safety_identifier": req.get("safety_identifier"),
        "service_tier": req.get("service_tier") or "default",
        "store": req.get("store", True),
        "temperature": req.get("temperature", 1.0),
        "text": req.get("text") or {"format": {"type": "text"}, "verbosity": "medium"},
        "tool_choice": req.get("tool_choice", "auto"),
        "tools": _tools(req),
        "top_logprobs": req.get("top_logprobs", 0),
        "top_p": req.get("top_p", 1.0),
        "truncation": req.get("truncation", "disabled"),
        "usage": usage,
        "user": req.get("user"),
        "metadata": req.get("metadata") or {},
    }


def _tools(req: dict[str, Any]) -> list[Any]:
    """The request's tools as the API echoes them: function tools with their optional fields
    filled in (strict defaults to true in the Responses API)."""
    tools = req.get("tools")
    if not isinstance(tools, list):
        return []
    return [
        {"description": None, "parameters": None, "strict": True, **t}
        if isinstance(t, dict) and t.get("type") == "function"
        else t
        for t in tools
    ]


def _final_status(reply: Reply) -> str:
    return "incomplete" if reply.finish_reason in _INCOMPLETE else "completed"


def response_body(rec: Received, req: dict[str, Any], reply: Reply, seq: int) -> dict[str, Any]:
    """The ``response`` object answering ``req`` with ``reply`` (non-streaming)."""
    calls = tool_calls_of(reply)
    usage = response_usage(usage_of(rec, reply, calls))
    output = _items(req, reply, seq, calls)
    return _response(req, reply, seq, status=_final_status(reply), output=output, usage=usage)


def response_events(rec: Received, req: dict[str, Any], reply: Reply, seq: int) -> list[bytes]:
    """The SSE events streaming ``reply``: ``response.created``, ``response.in_progress``,
    each output item from ``output_item.added`` through its deltas to ``output_item.done``,
    then ``response.completed`` (or ``response.incomplete``) with the whole response. No
    ``[DONE]``: the Responses API ends the stream after the last event."""
    final = response_body(rec, req, reply, seq)
    pieces = reply.stream_pieces
    events: list[bytes] = []

    def emit(kind: str, **data: Any) -> None:
        # sequence_number counts every event of the stream, from 0.
        events.append(sse_event(kind, {"type": kind, "sequence_number": len(events), **data}))

    start = _response(req, reply, seq, status="in_progress", output=[], usage=None)
    emit("response.created", response=start)
    emit("response.in_progress", response=start)
    for idx, done in enumerate(final["output"]):
        item_id = done["id"]
        at = {"item_id": item_id, "output_index": idx}
        kind = done["type"]
        if kind == "reasoning":
            # encrypted_content comes with the finished item, not the announcement.
            item = {"id": item_id, "type": "reasoning", "summary": []}
            emit("response.output_item.added", output_index=idx, item=item)
            for si, part in enumerate(done["summary"]):
                text = part["text"]
                emit(
                    "response.reasoning_summary_part.added",
                    **at,
                    summary_index=si,
                    part={"type": "summary_text", "text": ""},
                )
                for piece in split_text(text, pieces):
                    emit(
                        "response.reasoning_summary_text.delta", **at, summary_index=si, delta=piece
                    )
                emit("response.reasoning_summary_text.done", **at, summary_index=si, text=text)
                emit(
                    "response.reasoning_summary_part.done",
                    **at,
                    summary_index=si,
                    part={"type": "summary_text", "text": text},
                )
        elif kind == "compaction":
            # Opaque: announced and finished whole, as the API streams it.
            emit("response.output_item.added", output_index=idx, item=done)
        elif kind == "message":
            text = done["content"][0]["text"]
            emit(
                "response.output_item.added",
                output_index=idx,
                item={**done, "status": "in_progress", "content": []},
            )
            emit("response.content_part.added", **at, content_index=0, part=_output_text(""))
            for piece in split_text(text, pieces):
                emit("response.output_text.delta", **at, content_index=0, delta=piece, logprobs=[])
            emit("response.output_text.done", **at, content_index=0, text=text, logprobs=[])
            emit("response.content_part.done", **at, content_index=0, part=_output_text(text))
        else:
            custom = kind == "custom_tool_call"
            field = "input" if custom else "arguments"
            event = "custom_tool_call_input" if custom else "function_call_arguments"
            text = done[field]
            emit(
                "response.output_item.added",
                output_index=idx,
                item={**done, "status": "in_progress", field: ""},
            )
            for piece in split_text(text, pieces):
                emit(f"response.{event}.delta", **at, delta=piece)
            emit(f"response.{event}.done", **at, **{field: text})
        emit("response.output_item.done", output_index=idx, item=done)
    emit(f"response.{final['status']}", response=final)
    return events


RESPONSES = WireFormat("responses", response_body, response_events, reply_error_body)
