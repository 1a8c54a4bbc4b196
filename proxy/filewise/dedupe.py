"""Duplicate tool outputs forwarded as references to the earlier copy (pure, no I/O).

Agents run the same command twice (a test suite before and after a one-line fix, ``git diff``
again, a build log), and the second output repeats the first in whole or in long stretches.
:func:`duplicate` gives a new output's forwarded form against the outputs still forwarded
whole in the session (:class:`Earlier`): the same bytes as one of them become one line,
``[ctxproxy: identical to the output of call X in turn N (K lines); this copy: ...]``; else
every run of whole lines of at least ``min_bytes`` that repeats a run of one earlier output
becomes one line, ``[ctxproxy: lines A-B here repeat lines C-D of the output of call X in turn
N; this copy: read_offloaded file_path=... start_line=A]``. :func:`expand` gives the output
back from that form and the same earlier outputs, byte for byte.

How: a *window* is the fewest whole lines (split at ``\\n``, each keeping its ``\\n``) from a
position that hold ``min_bytes``, so any repeat of at least ``min_bytes`` starting at a line
begins with a whole window, identical on both sides. The new output's windows are hashed
(a rolling hash of the lines' CRC-32s); every earlier output sharing a line with it has its
windows hashed too and the positions whose window the new output has are kept; the new
output is then scanned left to right, each hit checked line by line and extended as far as
it goes, the longest kept (ties: the newest output, then its latest position), and the scan
resumes after it. CRC-32, not Python's ``hash``: that is salted per process, and every
replica must forward the same bytes; a collision costs a comparison, never a wrong reference.

Limits (both keep the cost linear in the bytes looked at: about 0.1 s for 6 MB of earlier
outputs sharing lines with the new one, a few ms when they share none): only the newest
earlier outputs totalling at most ``budget_bytes`` are looked at (:data:`BUDGET_BYTES`,
4 MiB: the text of a million-token window, more than any context holds), and each window
keeps :data:`CANDIDATES` of the positions it occurs at, the first two and the newest two (a
log repeating one block thousands of times is matched against four of them, not all: the
first ones let a long aligned repeat be found whole, the newest name the output most likely
still in the context). The whole-output check looks at every earlier output (a length
comparison each).
"""

from __future__ import annotations

import re
import zlib
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Final

from proxy.filewise.delta import split_lines
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

__all__ = ["BUDGET_BYTES", "CANDIDATES", "Dedup", "DedupIndex", "Earlier", "Span", "duplicate", "expand",
           "parse_reference"]

#: The newest earlier outputs looked at, in UTF-8 bytes.
BUDGET_BYTES: Final = 4 * 1024 * 1024
#: Positions kept per window hash: the first half and the newest half of those it occurs at.
CANDIDATES: Final = 4

_MOD: Final = (1 << 61) - 1
_BASE: Final = 1_000_003


@dataclass(frozen=True, slots=True)
class Earlier:
    """A tool output forwarded whole earlier in the session: the history index of its result,
    its call, the turn of that call (the assistant message's number, from 1), its text."""

    index: int
    call_id: str
    turn: int
    text: str


@dataclass(frozen=True, slots=True)
class Span:
    """Lines ``start``-``end`` of the output (1-based, inclusive) are lines
    ``from_start``-``from_end`` of the earlier output ``index`` (call ``call_id``)."""

    start: int
    end: int
    index: int
    call_id: str
    turn: int
    from_start: int
    from_end: int


@dataclass(frozen=True, slots=True)
class Dedup:
    """An output's forwarded form (``text``) and what it refers to: the earlier output it is
    identical to, or the spans replaced by references."""

    text: str
    spans: tuple[Span, ...] = ()
    identical: Earlier | None = None

    @property
    def refs(self) -> frozenset[int]:
        """The history indices of the earlier outputs this form needs forwarded whole."""
        if self.identical is not None:
            return frozenset({self.identical.index})
        return frozenset(s.index for s in self.spans)


_IDENTICAL: Final = "identical to the output of call {call} in turn {turn} ({n} lines)"
_SPAN: Final = "lines {a}-{b} here repeat lines {c}-{d} of the output of call {call} in turn {turn}"
_COPY: Final = "; this copy: {saved}"
_IDENTICAL_RE: Final = re.compile(
    re.escape(PREFIX)
    + rf"identical to the output of call (?P<call>{TOKEN}) in turn (?P<turn>[0-9]+) "
    + rf"\((?P<n>[0-9]+) lines\)(?:; this copy: {pointer('s')})?\]"
)
_SPAN_RE: Final = re.compile(
    re.escape(PREFIX)
    + r"lines (?P<a>[0-9]+)-(?P<b>[0-9]+) here repeat lines (?P<c>[0-9]+)-(?P<d>[0-9]+) "
    + rf"of the output of call (?P<call>{TOKEN}) in turn (?P<turn>[0-9]+)"
    + rf"(?:; this copy: {pointer('s', line=True)})?\]"
)


def _identical_line(e: Earlier, n: int, saved: Pointer | None) -> str:
    line = PREFIX + _IDENTICAL.format(call=token(e.call_id), turn=e.turn, n=n)
    return line + (_COPY.format(saved=saved.render()) if saved is not None else "") + "]"


def _span_line(s: Span, saved: Pointer | None) -> str:
    line = PREFIX + _SPAN.format(a=s.start, b=s.end, c=s.from_start, d=s.from_end,
                                 call=token(s.call_id), turn=s.turn)
    return line + (_COPY.format(saved=saved.render(s.start)) if saved is not None else "") + "]"


class _Lines:
    """A text's lines as UTF-8 bytes (each keeping its ``\\n``), their start offsets and the
    prefix hashes of their CRC-32s (the per-line work is C-level where it can be: this runs
    over every earlier output on every call)."""

    __slots__ = ("lines", "offsets", "prefix")

    def __init__(self, data: bytes) -> None:
        pieces = data.split(b"\n")
        lines = [p + b"\n" for p in pieces[:-1]]
        if pieces[-1]:
            lines.append(pieces[-1])
        self.lines = lines
        self.offsets = list(accumulate(map(len, lines), initial=0))
        prefix = [0]
        h = 0
        for key in map(zlib.crc32, lines):
            h = (h * _BASE + key) % _MOD
            prefix.append(h)
        self.prefix = prefix

    def windows(self, min_bytes: int, powers: list[int]) -> list[tuple[int, int]]:
        """(hash, line count) of the window at every line a window starts at (the fewest
        lines from there holding ``min_bytes``), in line order; the lines too close to the
        end have none (the list stops there)."""
        off, pre = self.offsets, self.prefix
        starts = min(bisect_right(off, off[-1] - min_bytes), len(self.lines))
        ends = [bisect_left(off, o + min_bytes) for o in off[:starts]]
        if not ends:
            return []
        pw = _powers(powers, max(e - k for k, e in enumerate(ends)))
        return [((pre[e] - pre[k] * pw[e - k]) % _MOD, e - k) for k, e in enumerate(ends)]


def _powers(powers: list[int], n: int) -> list[int]:
    """``powers`` (of the hash base, from 1) grown to hold index ``n``."""
    while len(powers) <= n:
        powers.append(powers[-1] * _BASE % _MOD)
    return powers


def _unique(earlier: Sequence[Earlier]) -> list[Earlier]:
    """The first output of each call id (a reference names the call), in order."""
    seen: set[str] = set()
    out: list[Earlier] = []
    for e in earlier:
        if e.call_id not in seen:
            seen.add(e.call_id)
            out.append(e)
    return out


def duplicate(
    text: str, earlier: Sequence[Earlier], *, min_bytes: int,
    saved: str | Pointer | None = None, budget_bytes: int = BUDGET_BYTES,
) -> Dedup | None:
    """``text`` (a new tool output) forwarded against ``earlier`` (outputs forwarded whole
    before it in the session, in history order; the first of each call id counts), or None
    when nothing of at least ``min_bytes`` UTF-8 bytes repeats (see the module docstring for
    the forms and the limits). ``saved``: where the proxy kept ``text`` whole (the caller
    keeps it, as for any offload; a path is a ``read_offloaded`` path), named in each
    reference line with the line to start at. The forwarded text is always smaller than
    ``text``.

    Not deduplicated (None): a text under ``min_bytes``; a text with a line starting
    ``[ctxproxy: `` (a reference could not be told from it, and :func:`expand` must be exact).
    Deterministic; :func:`expand` ``(result.text, earlier)`` gives ``text`` back exactly.
    One call; a caller deciding many outputs of one history in turn keeps a
    :class:`DedupIndex` instead (the same answers, each earlier output hashed once).
    """
    if 4 * len(text) < min_bytes or not earlier:
        return None
    index = DedupIndex(min_bytes=min_bytes, budget_bytes=budget_bytes)
    for e in earlier:
        index.add(e)
    return index.duplicate(text, saved=saved)


class DedupIndex:
    """The earlier outputs of one history, added in history order as they are found forwarded
    whole, and :meth:`duplicate` for each new one: what :func:`duplicate` answers against the
    outputs added so far, but each earlier output is hashed once, not once per new output (a
    history of N outputs costs O(N) hashing, not O(N * budget_bytes)).

    The window index keeps every position of every window; a lookup takes, of the positions
    in outputs inside the byte budget (the newest outputs totalling ``budget_bytes``), the
    first two and the newest two, as :func:`duplicate`'s per-call index keeps them."""

    __slots__ = ("_budget", "_by_text", "_calls", "_cum", "_done", "_hashed", "_index", "_min",
                 "_powers", "_sized", "spent")

    def __init__(self, *, min_bytes: int, budget_bytes: int = BUDGET_BYTES) -> None:
        self._min = min_bytes
        self._budget = budget_bytes
        self._calls: set[str] = set()
        self._by_text: dict[str, Earlier] = {}  # text -> the newest unique output with it
        self._sized: list[tuple[Earlier, int]] = []  # outputs a span may come from, their size
        self._cum: list[int] = [0]  # bytes of _sized before each
        self._hashed: dict[int, _Lines] = {}  # position in _sized -> its lines, once hashed
        self._done = 0  # how many of _sized are hashed (or skipped: out of the budget)
        self._index: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self._powers = [1]
        self.spent = 0  # bytes hashed (a work count)

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, e: Earlier) -> None:
        """An output forwarded whole, after every one added before (history order)."""
        if e.call_id in self._calls:
            return  # a reference names the call: its first output stands for it
        self._calls.add(e.call_id)
        self._by_text[e.text] = e
        if 4 * len(e.text) >= self._min:
            size = utf8_len(e.text)
            self._sized.append((e, size))
            self._cum.append(self._cum[-1] + size)

    def _low(self) -> int:
        """The first output in the byte budget: the newest ones totalling at most it."""
        total = self._cum[-1]
        return bisect_left(self._cum, total - self._budget, 0, len(self._sized))

    def _hash_pending(self, low: int) -> None:
        powers, min_bytes = self._powers, self._min
        for n in range(max(self._done, low), len(self._sized)):
            e, size = self._sized[n]
            lines = _Lines(e.text.encode("utf-8", "surrogatepass"))
            self.spent += size
            for k, w in enumerate(lines.windows(min_bytes, powers)):
                self._index.setdefault(w, []).append((n, k))
            self._hashed[n] = lines
        self._done = len(self._sized)

    def duplicate(self, text: str, *, saved: str | Pointer | None = None) -> Dedup | None:
        """:func:`duplicate` of ``text`` against the outputs added so far."""
        min_bytes = self._min
        if 4 * len(text) < min_bytes or not self._calls:
            return None
        data = text.encode("utf-8", "surrogatepass")
        if len(data) < min_bytes or text.startswith(PREFIX) or "\n" + PREFIX in text:
            return None
        where = as_pointer(saved)
        same = self._by_text.get(text)
        if same is not None:
            line = _identical_line(same, count_lines(text), where)
            if len(line.encode("utf-8", "surrogatepass")) < len(data):
                return Dedup(line, (), same)
        if not self._sized:
            return None  # no earlier output holds a span: its windows need not be hashed

        mine = _Lines(data)
        own = mine.lines
        windows = mine.windows(min_bytes, self._powers)
        if not windows:
            return None
        low = self._low()
        self._hash_pending(low)
        index = self._index
        hashed = self._hashed

        def hits(w: tuple[int, int]) -> list[tuple[int, int]]:
            found = index.get(w)
            if not found:
                return []
            start = bisect_left(found, (low, -1))
            if len(found) - start <= CANDIDATES:
                return found[start:]
            half = CANDIDATES // 2
            return found[start:start + half] + found[len(found) - half:]

        spans: list[tuple[int, int, int, int]] = []  # (start, end excl., output, its start)
        i = 0
        while i < len(windows):
            best: tuple[int, int, int] | None = None  # (length, output, its start)
            for n, k in reversed(hits(windows[i])):
                theirs = hashed[n].lines
                t = 0
                limit = min(len(own) - i, len(theirs) - k)
                while t < limit and own[i + t] == theirs[k + t]:
                    t += 1
                if mine.offsets[i + t] - mine.offsets[i] >= min_bytes and (
                    best is None or t > best[0]
                ):
                    best = (t, n, k)
            if best is not None:
                t, n, k = best
                e = self._sized[n][0]
                span = Span(i + 1, i + t, e.index, e.call_id, e.turn, k + 1, k + t)
                ref = _span_line(span, where)
                if len(ref.encode("utf-8", "surrogatepass")) + 1 < mine.offsets[i + t] - mine.offsets[i]:
                    spans.append((i, i + t, n, k))
                    i += t
                    continue
            i += 1
        if not spans:
            return None

        parts: list[str] = []
        out_spans: list[Span] = []
        at = 0
        for start, end, n, k in spans:
            if at < start:
                parts.append(b"".join(own[at:start]).decode("utf-8", "surrogatepass"))
            e = self._sized[n][0]
            span = Span(start + 1, end, e.index, e.call_id, e.turn, k + 1, k + end - start)
            out_spans.append(span)
            parts.append(_span_line(span, where) + "\n")
            at = end
        if at < len(own):
            parts.append(b"".join(own[at:]).decode("utf-8", "surrogatepass"))
        return Dedup("".join(parts), tuple(out_spans))


def expand(dedup_text: str, earlier: Sequence[Earlier]) -> str:
    """The output a :func:`duplicate` form stands for, given the same ``earlier`` outputs
    (those it names, at least). Raises ValueError when a reference names an output not among
    them, or does not fit it (other lines or line numbers than it says)."""
    by_call = {e.call_id: e for e in _unique(earlier)}
    if dedup_text.startswith(PREFIX) and "\n" not in dedup_text:
        m = _IDENTICAL_RE.fullmatch(dedup_text)
        if m is not None:
            e = by_call.get(untoken(m["call"]))
            if e is None or count_lines(e.text) != int(m["n"]):
                raise ValueError("the output it is identical to is not among the earlier ones")
            return e.text
    split: dict[str, list[str]] = {}
    out: list[str] = []
    count = 0
    for line in split_lines(dedup_text):
        if not line.startswith(PREFIX):
            out.append(line)
            count += 1
            continue
        m = _SPAN_RE.fullmatch(line.removesuffix("\n"))
        if m is None:
            raise ValueError(f"not a reference: {line!r}")
        a, b, c, d = int(m["a"]), int(m["b"]), int(m["c"]), int(m["d"])
        call = untoken(m["call"])
        e = by_call.get(call)
        if e is None:
            raise ValueError(f"call {call} is not among the earlier outputs")
        if e.call_id not in split:
            split[e.call_id] = split_lines(e.text)
        theirs = split[e.call_id]
        if a != count + 1 or b - a != d - c or not 1 <= c <= d <= len(theirs):
            raise ValueError(f"reference does not fit: {line!r}")
        out.extend(theirs[c - 1:d])
        count += b - a + 1
    return "".join(out)


def parse_reference(line: str) -> tuple[Span, Pointer | None] | None:
    """A span reference line (without its ``\\n``) read back (``index`` -1), or None."""
    m = _SPAN_RE.fullmatch(line)
    if m is None:
        return None
    try:
        span = Span(int(m["a"]), int(m["b"]), -1, untoken(m["call"]), int(m["turn"]),
                    int(m["c"]), int(m["d"]))
        saved = read_pointer(m, "s") if m["stool"] is not None else None
    except ValueError:
        return None
    return (span, saved) if _span_line(span, saved) == line else None
