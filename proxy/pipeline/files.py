"""File provenance: which tool calls read which file (and which lines of it), and which wrote,
edited or deleted which (pure, no I/O).

Coding agents spend most of their context on file content, and much of it goes dead: a file
read again later, or changed after it was read. ctxproxy's file-aware rules
(:mod:`proxy.pipeline.rereads`, :mod:`proxy.pipeline.dedupe`) work from this one parse of the
history, in the pipeline's message model (chat-shaped ``tool_calls``, whatever the wire
format), for every client's tools:

* reads: Claude Code ``Read(file_path, offset, limit)``, ``str_replace_based_edit_tool``
  ``view`` (``view_range``), chat clients' ``read_file``, the configured ``offload.read_tools``,
  and shell reads in Codex's ``exec_command`` / ``shell`` / ``local_shell_call`` (and Claude
  Code's ``Bash``): ``cat``, ``nl``, ``sed -n 'A,Bp'``, ``head -n N``, ``tail -n N``;
* writes and edits: ``Write``, ``Edit``, ``MultiEdit``, ``NotebookEdit``, ``apply_patch`` (a
  custom tool, a JSON function, an ``apply_patch_call`` item, a shell heredoc), chat
  ``write_file`` / ``edit_file`` / ``create_file`` / ``delete_file`` and the editor's
  ``create`` / ``str_replace`` / ``insert``, and shell writes where obvious (``>``, ``>>``,
  ``tee``, ``sed -i``, ``rm``, ``mv``, ``cp``, ``touch``).

Paths are normalised (``posixpath.normpath``; a shell call's relative paths joined to its
``workdir``); :func:`same_file` tells two spellings of one file apart from two files (a Codex
patch names ``src/x.py`` where a read named ``/repo/src/x.py``). Line numbers are 1-based.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "WHOLE",
    "FileEdit",
    "FileRead",
    "LineRange",
    "Provenance",
    "same_file",
]


@dataclass(frozen=True, slots=True)
class LineRange:
    """The lines of a file a read showed: ``start`` to ``end`` inclusive (``end`` None: to the
    end of the file, or as far as the tool's own limit went); a ``tail -n N`` read is
    ``tail=N`` (its first line is not known from the call)."""

    start: int = 1
    end: int | None = None
    tail: int | None = None

    def covers(self, other: LineRange) -> bool:
        """Whether every line ``other`` showed is shown by this range too."""
        if self.tail is not None or other.tail is not None:
            return self == other or (self.start == 1 and self.end is None and self.tail is None)
        if self.start > other.start:
            return False
        if self.end is None:
            return True
        return other.end is not None and other.end <= self.end


WHOLE = LineRange()


@dataclass(frozen=True, slots=True)
class FileRead:
    """A tool call whose result shows (part of) a file."""

    call_id: str
    tool: str
    path: str  # normalised
    lines: LineRange = WHOLE
    call_index: int = 0  # history index of the assistant message making the call
    result_index: int | None = None  # history index of its result (None: not answered yet)


@dataclass(frozen=True, slots=True)
class FileEdit:
    """A tool call that changed a file, with the text it quotes from the file as it was (an
    ``Edit``'s ``old_string``, an ``apply_patch`` hunk's context and removed lines)."""

    call_id: str
    tool: str
    path: str  # normalised
    kind: Literal["write", "edit", "delete", "move"]
    call_index: int = 0
    quotes: tuple[str, ...] = ()
    to: str | None = None  # a move's destination


@dataclass(frozen=True, slots=True)
class Provenance:
    """Every file read and edit of a history, in call order."""

    reads: tuple[FileRead, ...] = ()
    edits: tuple[FileEdit, ...] = ()
    # tool_call_id -> the reads that call made (a ``cat a b`` reads two files).
    by_call: Mapping[str, tuple[FileRead, ...]] = field(default_factory=dict)

    def reads_of(self, result_index: int) -> tuple[FileRead, ...]:
        """The reads whose result is history message ``result_index``."""
        return tuple(r for r in self.reads if r.result_index == result_index)


def same_file(a: str, b: str) -> bool:
    """Whether two normalised spellings name one file: equal, or a relative one is the other's
    tail."""
    if a == b:
        return True
    if not a.startswith("/") and b.endswith("/" + a):
        return True
    return not b.startswith("/") and a.endswith("/" + b)

