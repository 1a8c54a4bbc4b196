"""The memory message and where it goes: pure, format-neutral.

The pipeline works on chat-shaped messages whatever the wire format; :func:`inject` puts the
memory message right after the leading system/developer messages of the *client's* history,
that is before a summary the compaction inserted there. Each format writes it where it keeps
system text (chat: a system message; Responses: a developer item; Anthropic Messages: the
first text block of the first user turn, :mod:`proxy.formats.messages.request`). Same text and same
messages give the same bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from proxy.model import Message, content_text

__all__ = ["MEMORY_HEADING", "inject", "is_memory_message", "memory_message"]

MEMORY_HEADING: Final = "# Long-term memory"
_INTRO: Final = (
    "What this user taught you in earlier sessions: preferences and standing instructions (in "
    "their own words) and lessons from earlier attempts. Follow them unless the user says "
    "otherwise now."
)


def memory_message(text: str, *, tool_name: str | None) -> Message:
    """The system message carrying ``text`` (a MEMORY.md version)::

        # Long-term memory
        What this user taught you ... Follow them unless the user says otherwise now.
        [The dated notes it was folded from: call `<tool>` with file_path=memory/YYYY-MM-DD.md.]
        <blank line>
        <MEMORY.md, stripped>
    """
    intro = _INTRO
    if tool_name:
        intro += (f" The dated notes it was folded from can be read with `{tool_name}` "
                  "(file_path=memory/YYYY-MM-DD.md).")
    return {"role": "system", "content": f"{MEMORY_HEADING}\n{intro}\n\n{text.strip()}"}


def is_memory_message(msg: object) -> bool:
    if not isinstance(msg, Mapping) or msg.get("role") not in ("system", "developer"):
        return False
    text = content_text(msg.get("content"), placeholders=False)
    return text.lstrip().split("\n", 1)[0].rstrip() == MEMORY_HEADING


def inject(messages: Sequence[Message], memory: Message, head: int) -> list[Message]:
    """``messages`` with ``memory`` at index ``head`` (the number of leading system messages of
    the client's history: the summary, if any, sits right there and moves one down)."""
    head = max(0, min(head, len(messages)))
    return [*messages[:head], memory, *messages[head:]]
