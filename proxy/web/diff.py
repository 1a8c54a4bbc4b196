"""A cut tool result as a diff: the original (the offloaded file) against what was forwarded.

What ctxproxy forwards for a cut result is the original's first ``kept_bytes`` bytes, then the
truncation notice on a line of its own (:mod:`proxy.truncation.notice`: a newline is added first
when the excerpt ends mid-line). So the diff is always the same three hunks, and it is computed
from the file's head and its line count, never from the whole file (offloaded outputs can be
hundreds of megabytes):

* the kept lines, collapsed to a count with the last few shown as context;
* the removed lines, as a count from the first line not wholly kept (a line the cut split is
  shown removed, and its kept start added back), with the first few shown;
* the notice, added.

Pure: bytes in, a :class:`CutDiff` out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["CONTEXT", "CutDiff", "Line", "cut_diff", "head_bytes"]

CONTEXT: Final = 3  # lines of context on each side of the cut
LINE_CHARS: Final = 400  # a context line longer than this is clipped


@dataclass(frozen=True, slots=True)
class Line:
    number: int  # 1-based, in the original
    text: str  # without its newline; clipped to LINE_CHARS (``clipped``)
    clipped: bool = False


@dataclass(frozen=True, slots=True)
class CutDiff:
    total_bytes: int
    total_lines: int  # as a person counts them: a trailing newline adds none
    kept_bytes: int
    kept_lines: int  # lines forwarded whole
    removed_from: int | None  # the first line not forwarded whole (None: nothing was cut)
    removed_lines: int  # lines not forwarded whole, a split one included
    removed_bytes: int
    kept_context: tuple[Line, ...]  # the last kept lines
    removed_context: tuple[Line, ...]  # the first lines not forwarded whole
    partial: str | None  # the start of line ``removed_from`` that was forwarded (a mid-line cut)
    notice: tuple[str, ...]  # the notice's lines, as forwarded


def head_bytes(kept_bytes: int) -> int:
    """How much of the original :func:`cut_diff` reads: the excerpt and a little after it."""
    return max(0, kept_bytes) + CONTEXT * (LINE_CHARS * 4 + 1)


def _line(number: int, raw: bytes, torn: bool = False) -> Line:
    text = raw.decode("utf-8", "replace").removesuffix("\r")
    if len(text) > LINE_CHARS:
        return Line(number, text[:LINE_CHARS], True)
    return Line(number, text, torn)


def cut_diff(head: bytes, kept_bytes: int, notice: str, *, total_bytes: int,
             total_lines: int) -> CutDiff:
    """The diff of a cut: ``head`` is the original's first bytes (at least
    ``head_bytes(kept_bytes)`` of them, or all), ``total_bytes``/``total_lines`` its size."""
    kept = max(0, min(kept_bytes, total_bytes, len(head)))
    excerpt = head[:kept]
    whole = excerpt.count(b"\n")
    tail_start = excerpt.rfind(b"\n") + 1  # where the kept part of a split line starts
    partial_raw = excerpt[tail_start:]
    # The last whole lines: what follows the excerpt's last CONTEXT + 1 newlines.
    last = excerpt[:tail_start].rsplit(b"\n", CONTEXT + 1)[:-1][-CONTEXT:]
    kept_context = tuple(_line(whole - len(last) + 1 + i, raw) for i, raw in enumerate(last))
    cut = kept < total_bytes
    removed_context: tuple[Line, ...] = ()
    if cut:
        after = head[tail_start:]
        lines = after.split(b"\n")
        if after.endswith(b"\n"):
            lines.pop()  # the nothing after the last newline
        # The head may end inside a line: that line is shown clipped.
        torn = not after.endswith(b"\n") and len(head) < total_bytes
        shown = lines[:CONTEXT]
        removed_context = tuple(
            _line(whole + 1 + i, raw, torn and i == len(lines) - 1)
            for i, raw in enumerate(shown)
        )
    return CutDiff(
        total_bytes=total_bytes, total_lines=total_lines, kept_bytes=kept, kept_lines=whole,
        removed_from=whole + 1 if cut else None,
        removed_lines=max(0, total_lines - whole) if cut else 0,
        removed_bytes=total_bytes - kept,
        kept_context=kept_context, removed_context=removed_context,
        partial=_line(whole + 1, partial_raw).text if cut and partial_raw else None,
        notice=tuple(notice.split("\n")) if notice else (),
    )
