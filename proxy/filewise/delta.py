"""Re-read deltas: a new output as a delta against an earlier one (pure, no I/O).

A re-read (:func:`proxy.filewise.rereads.reread` finds the earlier read of the same tool, file
and range, still forwarded whole) is forwarded as :func:`delta_text`: a one-line "unchanged"
marker, or a unified diff with line numbers, when that is at most :data:`DELTA_MAX_RATIO` of
the output. :func:`parse_delta` reads a delta's first line back, :func:`apply_delta` applies
it. The diff is difflib's, the two outputs' common head and tail matched first in linear time,
with :data:`CONTEXT` lines around each hunk.

Everything here is a function of its arguments: the same two outputs give the same delta on
every replica. Lines are split at ``\\n`` only (a ``\\r\\n`` line keeps its ``\\r``), as
:func:`proxy.truncation.cut.count_lines` and the proxy's read tool count them.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Final

from proxy.filewise.markers import (
    PREFIX,
    TOKEN,
    Pointer,
    as_pointer,
    pointer,
    read_pointer,
    token,
    untoken,
)
from proxy.truncation.cut import count_lines
from proxy.truncation.notice import utf8_len

__all__ = [
    "DELTA_MAX_RATIO",
    "Delta",
    "apply_delta",
    "delta_text",
    "parse_delta",
    "split_lines",
]

#: A delta is forwarded only when it is at most this share of the new output's UTF-8 bytes.
#: A delta makes the model combine two places of its context to know the file; a larger one
#: would save less than half a read for that, and a diff that large is mostly hunks with
#: their context lines, the file again. (An unchanged re-read, a marker of ~150 bytes,
#: passes for any output over ~300 bytes.)
DELTA_MAX_RATIO: Final = 0.5
#: Lines of context around each hunk (``diff -u``'s default).
CONTEXT: Final = 3
# The middle of two outputs (after their common head and tail) is diffed only up to this many
# lines each: difflib's matcher is quadratic at worst (~0.2 s at this size for two scrambles
# of the same 150 lines). Bases are forwarded whole, so under the stage-1 budget (51 KB,
# some 1-2k lines): the cap is for the odd huge output, not for reads.
_MAX_DIFF_LINES: Final = 10_000


def split_lines(text: str) -> list[str]:
    """``text`` as lines split at ``\\n``, each keeping its ``\\n`` (the last may have none):
    the lines :func:`.truncate.count_lines` counts, joined back to ``text`` exactly."""
    pieces = text.split("\n")
    lines = [p + "\n" for p in pieces[:-1]]
    if pieces[-1]:
        lines.append(pieces[-1])
    return lines


_NO_EOL: Final = "\\ No newline at end of file\n"
_UNCHANGED: Final = "unchanged since the read in turn {turn} (call {call}): {path}, the same {n} lines"
_CHANGED: Final = ("changed since the read in turn {turn} (call {call}): {path}, {n} lines now; "
                   "unified diff against that output below")
_WHOLE: Final = "; the whole output: {saved}"
_HEAD_RE: Final = re.compile(
    re.escape(PREFIX)
    + r"(?P<what>unchanged|changed) since the read in turn (?P<turn>[0-9]+) "
    + rf"\(call (?P<call>{TOKEN})\): (?P<path>{TOKEN}), "
    + r"(?:the same (?P<same>[0-9]+) lines|(?P<now>[0-9]+) lines now; unified diff against "
    + r"that output below)"
    + rf"(?:; the whole output: {pointer('s')})?\]"
)
_HUNK_RE: Final = re.compile(r"@@ -([0-9]+)(?:,([0-9]+))? \+([0-9]+)(?:,([0-9]+))? @@\n")


@dataclass(frozen=True, slots=True)
class Delta:
    """What a delta's first line says (:func:`parse_delta`)."""

    path: str
    base_call: str
    base_turn: int
    lines: int  # of the new output
    unchanged: bool
    saved: Pointer | None


def _head(what: str, *, path: str, base_call: str, base_turn: int, lines: int,
          saved: Pointer | None) -> str:
    fmt = _UNCHANGED if what == "unchanged" else _CHANGED
    head = PREFIX + fmt.format(turn=base_turn, call=token(base_call), path=token(path), n=lines)
    if saved is not None:
        head += _WHOLE.format(saved=saved.render())
    return head + "]"


def delta_text(
    old: str, new: str, *, path: str, base_call: str, base_turn: int,
    saved: str | Pointer | None, max_ratio: float = DELTA_MAX_RATIO,
) -> str | None:
    """``new`` (a re-read's output) as a delta against ``old`` (the output of the read it
    repeats, :func:`reread`), or None when that is not at most ``max_ratio`` of ``new``'s
    UTF-8 bytes (:data:`DELTA_MAX_RATIO`: at least halved) or the two differ across more than
    10,000 lines.

    * ``new == old``: one line, ``[ctxproxy: unchanged since the read in turn N (call X):
      PATH, the same K lines; the whole output: read_offloaded file_path=...]``;
    * else that line saying ``changed ...; unified diff against that output below``, then the
      hunks of a unified diff of ``old`` to ``new`` (``@@ -a,b +c,d @@`` headers: the line
      numbers; 3 lines of context; ``\\ No newline at end of file`` after a last line without
      one), lines split at ``\\n``.

    ``saved`` says where the proxy kept ``new`` whole (the caller keeps it, as for any
    offload). Deterministic; :func:`apply_delta` ``(old, delta)`` gives back ``new`` exactly.
    """
    size = utf8_len(new)
    limit = size * max_ratio
    where = as_pointer(saved)
    if new == old:
        head = _head("unchanged", path=path, base_call=base_call, base_turn=base_turn,
                     lines=count_lines(new), saved=where)
        return head if utf8_len(head) <= limit else None
    a, b = split_lines(old), split_lines(new)
    hunks = _hunks(a, b, limit)
    if hunks is None:
        return None
    head = _head("changed", path=path, base_call=base_call, base_turn=base_turn,
                 lines=len(b), saved=where)
    body = _render_hunks(a, b, hunks)
    out = head + "\n" + body
    return out if utf8_len(out) <= limit else None


Opcode = tuple[str, int, int, int, int]


def _hunks(a: list[str], b: list[str], limit: float) -> list[list[Opcode]] | None:
    """The grouped opcodes of ``a`` -> ``b`` (difflib's, with :data:`CONTEXT` lines), the
    common head and tail matched first in linear time; None when the diff cannot fit in
    ``limit`` bytes (every line of ``b`` that ``a`` lacks is in it: a bound found in linear
    time) or the middle is over :data:`_MAX_DIFF_LINES`."""
    head = 0
    n = min(len(a), len(b))
    while head < n and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < n - head and a[len(a) - 1 - tail] == b[len(b) - 1 - tail]:
        tail += 1
    mid_a, mid_b = a[head:len(a) - tail], b[head:len(b) - tail]
    if max(len(mid_a), len(mid_b)) > _MAX_DIFF_LINES:
        return None
    known = set(mid_a)
    if sum(len(line) + 1 for line in mid_b if line not in known) > limit:  # chars <= bytes
        return None
    codes: list[Opcode] = []
    if head:
        codes.append(("equal", 0, head, 0, head))
    matcher = difflib.SequenceMatcher(None, mid_a, mid_b)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        codes.append((tag, i1 + head, i2 + head, j1 + head, j2 + head))
    if tail:
        codes.append(("equal", len(a) - tail, len(a), len(b) - tail, len(b)))
    return _group(_merge(codes), CONTEXT)


def _merge(codes: list[Opcode]) -> list[Opcode]:
    """Adjacent equal opcodes as one (the head or tail next to the matcher's own)."""
    out: list[Opcode] = []
    for c in codes:
        if out and c[0] == "equal" and out[-1][0] == "equal":
            p = out[-1]
            out[-1] = ("equal", p[1], c[2], p[3], c[4])
        elif c[1] != c[2] or c[3] != c[4]:
            out.append(c)
    return out


def _group(codes: list[Opcode], n: int) -> list[list[Opcode]]:
    """difflib.SequenceMatcher.get_grouped_opcodes on a given opcode list."""
    if not codes:
        codes = [("equal", 0, 1, 0, 1)]
    if codes[0][0] == "equal":
        tag, i1, i2, j1, j2 = codes[0]
        codes[0] = tag, max(i1, i2 - n), i2, max(j1, j2 - n), j2
    if codes[-1][0] == "equal":
        tag, i1, i2, j1, j2 = codes[-1]
        codes[-1] = tag, i1, min(i2, i1 + n), j1, min(j2, j1 + n)
    nn = n + n
    groups: list[list[Opcode]] = []
    group: list[Opcode] = []
    for tag, i1, i2, j1, j2 in codes:
        if tag == "equal" and i2 - i1 > nn:
            group.append((tag, i1, min(i2, i1 + n), j1, min(j2, j1 + n)))
            groups.append(group)
            group = []
            i1, j1 = max(i1, i2 - n), max(j1, j2 - n)
        group.append((tag, i1, i2, j1, j2))
    if group and not (len(group) == 1 and group[0][0] == "equal"):
        groups.append(group)
    return groups


def _line(prefix: str, line: str) -> str:
    return prefix + line if line.endswith("\n") else prefix + line + "\n" + _NO_EOL


def _range(start: int, stop: int) -> str:
    """A hunk side as ``diff -u`` and difflib write it: ``a,n``; ``a`` alone for one line; an
    empty side numbered by the line before it."""
    if stop - start == 1:
        return str(start + 1)
    return f"{start + 1 if stop > start else start},{stop - start}"


def _render_hunks(a: list[str], b: list[str], groups: list[list[Opcode]]) -> str:
    out: list[str] = []
    for group in groups:
        i1, i2 = group[0][1], group[-1][2]
        j1, j2 = group[0][3], group[-1][4]
        out.append(f"@@ -{_range(i1, i2)} +{_range(j1, j2)} @@\n")
        for tag, x1, x2, y1, y2 in group:
            if tag == "equal":
                out.extend(_line(" ", line) for line in a[x1:x2])
                continue
            if tag in ("replace", "delete"):
                out.extend(_line("-", line) for line in a[x1:x2])
            if tag in ("replace", "insert"):
                out.extend(_line("+", line) for line in b[y1:y2])
    return "".join(out)


def parse_delta(text: str) -> Delta | None:
    """What the first line of a :func:`delta_text` output says, or None when ``text`` does not
    begin with one (an unchanged marker must be all of ``text``; a changed one is followed by
    a newline and its hunks, not checked here: :func:`apply_delta` does)."""
    if not text.startswith(PREFIX):
        return None
    head, nl, _ = text.partition("\n")
    m = _HEAD_RE.fullmatch(head)
    if m is None or (m["what"] == "unchanged") == bool(nl):
        return None
    try:
        saved = read_pointer(m, "s") if m["stool"] is not None else None
        d = Delta(path=untoken(m["path"]), base_call=untoken(m["call"]),
                  base_turn=int(m["turn"]), lines=int(m["same"] or m["now"]),
                  unchanged=m["what"] == "unchanged", saved=saved)
    except ValueError:
        return None
    what = "unchanged" if d.unchanged else "changed"
    if _head(what, path=d.path, base_call=d.base_call, base_turn=d.base_turn, lines=d.lines,
             saved=d.saved) != head:
        return None
    return d


def apply_delta(old: str, delta: str) -> str:
    """The new output a :func:`delta_text` delta of it against ``old`` stands for. Raises
    ValueError when ``delta`` is not one, or does not apply to ``old`` (a context or removed
    line differs: the wrong base)."""
    d = parse_delta(delta)
    if d is None:
        raise ValueError("not a ctxproxy delta")
    if d.unchanged:
        return old
    a = split_lines(old)
    body = split_lines(delta.partition("\n")[2])
    out: list[str] = []
    at = 0  # next line of ``a`` not yet copied
    k = 0
    while k < len(body):
        h = _HUNK_RE.fullmatch(body[k])
        if h is None:
            raise ValueError(f"expected a hunk header, got {body[k]!r}")
        k += 1
        old_n, new_n = int(h[2] or 1), int(h[4] or 1)
        start = int(h[1]) - 1 if old_n else int(h[1])
        if start < at or start > len(a):
            raise ValueError("hunks out of order")
        out.extend(a[at:start])
        at = start
        seen_old = seen_new = 0
        while seen_old < old_n or seen_new < new_n:
            if k >= len(body):
                raise ValueError("hunk cut short")
            line = body[k]
            k += 1
            if k < len(body) and body[k] == _NO_EOL:
                line = line[:-1]
                k += 1
            sign, content = line[:1], line[1:]
            if sign in (" ", "-"):
                if at >= len(a) or a[at] != content:
                    raise ValueError(f"line {at + 1} of the base differs")
                at += 1
                seen_old += 1
                if sign == " ":
                    out.append(content)
                    seen_new += 1
            elif sign == "+":
                out.append(content)
                seen_new += 1
            else:
                raise ValueError(f"bad hunk line {line!r}")
        if seen_old != old_n or seen_new != new_n:
            raise ValueError("hunk line counts differ from its header")
    out.extend(a[at:])
    return "".join(out)
