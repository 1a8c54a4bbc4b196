"""Pure truncation of tool output: string in, string out.

See docs/offload.md#cutting and docs/offload.md#the-notice.

Positions. A position in a text is ``(line, byte)``: ``line`` is 1-based, ``byte`` is the UTF-8
byte offset within that line (0 = the line's start). Line ``L`` exists for
``1 <= L <= text.count("\\n") + 1``; the end of the text is a valid position (reading there gives
an empty chunk). A line is the text up to and including its ``"\\n"`` (a ``"\\r\\n"`` stays with
its line). ``total_lines`` counts as a person would: ``""`` -> 0, ``"\\n"`` -> 1, ``"a\\nb"`` ->
2, ``"a\\nb\\n"`` -> 2.

Cutting. All sizes are UTF-8 bytes. A chunk from a position is the longest prefix of the rest
that fits the budget and ends just after a ``"\\n"``; when not even the first (remaining) line
fits, it is cut inside that line at a character boundary (not between ``\\r`` and ``\\n`` when
avoidable) and the notice says where the line continues (``next_byte``). Budgets below
``MIN_BUDGET`` (4 bytes, the longest UTF-8 character) are raised to it, so every chunk makes
progress; excerpts are therefore at most ``max(budget, MIN_BUDGET)`` bytes. The budget covers
the excerpt only: the notice (a few hundred bytes) comes on top.

Reconstruction. Following the hints, ``read_chunk`` after ``read_chunk``, concatenating the
excerpts (``split_notice(...)[0]``) and finally the last chunk (returned bare, without notice or
end-of-file remark, like any read tool's output) reproduces the original exactly.

Client read tools. When the cut output came from the client's own read tool, the caller passes
that tool's name, the path to show, its argument names and ``line_offset`` (the client's read
started at line ``line_offset + 1`` of its file): every line number in the notice (start, next,
error lines) is then ``line_offset + line in the output``, so e.g. "call `Read` with
file_path=/abs/x.py offset=1201". ``Truncation.next_line``/``next_byte`` stay positions in
``original`` so that ``read_chunk`` can continue from them.

Error lines. The first five lines of the cut-away part (from the next position to the end; only
its first ``ERROR_SCAN_BYTES``, 1 MiB, are searched) that contain one of ``ERROR_MARKERS``,
case-sensitive substrings: ``Traceback``, ``Error`` (so ``ValueError:``, ``Error:``), ``Exception``, ``FAIL`` (pytest ``FAILED``, Go ``--- FAIL:``),
``ERROR``, ``error`` (compilers' ``error:``, ``error[E0308]``, ``level=error``), ``fatal`` (git
``fatal:``), ``panic`` (Go ``panic:``, Rust ``panicked``). A heuristic to point the model at the
right place first; it also flags prose or source code that merely mentions errors.

The notice grammar is documented in ``proxy.truncation.notice``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from proxy.truncation.notice import (
    MAX_ERROR_LINES,
    Notice,
    attach,
    parse_notice,
    split_notice,
    utf8_len,
)

__all__ = [
    "ERROR_MARKERS",
    "ERROR_SCAN_BYTES",
    "MIN_BUDGET",
    "Notice",
    "Truncation",
    "count_lines",
    "cut",
    "parse_notice",
    "read_chunk",
    "recut",
    "split_notice",
    "truncate",
    "utf8_len",
]

MIN_BUDGET = 4

# A lowercase marker costs one multi-byte find over the whole cut part, the dominant cost of a
# cut (about 0.1 ms per 250 KB each; capitalised ones usually ride on memchr, see _find), so the
# list is short and prefers prefixes that subsume variants: "Error" covers "ValueError:", "FAIL"
# covers "FAILED" and "--- FAIL:", "error" covers "error:" and "error[E0308]", "fatal" covers
# "fatal:", "panic" covers "panicked".
ERROR_MARKERS: tuple[bytes, ...] = (
    b"Traceback",
    b"Error",
    b"Exception",
    b"FAIL",
    b"ERROR",
    b"error",
    b"fatal",
    b"panic",
)
# The search stops this far into the cut part, so a multi-megabyte output costs no more than
# a 1 MiB one; the total_lines count is the only other full pass.
ERROR_SCAN_BYTES = 1 << 20

# Candidate first bytes tried one by one before _find gives up on memchr for that marker.
_PROBES = 32

# surrogatepass: tool output decoded leniently (e.g. JSON "\ud800") must not crash the proxy.
_ENC = ("utf-8", "surrogatepass")


@dataclass(frozen=True, slots=True)
class Truncation:
    """A cut: ``text`` (excerpt + notice) is what goes into the message.

    ``next_line``/``next_byte`` are the position in ``original`` where the cut-away part starts
    (``notice.next_line`` is the same line in the reader's coordinates, i.e. plus line_offset).
    """

    text: str
    excerpt: str
    notice: Notice
    next_line: int
    next_byte: int


def _encode(text: str) -> bytes:
    return text.encode(*_ENC)


def _decode(data: bytes) -> str:
    return data.decode(*_ENC)


def count_lines(text: str) -> int:
    """Lines as a person counts them: a trailing newline adds none, ``""`` has none."""
    return text.count("\n") + (1 if text and not text.endswith("\n") else 0)


def _count_lines_b(data: bytes) -> int:
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def _cut_end(data: bytes, start: int, budget: int) -> int:
    """End (exclusive) of the chunk of ``data`` from ``start``; ``budget`` >= MIN_BUDGET."""
    end = start + budget
    if end >= len(data):
        return len(data)
    nl = data.rfind(b"\n", start, end)
    if nl >= 0:
        return nl + 1
    # data[end] is the first byte left out; a continuation byte there means a split character.
    while end > start and data[end] & 0xC0 == 0x80:
        end -= 1
    if end - start > 1 and data[end - 1] == 0x0D and data[end] == 0x0A:
        end -= 1
    return end


def cut(text: str, budget: int) -> tuple[str, int]:
    """``(excerpt, rest_start)``: the chunk of ``text`` from its start, and where the rest begins.

    ``excerpt == text[:rest_start]``; the cut is mid-line exactly when
    ``0 < rest_start < len(text)`` and the excerpt does not end with ``"\\n"``.
    """
    data = _encode(text)
    excerpt = _decode(data[: _cut_end(data, 0, max(budget, MIN_BUDGET))])
    return excerpt, len(excerpt)


def _resolve(data: bytes, line: int, byte: int) -> tuple[int, int, int]:
    """Validate ``(line, byte)`` in ``data``; return it normalised plus its offset in ``data``."""
    if line < 1 or byte < 0:
        raise ValueError(f"invalid position: line {line}, byte {byte}")
    if line == 1:
        line_start = 0
    else:
        # split() finds the (line-1)-th newline at C speed; a find() loop would be Python-slow.
        parts = data.split(b"\n", line - 1)
        if len(parts) < line:
            raise ValueError(f"line {line} is past the end ({_count_lines_b(data)} lines)")
        line_start = len(data) - len(parts[-1])
    nl = data.find(b"\n", line_start)
    line_end = len(data) if nl < 0 else nl + 1
    offset = line_start + byte
    if offset > line_end:
        raise ValueError(f"byte {byte} is past the end of line {line}")
    if offset < len(data) and data[offset] & 0xC0 == 0x80:
        raise ValueError(f"byte {byte} of line {line} is inside a character")
    if byte and offset == line_end and nl >= 0:
        # "just past the newline" is the next line's start; saying so keeps line counts right.
        return line + 1, 0, offset
    return line, byte, offset


def _error_lines(data: bytes, pos: int, first_line: int) -> tuple[int, ...]:
    """Numbers of the first MAX_ERROR_LINES lines of ``data[pos:]`` that contain an error marker.

    ``first_line`` is the number of the line holding ``pos``.
    """
    # A line is identified by the offset of its end; one bytes.find per hit keeps this in C.
    ends: set[int] = set()
    size = len(data)
    bound = min(size, pos + ERROR_SCAN_BYTES)
    for marker in ERROR_MARKERS:
        find = _find if marker[:1].isupper() else bytes.find
        i = find(data, marker, pos, bound)
        found = 0
        while i >= 0 and found < MAX_ERROR_LINES:
            e = data.find(b"\n", i)
            e = size if e < 0 else e
            ends.add(e)
            found += 1
            if e >= bound:
                break
            i = find(data, marker, e + 1, bound)
        if len(ends) >= MAX_ERROR_LINES:
            # Later markers only matter if they hit before the current fifth line.
            bound = min(bound, sorted(ends)[MAX_ERROR_LINES - 1])
    numbers: list[int] = []
    line, at = first_line, pos
    for e in sorted(ends)[:MAX_ERROR_LINES]:
        line += data.count(b"\n", at, e)
        numbers.append(line)
        at = e
    return tuple(numbers)


def _find(data: bytes, needle: bytes, start: int, end: int) -> int:
    """``data.find(needle, start, end)``, much faster when the needle's first byte is rare.

    A one-byte find is memchr (about 50 times faster than a multi-byte find here), and the
    capitalised markers' first letters are rare in most output; where they are not, a few
    probes in, this falls back to the plain find, so the cost stays bounded.
    """
    first = needle[:1]
    i = data.find(first, start, end)
    for _ in range(_PROBES):
        if i < 0 or data.startswith(needle, i, end):
            return i
        i = data.find(first, i + 1, end)
    return -1 if i < 0 else data.find(needle, i, end)


def _next_position(excerpt: bytes, line: int, byte: int) -> tuple[int, int]:
    """Position just after ``excerpt``, which starts at ``(line, byte)``."""
    newlines = excerpt.count(b"\n")
    if newlines == 0:
        return line, byte + len(excerpt)
    return line + newlines, len(excerpt) - excerpt.rfind(b"\n") - 1


def truncate(
    original: str,
    budget: int,
    *,
    file_path: str,
    tool: str,
    start_line: int = 1,
    start_byte: int = 0,
    path_arg: str = "file_path",
    line_arg: str = "start_line",
    byte_arg: str | None = "start_byte",
    line_offset: int = 0,
) -> Truncation | None:
    """Cut ``original`` from ``(start_line, start_byte)`` to ``budget`` bytes, or None if it fits.

    Raises ValueError for a position outside ``original`` or inside a character, and for a
    ``file_path``/``tool``/argument name the notice could not carry unambiguously.
    """
    return _truncate(
        _encode(original),
        budget,
        file_path,
        tool,
        start_line,
        start_byte,
        path_arg,
        line_arg,
        byte_arg,
        line_offset,
    )[1]


def _truncate(
    data: bytes,
    budget: int,
    file_path: str,
    tool: str,
    start_line: int,
    start_byte: int,
    path_arg: str,
    line_arg: str,
    byte_arg: str | None,
    line_offset: int,
) -> tuple[int, Truncation | None]:
    """``(offset of the start position, the cut or None)``; shared so read_chunk encodes once."""
    if line_offset < 0:
        raise ValueError("line_offset must be >= 0")
    line, byte, offset = _resolve(data, start_line, start_byte)
    budget = max(budget, MIN_BUDGET)
    if len(data) - offset <= budget:
        return offset, None
    end = _cut_end(data, offset, budget)
    excerpt_b = data[offset:end]
    next_line, next_byte = _next_position(excerpt_b, line, byte)
    errors = _error_lines(data, end, next_line + line_offset)
    notice = Notice(
        total_lines=_count_lines_b(data),
        start_line=line + line_offset,
        excerpt_bytes=len(excerpt_b),
        tool=tool,
        file_path=file_path,
        next_line=next_line + line_offset,
        next_byte=next_byte,
        start_byte=byte,
        error_lines=errors,
        path_arg=path_arg,
        line_arg=line_arg,
        byte_arg=byte_arg,
    )
    excerpt = _decode(excerpt_b)
    return offset, Truncation(attach(excerpt, notice), excerpt, notice, next_line, next_byte)


def read_chunk(
    original: str,
    start_line: int,
    start_byte: int,
    budget: int,
    *,
    file_path: str,
    tool: str,
    path_arg: str = "file_path",
    line_arg: str = "start_line",
    byte_arg: str | None = "start_byte",
    line_offset: int = 0,
) -> str:
    """What a read tool returns for ``(start_line, start_byte)``: the chunk, plus a notice when
    more remains; the last chunk comes bare (empty at the end of the text).

    Raises ValueError like ``truncate``.
    """
    data = _encode(original)
    offset, t = _truncate(
        data,
        budget,
        file_path,
        tool,
        start_line,
        start_byte,
        path_arg,
        line_arg,
        byte_arg,
        line_offset,
    )
    return _decode(data[offset:]) if t is None else t.text


def recut(text: str, budget: int, *, byte_arg: str | None = "start_byte") -> str | None:
    """Stage 2: cut the excerpt of a message carrying our notice down to ``budget`` bytes.

    Only the excerpt, ``excerpt_bytes``, ``next_line``/``next_byte`` and the error lines (which
    gain those of the newly cut-away tail) change; the new excerpt is a prefix of the old one, so
    the hint still reads the original from the right place. Returns None when the excerpt already
    fits (so ``recut`` of its own output is None). ``byte_arg`` names the byte argument should
    the new cut be mid-line where the old one was not (the old text does not say it); an old
    mid-line notice keeps its own. Raises ValueError when ``text`` carries no notice.
    """
    split = split_notice(text)
    if split is None:
        raise ValueError("text carries no truncation notice")
    excerpt, old = split
    budget = max(budget, MIN_BUDGET)
    if old.excerpt_bytes <= budget:
        return None
    data = _encode(excerpt)
    end = _cut_end(data, 0, budget)
    next_line, next_byte = _next_position(data[:end], old.start_line, old.start_byte)
    # The dropped tail's lines all precede the old cut-away part, so merging keeps "first five".
    dropped = _error_lines(data, end, next_line)
    errors = tuple(sorted(set(dropped) | set(old.error_lines))[:MAX_ERROR_LINES])
    notice = dataclasses.replace(
        old,
        excerpt_bytes=end,
        next_line=next_line,
        next_byte=next_byte,
        error_lines=errors,
        byte_arg=old.byte_arg if old.next_byte else byte_arg,
    )
    return attach(_decode(data[:end]), notice)
