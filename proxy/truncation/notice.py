"""The truncation notice: rendering and parsing it back (pure, no I/O).

Grammar (lines joined by ``\\n``, no trailing newline; ``[...]`` lines are optional and, when
present, come in this order)::

    <<<TRUNCATED>>>
    The output above was truncated.
    The full content is saved to the file and contains {total_lines} lines in total.
    This excerpt starts at line {start_line} and covers the next {excerpt_bytes} bytes.
    If the current content is not enough, call `{tool}` with {path_arg}={file_path} {line_arg}={next_line}[ {byte_arg}={next_byte}] to read more.
    [Line {start_line} begins before this excerpt, which starts at byte {start_byte} of it.]
    [Line {next_line} continues past this excerpt; the next part starts at byte {next_byte} of that line.]
    [Lines that look like errors: {n1}, {n2}, ... {n5}.]

* The first four lines never vary, whatever the tool; agents recognise them.
* ``{byte_arg}={next_byte}`` and the "continues" line appear only when the excerpt ends mid-line
  (``next_byte > 0``). ``next_byte`` is the UTF-8 byte offset *within line next_line* where the
  next chunk starts, which is what the proxy's read tool takes as ``start_byte``. A client tool
  that cannot take a byte offset is rendered with ``byte_arg=None``: the argument is left out of
  the call, the "continues" line still says where the cut is.
* The "begins before" line appears only when the excerpt itself starts mid-line
  (``start_byte > 0``, a read that followed a mid-line hint). Stage 2 needs it to recompute
  ``next_byte`` after cutting harder, so it is spelled out rather than implied.
* Error lines: at most five absolute line numbers, strictly increasing, all in the cut-away part.
* All line numbers are in the coordinates the reader's tool uses (for a client read tool, offset
  by where the client's own read started); ``total_lines`` is the number of lines of the saved
  content, counted as a person would (a trailing newline adds none).

The message carrying a notice is ``excerpt + sep + notice`` where ``sep`` is ``"\\n"`` exactly when
the excerpt is non-empty and does not end with a newline (the marker must start a line). The
stated ``excerpt_bytes`` is what tells a parser whether that last newline is the excerpt's own.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

__all__ = [
    "MARKER",
    "MAX_ERROR_LINES",
    "Notice",
    "attach",
    "parse_notice",
    "split_notice",
    "utf8_len",
]

MARKER = "<<<TRUNCATED>>>"
MAX_ERROR_LINES = 5

_L2 = "The output above was truncated."
_L3 = "The full content is saved to the file and contains {} lines in total."
_L4 = "This excerpt starts at line {} and covers the next {} bytes."
_HINT = "If the current content is not enough, call `{}` with {} to read more."
_BEGINS = "Line {} begins before this excerpt, which starts at byte {} of it."
_CONTINUES = "Line {} continues past this excerpt; the next part starts at byte {} of that line."
_ERRORS = "Lines that look like errors: {}."

_ARG = r"[A-Za-z_][A-Za-z0-9_.-]*"
_ARG_RE = re.compile(_ARG)
_NUM = r"(0|[1-9][0-9]*)"
_L3_RE = re.compile(re.escape(_L3).replace(r"\{\}", _NUM))
_L4_RE = re.compile(re.escape(_L4).replace(r"\{\}", _NUM))
_BEGINS_RE = re.compile(re.escape(_BEGINS).replace(r"\{\}", _NUM))
_CONTINUES_RE = re.compile(re.escape(_CONTINUES).replace(r"\{\}", _NUM))
_ERRORS_RE = re.compile(re.escape(_ERRORS).replace(r"\{\}", r"([0-9]+(?:, [0-9]+){0,4})"))
_HINT_HEAD = "If the current content is not enough, call `"
_HINT_TAIL = " to read more."
# The path is free text (spaces, even "x=1"), so it is matched greedily and every reading is
# checked by re-rendering; the byte argument is tried first only when a "continues" line exists.
_HINT_BYTE_RE = re.compile(
    re.escape(_HINT_HEAD)
    + rf"([^`\n]*)` with ({_ARG})=(.*) ({_ARG})=([0-9]+) ({_ARG})=([0-9]+)"
    + re.escape(_HINT_TAIL),
    re.ASCII,
)
_HINT_RE = re.compile(
    re.escape(_HINT_HEAD)
    + rf"([^`\n]*)` with ({_ARG})=(.*) ({_ARG})=([0-9]+)"
    + re.escape(_HINT_TAIL),
    re.ASCII,
)
# Everything after the hint is at most three short lines of fixed text and numbers, so a message
# whose last few hundred characters lack the hint's ending cannot carry a notice.
_TAIL_WINDOW = 600


def utf8_len(text: str) -> int:
    """Size of ``text`` in UTF-8 bytes (lone surrogates count as the 3 bytes they encode to)."""
    return len(text.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True, slots=True)
class Notice:
    """Every field of a rendered notice; ``render()`` and ``parse_notice`` are exact inverses.

    One exception: with ``next_byte == 0`` no byte argument is rendered, so its name cannot be
    read back and parses as the default ``"start_byte"``.
    """

    total_lines: int
    start_line: int
    excerpt_bytes: int
    tool: str
    file_path: str
    next_line: int
    next_byte: int = 0
    start_byte: int = 0
    error_lines: tuple[int, ...] = ()
    path_arg: str = "file_path"
    line_arg: str = "start_line"
    byte_arg: str | None = "start_byte"

    def __post_init__(self) -> None:
        # Rejecting what cannot be rendered unambiguously keeps render/parse exact inverses.
        for name in ("total_lines", "excerpt_bytes", "next_byte", "start_byte"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.start_line < 1 or self.next_line < self.start_line:
            raise ValueError("need 1 <= start_line <= next_line")
        if "\n" in self.file_path:
            raise ValueError("file_path must not contain a newline")
        if "\n" in self.tool or "`" in self.tool:
            raise ValueError("tool must not contain a newline or a backtick")
        for arg in (self.path_arg, self.line_arg, self.byte_arg):
            if arg is not None and not _ARG_RE.fullmatch(arg):
                raise ValueError(f"bad argument name {arg!r}")
        errs = self.error_lines
        if len(errs) > MAX_ERROR_LINES or any(n < 1 for n in errs):
            raise ValueError("error_lines: at most five positive line numbers")
        if any(a >= b for a, b in itertools.pairwise(errs)):
            raise ValueError("error_lines must be strictly increasing")

    def render(self) -> str:
        args = f"{self.path_arg}={self.file_path} {self.line_arg}={self.next_line}"
        if self.next_byte and self.byte_arg is not None:
            args += f" {self.byte_arg}={self.next_byte}"
        lines = [
            MARKER,
            _L2,
            _L3.format(self.total_lines),
            _L4.format(self.start_line, self.excerpt_bytes),
            _HINT.format(self.tool, args),
        ]
        if self.start_byte:
            lines.append(_BEGINS.format(self.start_line, self.start_byte))
        if self.next_byte:
            lines.append(_CONTINUES.format(self.next_line, self.next_byte))
        if self.error_lines:
            lines.append(_ERRORS.format(", ".join(map(str, self.error_lines))))
        return "\n".join(lines)


def attach(excerpt: str, notice: Notice) -> str:
    """The message text: the excerpt, a newline if needed so the marker starts a line, the notice."""
    sep = "\n" if excerpt and not excerpt.endswith("\n") else ""
    return excerpt + sep + notice.render()


def split_notice(text: str) -> tuple[str, Notice] | None:
    """Split a message into (excerpt, notice) when it ends with a valid notice, else None.

    Only the last ``<<<TRUNCATED>>>`` at a line start is considered (none of the notice's own
    lines can contain the marker followed by a newline), the notice must end the text, must
    re-render to exactly the same characters, and the excerpt before it must be exactly
    ``excerpt_bytes`` long; a tool output that merely quotes the marker does not qualify.
    """
    tail_at = text.rfind(_HINT_TAIL, max(0, len(text) - _TAIL_WINDOW))
    if tail_at < 0:
        return None
    m = text.rfind(MARKER + "\n", 0, tail_at)
    if m < 0 or (m > 0 and text[m - 1] != "\n"):
        return None
    block = text[m:]
    notice = _parse_block(block)
    if notice is None:
        return None
    excerpt = text[:m]
    size = utf8_len(excerpt)
    if size == notice.excerpt_bytes and (not excerpt or excerpt.endswith("\n")):
        return excerpt, notice
    if (
        size == notice.excerpt_bytes + 1
        and len(excerpt) >= 2
        and excerpt[-2] != "\n"  # excerpt[-1] is "\n": the marker is at a line start
    ):
        return excerpt[:-1], notice
    return None


def parse_notice(text: str) -> Notice | None:
    """The notice at the end of ``text`` (see ``split_notice``), or None."""
    split = split_notice(text)
    return None if split is None else split[1]


def _parse_block(block: str) -> Notice | None:
    lines = block.split("\n")
    if not 5 <= len(lines) <= 8 or lines[0] != MARKER or lines[1] != _L2:
        return None
    m3 = _L3_RE.fullmatch(lines[2])
    m4 = _L4_RE.fullmatch(lines[3])
    if m3 is None or m4 is None:
        return None
    total_lines, start_line, excerpt_bytes = int(m3[1]), int(m4[1]), int(m4[2])

    extra = lines[5:]
    start_byte = 0
    cont: tuple[int, int] | None = None
    errors: tuple[int, ...] = ()
    if extra and (mb := _BEGINS_RE.fullmatch(extra[0])):
        start_byte = int(mb[2])
        extra = extra[1:]
    if extra and (mc := _CONTINUES_RE.fullmatch(extra[0])):
        cont = (int(mc[1]), int(mc[2]))
        extra = extra[1:]
    if extra and (me := _ERRORS_RE.fullmatch(extra[0])):
        errors = tuple(int(n) for n in me[1].split(", "))
        extra = extra[1:]
    if extra:
        return None

    # Each reading fixes every field; re-rendering decides, so a path that itself looks like
    # "x=5" cannot be mistaken for an argument.
    readings: list[tuple[str, str, str, str, int, str | None]] = []
    if cont is None:
        next_byte = 0
        if h := _HINT_RE.fullmatch(lines[4]):
            # No byte argument is rendered at a line boundary, so its name is not in the text.
            readings.append((h[1], h[2], h[3], h[4], int(h[5]), "start_byte"))
    else:
        next_byte = cont[1]
        if hb := _HINT_BYTE_RE.fullmatch(lines[4]):
            readings.append((hb[1], hb[2], hb[3], hb[4], int(hb[5]), hb[6]))
        if h := _HINT_RE.fullmatch(lines[4]):
            readings.append((h[1], h[2], h[3], h[4], int(h[5]), None))
    for tool, path_arg, path, line_arg, next_line, byte_arg in readings:
        try:
            notice = Notice(
                total_lines=total_lines,
                start_line=start_line,
                excerpt_bytes=excerpt_bytes,
                tool=tool,
                file_path=path,
                next_line=next_line,
                next_byte=next_byte,
                start_byte=start_byte,
                error_lines=errors,
                path_arg=path_arg,
                line_arg=line_arg,
                byte_arg=byte_arg,
            )
        except ValueError:
            continue
        if notice.render() == block:
            return notice
    return None
