"""What a tool call does to files, as values: the lines a read showed (:class:`LineRange`), a
read (:class:`FileRead`) and a change (:class:`FileEdit`), each with its call; and the records
the parsers (:mod:`proxy.filewise.provenance`, :mod:`proxy.filewise.shell`,
:mod:`proxy.filewise.patch`) build before paths are resolved (``_Change``, ``_Read``), with
``_ok_path``: a path that names no file (a glob, a variable, a device) is left out. Line
numbers are 1-based.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "WHOLE",
    "FileEdit",
    "FileRead",
    "LineRange",
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
    ``Edit``'s ``old_string``, an ``apply_patch`` hunk's context and removed lines).

    ``write`` replaced the whole file (or made it), ``edit`` changed part of it, ``delete``
    removed it, ``touch`` may have made it empty and left an existing one as it was. A
    ``move`` (``path`` moved to ``to``) is followed by the destination's own entry: ``write``
    (``mv``, ``move_file``), or ``edit`` after a patch's ``*** Move to:`` (the updated file's
    lines end up there)."""

    call_id: str
    tool: str
    path: str  # normalised
    kind: Literal["write", "edit", "delete", "move", "touch"]
    call_index: int = 0
    quotes: tuple[str, ...] = ()
    to: str | None = None  # a move's destination


_Kind = Literal["write", "edit", "delete", "move", "touch"]


@dataclass(slots=True)
class _Change:
    """An edit found in a call, its path as written and the directory it is relative to."""

    kind: _Kind
    path: str
    base: str | None = None
    quotes: list[str] = field(default_factory=list)
    to: str | None = None


_Read = tuple[str, str | None, LineRange]  # path as written, its directory, the lines


def _ok_path(path: object) -> str | None:
    """``path`` stripped, unless it is no file's name (a glob, a variable, a device, ...)."""
    if not isinstance(path, str):
        return None
    path = path.strip()
    if (not path or len(path) > 300 or "`" in path or any(c in path for c in "\n\r\t*?$")
            or path.startswith(("-", "&", "/dev/")) or path in (".", "..", "/")):
        return None
    return path
