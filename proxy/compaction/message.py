"""The summary message inserted into the forwarded request (docs/compaction.md#insertion), and
finding a summary a client sent back in its history.

Format in :func:`summary_message`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Final

from proxy.model import content_text

__all__ = [
    "CLOSING_LINE",
    "SUMMARY_HEADING",
    "find_summary_message",
    "is_summary_message",
    "previous_from_messages",
    "previous_text",
    "summary_body",
    "summary_message",
]

SUMMARY_HEADING: Final = "# Summary of previous conversation"
CLOSING_LINE: Final = (
    "Use this summary for continuity: continue the task from where it left off, without "
    "re-asking the user for anything already known from it."
)
_POINTER_PREFIX: Final = "The earlier part of this conversation was compacted"

_SPAN_RE: Final = re.compile(r"^(\S+) lines? (\d+)(?:-(\d+))?$")
# How far before the end of the range the suggested first read starts (dialog lines are whole
# messages, so about the last twenty).
_READ_BACK: Final = 19


def _pointer_line(pointer: str, tool_name: str | None) -> str:
    pointer = " ".join(pointer.split())  # the line must stay one line
    if not pointer:
        return f"{_POINTER_PREFIX} into the summary below."
    line = (
        f"{_POINTER_PREFIX} into the summary below; its full messages are saved in {pointer}. "
        "If you need details the summary lacks, read them from the end backwards"
    )
    if not tool_name:
        return line + "."
    m = _SPAN_RE.match(pointer.rsplit(",", 1)[-1].strip())
    if m is None:
        return line + f" with `{tool_name}`, starting near the end of the range."
    file, first = m[1], int(m[2])
    last = int(m[3]) if m[3] else first
    start = max(first, last - _READ_BACK)
    return line + (
        f": call `{tool_name}` with file_path={file} and a start_line near the end "
        f"(e.g. start_line={start}), then earlier lines as needed."
    )


def summary_message(text: str, *, pointer: str, tool_name: str | None) -> dict[str, str]:
    """The system message inserted after the leading system messages::

        # Summary of previous conversation
        The earlier part of this conversation was compacted into the summary below; its full
        messages are saved in <pointer>. If you need details the summary lacks, read them from
        the end backwards: call `<tool>` with file_path=<last file> and a start_line near the end
        (e.g. start_line=<last-19>), then earlier lines as needed.
        <blank line>
        <summary text, stripped>
        <blank line>
        Use this summary for continuity: ...

    (the second line is one line.) Without ``tool_name`` the advice ends after "backwards";
    with an empty ``pointer`` the line only says that the turns were compacted.
    """
    content = (
        f"{SUMMARY_HEADING}\n{_pointer_line(pointer, tool_name)}\n\n{text.strip()}\n\n"
        f"{CLOSING_LINE}"
    )
    return {"role": "system", "content": content}


def _is_summary_text(text: str) -> bool:
    return text.lstrip().split("\n", 1)[0].rstrip() == SUMMARY_HEADING


def is_summary_message(msg: object) -> bool:
    """Whether ``msg`` is a summary message made by :func:`summary_message` (as a client may
    send it back: role system or developer, content a string or text parts)."""
    if not isinstance(msg, Mapping) or msg.get("role") not in ("system", "developer"):
        return False
    return _is_summary_text(content_text(msg.get("content"), placeholders=False))


def summary_body(content: str) -> str | None:
    """The summary text inside a summary message's content (heading, pointer line and closing
    line removed), or None when there is none."""
    lines = content.strip().split("\n")
    if not lines or lines[0].rstrip() != SUMMARY_HEADING:
        return None
    lines = lines[1:]
    if lines and lines[0].startswith(_POINTER_PREFIX):
        lines = lines[1:]
    body = "\n".join(lines).strip()
    if body.endswith(CLOSING_LINE):
        body = body[: -len(CLOSING_LINE)].rstrip()
    return body or None


def find_summary_message(messages: Sequence[object]) -> int | None:
    """Index of the last summary message in ``messages``."""
    for i in range(len(messages) - 1, -1, -1):
        if is_summary_message(messages[i]):
            return i
    return None


def previous_from_messages(messages: Sequence[object]) -> str | None:
    """The summary a client sent back inside its history (the last one), so the next
    compaction merges it instead of summarizing a summary; None when there is none."""
    i = find_summary_message(messages)
    if i is None:
        return None
    msg = messages[i]
    assert isinstance(msg, Mapping)
    return summary_body(content_text(msg.get("content"), placeholders=False))


def previous_text(previous: str | None) -> str:
    """``previous`` as a summary body: a whole inserted summary message (a client may hand one
    back) is unwrapped, so its heading and pointer line never nest into a new summary."""
    if previous is None:
        return ""
    if _is_summary_text(previous):
        return summary_body(previous) or ""
    return previous
