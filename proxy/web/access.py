"""What a ``/files`` request asks for (its format) and windows of the files it reads.

Who is asking is :class:`proxy.auth.Gate`'s decision, as for every route.

Format: ``?format=json|html|text`` or ``?raw=1`` win, then the ``Accept`` header (highest q of
``text/html``, ``application/json``, ``text/plain``; ties prefer HTML), else HTML -- except that
a windowed read of a file (``?start_line=``/``?lines=``) from a client that stated no preference
(``curl``, a model's fetch tool) gets raw text, as the offload notices promise.

File access goes through :mod:`proxy.store.fs` (``openat`` one component at a time with
``O_NOFOLLOW``), the one way anything under ``data_dir`` is opened.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "Ask",
    "Fmt",
    "Window",
    "ask_of",
    "read_head",
    "read_window",
]

_CHUNK: Final = 1 << 16


Fmt = Literal["html", "json", "text"]
_MEDIA: Final[Mapping[str, Fmt]] = {
    "text/html": "html",
    "application/xhtml+xml": "html",
    "application/json": "json",
    "text/plain": "text",
}
_PREFERENCE: Final[Mapping[Fmt, int]] = {"html": 3, "json": 2, "text": 1}
_NAMED: Final[Mapping[str, Fmt]] = {"html": "html", "json": "json", "text": "text"}


@dataclass(frozen=True, slots=True)
class Ask:
    """What a request asks for, beyond its path."""

    fmt: Fmt
    explicit: bool  # the client named a format rather than accepting anything
    query: Mapping[str, str]
    base: str  # URL of /files itself (behind a root_path too)

    def file_fmt(self) -> Fmt:
        windowed = "start_line" in self.query or "lines" in self.query
        return "text" if windowed and not self.explicit else self.fmt


def _from_accept(header: str) -> Fmt | None:
    best: tuple[float, int, Fmt] | None = None
    for item in header.split(","):
        media, *params = item.strip().split(";")
        fmt = _MEDIA.get(media.strip().lower())
        if fmt is None:
            continue
        q = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if q > 0 and (best is None or (q, _PREFERENCE[fmt]) > best[:2]):
            best = (q, _PREFERENCE[fmt], fmt)
    return None if best is None else best[2]


def ask_of(headers: Mapping[str, str], query: Mapping[str, str], root_path: str = "") -> Ask:
    params = dict(query)
    base = root_path + "/files"
    named = _NAMED.get(params.get("format", ""))
    if named is not None:
        return Ask(named, True, params, base)
    if params.get("raw") in ("1", "true", "yes"):
        return Ask("text", True, params, base)
    accepted = _from_accept(headers.get("accept", ""))
    return Ask(accepted or "html", accepted is not None, params, base)


# --- file windows ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Window:
    total_lines: int
    start_line: int  # 1-based
    lines: list[bytes]  # each with its own terminator, as in the file
    truncated: bool  # the byte budget ended the window before ``count`` lines

    @property
    def next_start(self) -> int | None:
        after = self.start_line + len(self.lines)
        return after if after <= self.total_lines else None


def read_window(fd: int, start: int, count: int | None, max_bytes: int) -> Window:
    """Lines ``start .. start+count-1`` (1-based; ``None``: to the end) of ``fd``, at most
    ``max_bytes`` of them (but always one line), and the total line count. Lines end at ``\\n``
    only, as the offload notices count them."""
    lines: list[bytes] = []
    taken = 0
    number = 0
    end = None if count is None else start + count
    os.lseek(fd, 0, os.SEEK_SET)
    with open(fd, "rb", buffering=_CHUNK, closefd=False) as handle:
        for line in handle:
            number += 1
            if number < start:
                continue
            if (end is not None and number >= end) or (lines and taken + len(line) > max_bytes):
                truncated = end is None or number < end
                break
            lines.append(line)
            taken += len(line)
        else:
            return Window(number, start, lines, False)
        # The window is full: count the rest without splitting it into line objects.
        last = b"\n"
        while chunk := handle.read(_CHUNK * 16):
            number += chunk.count(b"\n")
            last = chunk
        if not last.endswith(b"\n"):
            number += 1
    return Window(number, start, lines, truncated)


def read_head(fd: int, max_bytes: int) -> tuple[bytes, int]:
    """The first ``max_bytes`` bytes of ``fd`` and its line count, counted as
    :func:`read_window` counts them (a trailing newline adds none), the rest never held."""
    os.lseek(fd, 0, os.SEEK_SET)
    with open(fd, "rb", buffering=_CHUNK, closefd=False) as handle:
        head = handle.read(max_bytes)
        number = head.count(b"\n")
        last = head[-1:]
        while chunk := handle.read(_CHUNK * 16):
            number += chunk.count(b"\n")
            last = chunk[-1:]
    return head, number + (1 if last not in (b"", b"\n") else 0)
