"""The Anthropic Messages API (``POST /v1/messages``), read into the pipeline's message model.

Reading (one pass; each history message remembers the wire message and blocks it stands for):

* ``system`` (a string or text blocks) becomes a leading system message; it stays in its field
  when written back;
* an assistant message is one assistant message: its text blocks are the text, its ``tool_use``
  blocks the ``tool_calls`` (input as JSON arguments), its thinking text is counted
  (``reasoning_content``); ``thinking``, ``redacted_thinking``, server-tool and unknown blocks
  ride along, so they are kept or dropped with their turn and never edited; a message holding
  a ``compaction`` block (the provider's compaction) is marked as such (:mod:`proxy.history.native`);
* a user message becomes one tool message per ``tool_result`` block (what offload and ageing
  cut; string content or text blocks, images inside pass), then one user message with the
  other blocks, if any (the API wants tool results first in their message);
* a ``role: "system"`` message in ``messages`` (a beta Claude Code uses) is a system message
  where it stands.

Writing back copies every wire message whose history messages all went out unchanged from the
client's bytes. A message that lost or changed a part is rebuilt from its blocks: the kept ones
byte for byte, a cut ``tool_result`` with its new content (the block's other fields, such as
``cache_control``, kept), a placeholder result the validator added for an unanswered call. An
assistant message is never rebuilt (thinking signatures are verified by the provider): it goes
out as sent, or without its ``thinking`` and ``redacted_thinking`` blocks (all of them, the other
blocks byte for byte: a turn a compaction kept, :mod:`proxy.history.epoch`), or not at all.

What the pipeline adds as a system message (memory, a summary) goes out as leading text blocks of
the conversation's first user turn, in the pipeline's order: merged into the first user message
(after its ``tool_result`` blocks, which the API wants first), or a user message of its own at the
start when the conversation would otherwise start with an assistant turn. That placement is valid
on every model: the API wants ``messages`` to start with a user turn, and accepts a ``role:
"system"`` message inside ``messages`` only on the models that support mid-conversation system
messages, and there only right after a user turn (platform.claude.com, "Mid-conversation system
messages"). It is never an edit of the ``system`` field (every signed thinking block is bound to
it, and it is the provider's first cache breakpoint). ``system`` messages the client put before
its first assistant turn (Claude Code's environment, on the models that take them), which a
compaction evicted, are put back right after that first user turn, as the client had them. A
``cache_control`` marker evicted with the turns it stood on moves to the last added block when
the request has fewer than the provider's four, so the new prefix caches.

Checked at the edge (the rules in :mod:`proxy.formats.body` and docs/errors.md#malformed-bodies;
refusals worded as Anthropic's API words them, in its envelope), as the API reference
documents the fields (https://docs.anthropic.com/en/api/messages): ``messages`` an array of
objects, each with a string ``role`` and a ``content`` that is a string or an array of block
objects whose ``type`` is a string; a ``text`` block's ``text`` and a ``thinking`` block's
``thinking`` strings; a ``tool_use`` block's ``id`` (what its result answers) and ``name``
strings; a ``tool_result`` block's ``tool_use_id`` a string and its ``content`` a string or an
array of block objects; ``system`` a string or an array of block objects; ``tools`` an array
of objects whose ``name`` and ``type`` are strings; ``role`` and ``content`` are required.
Null stands for absent otherwise; unknown fields and block types (server tools, a new kind)
are not checked.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from proxy import rawjson as json
from proxy.errors import BadRequest
from proxy.formats import Parsed
from proxy.formats.body import ANTHROPIC, Shape, check_objects, conform, load_object, require_model
from proxy.formats.messages.answer import MessagesTap
from proxy.history.epoch import SIGNED, THINKING_DROPPED
from proxy.history.native import COMPACTION
from proxy.model import NATIVE, WIRE, Message

__all__ = [
    "MAX_CACHE_MARKERS",
    "MESSAGES",
    "MessagesFormat",
    "cache_markers",
    "chat_tools",
    "strip_cache_control",
]

MAX_CACHE_MARKERS: Final = 4  # the provider rejects a request with more cache_control blocks
_SYSTEM_ROLES: Final = frozenset({"system", "developer"})
_SIGNED_KINDS: Final = frozenset({"thinking", "redacted_thinking"})
_THOUGHT_OMITTED: Final = "(earlier reasoning omitted)"


@dataclass(frozen=True, slots=True)
class _Source:
    """Where a history message came from: wire message ``wire`` (``-1``: the ``system``
    field), its blocks ``blocks`` (None: the whole content, a string)."""

    wire: int
    blocks: tuple[int, ...] | None


@dataclass(slots=True)
class _Group:
    """One wire message being written: its role, the wire message it comes from (None: new)
    and its parts (history index or None, the message)."""

    role: str
    src: int | None
    parts: list[tuple[int | None, Message]] = field(default_factory=list)


def _blocks(content: Any) -> list[Any]:
    if isinstance(content, list):
        return content
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return []


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(b["text"] for b in _blocks(content)
                   if isinstance(b, dict) and b.get("type") == "text"
                   and isinstance(b.get("text"), str))


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Anthropic tool definitions in chat shape, for counting (server tools as they are)."""
    if not isinstance(tools, list):
        return None
    out: list[dict[str, Any]] = []
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        if isinstance(tool.get("name"), str) and "input_schema" in tool:
            fn = {"name": tool["name"], "description": tool.get("description") or "",
                  "parameters": tool.get("input_schema") or {}}
            out.append({"type": "function", "function": fn})
        else:
            out.append(tool)
    return out


def _assistant(content: Any) -> Message:
    text: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    other: list[Any] = []
    signed = 0
    for block in _blocks(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in _SIGNED_KINDS:
            signed += 1
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind == "tool_use" and isinstance(block.get("id"), str):
            args = orjson.dumps(block.get("input", {})).decode()
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": str(block.get("name")), "arguments": args}})
        elif kind not in ("redacted_thinking", "thinking"):
            other.append(block)  # server tools and unknown blocks: counted as their JSON
    message: Message = {"role": "assistant", "content": "".join(text)}
    if signed:
        message[SIGNED] = signed
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    if other:
        message["blocks"] = other
        if any(isinstance(b, dict) and b.get("type") == COMPACTION for b in other):
            message[NATIVE] = COMPACTION  # the provider's compaction (pipeline.native)
    return message


def _is_result(block: Any) -> bool:
    return (isinstance(block, dict) and block.get("type") == "tool_result"
            and isinstance(block.get("tool_use_id"), str))


class _Reader:
    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.history: list[Message] = []
        self.spans: list[range] = []
        self.sources: list[_Source] = []
        self.by_wire: dict[int, list[int]] = {}

    def add(self, message: Message, wire: int, blocks: tuple[int, ...] | None) -> None:
        item = wire + self.offset
        self.by_wire.setdefault(wire, []).append(len(self.history))
        self.history.append(message)
        self.spans.append(range(item, item + 1))
        self.sources.append(_Source(wire, blocks))

    def message(self, j: int, wire: dict[str, Any]) -> None:
        role = wire["role"]
        content = wire.get("content")
        if role == "assistant":
            self.add(_assistant(content), j, None)
            return
        if role != "user" or not isinstance(content, list):
            self.add({"role": role, "content": content}, j, None)
            return
        rest: list[int] = []
        for b, block in enumerate(content):
            if _is_result(block):
                self.add({"role": "tool", "tool_call_id": block["tool_use_id"],
                          "content": block.get("content", "")}, j, (b,))
            else:
                rest.append(b)
        if rest or not content:
            self.add({"role": "user", "content": [content[b] for b in rest]}, j, tuple(rest))


class _Block(Shape):
    """What every block is read for: its ``type``."""

    type: str | None = None


class _Text(Shape):
    text: str | None = None


class _Thinking(Shape):
    thinking: str | None = None


class _ToolUse(Shape):
    id: str | None = None
    name: str | None = None


class _ToolResult(Shape):
    tool_use_id: str | None = None
    content: str | list[_Block] | None = None


class _Message(Shape):
    role: str
    content: str | list[_Block]


class _Tool(Shape):
    type: str | None = None
    name: str | None = None


class _Body(Shape):
    messages: list[_Message]
    system: str | list[_Block] | None = None
    tools: list[_Tool] | None = None


_SHAPES: Final[Mapping[str, type[Shape]]] = {
    "text": _Text, "thinking": _Thinking, "tool_use": _ToolUse, "tool_result": _ToolResult,
}


def _check(body: dict[str, Any], max_items: int) -> list[Any]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise BadRequest("messages: Field required" if messages is None
                         else "messages: Input should be a valid list", param="messages")
    check_objects(messages, "messages", max_items, style=ANTHROPIC)
    conform(body, _Body, style=ANTHROPIC)
    for i, message in enumerate(messages):
        content = message["content"]
        if isinstance(content, list):
            for b, block in enumerate(content):
                shape = _SHAPES.get(block.get("type"))
                if shape is not None:
                    conform(block, shape, ("messages", i, "content", b), ANTHROPIC)
    system = body.get("system")
    if isinstance(system, list):
        for b, block in enumerate(system):
            if block.get("type") == "text":
                conform(block, _Text, ("system", b), ANTHROPIC)
    return messages


class MessagesFormat:
    name = "messages"
    subpath = "v1/messages"  # below anthropic.base_url

    def tap(self) -> MessagesTap:
        return MessagesTap()

    def parse(self, raw: bytes, max_items: int) -> Parsed:
        body = load_object(raw)
        model = require_model(body)
        messages = _check(body, max_items)
        system = body.get("system")
        has_system = bool(system)
        reader = _Reader(1 if has_system else 0)
        items: list[Any] = list(messages)
        if has_system:
            items = [{"role": "system", "content": system}, *messages]
            item = {"role": "system", "content": system}
            reader.history.append(item)
            reader.spans.append(range(0, 1))
            reader.sources.append(_Source(-1, None))
        for j, message in enumerate(messages):
            reader.message(j, message)
        return Parsed(
            body=body, model=model, items=items, history=reader.history, spans=reader.spans,
            tools=chat_tools(body.get("tools")), stream=body.get("stream") is True,
            extra={"sources": reader.sources, "by_wire": reader.by_wire},
        )

    def write(
        self, raw: bytes, parsed: Parsed, messages: Sequence[Message] | None, *,
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> bytes:
        members = json.members(raw)
        replace: dict[str, json.RawJSON] = {}
        if messages is not None:
            _Writer(members, parsed).write(messages, replace)
        if tools:
            existing = json.array_items(members["tools"]) if _is_array(members.get("tools")) else []
            replace["tools"] = json.join_array([*existing, *(json.dumps(t) for t in tools)])
        return json.splice(members, replace)


class _Writer:
    def __init__(self, members: Mapping[str, json.RawJSON], parsed: Parsed) -> None:
        self.members = members
        self.parsed = parsed
        self.body = parsed.body
        self.wire: list[Any] = self.body["messages"]
        self.sources: list[_Source] = parsed.extra["sources"]
        self.by_wire: Mapping[int, list[int]] = parsed.extra["by_wire"]
        self._raw_items: list[json.RawJSON] | None = None
        self._raw_blocks: dict[int, list[json.RawJSON]] = {}

    def raw_blocks(self, j: int) -> list[json.RawJSON]:
        """The content blocks of wire message ``j``, each as the client wrote it."""
        found = self._raw_blocks.get(j)
        if found is None:
            found = json.array_items(json.members(self.raw_item(j))["content"])
            self._raw_blocks[j] = found
        return found

    def raw_item(self, j: int) -> json.RawJSON:
        if self._raw_items is None:
            self._raw_items = json.array_items(self.members["messages"])
        return self._raw_items[j]

    def write(self, messages: Sequence[Message], replace: dict[str, json.RawJSON]) -> None:
        history = self.parsed.history
        at = {id(m): k for k, m in enumerate(history)}
        results = {k: m for k, m in enumerate(history) if m.get("role") == "tool"}
        groups: list[_Group] = []
        # The proxy's system text (memory, a summary), by the index of the group it leads.
        added: dict[int, list[Message]] = {}
        barrier = False  # the next message opens a group of its own (it follows added text)
        cursor = 0
        for m in messages:
            k = at.get(id(m))
            if k is None and isinstance(m.get(THINKING_DROPPED), int):
                k = m[THINKING_DROPPED]  # an assistant turn without its thinking
            role = m.get("role")
            if k is not None:
                cursor = k + 1
                src = self.sources[k].wire
                if src < 0:
                    continue  # the system field: it stays where it is, byte for byte
            elif role in _SYSTEM_ROLES:
                added.setdefault(len(groups), []).append(m)  # text of the next user turn
                barrier = True
                continue
            elif role == "tool":
                k = _find_result(results, m.get("tool_call_id"), cursor)
                if k is not None:
                    cursor = k + 1
                src = self.sources[k].wire if k is not None else -1
            else:
                src = -1
            open_group = groups[-1] if groups and not barrier else None
            barrier = False
            if (role in ("user", "tool") and open_group is not None and open_group.role == "user"
                    and (src < 0 or open_group.src is None or open_group.src == src)):
                if open_group.src is None and src >= 0:
                    open_group.src = src
                open_group.parts.append((k, m))
                continue
            wire_role = "user" if role == "tool" else str(role)
            groups.append(_Group(wire_role, src if src >= 0 else None, [(k, m)]))
        out = [self._message(g) for g in groups]
        roles = [g.role for g in groups]
        if added:
            first = min(added)
            # Last first: an insertion never moves an index still to be done.
            for index in sorted(added, reverse=True):
                self._lead(out, roles, index, added[index], marker=index == first)
            self._pin(out, roles, groups)
        replace["messages"] = json.join_array([raw for raw, _ in out])

    def _lead(self, out: list[tuple[json.RawJSON, list[Any]]], roles: list[str], at: int,
              added: Sequence[Message], *, marker: bool) -> None:
        """The proxy's system text as the first text blocks of the user turn at ``at`` (a new
        one when the message there is not a user turn; see the module docstring). With
        ``marker``, the last block takes a ``cache_control`` marker lost with the evicted
        turns when there is room for it: the new prefix then caches."""
        blocks = [b for m in added for b in _blocks(m.get("content"))
                  if isinstance(b, dict) and b.get("type") == "text" and b.get("text")]
        if not blocks:
            return
        moved: list[Any] = []
        if marker:
            before = [*_markers(self.body.get("tools")), *_markers(self.body.get("system"))]
            lost = self._moved_marker(before, [mk for _, found in out for mk in found])
            if lost is not None:
                blocks[-1] = {**blocks[-1], "cache_control": lost}
                moved = [lost]
        if at >= len(roles) or roles[at] != "user":
            out.insert(at, (json.dumps({"role": "user", "content": blocks}), moved))
            roles.insert(at, "user")
            return
        raw, found = out[at]
        members = json.members(bytes(raw))
        content = members.get("content")
        if content is not None and _is_array(content):
            items = json.array_items(content)
            decoded = orjson.loads(bytes(content))
        else:  # a string: one text block, as the API reads it
            text = orjson.loads(bytes(content)) if content is not None else ""
            decoded = [{"type": "text", "text": text}]
            items = [json.dumps(decoded[0])]
        results = 0  # tool results stay first (the API's rule)
        while (results < len(decoded) and isinstance(decoded[results], dict)
               and decoded[results].get("type") == "tool_result"):
            results += 1
        joined = json.join_array([*items[:results], *(json.dumps(b) for b in blocks),
                                  *items[results:]])
        out[at] = (json.splice(members, {"content": joined}), [*found, *moved])

    def _pin(self, out: list[tuple[json.RawJSON, list[Any]]], roles: list[str],
             groups: list[_Group]) -> None:
        """A compaction keeps the ``system`` messages the client put before its first assistant
        turn (Claude Code's environment: working directory, platform, date): right after the
        first user turn, as the client had them (the API takes one there, followed by an
        assistant turn)."""
        first = next((j for j, m in enumerate(self.wire) if m.get("role") == "assistant"),
                     len(self.wire))
        present = {g.src for g in groups if g.src is not None}
        lost = [j for j in range(first) if self.wire[j].get("role") in _SYSTEM_ROLES
                and j not in present]
        if not lost:
            return
        at = 0
        while at < len(roles) and roles[at] == "user":
            at += 1  # consecutive user messages are one turn to the API
        out[at:at] = [(self.raw_item(j), list(_markers(self.wire[j]))) for j in lost]
        roles[at:at] = ["system"] * len(lost)

    # -- one wire message ----------------------------------------------------------------------

    def _message(self, group: _Group) -> tuple[json.RawJSON, list[Any]]:
        """The message's bytes and the cache_control markers it carries."""
        inserted = _inserted(group)
        if inserted is not None:
            return inserted
        history = self.parsed.history
        src = group.src
        originals = [k for k, m in group.parts if k is not None and m is history[k]]
        if (src is not None and len(originals) == len(group.parts)
                and originals == self.by_wire.get(src)):
            return self.raw_item(src), list(_markers(self.wire[src]))  # as the client sent it
        if src is not None and group.role == "assistant":
            if any(THINKING_DROPPED in m for _, m in group.parts):
                return self._unsigned(src)
            return self.raw_item(src), list(_markers(self.wire[src]))  # never rebuilt
        blocks: list[json.RawJSON] = []
        found: list[Any] = []
        for k, m in group.parts:
            for raw, block in self._blocks(k, m):
                blocks.append(raw)
                found += _markers(block)
        content = json.join_array(blocks)
        if src is None:
            return json.dumps({"role": group.role, "content": orjson.Fragment(content)}), found
        return json.splice(json.members(self.raw_item(src)), {"content": content}), found

    def _unsigned(self, src: int) -> tuple[json.RawJSON, list[Any]]:
        """Assistant message ``src`` without its thinking and redacted_thinking blocks (all of
        them: the prefix check refuses one left out between others); every other block and
        field byte for byte. A message of thinking alone keeps a one-line text block (the API
        refuses empty content)."""
        content = self.wire[src].get("content")
        if not isinstance(content, list):
            return self.raw_item(src), list(_markers(self.wire[src]))
        kept = [(raw, block) for raw, block in zip(self.raw_blocks(src), content, strict=True)
                if not (isinstance(block, dict) and block.get("type") in _SIGNED_KINDS)]
        if not kept:
            block = {"type": "text", "text": _THOUGHT_OMITTED}
            kept = [(json.dumps(block), block)]
        raw = json.splice(json.members(self.raw_item(src)),
                          {"content": json.join_array([r for r, _ in kept])})
        return raw, [mk for _, block in kept for mk in _markers(block)]

    def _blocks(self, k: int | None, m: Message) -> Iterator[tuple[json.RawJSON, Any]]:
        history = self.parsed.history
        if k is None:  # new: a placeholder result, a bridging user message
            if m.get("role") == "tool":
                block = {"type": "tool_result", "tool_use_id": m.get("tool_call_id"),
                         "content": _text(m.get("content"))}
                yield json.dumps(block), block
            else:
                for block in _blocks(m.get("content")):
                    yield json.dumps(block), block
            return
        source = self.sources[k]
        content = self.wire[source.wire].get("content")
        if source.blocks is None:  # a whole string content
            block = {"type": "text", "text": content if isinstance(content, str) else ""}
            yield json.dumps(block), block
            return
        raw_blocks = self.raw_blocks(source.wire)
        for b in source.blocks:
            block = content[b]
            if m is history[k]:
                yield raw_blocks[b], block
            else:  # a cut result: the block with its new content, every other field kept
                new = {**block, "content": m.get("content")}
                yield json.dumps(new), new

    def _moved_marker(self, before: list[Any], after: list[Any]) -> Any:
        """``after``: the markers of the messages written."""
        if len(before) + len(after) >= MAX_CACHE_MARKERS:
            return None  # no room
        lost = _lost(list(_markers(self.wire)), after)
        if not lost or not isinstance(lost[-1], dict):
            return None
        marker = dict(lost[-1])
        # The provider wants every 1-hour marker before every 5-minute one.
        needs_short = any(_ttl(mk) != "1h" for mk in before)
        needs_long = any(_ttl(mk) == "1h" for mk in after)
        if needs_short and needs_long:
            return None
        if needs_long:
            marker["ttl"] = "1h"
        elif needs_short:
            marker.pop("ttl", None)
        return marker


def _inserted(group: _Group) -> tuple[json.RawJSON, list[Any]] | None:
    """An assistant message the pipeline put back (the proxy's own read rounds,
    :mod:`proxy.retrieval.replay`) goes out as the bytes it was forwarded as inside the read
    loop (``model.WIRE``): its thinking blocks are signed, so they are never re-serialised.
    None for any other group."""
    if group.src is not None or group.role != "assistant" or len(group.parts) != 1:
        return None
    wire = group.parts[0][1].get(WIRE)
    if not isinstance(wire, list) or len(wire) != 1 or not isinstance(wire[0], str):
        return None
    raw = wire[0].encode()
    return raw, list(_markers(orjson.loads(raw)))


def _lost(sent: list[Any], kept: list[Any]) -> list[Any]:
    left = list(kept)
    out = []
    for mk in sent:
        if mk in left:
            left.remove(mk)
        else:
            out.append(mk)
    return out


def _ttl(marker: Any) -> str:
    return str(marker.get("ttl") or "5m") if isinstance(marker, dict) else "5m"


def _markers(value: Any) -> Iterator[Any]:
    """Every ``cache_control`` value set in ``value`` (blocks, nested tool-result content)."""
    if isinstance(value, dict):
        marker = value.get("cache_control")
        if marker is not None:
            yield marker
        for key, inner in value.items():
            if key != "cache_control" and isinstance(inner, dict | list):
                yield from _markers(inner)
    elif isinstance(value, list):
        for inner in value:
            if isinstance(inner, dict | list):
                yield from _markers(inner)


def strip_cache_control(value: Any) -> Any:
    """``value`` without any ``cache_control`` key, at any depth: a marker is no part of the
    prefix a provider caches or binds a signature to (Claude Code moves its marker every turn)."""
    if isinstance(value, dict):
        return {k: strip_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [strip_cache_control(v) for v in value]
    return value


def cache_markers(body: Mapping[str, Any]) -> int:
    """How many ``cache_control`` markers a Messages body carries (tools, system, messages)."""
    return sum(len(list(_markers(body.get(k)))) for k in ("tools", "system", "messages"))


def _find_result(results: Mapping[int, Message], call_id: Any, cursor: int) -> int | None:
    for k in sorted(results):
        if k >= cursor and results[k].get("tool_call_id") == call_id:
            return k
    return None


def _is_array(raw: json.RawJSON | None) -> bool:
    return raw is not None and bytes(memoryview(raw)[:1]) == b"["


MESSAGES = MessagesFormat()
