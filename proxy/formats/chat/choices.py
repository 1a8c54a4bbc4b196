"""Per-choice accumulation of streamed deltas, and the message of a non-stream answer.

The rules are in :mod:`proxy.formats.chat.answer`'s docstring; this module holds the state of one
choice and the pure functions that update it and build the final message.
"""

from __future__ import annotations

from typing import Any

import orjson


class ToolCall:
    __slots__ = ("id", "type", "name", "args")

    def __init__(self) -> None:
        self.id: str | None = None
        self.type: str | None = None
        self.name: str | None = None
        self.args: list[str] = []


class Choice:
    """What arrived for one choice index. Text is kept as lists of pieces: joining once is linear,
    whereas ``str +=`` on an attribute copies the whole text on every delta."""

    __slots__ = (
        "role",
        "content",
        "saw_content",
        "refusal",
        "reasoning_content",
        "reasoning",
        "tools",
        "last_tool",
        "fn_name",
        "fn_args",
        "has_fn",
        "finish_reason",
        "lp_content",
        "lp_refusal",
        "has_lp",
    )

    def __init__(self) -> None:
        self.role: str | None = None
        self.content: list[str] = []
        self.saw_content = False
        self.refusal: list[str] = []
        self.reasoning_content: list[str] = []
        self.reasoning: list[str] = []
        self.tools: dict[int, ToolCall] = {}
        self.last_tool: int | None = None
        self.fn_name: str | None = None
        self.fn_args: list[str] = []
        self.has_fn = False
        self.finish_reason: str | None = None
        self.lp_content: list[Any] = []
        self.lp_refusal: list[Any] = []
        self.has_lp = False

# Delta fields accumulated as text besides `content` (each a list on Choice, same name).
_TEXT_PARTS = ("refusal", "reasoning_content", "reasoning")


def apply_delta(st: Choice, delta: dict[str, Any]) -> None:
    role = delta.get("role")
    if type(role) is str:
        st.role = role
    content = delta.get("content")
    if type(content) is str:
        st.content.append(content)
        st.saw_content = True
    for part in _TEXT_PARTS:
        v = delta.get(part)
        if type(v) is str:
            getattr(st, part).append(v)
    calls = delta.get("tool_calls")
    if type(calls) is list:
        for tc in calls:
            if type(tc) is dict:
                apply_tool_call(st, tc)
    fc = delta.get("function_call")
    if type(fc) is dict:
        st.has_fn = True
        name = fc.get("name")
        if type(name) is str and name and not st.fn_name:
            st.fn_name = name
        args = fc.get("arguments")
        if type(args) is str:
            st.fn_args.append(args)


def apply_tool_call(st: Choice, tc: dict[str, Any]) -> None:
    idx = tc.get("index")
    cid = tc.get("id")
    if type(idx) is not int:
        # Not OpenAI's format, but some compatible servers omit the index: a new id starts a
        # call, anything else continues the latest one.
        idx = None
        if type(cid) is str and cid:
            idx = next((i for i, t in st.tools.items() if t.id == cid), None)
            if idx is None:
                idx = max(st.tools, default=-1) + 1
        elif st.last_tool is not None:
            idx = st.last_tool
        else:
            idx = 0
    call = st.tools.get(idx)
    if call is None:
        call = st.tools[idx] = ToolCall()
    st.last_tool = idx
    # First value wins for id/type/name: OpenAI sends them once, and servers that repeat them
    # on every delta repeat the same value.
    if call.id is None and type(cid) is str and cid:
        call.id = cid
    typ = tc.get("type")
    if call.type is None and type(typ) is str and typ:
        call.type = typ
    fn = tc.get("function")
    if type(fn) is dict:
        name = fn.get("name")
        if call.name is None and type(name) is str and name:
            call.name = name
        args = fn.get("arguments")
        if type(args) is str:
            call.args.append(args)


def apply_logprobs(st: Choice, lp: dict[str, Any]) -> None:
    st.has_lp = True
    for name in ("content", "refusal"):
        v = lp.get(name)
        if type(v) is list:
            getattr(st, f"lp_{name}").extend(v)


def build_message(st: Choice) -> dict[str, Any]:
    text = "".join(st.content)
    refusal = "".join(st.refusal)
    content: str | None
    if text:
        content = text
    elif st.tools or st.has_fn or refusal:
        content = None
    else:
        content = "" if st.saw_content else None
    msg: dict[str, Any] = {"role": st.role or "assistant", "content": content}
    if refusal:
        msg["refusal"] = refusal
    reasoning_content = "".join(st.reasoning_content)
    if reasoning_content:
        msg["reasoning_content"] = reasoning_content
    reasoning = "".join(st.reasoning)
    if reasoning:
        msg["reasoning"] = reasoning
    if st.tools:
        msg["tool_calls"] = [
            {
                "id": call.id or "",
                "type": call.type or "function",
                "function": {"name": call.name or "", "arguments": "".join(call.args)},
            }
            for _, call in sorted(st.tools.items())
        ]
    if st.has_fn:
        msg["function_call"] = {"name": st.fn_name or "", "arguments": "".join(st.fn_args)}
    return msg


def message_from_completion(
    body: bytes | bytearray | memoryview | str, index: int = 0
) -> dict[str, Any] | None:
    """The assistant message of a non-stream ``chat.completion`` body: the choice whose
    ``index`` is ``index`` (else ``choices[index]``), its ``message`` as parsed. None when the
    body is not such JSON or has no such choice or message; never raises."""
    try:
        obj = orjson.loads(body)
    except Exception:  # JSONDecodeError, or a body of the wrong type
        return None
    if type(obj) is not dict:
        return None
    choices = obj.get("choices")
    if type(choices) is not list or not choices:
        return None
    choice = next((c for c in choices if type(c) is dict and c.get("index") == index), None)
    if choice is None and 0 <= index < len(choices):
        choice = choices[index]
    if type(choice) is not dict:
        return None
    msg = choice.get("message")
    return msg if type(msg) is dict else None
