"""Superseded and stale reads, re-read deltas (proxy.filewise.rereads): pure functions."""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from proxy.config import config_from_mapping
from proxy.filewise.calls import WHOLE, FileEdit, FileRead, LineRange
from proxy.filewise.delta import DELTA_MAX_RATIO, apply_delta, delta_text, parse_delta
from proxy.filewise.markers import Pointer
from proxy.filewise.provenance import Provenance, provenance, same_file
from proxy.filewise.rereads import Supersession, marker, parse_marker, reread, superseded, turn_of
from proxy.formats.messages.request import MESSAGES
from proxy.formats.responses.request import RESPONSES
from proxy.truncation.notice import utf8_len

from .conftest import examples

FAST = settings(max_examples=examples(200), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

Message = dict[str, Any]


# -- building histories ---------------------------------------------------------------------


@dataclass
class Session:
    """A history and the Provenance the parser would give for it, built call by call."""

    history: list[Message] = field(default_factory=list)
    reads: list[FileRead] = field(default_factory=list)
    edits: list[FileEdit] = field(default_factory=list)
    n: int = 0

    def _id(self) -> str:
        self.n += 1
        return f"toolu_{self.n:02d}"

    def user(self, text: str = "go on") -> None:
        self.history.append({"role": "user", "content": text})

    def turn(self, *calls: tuple[str, dict[str, Any], str, list[Any]]) -> list[str]:
        """One assistant message making ``calls`` (name, args, output, facts), then their
        results; each fact is a FileRead/FileEdit template whose ids and indices are set."""
        at = len(self.history)
        ids = [self._id() for _ in calls]
        self.history.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function",
             "function": {"name": name, "arguments": orjson.dumps(args).decode()}}
            for cid, (name, args, _, _) in zip(ids, calls, strict=True)]})
        for cid, (name, _, output, facts) in zip(ids, calls, strict=True):
            res = len(self.history)
            self.history.append({"role": "tool", "tool_call_id": cid, "content": output})
            for f in facts:
                if isinstance(f, FileRead):
                    self.reads.append(replace(f, call_id=cid, tool=name, call_index=at,
                                              result_index=res))
                else:
                    self.edits.append(replace(f, call_id=cid, tool=name, call_index=at))
        return ids

    def read(self, path: str, output: str, lines: LineRange = WHOLE, tool: str = "Read",
             args: dict[str, Any] | None = None) -> str:
        if args is None:
            args = {"file_path": path}
            if lines.end is not None:
                args |= {"offset": lines.start, "limit": lines.end - lines.start + 1}
        return self.turn((tool, args, output, [FileRead("", tool, path, lines)]))[0]

    def edit(self, path: str, *quotes: str,
             kind: Literal["write", "edit", "delete", "move", "touch"] = "edit",
             tool: str = "Edit", to: str | None = None) -> str:
        args = {"file_path": path, "old_string": quotes[0] if quotes else "", "new_string": "x"}
        return self.turn((tool, args, "ok", [FileEdit("", tool, path, kind, quotes=quotes,
                                                      to=to)]))[0]

    @property
    def prov(self) -> Provenance:
        by_call: dict[str, tuple[FileRead, ...]] = {}
        for r in self.reads:
            by_call[r.call_id] = by_call.get(r.call_id, ()) + (r,)
        return Provenance(tuple(self.reads), tuple(self.edits), by_call)

    def index(self, cid: str) -> int:
        return next(i for i, m in enumerate(self.history) if m.get("tool_call_id") == cid)


def numbered(lines: Sequence[str], start: int = 1) -> str:
    return "".join(f"{i:>6}\t{line}\n" for i, line in enumerate(lines, start))


SRC = [f"def function_{i}(x):  return x + {i}" for i in range(1, 41)]


# -- superseded: the rules, by example --------------------------------------------------------


def test_a_read_shown_again_is_superseded_and_the_newest_stays() -> None:
    s = Session()
    s.user("fix it")
    first = s.read("/repo/src/app.py", numbered(SRC))
    s.user()
    second = s.read("/repo/src/app.py", numbered(SRC))
    got = superseded(s.history, s.prov, len(s.history))
    assert set(got) == {s.index(first)}
    m = got[s.index(first)]
    assert (m.kind, m.by_kind, m.by_call, m.by_turn) == ("superseded", "read", second, 2)
    assert (m.call_id, m.path, m.tool) == (first, "/repo/src/app.py", "Read")


def test_only_a_covering_later_read_supersedes() -> None:
    s = Session()
    wide = s.read("/a.py", numbered(SRC[:30]), LineRange(1, 30))
    s.read("/a.py", numbered(SRC[:10]), LineRange(1, 10))  # narrower: covers nothing
    assert superseded(s.history, s.prov, len(s.history)) == {}
    s.read("/a.py", numbered(SRC), LineRange(1, None))  # to the end: covers 1-30
    assert set(superseded(s.history, s.prov, len(s.history))) == {
        s.index(wide), s.index(s.reads[1].call_id)}


def test_a_read_of_a_file_changed_since_is_stale() -> None:
    s = Session()
    old = s.read("/a.py", numbered(SRC))
    write = s.edit("/a.py", kind="write", tool="Write")
    s.read("/a.py", numbered(SRC[:5]), LineRange(1, 5))  # the newest read, covering nothing
    got = superseded(s.history, s.prov, len(s.history))
    assert set(got) == {s.index(old)}
    m = got[s.index(old)]
    assert (m.kind, m.by_kind, m.by_tool, m.by_call, m.by_turn) == (
        "stale", "write", "Write", write, 2)
    assert "stale: the file was written by Write in turn 2 (call toolu_02)" in marker(
        m, saved=None)


def test_the_newest_read_stays_even_when_stale() -> None:
    s = Session()
    s.read("/a.py", numbered(SRC))
    s.edit("/a.py", kind="write", tool="Write")
    assert superseded(s.history, s.prov, len(s.history)) == {}


def test_superseded_or_stale_by_whichever_came_last() -> None:
    s = Session()
    r1 = s.read("/a.py", numbered(SRC), LineRange(1, 40))
    s.edit("/a.py", kind="delete", tool="Bash")
    r2 = s.read("/a.py", numbered(SRC), LineRange(1, 40))  # after the change: superseded
    s.read("/a.py", "short", LineRange(1, 2))
    got = superseded(s.history, s.prov, len(s.history))
    assert got[s.index(r1)].by_call == r2 and got[s.index(r1)].kind == "superseded"
    assert s.index(r2) not in got  # the later read covers nothing of it, nothing changed since
    s2 = Session()
    r1 = s2.read("/a.py", numbered(SRC))
    s2.read("/a.py", numbered(SRC))
    e = s2.edit("/a.py", kind="delete", tool="Bash")
    s2.read("/a.py", "x", LineRange(3, 3))
    got = superseded(s2.history, s2.prov, len(s2.history))
    assert got[s2.index(r1)].by_call == e and got[s2.index(r1)].by_kind == "delete"


def test_a_read_a_later_edit_quotes_stays_verbatim() -> None:
    s = Session()
    quoted = s.read("/a.py", "def f():\n    return 1\n" + "# pad\n" * 50)
    s.edit("/a.py", "    return 1\n")
    s.read("/a.py", "def f():\n    return 2\n", LineRange(1, 2))
    assert superseded(s.history, s.prov, len(s.history)) == {}
    # An edit before the read, or of another file, protects nothing.
    t = Session()
    t.edit("/a.py", "    return 1\n")
    early = t.read("/a.py", "def f():\n    return 1\n")
    t.edit("/b.py", "    return 1\n")
    t.read("/a.py", "def f():\n    return 1\n")
    assert set(superseded(t.history, t.prov, len(t.history))) == {t.index(early)}
    assert quoted


def test_quotes_are_matched_without_cat_n_numbers() -> None:
    s = Session()
    s.read("/a.py", numbered(SRC))
    s.edit("/a.py", f"{SRC[4]}\n{SRC[5]}\n")  # as the model quotes: no numbers
    s.read("/a.py", numbered(SRC[:3]), LineRange(1, 3))
    assert superseded(s.history, s.prov, len(s.history)) == {}
    arrows = Session()  # Claude Code's other prefix, "    12→"
    arrows.read("/a.py", "".join(f"{i:>6}\u2192{line}\n" for i, line in enumerate(SRC, 1)))
    arrows.edit("/a.py", f"{SRC[4]}\n{SRC[5]}")
    arrows.read("/a.py", "x", LineRange(1, 1))
    assert superseded(arrows.history, arrows.prov, len(arrows.history)) == {}
    empty = Session()  # an empty quote (a Write's) quotes nothing
    r = empty.read("/a.py", numbered(SRC))
    empty.edit("/a.py", "")
    empty.read("/a.py", "x", LineRange(1, 1))
    assert set(superseded(empty.history, empty.prov, len(empty.history))) == {empty.index(r)}


def test_decided_on_history_before_seen() -> None:
    s = Session()
    first = s.read("/a.py", numbered(SRC))
    seen = len(s.history)
    s.read("/a.py", numbered(SRC))
    assert superseded(s.history, s.prov, seen) == {}  # the later read is after seen
    assert set(superseded(s.history, s.prov, len(s.history))) == {s.index(first)}
    assert superseded(s.history, s.prov, 0) == {}
    # A call before seen whose result is not: not a read yet.
    t = Session()
    first = t.read("/a.py", numbered(SRC))
    t.read("/a.py", numbered(SRC))
    assert superseded(t.history, t.prov, len(t.history) - 1) == {}


def test_keep_and_multi_file_results_are_never_marked() -> None:
    s = Session()
    first = s.read("/a.py", numbered(SRC))
    s.read("/a.py", numbered(SRC))
    assert superseded(s.history, s.prov, len(s.history), keep={s.index(first)}) == {}
    t = Session()
    both = t.turn(("exec_command", {"cmd": "cat /a.py /b.py"}, "A\nB\n",
                   [FileRead("", "", "/a.py"), FileRead("", "", "/b.py")]))[0]
    t.read("/a.py", "A\n")
    t.read("/b.py", "B\n")
    assert superseded(t.history, t.prov, len(t.history)) == {}
    assert both


def test_relative_and_moved_paths() -> None:
    s = Session()
    r = s.read("/repo/src/a.py", numbered(SRC))
    patch = s.turn(("apply_patch", {"input": "*** Begin Patch"}, "Done",
                    [FileEdit("", "", "src/a.py", "edit")]))[0]
    s.read("/repo/src/a.py", "x", LineRange(1, 1))
    got = superseded(s.history, s.prov, len(s.history))
    assert got[s.index(r)].by_call == patch and got[s.index(r)].by_tool == "apply_patch"
    # A move makes both its source and its destination stale.
    t = Session()
    src = t.read("/a.py", numbered(SRC))
    dst = t.read("/b.py", numbered(SRC))
    mv = t.turn(("Bash", {"command": "mv /c.py /b.py && mv /a.py /z.py && touch /a.py"}, "",
                 [FileEdit("", "", "/c.py", "move", to="/b.py"),
                  FileEdit("", "", "/b.py", "write"),  # a move's destination: its own entry
                  FileEdit("", "", "/a.py", "move", to="/z.py"),
                  FileEdit("", "", "/z.py", "write"),
                  FileEdit("", "", "/a.py", "touch")]))[0]
    t.read("/a.py", "x", LineRange(1, 1))
    t.read("/b.py", "x", LineRange(1, 1))
    got = superseded(t.history, t.prov, len(t.history))
    assert got[t.index(src)].by_kind == "move" and got[t.index(src)].by_call == mv
    assert got[t.index(dst)].by_kind == "write"
    # A touch alone changes no file that was read.
    u = Session()
    u.read("/a.py", numbered(SRC))
    u.turn(("Bash", {"command": "touch /a.py"}, "", [FileEdit("", "", "/a.py", "touch")]))
    u.read("/a.py", "x", LineRange(1, 1))
    assert superseded(u.history, u.prov, len(u.history)) == {}


def test_turns_count_assistant_messages() -> None:
    s = Session()
    s.history.append({"role": "system", "content": "sys"})
    s.user()
    s.history.append({"role": "assistant", "content": "thinking aloud"})
    first = s.read("/a.py", numbered(SRC))
    s.user()
    second = s.read("/a.py", numbered(SRC))
    got = superseded(s.history, s.prov, len(s.history))
    assert got[s.index(first)].by_turn == 3 == turn_of(s.history, s.reads[1].call_index)
    assert second


# -- the marker -----------------------------------------------------------------------------


def test_marker_text() -> None:
    s = Supersession(tool="Read", path="/repo/src/app.py", lines=LineRange(1, 200),
                     by_kind="read", by_tool="Read", by_call="toolu_09", by_turn=14,
                     again_tool="Read", again_args=(("file_path", "/repo/src/app.py"),
                                                    ("offset", "1"), ("limit", "200")))
    text = marker(s, saved="tool_result/0f3c.txt")
    assert text == (
        "[ctxproxy: Read of /repo/src/app.py lines 1-200 superseded by the Read in turn 14 "
        "(call toolu_09): read it again with Read file_path=/repo/src/app.py offset=1 "
        "limit=200, or read_offloaded file_path=tool_result/0f3c.txt for this output]")
    assert parse_marker(text) == (s, Pointer("tool_result/0f3c.txt"))
    stale = replace(s, by_kind="edit", by_tool="Edit", by_call="toolu_11", by_turn=15,
                    lines=WHOLE, index=7, call_id="toolu_03")
    text = marker(stale, saved=None)
    assert text == (
        "[ctxproxy: Read of /repo/src/app.py stale: the file was edited by Edit in turn 15 "
        "(call toolu_11): read it again with Read file_path=/repo/src/app.py offset=1 "
        "limit=200]")
    assert parse_marker(text) == (replace(stale, index=-1, call_id=""), None)
    client = Pointer("/data/t/s/tool_result/x.txt", "Read", "file_path", "offset")
    parsed = parse_marker(marker(s, saved=client))
    assert parsed is not None and parsed[1] == replace(client, line_arg="start_line")


def test_read_again_with_the_original_arguments_or_a_plain_shell_read() -> None:
    s = Session()
    s.read("/a.py", numbered(SRC), LineRange(5, 9))
    s.read("/a.py", numbered(SRC))
    s.turn(("exec_command", {"cmd": "make && sed -n '3,8p' 'my file.py'", "workdir": "/w"},
            "x\n" * 6, [FileRead("", "", "/w/my file.py", LineRange(3, 8))]))
    s.turn(("shell", {"command": ["bash", "-lc", "tail -n 20 b.py"]}, "y\n" * 20,
            [FileRead("", "", "b.py", LineRange(tail=20))]))
    s.read("/w/my file.py", "z")
    s.read("b.py", "z")
    got = superseded(s.history, s.prov, len(s.history))
    by_call = {m.call_id: m for m in got.values()}
    assert (by_call["toolu_01"].again_tool, by_call["toolu_01"].again_args) == (
        "Read", (("file_path", "/a.py"), ("offset", "5"), ("limit", "5")))
    assert by_call["toolu_03"].again_args == (("cmd", "sed -n '3,8p' '/w/my file.py'"),)
    assert by_call["toolu_04"].again_args == (("command", "tail -n 20 b.py"),)
    assert 'cmd="sed -n \'3,8p\' \'/w/my file.py\'"' in marker(by_call["toolu_03"], saved=None)
    for m in got.values():
        assert parse_marker(marker(m, saved="tool_result/a.txt")) is not None


def test_parse_marker_rejects_near_misses() -> None:
    s = Supersession("Read", "/a.py", WHOLE, "read", "Read", "c2", 3, "Read",
                     (("file_path", "/a.py"),))
    good = marker(s, saved=None)
    for bad in (good[:-1], good + "\n", " " + good, good.replace("turn 3", "turn x"),
                good.replace("superseded by", "replaced by"), "", "[ctxproxy: ]",
                good.replace("of /a.py", 'of "/a.py"'),  # quoted when it need not be
                good.replace("turn 3", "turn 03")):
        assert parse_marker(bad) is None


# -- superseded: properties over generated sessions ------------------------------------------

PATHS = ["/repo/a.py", "/repo/b.py", "a.py", "/other/a.py"]
RANGES = [WHOLE, LineRange(1, 10), LineRange(1, 20), LineRange(5, 10), LineRange(11),
          LineRange(tail=5)]
WORDS = ["alpha\n", "beta\n", "gamma\n", "delta\n", "x = 1\n", "\r\n", "é中\n"]


@st.composite
def sessions(draw: st.DrawFn) -> tuple[Session, int]:
    s = Session()
    for _ in range(draw(st.integers(0, 14))):
        op = draw(st.sampled_from(["read", "read", "read", "edit", "multi", "user", "pair"]))
        path = draw(st.sampled_from(PATHS))
        body = "".join(draw(st.lists(st.sampled_from(WORDS), max_size=6)))
        if draw(st.booleans()):
            body = numbered(body.splitlines(keepends=False)) if body else body
        if op == "read":
            s.read(path, body, draw(st.sampled_from(RANGES)),
                   tool=draw(st.sampled_from(["Read", "view"])))
        elif op == "edit":
            kind = draw(st.sampled_from(["edit", "write", "delete", "move", "touch"]))
            quotes = tuple(draw(st.lists(st.sampled_from(WORDS + ["", "beta\ngamma\n"]),
                                         max_size=2)))
            if kind == "move":  # as the parser gives it: the destination's own entry follows
                to = draw(st.sampled_from(PATHS))
                s.turn(("Bash", {"command": f"mv {path} {to}"}, "",
                        [FileEdit("", "", path, "move", to=to), FileEdit("", "", to, "write")]))
            else:
                s.edit(path, *quotes, kind=kind)
        elif op == "multi":
            other = draw(st.sampled_from(PATHS))
            s.turn(("exec_command", {"cmd": f"cat {path} {other}"}, body,
                    [FileRead("", "", path), FileRead("", "", other)]))
        elif op == "pair":  # two calls in one assistant message: a read, then an edit
            s.turn(("Read", {"file_path": path}, body, [FileRead("", "", path)]),
                   ("Edit", {"file_path": path}, "ok",
                    [FileEdit("", "", path, "edit", quotes=("alpha\n",))]))
        else:
            s.user()
    return s, draw(st.integers(0, len(s.history)))


def _order(s: Session, call_id: str) -> tuple[int, int]:
    for i, m in enumerate(s.history):
        for pos, c in enumerate(m.get("tool_calls") or ()):
            if c["id"] == call_id:
                return i, pos
    raise AssertionError(call_id)


def _oracle(s: Session, seen: int) -> dict[int, str]:
    """The rule, read off the brief and checked pair by pair: index -> superseded|stale."""
    reads = [r for r in s.reads if r.result_index is not None and r.result_index < seen]
    edits = [e for e in s.edits if e.call_index < seen]
    out: dict[int, str] = {}
    for r in reads:
        assert r.result_index is not None
        if sum(x.result_index == r.result_index for x in reads) != 1:
            continue
        at = _order(s, r.call_id)
        later = [x for x in reads if _order(s, x.call_id) > at and same_file(x.path, r.path)]
        if not later:
            continue
        changes = [(e, e.kind) for e in edits if e.kind != "touch"
                   and _order(s, e.call_id) > at and same_file(e.path, r.path)]
        text = s.history[r.result_index]["content"]
        plain = re.sub(r"^ *[0-9]+\t", "", text, flags=re.M)
        if any(q and (q in text or q in plain) for e, _ in changes for q in e.quotes):
            continue
        covering = [x for x in later if x.lines.covers(r.lines)]
        if not covering and not changes:
            continue
        last_read = max((_order(s, x.call_id) for x in covering), default=None)
        last_change = max((_order(s, e.call_id) for e, _ in changes), default=None)
        if last_read is not None and (last_change is None or last_read > last_change):
            out[r.result_index] = "superseded"
        else:
            out[r.result_index] = "stale"
    return out


@FAST
@given(sessions(), st.data())
def test_superseded_properties(case: tuple[Session, int], data: st.DataObject) -> None:
    s, seen = case
    prov = s.prov
    got = superseded(s.history, prov, seen)
    # Deterministic, and a function of history[:seen] alone.
    assert got == superseded([dict(m) for m in s.history], prov, seen)
    assert got == superseded(s.history[:seen], prov, seen)
    assert all(i < seen for i in got)
    # Exactly the brief's rule.
    assert {i: m.kind for i, m in got.items()} == _oracle(s, seen)
    for i, m in got.items():
        read = next(r for r in prov.reads if r.result_index == i)
        assert (m.index, m.call_id, m.path, m.lines, m.tool) == (
            i, read.call_id, read.path, read.lines, read.tool)
        by_index = _order(s, m.by_call)[0]
        assert by_index < seen and _order(s, m.by_call) > _order(s, m.call_id)
        assert m.by_turn == turn_of(s.history, by_index)
        text = marker(m, saved="tool_result/x.txt")
        assert len(text.splitlines()) == 1
        assert parse_marker(text) == (replace(m, index=-1, call_id=""),
                                      Pointer("tool_result/x.txt"))
    # The newest read of each file, and a kept index, are never marked.
    in_seen = [r for r in prov.reads if r.result_index is not None and r.result_index < seen]
    for r in in_seen:
        if not any(_order(s, x.call_id) > _order(s, r.call_id) and same_file(x.path, r.path)
                   for x in in_seen):
            assert r.result_index not in got
    keep = set(data.draw(st.sets(st.sampled_from(sorted(got)))) if got else set())
    assert set(superseded(s.history, prov, seen, keep=keep)) == set(got) - keep


# -- re-reads -------------------------------------------------------------------------------


def test_reread_finds_the_newest_earlier_read_of_the_same_range_still_whole() -> None:
    s = Session()
    a = s.read("/a.py", numbered(SRC), LineRange(1, 40))
    b = s.read("/a.py", numbered(SRC), LineRange(1, 40))
    s.read("/a.py", numbered(SRC[:10]), LineRange(1, 10))  # another range
    s.read("/a.py", numbered(SRC), LineRange(1, 40), tool="view",
           args={"path": "/a.py", "view_range": [1, 40]})  # another tool
    new = s.read("/a.py", numbered(SRC), LineRange(1, 40))
    whole = {s.index(a), s.index(b)}
    asked: list[int] = []

    def forwarded_whole(j: int) -> bool:
        asked.append(j)
        return j in whole

    got = reread(s.history, s.prov, s.index(new), forwarded_whole=forwarded_whole)
    assert got is not None and got.base.call_id == b and got.base_index == s.index(b)
    assert got.read.call_id == new and got.base_turn == 2 and asked == [s.index(b)]
    whole.discard(s.index(b))  # b was cut or marked: fall back to a
    got = reread(s.history, s.prov, s.index(new), forwarded_whole=forwarded_whole)
    assert got is not None and got.base.call_id == a
    assert reread(s.history, s.prov, s.index(new), forwarded_whole=lambda j: False) is None
    # The first read repeats nothing; a non-read result is no re-read.
    assert reread(s.history, s.prov, s.index(a), forwarded_whole=lambda j: True) is None
    assert reread(s.history, s.prov, 0, forwarded_whole=lambda j: True) is None


def test_reread_skips_multi_file_results() -> None:
    s = Session()
    s.turn(("exec_command", {"cmd": "cat /a.py /b.py"}, "A\nB\n",
            [FileRead("", "", "/a.py"), FileRead("", "", "/b.py")]))
    new = s.turn(("exec_command", {"cmd": "cat /a.py"}, "A\n", [FileRead("", "", "/a.py")]))
    assert reread(s.history, s.prov, s.index(new[0]), forwarded_whole=lambda j: True) is None
    # Nor is a new result showing two files a re-read of one.
    both = s.turn(("exec_command", {"cmd": "cat /a.py /b.py"}, "A\nB\n",
                   [FileRead("", "", "/a.py"), FileRead("", "", "/b.py")]))
    assert reread(s.history, s.prov, s.index(both[0]), forwarded_whole=lambda j: True) is None


def test_parallel_calls_run_in_their_order() -> None:
    s = Session()
    read_then_edit = s.turn(("Read", {"file_path": "/a.py"}, numbered(SRC),
                             [FileRead("", "", "/a.py")]),
                            ("Edit", {"file_path": "/a.py"}, "ok",
                             [FileEdit("", "", "/a.py", "edit")]))
    s.read("/a.py", "x", LineRange(1, 1))
    got = superseded(s.history, s.prov, len(s.history))
    assert got[s.index(read_then_edit[0])].by_call == read_then_edit[1]
    t = Session()
    edit_then_read = t.turn(("Edit", {"file_path": "/a.py"}, "ok",
                             [FileEdit("", "", "/a.py", "edit")]),
                            ("Read", {"file_path": "/a.py"}, numbered(SRC),
                             [FileRead("", "", "/a.py")]))
    t.read("/a.py", "x", LineRange(1, 1))
    assert superseded(t.history, t.prov, len(t.history)) == {}
    assert edit_then_read


def test_long_arguments_are_left_out_of_the_marker() -> None:
    s = Session()
    first = s.read("/a.py", numbered(SRC), args={"file_path": "/a.py", "note": "n" * 301,
                                                  "limit": 40})
    s.read("/a.py", numbered(SRC))
    m = superseded(s.history, s.prov, len(s.history))[s.index(first)]
    assert m.again_args == (("file_path", "/a.py"), ("limit", "40"))


@FAST
@given(sessions())
def test_reread_properties(case: tuple[Session, int]) -> None:
    s, _ = case
    prov = s.prov
    whole = {r.result_index for r in prov.reads if r.result_index and r.result_index % 3}
    for index in range(len(s.history)):
        got = reread(s.history, prov, index, forwarded_whole=lambda j: j in whole)
        assert got == reread(s.history, prov, index, forwarded_whole=lambda j: j in whole)
        mine = [r for r in prov.reads if r.result_index == index]
        if got is None:
            continue
        assert mine == [got.read]
        b = got.base
        assert b.result_index is not None and b.result_index < index
        assert b.result_index in whole and (b.tool, b.lines) == (got.read.tool, got.read.lines)
        assert same_file(b.path, got.read.path)
        assert [r for r in prov.reads if r.result_index == b.result_index] == [b]
        # No newer candidate was passed over.
        for r in prov.reads:
            if (r.result_index in whole and r.result_index is not None
                    and b.result_index < r.result_index < index
                    and (r.tool, r.lines) == (b.tool, b.lines)
                    and same_file(r.path, got.read.path)):
                assert sum(x.result_index == r.result_index for x in prov.reads) != 1


# -- deltas ---------------------------------------------------------------------------------

BIG = numbered([f"line {i}: some code that is long enough to count" for i in range(1, 201)])


def test_unchanged_reread_is_one_line() -> None:
    d = delta_text(BIG, BIG, path="/a.py", base_call="toolu_05", base_turn=12,
                   saved="tool_result/x.txt")
    assert d == ("[ctxproxy: unchanged since the read in turn 12 (call toolu_05): /a.py, the "
                 "same 200 lines; the whole output: read_offloaded file_path=tool_result/x.txt]")
    assert apply_delta(BIG, d) == BIG
    p = parse_delta(d)
    assert p is not None and p.unchanged and (p.base_call, p.base_turn, p.lines) == (
        "toolu_05", 12, 200)
    # Not worth a marker for a short output.
    assert delta_text("x\n", "x\n", path="/a.py", base_call="c", base_turn=1, saved=None) is None


def test_changed_reread_is_a_unified_diff_with_line_numbers() -> None:
    lines = BIG.splitlines(keepends=True)
    new_lines = lines[:49] + ["    50\tCHANGED\n"] + lines[50:150] + lines[151:] + ["tail"]
    new = "".join(new_lines)
    d = delta_text(BIG, new, path="/a.py", base_call="toolu_05", base_turn=12,
                   saved="tool_result/y.txt")
    assert d is not None
    head, _, body = d.partition("\n")
    assert head == ("[ctxproxy: changed since the read in turn 12 (call toolu_05): /a.py, 200 "
                    "lines now; unified diff against that output below; the whole output: "
                    "read_offloaded file_path=tool_result/y.txt]")
    # The hunks are difflib's unified diff, headers (the line numbers) and lines alike.
    ref = list(difflib.unified_diff(lines, new_lines, n=3))[2:]
    ref = [x if x.endswith("\n") else x + "\n\\ No newline at end of file\n" for x in ref]
    assert body == "".join(ref)
    assert apply_delta(BIG, d) == new
    assert utf8_len(d) <= DELTA_MAX_RATIO * utf8_len(new)
    with pytest.raises(ValueError):
        apply_delta(BIG.replace("line 48:", "line 48!"), d)  # the wrong base
    with pytest.raises(ValueError):
        apply_delta(BIG, "not a delta")


def test_a_delta_not_small_enough_is_none() -> None:
    new = BIG.replace("line", "LINE")
    assert delta_text(BIG, new, path="/a.py", base_call="c", base_turn=1, saved=None) is None
    d = delta_text(BIG, new, path="/a.py", base_call="c", base_turn=1, saved=None, max_ratio=3)
    assert d is not None and apply_delta(BIG, d) == new


PIECES = ["a", "word ", "é", "中文", "😀", "\n", "\r\n", "\r", "\n\n", "\x85", "\u2028",
          "\ud800", "@@ -1,2 +1,2 @@\n", "\\ No newline at end of file\n", "+x\n", " y\n",
          "[ctxproxy: unchanged since the read in turn 1 (call c): p, the same 1 lines]"]
texts = st.one_of(st.text(max_size=200), st.lists(st.sampled_from(PIECES), max_size=40)
                  .map("".join), st.just(""))
# Few distinct lines: the repeats where a diff's alignment can go wrong.
# One line repeated, more or fewer times: the common head and tail overlap.
runs = st.builds(lambda a, b, end: ("x\n" * a + end, "x\n" * b + end), st.integers(0, 6),
                 st.integers(0, 6), st.sampled_from(["", "x", "y\n"]))
repetitive = st.lists(st.sampled_from(["a\n", "b\n", "\n", "a"]), max_size=30).map("".join)


@st.composite
def edits_of(draw: st.DrawFn) -> tuple[str, str]:
    """An old output and a new one made from it by a few line edits (so diffs are small)."""
    old = draw(st.one_of(texts, repetitive))
    lines = old.split("\n")
    for _ in range(draw(st.integers(0, 4))):
        at = draw(st.integers(0, len(lines)))
        op = draw(st.sampled_from(["insert", "delete", "change"]))
        if op == "insert":
            lines.insert(at, draw(st.sampled_from(["a", "b", ""]) | texts).replace("\n", ""))
        elif lines and at < len(lines):
            if op == "delete":
                del lines[at]
            else:
                lines[at] = draw(texts).replace("\n", "")
    return old, "\n".join(lines)


tokens = st.one_of(st.text(max_size=20), st.sampled_from(
    ["/repo/src/app.py", "toolu_01", "a b", 'q"uote', "x,y", "(p)", "[b]", "k=v", "a\nb",
     "\u2028", "\x85", ""]))


@FAST
@given(st.one_of(edits_of(), st.tuples(texts, texts), st.tuples(repetitive, repetitive),
                 runs),
       tokens, tokens,
       st.integers(0, 10**6), st.one_of(st.none(), tokens),
       st.sampled_from([DELTA_MAX_RATIO, 100.0]))
@example(("a\nb\n", "a\nb"), "/p", "c", 1, None, 100.0)
@example(("a\na\n", "a\na\na\n"), "/p", "c", 1, None, 100.0)
@example(("a", "a\r\nb"), "/p", "c", 1, None, 100.0)
@example(("", "x"), "/p", "c", 1, None, 100.0)
def test_delta_properties(pair: tuple[str, str], path: str, call: str, turn: int,
                          saved: str | None, ratio: float) -> None:
    old, new = pair
    d = delta_text(old, new, path=path, base_call=call, base_turn=turn, saved=saved,
                   max_ratio=ratio)
    assert d == delta_text(old, new, path=path, base_call=call, base_turn=turn, saved=saved,
                           max_ratio=ratio)
    if d is None:
        return
    assert utf8_len(d) <= ratio * utf8_len(new)
    assert apply_delta(old, d) == new  # recoverable byte for byte
    p = parse_delta(d)
    assert p is not None and (p.path, p.base_call, p.base_turn, p.unchanged) == (
        path, call, turn, old == new)
    assert p.saved == (None if saved is None else Pointer(saved))
    assert len(d.partition("\n")[0].splitlines()) == 1


@FAST
@given(texts)
def test_parse_delta_and_marker_never_raise(text: str) -> None:
    assert parse_delta(text) is None or text.startswith("[ctxproxy: ")
    assert parse_marker(text) is None
    for old, delta in ((text, text), ("", text), (text, "[ctxproxy: changed since the read in "
                       "turn 1 (call c): p, 1 lines now; unified diff against that output "
                       "below]\n" + text)):
        try:
            apply_delta(old, delta)
        except ValueError:
            pass


ranges = st.one_of(
    st.just(WHOLE), st.builds(LineRange, st.integers(2, 10**6)),
    st.builds(lambda a, n: LineRange(a, a + n), st.integers(1, 10**6), st.integers(0, 10**4)),
    st.builds(lambda n: LineRange(tail=n), st.integers(0, 10**4)))


@FAST
@given(tokens, tokens, ranges, st.sampled_from(["read", "write", "edit", "delete", "move"]),
       tokens, tokens, st.integers(0, 10**6), tokens,
       st.lists(st.tuples(tokens, tokens), max_size=3),
       st.one_of(st.none(), tokens, st.builds(Pointer, tokens, tokens, tokens, tokens)))
def test_markers_parse_back(tool: str, path: str, lines: LineRange, by_kind: Any, by_tool: str,
                            by_call: str, turn: int, again_tool: str,
                            args: list[tuple[str, str]], saved: str | Pointer | None) -> None:
    s = Supersession(tool, path, lines, by_kind, by_tool, by_call, turn, again_tool,
                     tuple(args), index=5, call_id="toolu_x")
    text = marker(s, saved=saved)
    assert text == marker(s, saved=saved)
    assert len(text.splitlines()) == 1 and text.startswith("[ctxproxy: ")
    want = Pointer(saved) if isinstance(saved, str) else saved
    if want is not None:
        want = replace(want, line_arg="start_line")  # not written without a line
    assert parse_marker(text) == (replace(s, index=-1, call_id=""), want)
    assert parse_delta(text) is None


# -- through the real parser, on calls recorded from the real CLIs ------------------------------

FIXTURES = Path(__file__).parent / "fixtures" / "provenance"
TOOLS = config_from_mapping({}).offload.read_tools


def test_claude_code_recorded_session() -> None:
    """Claude Code 2.1.332: Read app.py whole, Read lines 3-4, Read notes.txt from line 4,
    Edit app.py twice (quoting what both app.py reads show), Bash reads and shell edits
    (``>> notes.txt``, ``sed -i``), a notebook."""
    rec = orjson.loads((FIXTURES / "claude_code.json").read_bytes())
    history = MESSAGES.parse(orjson.dumps(rec["body"]), 10_000).history
    prov = provenance(history, TOOLS)
    got = superseded(history, prov, len(history))
    # Both app.py reads hold text the Edits quote (cat -n numbers stripped): verbatim. The
    # notes.txt read was changed by Bash since and read again after: stale.
    assert {m.call_id: m.kind for m in got.values()} == {"toolu_rec_2": "stale"}
    m = next(iter(got.values()))
    assert (m.by_kind, m.by_tool, m.by_call) == ("edit", "Bash", "toolu_rec_8")
    assert m.by_turn == turn_of(history, next(
        i for i, x in enumerate(history) if x.get("tool_calls")
        and x["tool_calls"][0]["id"] == "toolu_rec_8"))
    w = rec["workdir"]
    assert marker(m, saved="tool_result/n.txt") == (
        f"[ctxproxy: Read of {w}/notes.txt from line 4 stale: the file was edited by Bash in "
        f"turn 9 (call toolu_rec_8): read it again with Read file_path={w}/notes.txt offset=4, "
        "or read_offloaded file_path=tool_result/n.txt for this output]")
    # Decided before the Edits: the whole read is superseded by nothing and quoted by none
    # yet; before the notes.txt change, nothing is stale.
    before = next(i for i, x in enumerate(history) if x.get("tool_calls")
                  and x["tool_calls"][0]["id"] == "toolu_rec_8")
    assert superseded(history, provenance(history[:before], TOOLS), before) == {}
    # Re-reads: none repeats an earlier range.
    assert all(reread(history, prov, r.result_index, forwarded_whole=lambda j: True) is None
               for r in prov.reads if r.result_index is not None)


def test_codex_recorded_session() -> None:
    """Codex 0.171.0: sed -n '2,4p' src/app.py (no workdir), nl -ba | sed -n '1,3p' (workdir),
    a cat/head/tail chain, then apply_patch (custom tool and heredoc) and shell edits."""
    rec = orjson.loads((FIXTURES / "codex.json").read_bytes())
    history = RESPONSES.parse(orjson.dumps(rec["body"]), 10_000).history
    prov = provenance(history, TOOLS)
    got = superseded(history, prov, len(history))
    # Lines 2-4 hold the patch's quoted "    return 2": verbatim; lines 1-3 do not, and the
    # patch changed the file: stale, to be read again with a plain sed.
    w = rec["workdir"]
    assert {m.call_id: (m.kind, m.by_call, m.by_tool) for m in got.values()} == {
        "call_rec_1": ("stale", "call_rec_3", "apply_patch")}
    m = next(iter(got.values()))
    assert (m.again_tool, m.again_args) == (
        "exec_command", (("cmd", f"sed -n '1,3p' {w}/src/app.py"),))
    assert parse_marker(marker(m, saved=None)) == (replace(m, index=-1, call_id=""), None)


def test_rereads_through_the_parser() -> None:
    """Claude Code reading one file three times, editing it between the second and third."""
    src = "".join(f"{i}\t{line}\n" for i, line in enumerate(SRC, 1))
    changed = src.replace("function_20(", "function_twenty(")
    s = Session()
    a = s.read("/repo/app.py", src)
    b = s.read("/repo/app.py", src)
    s.edit("/repo/app.py", "def function_20(x)")
    c = s.read("/repo/app.py", changed)
    prov = provenance(s.history, TOOLS)
    assert [(r.call_id, r.result_index) for r in prov.reads] == [
        (x, s.index(x)) for x in (a, b, c)]
    whole = {s.index(a)}  # b went out as a delta against a
    rb = reread(s.history, prov, s.index(b), forwarded_whole=lambda j: j in whole)
    assert rb is not None and rb.base.call_id == a and rb.base_turn == 1
    assert delta_text(src, src, path="/repo/app.py", base_call=a, base_turn=1,
                      saved=None) is not None
    rc = reread(s.history, prov, s.index(c), forwarded_whole=lambda j: j in whole)
    assert rc is not None and rc.base.call_id == a
    d = delta_text(src, changed, path="/repo/app.py", base_call=a, base_turn=rc.base_turn,
                   saved="tool_result/c.txt")
    assert d is not None and apply_delta(src, d) == changed
    assert "-20\tdef function_20(x):" in d and "+20\tdef function_twenty(x):" in d
    # At an epoch: a and b hold the Edit's quote, so they stay verbatim even though c covers
    # them; c does not hold it.
    assert superseded(s.history, prov, len(s.history)) == {}
    s.edit("/repo/app.py", kind="write", tool="Write")
    s.read("/repo/app.py", "x", LineRange(1, 1))
    prov = provenance(s.history, TOOLS)
    got = superseded(s.history, prov, len(s.history))
    assert list(got) == [s.index(c)] and got[s.index(c)].kind == "stale"
    assert got[s.index(c)].by_tool == "Write"
