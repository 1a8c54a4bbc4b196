"""Superseded and stale reads, and the reads a re-read repeats (pure, no I/O).

Coding agents read the same files again and again; the earlier copies stay in the context,
dead. Two rules, both from :class:`.files.Provenance` (one parse of the history):

* **At an epoch** (a compaction, docs/epochs.md), :func:`superseded` picks the reads in
  ``history[:seen]`` to forward as a one-line :func:`marker`: a read shown again later (the
  same file, a range that covers it) or of a file changed since (written, edited, deleted,
  moved). The newest read of each file and any read a later edit quotes stay verbatim.
* **On arrival**, :func:`reread` finds the earlier read a new one repeats (same tool, file and
  range, still forwarded whole): the base the new output is forwarded as a delta against
  (:mod:`proxy.filewise.delta`).

*Turn* in every marker: the number of the assistant message making the call, counted over the
history's assistant messages from 1 (:func:`turn_of`); it is what a person scrolling the
transcript counts, and it does not depend on compactions (the history is the client's).

Everything here is a function of its arguments: the same history forwards the same bytes on
every replica.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson

from proxy.filewise.calls import WHOLE, FileEdit, FileRead, LineRange
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
from proxy.filewise.provenance import Provenance, same_file, shell_tool
from proxy.filewise.shell import shell_script
from proxy.model import Message, result_text

__all__ = [
    "Reread",
    "Rereads",
    "Supersession",
    "marker",
    "parse_marker",
    "reread",
    "superseded",
    "turn_of",
    "turns_upto",
]

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
