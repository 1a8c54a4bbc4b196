"""The OpenAI Responses API (``POST /v1/responses``), read into the pipeline's message model.

The pipeline works on chat-completions messages; a Responses request is a list of ``input``
items. Reading groups them (each history message stands for a contiguous run of items):

* ``instructions`` becomes a leading system message (it stays in its field when written back);
* a ``message`` item of role system, developer or user is one message; a leading
  ``additional_tools`` item is a developer message too (tools made available from there on);
* a run of assistant-side items (``reasoning``, assistant ``message``, ``function_call``,
  ``custom_tool_call`` and the other calls, server-side calls, unknown items) is one assistant
  message: its text is the assistant text, its ``tool_calls`` the client-executed calls (by
  ``call_id``), and reasoning and everything else ride along, so they are kept or dropped
  together with their turn, never edited;
* an output item (``function_call_output``, ``custom_tool_call_output``, ...) is one tool
  message with its text: what offload and ageing cut;
* a ``compaction`` item (the provider's opaque compaction, ``encrypted_content``) rides in its
  assistant run like the others; that message is marked as holding one and counts the item's
  estimate (:mod:`proxy.history.native`: ctxproxy never compacts it or anything before it). A
  ``compaction_trigger`` item (Codex asking the provider to compact) rides along the same way.

Writing back copies every item behind an unchanged message from the client's bytes, rewrites
only the output text of a cut result, and writes what the pipeline added: a summary (or memory)
as a ``developer`` message item, a placeholder result for a call left unanswered, the proxy's
read rounds put back (``model.WIRE``) as the items they were sent as. An
``additional_tools`` item that compaction would evict is kept right after the summary: the
tools it makes available must stay available.

Checked at the edge (the rules in :mod:`proxy.formats.body` and docs/errors.md#malformed-bodies),
as the API reference documents the fields (https://platform.openai.com/docs/api-reference/
responses/create): ``input`` a string or an array of objects, each item's ``type`` a string
(an item without one is a message); a ``message`` item's ``role`` a string and its
``content`` a string or an array of part objects whose ``type`` is a string; a client-executed
call's and an output's ``call_id`` a string; a ``function_call``'s ``name`` and ``arguments``,
a ``custom_tool_call``'s ``name`` and ``input`` strings; an output's text (``output``, a
``program_output``'s ``result``) a string or an array of part objects; ``instructions`` a
string; ``tools`` an array of objects whose ``type`` and ``name`` are strings. Null stands for
absent; unknown fields and item types are not checked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import orjson

from proxy import rawjson as json
from proxy.errors import BadRequest
from proxy.formats import Parsed
from proxy.formats.body import Shape, check_objects, conform, json_type, load_object, require_model
from proxy.formats.responses.answer import ResponsesTap
from proxy.history.native import COMPACTION, opaque_tokens
from proxy.model import NATIVE, OPAQUE_TOKENS, WIRE, Message

__all__ = ["RESPONSES", "ResponsesFormat", "chat_tools"]

# Calls the client executes: each is answered by an output item with the same call_id.
_CLIENT_CALLS: Final = {
    "function_call": "function_call_output",
    "custom_tool_call": "custom_tool_call_output",
    "local_shell_call": "local_shell_call_output",
    "shell_call": "shell_call_output",
    "apply_patch_call": "apply_patch_call_output",
    "computer_call": "computer_call_output",
    "program": "program_output",
}
_OUTPUTS: Final = frozenset(_CLIENT_CALLS.values())
# Where an output item keeps its text.
_OUTPUT_KEY: Final = {"program_output": "result"}
_PINNED: Final = frozenset({"additional_tools"})
_LEADING_ROLES: Final = frozenset({"system", "developer"})
_INSTRUCTIONS: Final = "instructions"  # the pseudo-item `instructions` is archived as


class _Part(Shape):
    type: str | None = None


class _Item(Shape):
    """What every item is read for: its ``type`` (absent: a message)."""

    type: str | None = None


class _MessageItem(Shape):
    role: str | None = None
    content: str | list[_Part] | None = None


class _CallItem(Shape):
    """A client-executed call, or an output: its ``call_id`` pairs them (a
    ``local_shell_call_output`` has none: its ``id`` names the call)."""

    call_id: str | None = None


class _FunctionCall(_CallItem):
    name: str | None = None
    arguments: str | None = None


class _CustomCall(_CallItem):
    name: str | None = None
    input: str | None = None


class _Output(_CallItem):
    output: str | list[_Part] | None = None


class _ProgramOutput(_CallItem):
    result: str | list[_Part] | None = None


class _Tool(Shape):
    type: str | None = None
    name: str | None = None


class _Body(Shape):
    instructions: str | None = None
    tools: list[_Tool] | None = None


_SHAPES: Final[Mapping[str, type[Shape]]] = {
    "message": _MessageItem,
    **dict.fromkeys(_CLIENT_CALLS, _CallItem),
    "function_call": _FunctionCall,
    "custom_tool_call": _CustomCall,
    **dict.fromkeys(_OUTPUTS, _Output),
    "program_output": _ProgramOutput,
}


def _check_items(items: list[Any]) -> None:
    """Each item as its type is read (an unknown type: only that ``type`` is a string)."""
    for i, item in enumerate(items):
        conform(item, _Item, ("input", i))
        shape = _SHAPES.get(_kind(item))
        if shape is not None:
            conform(item, shape, ("input", i))


def _kind(item: Any) -> str:
    if not isinstance(item, dict):
        return ""
    kind = item.get("type")
    if isinstance(kind, str):
        return kind
    return "message" if "role" in item else ""  # the "easy" input message form


def _parts_to_chat(content: Any) -> Any:
    """Responses content parts as chat parts (text and images, for counting and summaries)."""
    if not isinstance(content, list):
        return content
    out: list[Any] = []
    for part in content:
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "input_image":
            url = part.get("image_url")
            if isinstance(url, str):
                image = {"url": url, "detail": part.get("detail") or "auto"}
                out.append({"type": "image_url", "image_url": image})
            else:
                out.append({"type": "file", "file": {"file_id": part.get("file_id")}})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append({"type": "text", "text": part["refusal"]})
    return out


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    chat = _parts_to_chat(content)
    if isinstance(chat, list):
        return "".join(p["text"] for p in chat if isinstance(p, dict) and p.get("type") == "text")
    return ""


def _call(item: dict[str, Any]) -> dict[str, Any] | None:
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        return None
    kind = item.get("type")
    if kind == "function_call":
        args = item.get("arguments")
        name = item.get("name")
    elif kind == "custom_tool_call":
        args = item.get("input")
        name = item.get("name")
    else:
        args = orjson.dumps({k: v for k, v in item.items() if k not in ("id", "status")}).decode()
        name = kind
    return {"id": call_id, "type": "function",
            "function": {"name": name if isinstance(name, str) else str(kind),
                         "arguments": args if isinstance(args, str) else orjson.dumps(args).decode()}}


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses tool definitions in chat shape, for counting."""
    if not isinstance(tools, list):
        return None
    out: list[dict[str, Any]] = []
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        if tool.get("type") in ("function", "custom") and isinstance(tool.get("name"), str):
            fn = {"name": tool["name"], "description": tool.get("description") or "",
                  "parameters": tool.get("parameters") or tool.get("format") or {}}
            out.append({"type": "function", "function": fn})
    return out


class _Reader:
    """Builds the history from the items, one pass."""

    def __init__(self) -> None:
        self.history: list[Message] = []
        self.spans: list[range] = []
        self._open: tuple[int, dict[str, Any]] | None = None  # the assistant run being read

    def add(self, message: Message, start: int, end: int) -> None:
        self.history.append(message)
        self.spans.append(range(start, end))

    def close(self, end: int) -> None:
        if self._open is not None:
            start, message = self._open
            if not message["tool_calls"]:
                del message["tool_calls"]
            self.add(message, start, end)
            self._open = None

    def assistant(self, index: int, item: dict[str, Any], kind: str) -> None:
        if self._open is None:
            self._open = (index, {"role": "assistant", "content": "", "tool_calls": []})
        message = self._open[1]
        if kind == "message":
            message["content"] += _text(item.get("content"))
        elif kind in _CLIENT_CALLS:
            call = _call(item)
            if call is not None:
                message["tool_calls"].append(call)
        elif kind == COMPACTION:
            # The provider's compaction: opaque, it stands for everything before it (see
            # pipeline.native); it rides with its turn like any other item, marked and counted.
            message[NATIVE] = COMPACTION
            message[OPAQUE_TOKENS] = message.get(OPAQUE_TOKENS, 0) + opaque_tokens(item)


def _history(items: list[Any], instructions: Any) -> tuple[list[Message], list[range]]:
    reader = _Reader()
    offset = 0
    if isinstance(instructions, str) and instructions:
        reader.add({"role": "system", "content": instructions}, 0, 1)
        offset = 1
    leading = True
    for i, item in enumerate(items, start=offset):
        kind = _kind(item)
        role = item.get("role") if isinstance(item, dict) else None
        if kind == "message" and role != "assistant":
            reader.close(i)
            leading = leading and role in _LEADING_ROLES
            reader.add({"role": role if isinstance(role, str) else "user",
                        "content": _parts_to_chat(item.get("content"))}, i, i + 1)
        elif kind in _PINNED and (leading or reader._open is None):
            reader.close(i)
            reader.add({"role": "developer", "content": orjson.dumps(item).decode()}, i, i + 1)
        elif kind in _OUTPUTS and isinstance(item.get("call_id"), str):
            reader.close(i)
            leading = False
            key = _OUTPUT_KEY.get(kind, "output")
            reader.add({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _parts_to_chat(item.get(key))}, i, i + 1)
        else:
            leading = False
            reader.assistant(i, item if isinstance(item, dict) else {}, kind)
    reader.close(offset + len(items))
    return reader.history, reader.spans


class ResponsesFormat:
    name = "responses"
    subpath = "responses"

    def tap(self) -> ResponsesTap:
        return ResponsesTap()

    def parse(self, raw: bytes, max_items: int) -> Parsed:
        body = load_object(raw)
        model = require_model(body)
        given = body.get("input")
        if isinstance(given, str):
            items: list[Any] = [{"type": "message", "role": "user", "content": given}]
        elif isinstance(given, list):
            items = given
        elif given is None:
            items = []
        else:
            raise BadRequest(f"Invalid type for 'input': expected a string or an array, but got "
                             f"{json_type(given)} instead.", param="input")
        check_objects(items, "input", max_items, "items")
        conform(body, _Body)
        if isinstance(given, list):
            _check_items(items)
        instructions = body.get("instructions")
        history, spans = _history(items, instructions)
        archived: list[Any] = list(items)
        if isinstance(instructions, str) and instructions:
            archived = [{"type": _INSTRUCTIONS, "text": instructions}, *items]
        continued = bool(body.get("previous_response_id") or body.get("conversation"))
        return Parsed(
            body=body, model=model, items=archived, history=history, spans=spans,
            tools=chat_tools(body.get("tools")), stream=body.get("stream") is True,
            continued=continued,
            extra={"offset": len(archived) - len(items), "string_input": isinstance(given, str)},
        )

    def write(
        self, raw: bytes, parsed: Parsed, messages: Sequence[Message] | None, *,
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> bytes:
        members = json.members(raw)
        replace: dict[str, json.RawJSON] = {}
        if messages is not None:
            replace["input"] = json.join_array(self._items(members, parsed, messages))
        if tools:
            existing = json.array_items(members["tools"]) if _is_array(members.get("tools")) else []
            replace["tools"] = json.join_array([*existing, *(json.dumps(t) for t in tools)])
        return json.splice(members, replace)

    def _items(
        self, members: Mapping[str, json.RawJSON], parsed: Parsed, messages: Sequence[Message]
    ) -> list[json.RawJSON]:
        offset = int(parsed.extra.get("offset", 0))
        raw_items: list[json.RawJSON]
        if parsed.extra.get("string_input"):
            raw_items = [json.dumps(parsed.items[offset])]
        else:
            raw_items = json.array_items(members["input"]) if "input" in members else []
        history = parsed.history
        at = {id(m): k for k, m in enumerate(history)}
        results = {k: m for k, m in enumerate(history) if m.get("role") == "tool"}
        kept: set[int] = set()
        out: list[json.RawJSON] = []
        pinned_at: int | None = None
        cursor = 0  # history index the next changed result is looked for from
        for m in messages:
            k = at.get(id(m))
            if k is not None:  # unchanged: its items as the client sent them
                kept.add(k)
                cursor = k + 1
                out += [raw_items[i - offset] for i in parsed.spans[k] if i >= offset]
                continue
            wire = m.get(WIRE)
            if wire:  # put back by the pipeline (the proxy's read rounds): the items as sent
                out += [item.encode() for item in wire]
                continue
            if m.get("role") == "tool":
                k = _find_result(results, m.get("tool_call_id"), cursor)
                if k is not None:  # a cut result: its item with the new text
                    kept.add(k)
                    cursor = k + 1
                    i = parsed.spans[k][0]
                    out.append(json.dumps(_with_output(parsed.items[i], m.get("content"))))
                    continue
                out.append(json.dumps(_placeholder(m, parsed, history)))
                continue
            out.append(json.dumps(_developer(m)))
            if pinned_at is None and m.get("role") in _LEADING_ROLES:
                pinned_at = len(out)
        # Tools made available by an evicted additional_tools item stay available.
        evicted = [raw_items[i - offset] for k, span in enumerate(parsed.spans) if k not in kept
                   for i in span if i >= offset and _kind(parsed.items[i]) in _PINNED]
        if evicted:
            where = pinned_at if pinned_at is not None else 0
            out[where:where] = evicted
        return out


def _find_result(results: Mapping[int, Message], call_id: Any, cursor: int) -> int | None:
    for k in sorted(results):
        if k >= cursor and results[k].get("tool_call_id") == call_id:
            return k
    return None


def _with_output(item: dict[str, Any], content: Any) -> dict[str, Any]:
    """The output item with the cut text in place of its original text (other parts, such as
    images, kept)."""
    key = _OUTPUT_KEY.get(_kind(item), "output")
    text = _text(content)
    original = item.get(key)
    if not isinstance(original, list):
        return {**item, key: text}
    parts: list[Any] = []
    placed = False
    for part in original:
        if isinstance(part, dict) and part.get("type") in ("input_text", "output_text"):
            if not placed:
                parts.append({**part, "text": text})
                placed = True
            continue
        parts.append(part)
    return {**item, key: parts}


def _placeholder(message: Message, parsed: Parsed, history: Sequence[Message]) -> dict[str, Any]:
    """A result the validator added for an unanswered call, in the call's own output type."""
    call_id = message.get("tool_call_id")
    kind = "function_call"
    for k, m in enumerate(history):
        for call in m.get("tool_calls") or ():
            if call.get("id") == call_id:
                for i in parsed.spans[k]:
                    item = parsed.items[i]
                    if isinstance(item, dict) and item.get("call_id") == call_id:
                        kind = _kind(item)
    output_type = _CLIENT_CALLS.get(kind, "function_call_output")
    return {"type": output_type, "call_id": call_id,
            _OUTPUT_KEY.get(output_type, "output"): _text(message.get("content"))}


def _developer(message: Message) -> dict[str, Any]:
    """A message the pipeline added (a summary, memory): a developer message item."""
    return {"type": "message", "role": "developer",
            "content": [{"type": "input_text", "text": _text(message.get("content"))}]}


def _is_array(raw: json.RawJSON | None) -> bool:
    return raw is not None and bytes(memoryview(raw)[:1]) == b"["


RESPONSES = ResponsesFormat()
