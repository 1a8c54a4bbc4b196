"""Chat completions (``POST /v1/chat/completions``): the pipeline's own message model, so reading
is checking and writing is splicing the changed messages into the client's bytes.

Checked at the edge (:func:`parse`; the rules in :mod:`proxy.formats.body` and
docs/errors.md#malformed-bodies): what the pipeline dispatches, pairs and cuts on must have the
type OpenAI documents (https://platform.openai.com/docs/api-reference/chat/create): ``messages``
an array of objects, each ``role`` a string, ``content`` a string, null or an array of content
part objects whose ``type`` is a string; ``tool_calls`` an array of objects, each ``id`` a
string, its ``type`` a string, its ``function`` (or ``custom``) an object with string ``name``
and ``arguments`` (``input``); ``tool_call_id`` and ``name`` strings; the legacy
``function_call`` an object like ``function``; ``tools`` an array of objects whose ``type`` is a
string and whose ``function`` (``custom``) is an object with a string ``name``. Null stands for
absent everywhere; unknown fields, roles and part types are not checked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from proxy import rawjson as json
from proxy.errors import BadRequest, envelope
from proxy.formats import Parsed
from proxy.formats.body import Shape, check_objects, conform, load_object, require_model
from proxy.formats.chat.answer import StreamAssembler, message_from_completion
from proxy.model import Message

__all__ = ["CHAT", "ChatFormat", "ChatTap", "parse", "write"]


class _Function(Shape):
    """A call's ``function`` (and the legacy ``function_call``)."""

    name: str | None = None
    arguments: str | None = None


class _Custom(Shape):
    """A custom (free-form) tool's call."""

    name: str | None = None
    input: str | None = None


class _Call(Shape):
    id: str | None = None  # what its result answers: the pairing rules read it
    type: str | None = None
    function: _Function | None = None
    custom: _Custom | None = None


class _Part(Shape):
    type: str | None = None


class _Message(Shape):
    role: str | None = None
    content: str | list[_Part] | None = None
    tool_calls: list[_Call] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    function_call: _Function | None = None


class _ToolName(Shape):
    name: str | None = None


class _Tool(Shape):
    type: str | None = None
    function: _ToolName | None = None
    custom: _ToolName | None = None


class _Body(Shape):
    messages: list[_Message]
    tools: list[_Tool] | None = None


def parse(raw: bytes, max_messages: int = 100_000) -> dict[str, Any]:
    """The body, checked where the pipeline depends on it (anything else is the upstream's to
    judge); a :class:`BadRequest` naming the field otherwise."""
    body = load_object(raw)
    require_model(body)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise BadRequest("'messages' is required and must be an array", param="messages")
    check_objects(messages, "messages", max_messages)
    conform(body, _Body)
    return body


def write(
    raw: bytes,
    originals: Sequence[Message],
    messages: Sequence[Message] | None,
    *,
    tools: Sequence[Mapping[str, Any]] = (),
) -> bytes:
    """The client's body with ``messages`` (None: unchanged) and extra ``tools`` appended. A
    message that is one of ``originals`` (the same object) is copied from the client's bytes."""
    if messages is None and not tools:
        return raw
    members = json.members(raw)
    replace: dict[str, json.RawJSON] = {}
    if messages is not None:
        items = json.array_items(members["messages"])
        at = {id(m): i for i, m in enumerate(originals)}
        replace["messages"] = json.join_array([
            items[at[id(m)]] if id(m) in at else json.dumps(m) for m in messages
        ])
    if tools:
        existing = json.array_items(members["tools"]) if _is_array(members.get("tools")) else []
        replace["tools"] = json.join_array([*existing, *(json.dumps(t) for t in tools)])
    return json.splice(members, replace)


def _is_array(raw: json.RawJSON | None) -> bool:
    return raw is not None and bytes(memoryview(raw)[:1]) == b"["


class ChatTap:
    """Sees the answer's bytes as they pass to the client, to archive it assembled as one
    assistant message."""

    __slots__ = ("_told", "assembler", "body")

    def __init__(self) -> None:
        self.assembler: StreamAssembler | None = None
        self.body: bytes | None = None
        self._told: Any = None

    def saw_usage(self, usage: Any) -> None:
        """Told of a usage the bytes may not carry: a litellm route's stream has its usage
        chunk only when the client asked for one, and the provider billed the call anyway."""
        if usage is not None:
            self._told = usage

    def stream(self, chunk: bytes) -> None:
        if self.assembler is None:
            self.assembler = StreamAssembler()
        self.assembler.feed(chunk)

    def whole(self, body: bytes) -> None:
        self.body = body

    def error_event(self, message: str, code: str) -> bytes:
        return b"data: " + orjson.dumps(envelope(message, "upstream_error", None, code)) + b"\n\n"

    def complete(self) -> bool:
        if self.assembler is not None:
            return self.assembler.done
        return self.body is not None

    def answer(self) -> dict[str, Any] | None:
        """The assistant message, as the non-stream answer would carry it."""
        if self.assembler is not None:
            return self.assembler.message()
        if self.body is not None:
            return message_from_completion(self.body)
        return None

    def usage(self) -> Any:
        """The last non-null ``usage`` of the stream (the ``include_usage`` chunk's), or the
        body's; what :meth:`saw_usage` was told when the bytes had none."""
        seen: Any = None
        if self.assembler is not None:
            seen = self.assembler.usage
        elif self.body is not None:
            seen = _body_usage(self.body)
        return seen if seen is not None else self._told


def _body_usage(body: bytes) -> Any:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return data.get("usage") if isinstance(data, dict) else None


class ChatFormat:
    """Chat completions: items are messages, and the pipeline's model is the format itself."""

    name = "chat"
    subpath = "chat/completions"

    def tap(self) -> ChatTap:
        return ChatTap()

    def parse(self, raw: bytes, max_items: int) -> Parsed:
        body = parse(raw, max_items)
        messages: list[Message] = body["messages"]
        tools = body.get("tools")
        return Parsed(
            body=body, model=body["model"], items=messages, history=messages,
            tools=tools if isinstance(tools, list) else None, stream=body.get("stream") is True,
        )

    def write(
        self, raw: bytes, parsed: Parsed, messages: Sequence[Message] | None, *,
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> bytes:
        return write(raw, parsed.history, messages, tools=tools)


CHAT = ChatFormat()
