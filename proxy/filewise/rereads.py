"""Superseded and stale reads, and re-reads forwarded as deltas (pure, no I/O).

Coding agents read the same files again and again; the earlier copies stay in the context,
dead. Two rules, both from :class:`.files.Provenance` (one parse of the history):

* **At an epoch** (a compaction, docs/epochs.md), :func:`superseded` picks the reads in
  ``history[:seen]`` to forward as a one-line :func:`marker`: a read shown again later (the
  same file, a range that covers it) or of a file changed since (written, edited, deleted,
  moved). The newest read of each file and any read a later edit quotes stay verbatim.
* **On arrival**, :func:`reread` finds the earlier read a new one repeats (same tool, file and
  range, still forwarded whole) and :func:`delta_text` gives the new output as a delta against
  it: a one-line "unchanged" marker, or a unified diff with line numbers, when that is at most
  :data:`DELTA_MAX_RATIO` of the output. :func:`apply_delta` applies it back.

*Turn* in every marker: the number of the assistant message making the call, counted over the
history's assistant messages from 1 (:func:`turn_of`); it is what a person scrolling the
transcript counts, and it does not depend on compactions (the history is the client's).

Everything here is a function of its arguments: the same history forwards the same bytes on
every replica. Lines are split at ``\\n`` only (a ``\\r\\n`` line keeps its ``\\r``), as
:func:`.truncate.count_lines` and the proxy's read tool count them.
"""

from __future__ import annotations

import difflib
import posixpath
import re
import shlex
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson

from proxy.filewise.markers import (
    KEY,
    PREFIX,
    TOKEN,
    Pointer,
    as_pointer,
    pointer,
    read_pointer,
    token,
    untoken,
)
from proxy.filewise.provenance import (
    WHOLE,
    FileEdit,
    FileRead,
    LineRange,
    Provenance,
    same_file,
    shell_script,
    shell_tool,
)
from proxy.model import Message, result_text
from proxy.truncation.cut import count_lines
from proxy.truncation.notice import utf8_len

__all__ = [
    "DELTA_MAX_RATIO",
    "Delta",
    "Reread",
    "Rereads",
    "Supersession",
    "apply_delta",
    "delta_text",
    "marker",
    "parse_delta",
    "parse_marker",
    "reread",
    "split_lines",
    "superseded",
    "turn_of",
    "turns_upto",
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

# A read argument longer than this is not one to repeat in a one-line marker.
_MAX_ARG_CHARS: Final = 300
# Claude Code's Read (``     12\t``, older ``    12→``), the editor's view, ``cat -n``/``nl``.
_NUMBERS: Final = re.compile(r"^ *[0-9]+[\t\u2192]", re.M)

_VERBS: Final[Mapping[str, str]] = {"write": "written", "edit": "edited", "delete": "deleted",
                                    "move": "moved"}
_KINDS: Final = {v: k for k, v in _VERBS.items()}


# -- turns and call order -------------------------------------------------------------------


def turn_of(history: Sequence[Message], index: int) -> int:
    """The turn of the assistant message at ``index``: how many assistant messages
    ``history[:index + 1]`` holds."""
    return sum(1 for m in history[: index + 1] if m.get("role") == "assistant")


def turns_upto(history: Sequence[Message], upto: int) -> list[int]:
    """turn_of for every index below ``upto``, in one pass."""
    out: list[int] = []
    n = 0
    for m in history[:upto]:
        n += m.get("role") == "assistant"
        out.append(n)
    return out


def _positions(history: Sequence[Message], upto: int) -> dict[str, tuple[int, int]]:
    """tool_call_id -> (index of its assistant message, position among its calls): the order
    in which the client ran them."""
    found: dict[str, tuple[int, int]] = {}
    for i, m in enumerate(history[:upto]):
        if m.get("role") != "assistant":
            continue
        for pos, call in enumerate(m.get("tool_calls") or ()):
            cid = call.get("id") if isinstance(call, dict) else None
            if isinstance(cid, str):
                found.setdefault(cid, (i, pos))
    return found


def _position(history: Sequence[Message], read: FileRead) -> tuple[int, int]:
    """(index of the read's assistant message, position of its call there)."""
    i = read.call_index
    calls = history[i].get("tool_calls") if 0 <= i < len(history) else None
    for pos, call in enumerate(calls or ()):
        if isinstance(call, dict) and call.get("id") == read.call_id:
            return i, pos
    return i, 0


def _call(history: Sequence[Message], index: int, call_id: str) -> tuple[str, str] | None:
    """(name, raw arguments) of call ``call_id`` of the assistant message at ``index``."""
    if not 0 <= index < len(history):
        return None
    for call in history[index].get("tool_calls") or ():
        if isinstance(call, dict) and call.get("id") == call_id:
            fn = call.get("function")
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                args = fn.get("arguments")
                return fn["name"], args if isinstance(args, str) else ""
    return None


# -- superseded and stale reads ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Supersession:
    """Why the read whose result is ``history[index]`` is forwarded as a marker, and how to
    read it again.

    ``by_kind`` is ``"read"`` when a later read of the same file covers it (*superseded*),
    else the change that made it *stale*. ``by_turn``: see the module docstring. ``again_*``:
    the call that shows the same lines again (the original call's arguments; for a shell read,
    a plain ``cat``/``sed -n``/``tail`` of the file). ``index`` and ``call_id`` (the read's
    own) are not written in the marker: :func:`parse_marker` gives -1 and ``""``.
    """

    tool: str
    path: str
    lines: LineRange
    by_kind: Literal["read", "write", "edit", "delete", "move"]
    by_tool: str
    by_call: str
    by_turn: int
    again_tool: str
    again_args: tuple[tuple[str, str], ...] = ()
    index: int = -1
    call_id: str = ""

    @property
    def kind(self) -> Literal["superseded", "stale"]:
        return "superseded" if self.by_kind == "read" else "stale"


def _strip_numbers(text: str) -> str:
    return _NUMBERS.sub("", text)


def _calls_of(history: Sequence[Message], index: int) -> dict[str, tuple[str, str]]:
    """call id -> (name, raw arguments) of the calls of the assistant message at ``index``:
    for each id the first call with a named function, as :func:`_call` finds it."""
    out: dict[str, tuple[str, str]] = {}
    if not 0 <= index < len(history):
        return out
    for call in history[index].get("tool_calls") or ():
        if not isinstance(call, dict) or not isinstance(call.get("id"), str) or call["id"] in out:
            continue
        fn = call.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            args = fn.get("arguments")
            out[call["id"]] = (fn["name"], args if isinstance(args, str) else "")
    return out


def _again(history: Sequence[Message], read: FileRead,
           calls: dict[int, dict[str, tuple[str, str]]] | None = None,
           ) -> tuple[str, tuple[tuple[str, str], ...]]:
    """The call that reads ``read``'s lines again; ``calls`` keeps each message's calls by id
    (many reads of one message: each found in O(1))."""
    if calls is None:
        found = _call(history, read.call_index, read.call_id)
    else:
        if read.call_index not in calls:
            calls[read.call_index] = _calls_of(history, read.call_index)
        found = calls[read.call_index].get(read.call_id)
    name, raw = found if found is not None else (read.tool, "")
    try:
        args = orjson.loads(raw) if raw.lstrip().startswith("{") else None
    except orjson.JSONDecodeError:
        args = None
    if shell_tool(name):  # a plain read, not the script (which may also build, test, write)
        return name, _shell_again(read, args if isinstance(args, dict) else {})
    if not isinstance(args, dict) or not args:
        return name, (("file_path", read.path),)
    out: list[tuple[str, str]] = []
    for key, value in args.items():
        text = value if isinstance(value, str) else orjson.dumps(value).decode()
        if len(text) <= _MAX_ARG_CHARS:
            out.append((key, text))
    return name, tuple(out)


def _shell_again(read: FileRead, args: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    path = shlex.quote(read.path)
    r = read.lines
    if r.tail is not None:
        command = f"tail -n {r.tail} {path}"
    elif r.start == 1 and r.end is None:
        command = f"cat {path}"
    else:
        command = f"sed -n '{r.start},{'$' if r.end is None else r.end}p' {path}"
    action = args.get("action")
    key = "command" if "command" in args or isinstance(action, Mapping) else "cmd"
    out: tuple[tuple[str, str], ...] = ((key, command),)
    _, workdir = shell_script(args)
    if not read.path.startswith("/") and workdir:
        out += (("workdir", workdir),)
    return out


def _basename(path: str) -> str:
    return posixpath.basename(path.rstrip("/")) or path


def superseded(
    history: Sequence[Message], prov: Provenance, seen: int, *,
    keep: Iterable[int] = frozenset(),
) -> dict[int, Supersession]:
    """The read results in ``history[:seen]`` to forward as a :func:`marker` in the epoch that
    begins at ``seen``: result index -> :class:`Supersession`.

    Decided on ``history[:seen]`` alone (reads whose call and result are before ``seen``, edits
    whose call is), so the caller may keep it for the epoch, and no index at or after ``seen``
    is ever in it. A read R of path p is

    * *superseded* when a later read (by call order: message, then position among the calls)
      of the same file (:func:`.files.same_file`) shows every line R showed
      (:meth:`.files.LineRange.covers`): the marker names the newest such read;
    * *stale* when a write, edit, delete or move of p comes after it (``prov.edits``: a move's
      destination has its own entry; a ``touch`` changes no file that was read): the marker
      names the newest such change, unless a covering read comes after that change (then it
      is superseded).

    Never marked: the newest read of each file (whatever its range); any read whose result
    contains verbatim a quote (``FileEdit.quotes``: an Edit's ``old_string``, a patch's
    context and removed lines) of a later edit of that file, with ``cat -n`` line-number
    prefixes (``     12\\t``, ``    12→``) stripped before matching too, since the model
    quotes the file, not the numbers; a result showing more than one file (``cat a b``: one
    marker cannot say how to read both again); a result with no text; the indices in ``keep``
    (say, the base a forwarded delta needs).

    Cost: one pass over ``history[:seen]`` plus, per read, the reads and edits of files with
    its base name; quotes are searched only in reads otherwise marked.
    """
    seen = max(0, min(seen, len(history)))
    if seen == 0 or not prov.reads:
        return {}
    kept = frozenset(keep)
    positions = _positions(history, seen)

    def order(call_id: str, call_index: int) -> tuple[int, int]:
        return positions.get(call_id, (call_index, 0))

    reads = [r for r in prov.reads
             if r.result_index is not None and r.call_index < seen and r.result_index < seen]
    per_result: dict[int, int] = {}
    by_name: dict[str, list[tuple[tuple[int, int], FileRead]]] = {}
    for r in reads:
        assert r.result_index is not None
        per_result[r.result_index] = per_result.get(r.result_index, 0) + 1
        by_name.setdefault(_basename(r.path), []).append((order(r.call_id, r.call_index), r))
    # A touch leaves an existing file (one that was read) as it was. A move's destination has
    # an entry of its own (the provenance contract).
    changes: dict[str, list[tuple[tuple[int, int], FileEdit]]] = {}
    for e in prov.edits:
        if e.call_index < seen and e.kind != "touch":
            at = order(e.call_id, e.call_index)
            changes.setdefault(_basename(e.path), []).append((at, e))

    turns = turns_upto(history, seen)
    # Per file spelling: the newest read of each range, and the changes in order, so that
    # each read is judged in O(its file's spellings and ranges) rather than O(all its reads).
    newest: dict[str, dict[LineRange, tuple[tuple[int, int], FileRead]]] = {}
    for r in reads:
        k = order(r.call_id, r.call_index)
        ranges = newest.setdefault(r.path, {})
        if r.lines not in ranges or ranges[r.lines][0] < k:
            ranges[r.lines] = (k, r)
    changed: dict[str, list[tuple[tuple[int, int], FileEdit]]] = {}
    for at_edit, e in sorted((kc for group in changes.values() for kc in group),
                             key=lambda kc: kc[0]):
        changed.setdefault(e.path, []).append((at_edit, e))
    spellings: dict[str, list[str]] = {}
    for path in (*newest, *changed):
        spellings.setdefault(_basename(path), [])
        if path not in spellings[_basename(path)]:
            spellings[_basename(path)].append(path)
    compatible: dict[str, list[str]] = {}
    calls: dict[int, dict[str, tuple[str, str]]] = {}
    out: dict[int, Supersession] = {}
    for r in reads:
        i = r.result_index
        assert i is not None
        if i in kept or per_result[i] != 1 or i in out:
            continue
        at = order(r.call_id, r.call_index)
        paths = compatible.get(r.path)
        if paths is None:
            paths = [q for q in spellings[_basename(r.path)] if same_file(q, r.path)]
            compatible[r.path] = paths
        later = False
        covering: tuple[tuple[int, int], FileRead] | None = None
        for q in paths:
            for lines, (k, x) in newest.get(q, {}).items():
                if k > at:
                    later = True
                    if lines.covers(r.lines) and (covering is None or k > covering[0]):
                        covering = (k, x)
        if not later:
            continue  # the newest read of its file
        edits: list[tuple[tuple[int, int], FileEdit]] = []
        for q in paths:
            done = changed.get(q, [])
            edits += done[bisect_right(done, at, key=lambda kc: kc[0]):]
        if covering is None and not edits:
            continue
        text = result_text(history[i].get("content"))
        if text is None or _quoted(text, (e for _, e in edits)):
            continue
        change = max(edits, key=lambda kc: kc[0], default=None)
        again_tool, again_args = _again(history, r, calls)
        if covering is not None and (change is None or covering[0] > change[0]):
            by = covering[1]
            why: tuple[Any, str, str, int] = ("read", by.tool, by.call_id, by.call_index)
        else:
            assert change is not None
            c = change[1]
            why = (c.kind, c.tool, c.call_id, c.call_index)
        out[i] = Supersession(tool=r.tool, path=r.path, lines=r.lines, by_kind=why[0],
                              by_tool=why[1], by_call=why[2], by_turn=_turn(turns, why[3]),
                              again_tool=again_tool, again_args=again_args, index=i,
                              call_id=r.call_id)
    return out


def _turn(turns: Sequence[int], index: int) -> int:
    return turns[index] if 0 <= index < len(turns) else (turns[-1] if turns else 0)


def _quoted(text: str, edits: Iterable[FileEdit]) -> bool:
    stripped: str | None = None
    for e in edits:
        for q in e.quotes:
            if not q:
                continue
            if q in text:
                return True
            if stripped is None:
                stripped = _strip_numbers(text)
            if q in stripped:
                return True
    return False


# -- the marker -----------------------------------------------------------------------------

_WHAT: Final = "{tool} of {path}{lines}"
_BY_READ: Final = " superseded by the {by_tool} in turn {turn} (call {by_call})"
_BY_CHANGE: Final = " stale: the file was {verb} by {by_tool} in turn {turn} (call {by_call})"
_AGAIN: Final = ": read it again with {again}"
_SAVED: Final = ", or {saved} for this output"


def _lines(r: LineRange) -> str:
    if r.tail is not None:
        return f" last {r.tail} lines"
    if r.end is not None:
        return f" lines {r.start}-{r.end}"
    return "" if r.start == 1 else f" from line {r.start}"


def marker(s: Supersession, *, saved: str | Pointer | None) -> str:
    """The one line that stands for a superseded or stale read, e.g.::

        [ctxproxy: Read of /repo/src/app.py lines 1-200 superseded by the Read in turn 14 (call toolu_09): read it again with Read file_path=/repo/src/app.py offset=1 limit=200, or read_offloaded file_path=tool_result/<id>.txt for this output]
        [ctxproxy: Read of /repo/src/app.py stale: the file was edited by Edit in turn 15 (call toolu_11): read it again with Read file_path=/repo/src/app.py]

    ``saved``: where the proxy kept the original output (a path is a ``read_offloaded`` path;
    a :class:`.markers.Pointer` for the other retrieval modes); None: not kept, not offered.
    Free text is written as marker tokens (:mod:`.markers`), so the line never breaks and
    :func:`parse_marker` reads it back. A range with ``tail`` is written as ``last N lines``
    (its start and end are not: the parser's tail ranges have none).
    """
    what = _WHAT.format(tool=token(s.tool), path=token(s.path), lines=_lines(s.lines))
    fields = {"by_tool": token(s.by_tool), "turn": s.by_turn, "by_call": token(s.by_call)}
    by = (_BY_READ.format(**fields) if s.by_kind == "read"
          else _BY_CHANGE.format(verb=_VERBS[s.by_kind], **fields))
    again = " ".join([token(s.again_tool)]
                     + [f"{token(k, key=True)}={token(v)}" for k, v in s.again_args])
    p = as_pointer(saved)
    tail = _SAVED.format(saved=p.render()) if p is not None else ""
    return f"{PREFIX}{what}{by}{_AGAIN.format(again=again)}{tail}]"


_MARKER_RE: Final = re.compile(
    re.escape(PREFIX)
    + rf"(?P<tool>{TOKEN}) of (?P<path>{TOKEN})"
    + r"(?: last (?P<tail>[0-9]+) lines| lines (?P<start>[0-9]+)-(?P<end>[0-9]+)"
    + r"| from line (?P<from>[0-9]+))?"
    + rf"(?: superseded by the (?P<rtool>{TOKEN})"
    + rf"| stale: the file was (?P<verb>written|edited|deleted|moved) by (?P<ctool>{TOKEN}))"
    + rf" in turn (?P<turn>[0-9]+) \(call (?P<call>{TOKEN})\)"
    + rf": read it again with (?P<atool>{TOKEN})(?P<args>(?: {KEY}={TOKEN})*)"
    + rf"(?:, or {pointer('s')} for this output)?\]"
)
_ARG_RE: Final = re.compile(rf" (?P<k>{KEY})=(?P<v>{TOKEN})")


def parse_marker(text: str) -> tuple[Supersession, Pointer | None] | None:
    """The supersession and pointer a :func:`marker` line says (``index`` -1, ``call_id``
    ""), or None when ``text`` is not exactly one. Exact: the fields re-render to ``text``."""
    if not text.startswith(PREFIX) or not text.endswith("]") or "\n" in text:
        return None
    m = _MARKER_RE.fullmatch(text)
    if m is None:
        return None
    try:
        if m["tail"] is not None:
            lines = LineRange(tail=int(m["tail"]))
        elif m["start"] is not None:
            lines = LineRange(int(m["start"]), int(m["end"]))
        elif m["from"] is not None:
            lines = LineRange(int(m["from"]))
        else:
            lines = WHOLE
        by_kind: Literal["read", "write", "edit", "delete", "move"]
        if m["rtool"] is not None:
            by_kind, by_tool = "read", untoken(m["rtool"])
        else:
            by_kind, by_tool = _KINDS[m["verb"]], untoken(m["ctool"])  # type: ignore[assignment]
        args = tuple((untoken(a["k"]), untoken(a["v"])) for a in _ARG_RE.finditer(m["args"]))
        s = Supersession(tool=untoken(m["tool"]), path=untoken(m["path"]), lines=lines,
                         by_kind=by_kind, by_tool=by_tool, by_call=untoken(m["call"]),
                         by_turn=int(m["turn"]), again_tool=untoken(m["atool"]),
                         again_args=args)
        saved = read_pointer(m, "s") if m["stool"] is not None else None
    except ValueError:
        return None
    return (s, saved) if marker(s, saved=saved) == text else None


# -- re-reads -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reread:
    """A read (arriving now) and the earlier read of the same tool, file and range it repeats,
    whose result is still forwarded whole: the base of its :func:`delta_text`."""

    read: FileRead
    base: FileRead
    base_turn: int

    @property
    def base_index(self) -> int:
        assert self.base.result_index is not None
        return self.base.result_index


def reread(
    history: Sequence[Message], prov: Provenance, index: int, *,
    forwarded_whole: Callable[[int], bool],
) -> Reread | None:
    """For the read whose result is ``history[index]``, the earlier read it repeats: the most
    recent earlier read (call before its call, result before ``index``) with the same tool, the
    same file (:func:`.files.same_file`) and the same :class:`.files.LineRange`, whose result
    shows that file alone and ``forwarded_whole(j)`` (j: that result's index; the caller knows
    whether it is forwarded verbatim: not cut, not a marker, not itself a delta, not evicted).
    None when ``history[index]`` is not the result of exactly one read, or there is none.

    Depends on ``history[:index + 1]`` and the caller's predicate alone: decided on arrival, it
    stays for the epoch. ``forwarded_whole`` is called newest candidate first, and no more
    once one answers True.
    """
    mine = [r for r in prov.reads if r.result_index == index]
    if len(mine) != 1 or not 0 <= index < len(history):
        return None
    r = mine[0]
    at = _position(history, r)
    per_result: dict[int, int] = {}
    for x in prov.reads:
        if x.result_index is not None:
            per_result[x.result_index] = per_result.get(x.result_index, 0) + 1
    candidates: list[tuple[tuple[int, int], FileRead]] = []
    for b in prov.reads:
        j = b.result_index
        if j is None or j >= index or b.tool != r.tool or b.lines != r.lines:
            continue
        if per_result[j] != 1 or b.call_index > r.call_index or not same_file(b.path, r.path):
            continue
        k = _position(history, b)
        if k < at:
            candidates.append((k, b))
    for _, b in sorted(candidates, key=lambda kb: kb[0], reverse=True):
        assert b.result_index is not None
        if forwarded_whole(b.result_index):
            return Reread(r, b, turn_of(history, b.call_index))
    return None


class Rereads:
    """:func:`reread` for each result of one history in turn, in history order, each answer in
    O(log n) instead of a pass over every read: the caller tells it which results it found
    forwarded whole (:meth:`whole`, in history order, before deciding any later result), and
    :meth:`find` answers as :func:`reread` with ``forwarded_whole`` true exactly for those."""

    __slots__ = ("_bases", "_by_result", "_history", "_indexed", "_positions", "_turns")

    def __init__(self, history: Sequence[Message], prov: Provenance,
                 turns: Sequence[int]) -> None:
        self._history = history
        self._turns = turns  # turns_upto(history, len(history))
        self._by_result: dict[int, list[FileRead]] = {}
        for r in prov.reads:
            if r.result_index is not None:
                self._by_result.setdefault(r.result_index, []).append(r)
        # (assistant message index, call id) -> the call's position there (its first one).
        self._positions: dict[tuple[int, str], int] = {}
        self._indexed: set[int] = set()  # the assistant messages whose calls are in it
        # (tool, lines, base name) -> the whole single-read results: (position, read), sorted.
        self._bases: dict[tuple[str, LineRange, str], list[tuple[tuple[int, int], FileRead]]] = {}

    def _position(self, read: FileRead) -> tuple[int, int]:
        i = read.call_index
        positions = self._positions
        if i not in self._indexed:
            self._indexed.add(i)
            calls = self._history[i].get("tool_calls") if 0 <= i < len(self._history) else None
            for pos, call in enumerate(calls or ()):
                cid = call.get("id") if isinstance(call, dict) else None
                if isinstance(cid, str):
                    positions.setdefault((i, cid), pos)
        return i, positions.get((i, read.call_id), 0)

    def reads(self, index: int) -> Sequence[FileRead]:
        """The reads whose result is history message ``index``."""
        return self._by_result.get(index, ())

    def whole(self, index: int) -> None:
        """Result ``index`` is forwarded whole (called in history order)."""
        mine = self._by_result.get(index)
        if mine is None or len(mine) != 1:
            return
        r = mine[0]
        key = (r.tool, r.lines, _basename(r.path))
        entry = (self._position(r), r)
        found = self._bases.setdefault(key, [])
        if not found or found[-1][0] < entry[0]:
            found.append(entry)
        else:
            insort(found, entry, key=lambda e: e[0])

    def find(self, index: int) -> Reread | None:
        """:func:`reread` of result ``index`` (every result before it told of already)."""
        mine = self._by_result.get(index)
        if mine is None or len(mine) != 1 or not 0 <= index < len(self._history):
            return None
        r = mine[0]
        found = self._bases.get((r.tool, r.lines, _basename(r.path)))
        if not found:
            return None
        at = self._position(r)
        k = bisect_left(found, at, key=lambda e: e[0])
        while k > 0:
            k -= 1
            b = found[k][1]
            if b.call_index <= r.call_index and same_file(b.path, r.path):
                return Reread(r, b, _turn(self._turns, b.call_index))
        return None


# -- deltas ---------------------------------------------------------------------------------


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
