"""Telling the proxy's own model calls (the compaction summarizer, the memory fold) from a
client's in a fake upstream's requests, in any of the three wire formats.

Each format carries the instructions elsewhere: chat completions in a leading ``system``
message, Messages in ``system``, Responses in ``instructions``; and the last turn's text in the
last message (or input item).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal

from proxy.compaction.prompt import SYSTEM_PROMPT
from proxy.memory.fold import fold_prompt

__all__ = ["FOLD_MARK", "SUMMARIZER_MARK", "instructions_of", "last_text", "own_call"]

SUMMARIZER_MARK: Final = SYSTEM_PROMPT[:40]
FOLD_MARK: Final = str(fold_prompt(None, [], max_bytes=512, input_chars=1000)[0]["content"])[:30]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, Mapping))
    return ""


def instructions_of(body: Mapping[str, Any]) -> str:
    """The request's instructions: Responses' ``instructions``, Messages' ``system``, else the
    leading system (or developer) message of chat completions."""
    if isinstance(body.get("instructions"), str):
        return str(body["instructions"])
    if body.get("system") is not None:
        return _text(body["system"])
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[0], Mapping) and (
            messages[0].get("role") in ("system", "developer")):
        return _text(messages[0].get("content"))
    return ""


def last_text(body: Mapping[str, Any]) -> str:
    """The text of the request's last message or input item."""
    turns = body.get("messages") if body.get("messages") is not None else body.get("input")
    if isinstance(turns, str):
        return turns
    if not isinstance(turns, list) or not turns or not isinstance(turns[-1], Mapping):
        return ""
    return _text(turns[-1].get("content"))


def own_call(body: Mapping[str, Any]) -> Literal["summarizer", "fold"] | None:
    """Which of the proxy's own calls ``body`` is, or None for a client's request."""
    if body.get("tools"):
        return None
    text = instructions_of(body)
    if text.startswith(FOLD_MARK):
        return "fold"
    if text.startswith(SUMMARIZER_MARK):
        return "summarizer"
    return None
