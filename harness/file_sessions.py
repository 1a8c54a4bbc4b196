"""Real coding-agent sessions that re-read and edit files (issue 22): Claude Code (``claude -p``)
and the Codex CLI (``codex exec``), headless, through a real ctxproxy in front of the fake
upstream. Used by ``tests/test_file_sessions.py`` and ``bench/file_sessions.py``.

**The project** (:func:`make_project`): a temporary repository whose ``src/`` holds modules of
this Python's standard library under other names (real text, 6-40 KB each), a stand-in test
runner (``tests/run_tests.py``: one line per top-level function and class of ``src/``, a
contract test that fails until ``src/heap.py`` is fixed) and an inventory script.

**The plan** (:func:`build_plan`, :data:`Step`): one list of steps both clients play, each the
model's next tool call -- reads (whole, a line range), re-reads of an unchanged file and of a
file changed since, a range then the whole file, edits quoting a line the agent read, a new
file, an existing file overwritten, a ``grep`` run three times, the test log run three times
(with one test going from FAILED to PASSED), a listing under a per-tool budget, a command
whose repeats a policy protects. ``Step.repeats`` names the earlier step a read or command
repeats, so the assertions and the benchmark know what each feature should have done.

**The model** (:class:`PlanModel`, the fake's responder) plays the plan like an agent: the next
step follows the newest tool result's call id (``toolu_s007`` / ``call_s007``), so compaction
cannot confuse it. An edit quotes what the model is *shown*: the target line (Codex: with its
neighbours as patch context) is looked up in the newest read of that file in the forwarded
request; when no read there shows it, the model reads the file again first (a forced re-read,
counted) and edits then. Claude Code refuses an ``Edit`` whose ``old_string`` is not in the
file and Codex a patch whose context does not match, so an edit landing on disk is the proof
that the quoted text reached the model intact. The proxy's summarizer calls get a summary.

Claude Code renders steps as ``Read(file_path, offset, limit)``, ``Edit``, ``Write``, ``Bash``;
Codex as ``exec_command`` running ``cat``, ``nl -ba``, ``head -n``, ``sed -n 'A,Bp'``, a heredoc
write, and the freeform ``apply_patch`` tool (``gpt-5.5`` from Codex's own model catalog, the
one that offers it; ``tool_output_token_limit`` raised so Codex itself does not truncate).

:class:`FileSession` keeps what each client sent (through the proxy's app), what the proxy
forwarded, the ``x-ctxproxy-*`` headers, each edit's outcome and the files as the session left
them; its methods find, per feature, the places a file-aware proxy should have slimmed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

from harness.claude_code import MODEL as CLAUDE_MODEL
from harness.claude_code import summarizer_request
from harness.codex import Recording, run_codex, write_codex_home
from proxy.app import create_app
from proxy.compaction.message import SUMMARY_HEADING
from proxy.config import Config, config_from_mapping
from proxy.demo.fake.own_calls import own_call
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.servers import serve_in_thread

__all__ = [
    "CLAUDE_MODEL",
    "CLAUDE_WINDOW",
    "CODEX_MODEL",
    "CODEX_WINDOW",
    "FINAL",
    "Client",
    "EditOutcome",
    "FileSession",
    "PlanModel",
    "Step",
    "build_plan",
    "make_project",
    "run_claude_session",
    "run_codex_session",
    "session_config",
]

Client = Literal["claude", "codex"]
#: Codex's catalog model that offers the freeform ``apply_patch`` tool
CODEX_MODEL = "gpt-5.5"
#: Context windows the proxy is told, small enough that each session compacts several times
#: (Claude Code's system prompt and tools are ~25k tokens, Codex's ~12k).
CLAUDE_WINDOW = 90_000
CODEX_WINDOW = 60_000
FINAL = "Checklist done: the contract test passes and every edit is in."
PROMPT = ("Work through the maintenance checklist for this repository: read the modules, fix "
          "the heap contract, keep the tests green, and note what you changed.")
EDIT_MARK = "ctxproxy-edit"
SUMMARY = f"""{SUMMARY_HEADING}
## Goal
Work through the maintenance checklist: read the modules under src/, fix the heap contract,
keep tests/run_tests.py green, note the changes.
## Constraints & Preferences
- edit with the client's own tools; run the tests after each fix
## Progress
### Done
- read and edited several modules under src/
### In Progress
- the next checklist item
### Blocked
- nothing
## Key Decisions
- each fix is marked with a ctxproxy-edit comment
## Next Steps
- continue the checklist
## Critical Context
- the contract test checks src/heap.py
"""

# The project's modules: (name in src/, the stdlib module whose text it holds). All under the
# proxy's 50 KB stage-1 budget and Claude Code's Read limits.
MODULES: tuple[tuple[str, str], ...] = (
    ("wrap.py", "textwrap.py"), ("lexer.py", "shlex.py"), ("tools.py", "functools.py"),
    ("heap.py", "heapq.py"), ("cal.py", "calendar.py"), ("tokens.py", "tokenize.py"),
    ("fractions_.py", "fractions.py"), ("ctx.py", "contextlib.py"), ("csvio.py", "csv.py"),
    ("pretty.py", "pprint.py"), ("settings.py", "string.py"), ("match.py", "fnmatch.py"),
    ("sched_.py", "sched.py"), ("copy_.py", "copy.py"), ("glob_.py", "glob.py"),
)

RUN_TESTS = '''"""A stand-in test runner: one test per top-level function and class of src/, and the heap
contract test, which fails until src/heap.py carries its fix."""
import pathlib
import re
import sys

root = pathlib.Path(__file__).resolve().parent.parent
collect = "--collect-only" in sys.argv
tests = [(m.stem, name.lower()) for m in sorted((root / "src").glob("*.py"))
         for name in re.findall(r"^(?:def|class) (\\w+)", m.read_text(), re.M)]
tests.append(("heap", "contract"))
print("=" * 29 + " test session starts " + "=" * 30)
print("platform linux -- Python 3.11.9, pytest-8.3.4, pluggy-1.5.0")
print(f"rootdir: {root.name}")
print(f"collected {len(tests)} items")
print()
if collect:
    for mod, name in tests:
        print(f"<Module tests/test_{mod}.py>  <Function test_{name}>")
    sys.exit(0)
fixed = "ctxproxy-edit" in (root / "src" / "heap.py").read_text()
for i, (mod, name) in enumerate(tests, 1):
    ok = fixed or name != "contract"
    print(f"tests/test_{mod}.py::test_{name} {'PASSED' if ok else 'FAILED'} "
          f"[{i * 100 // len(tests):3d}%]")
print()
if not fixed:
    print("=" * 36 + " FAILURES " + "=" * 36)
    print("_" * 33 + " test_contract " + "_" * 33)
    print()
    print("    def test_contract():")
    print(">       assert heap.contract_holds(heap.heapify_sample())")
    print("E       AssertionError: heap invariant broken after heapreplace on equal keys")
    print()
    print("tests/test_heap.py:41: AssertionError")
    print("=" * 29 + " short test summary info " + "=" * 26)
    print("FAILED tests/test_heap.py::test_contract - AssertionError: heap invariant broken")
    print("=" * 25 + f" 1 failed, {len(tests) - 1} passed in 0.84s " + "=" * 25)
    sys.exit(1)
print("=" * 30 + f" {len(tests)} passed in 0.84s " + "=" * 30)
'''

INVENTORY = '''"""Every top-level function and class of src/: module, line, name, lines long."""
import pathlib
import re

root = pathlib.Path(__file__).resolve().parent.parent
for m in sorted((root / "src").glob("*.py")):
    lines = m.read_text().splitlines()
    starts = [(i, re.match(r"^(def|class) (\\w+)", ln)) for i, ln in enumerate(lines, 1)]
    found = [(i, hit.group(1), hit.group(2)) for i, hit in starts if hit]
    for (i, kind, name), nxt in zip(found, [f[0] for f in found[1:]] + [len(lines) + 1]):
        print(f"{m.name:14} {i:5d}  {kind:5} {name:32} {nxt - i:5d} lines")
'''


def _stdlib_text(rel: str) -> str:
    return (Path(sysconfig.get_paths()["stdlib"]) / rel).read_text(encoding="utf-8")


def make_project(root: Path) -> dict[str, str]:
    """Write the project under ``root``; its files, relative path -> text."""
    files = {f"src/{name}": _stdlib_text(rel) for name, rel in MODULES}
    files["tests/run_tests.py"] = RUN_TESTS
    files["tools/inventory.py"] = INVENTORY
    files["README.md"] = "# ledgerkit\n\nSmall utilities. Run `python3 tests/run_tests.py`.\n"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    return files


# --- the plan ---------------------------------------------------------------------------------

StepKind = Literal["read", "edit", "write", "shell"]


@dataclass(frozen=True, slots=True)
class Step:
    """One tool call of the plan. ``repeats``: the earlier step this read (same file, same
    range) or command (same command) repeats. A read's ``via`` is how Codex reads (``cat``,
    ``nl``, ``head``, ``sed``); ``start``/``end`` 1-based inclusive (None: the whole file)."""

    kind: StepKind
    path: str = ""  # relative to the project root
    start: int | None = None
    end: int | None = None
    via: str = "cat"
    line: int = 0  # an edit's target line
    quote: str = ""  # an edit's target line's text, as the file holds it
    command: str = ""
    content: str = ""  # a write's new text
    new_file: bool = False  # a write creating the file (Codex: apply_patch's Add File)
    repeats: int | None = None
    note: str = ""

    def covers(self, other: Step) -> bool:
        """Whether this read shows every line ``other`` (a read of the same file) showed."""
        if self.start is None:
            return True
        if other.start is None:
            return False
        return self.start <= other.start and (self.end or 0) >= (other.end or 0)

    @property
    def marker(self) -> str:
        """What an edit adds to its line (unique per step)."""
        return f"  # {EDIT_MARK}-{self.path.rsplit('/', 1)[-1].removesuffix('.py')}"


def _target(text: str, near: int) -> int:
    """A line from ``near`` on that is worth editing: unique in the file, plain code or
    comment text 20-90 characters long, not a ``def``/``class`` line (the grep steps must
    repeat identically), neighbours on both sides."""
    lines = text.splitlines()
    counts: dict[str, int] = {}
    for ln in lines:
        counts[ln] = counts.get(ln, 0) + 1
    for n in range(max(near, 3), len(lines) - 2):
        ln = lines[n - 1]
        body = ln.strip()
        if (counts[ln] == 1 and 20 <= len(ln) <= 90 and not body.startswith(("def ", "class "))
                and "\t" not in ln and not ln.endswith("\\")
                and all(lines[k - 1].strip() for k in (n - 1, n + 1))):
            return n
    raise ValueError(f"no line to edit from {near}")


def build_plan(files: Mapping[str, str]) -> list[Step]:
    """The session both clients play (see the module docstring); edit targets are chosen in
    ``files`` as :func:`make_project` wrote them."""
    steps: list[Step] = []

    def add(step: Step) -> int:
        steps.append(step)
        return len(steps) - 1

    def read(path: str, start: int | None = None, end: int | None = None, via: str = "cat",
             repeats: int | None = None, note: str = "") -> int:
        if start is not None and via == "cat":
            via = "head" if start == 1 else "sed"
        return add(Step("read", f"src/{path}", start, end, via, repeats=repeats, note=note))

    def edit(path: str, near: int, note: str = "") -> int:
        text = files[f"src/{path}"]
        n = _target(text, near)
        return add(Step("edit", f"src/{path}", line=n, quote=text.splitlines()[n - 1],
                        note=note))

    def shell(command: str, repeats: int | None = None, note: str = "") -> int:
        return add(Step("shell", command=command, repeats=repeats, note=note))

    grep = "grep -rn '^def \\|^class ' src | sort"
    tests = "python3 tests/run_tests.py"
    collect = "python3 tests/run_tests.py --collect-only"
    shell("find src tests tools -name '*.py' | sort", note="layout")
    r_wrap = read("wrap.py")
    edit("wrap.py", 120, "edit quoting the read")
    r_wrap2 = read("wrap.py", repeats=r_wrap, note="re-read after an edit: changed")
    r_lexer = read("lexer.py")
    read("lexer.py", repeats=r_lexer, note="re-read, unchanged")
    g1 = shell(grep, note="a grep")
    r_match = read("match.py")
    shell(grep, repeats=g1, note="the grep again, nothing written since: same output")
    read("tools.py", 100, 180, note="a range")
    read("tools.py", note="the whole file after a range: supersedes it")
    t1 = shell(tests, note="the test log: contract FAILED")
    r_heap = read("heap.py")
    edit("heap.py", 300, "the contract fix")
    t2 = shell(tests, repeats=t1, note="the test log again: contract PASSED")
    add(Step("write", "src/notes.py", content=NOTES, new_file=True, note="a new file"))
    r_cal = read("cal.py", via="nl")
    read("cal.py", via="nl", repeats=r_cal, note="re-read, unchanged")
    read("sched_.py", 20, 80, note="a range")
    read("sched_.py", note="the whole file after a range: supersedes it")
    shell("python3 tools/inventory.py", note="a listing under a per-tool budget (tests)")
    read("tokens.py", 200, 260, note="a range")
    r_tok = read("tokens.py", note="the whole file after a range: supersedes it")
    edit("tokens.py", 420, "edit outside the range read first")
    read("tokens.py", repeats=r_tok, note="re-read after an edit: changed")
    r_copy = read("copy_.py")
    read("copy_.py", repeats=r_copy, note="re-read, unchanged")
    shell(grep, repeats=g1, note="the grep a third time: notes.py is new")
    read("settings.py", note="read before it is overwritten")
    add(Step("write", "src/settings.py", content=SETTINGS, note="overwrite: the read is stale"))
    read("fractions_.py")
    r_ctx = read("ctx.py")
    edit("ctx.py", 200, "edit")
    read("ctx.py", repeats=r_ctx, note="re-read after an edit: changed")
    read("glob_.py", 1, 40, note="a range")
    read("glob_.py", note="the whole file after a range: supersedes it")
    c1 = shell(collect, note="a listing a policy protects (tests)")
    shell(collect, repeats=c1, note="the protected listing again")
    r_pretty = read("pretty.py")
    read("pretty.py", repeats=r_pretty, note="re-read, unchanged")
    read("csvio.py", 50, 120, note="a range")
    read("csvio.py", note="the whole file after a range: supersedes it")
    edit("csvio.py", 300, "edit")
    read("match.py", 1, 30, note="a range of a file read whole before")
    read("match.py", repeats=r_match, note="re-read, unchanged")
    read("wrap.py", repeats=r_wrap2, note="re-read, unchanged since the last read")
    edit("fractions_.py", 500, "edit quoting a read many turns back")
    shell(tests, repeats=t2, note="the test log a third time: as the second")
    read("lexer.py", 1, 60, note="a range the earlier whole reads cover")
    read("heap.py", repeats=r_heap, note="re-read after the fix: changed")
    return steps


NOTES = '''"""Maintenance notes: what changed and why (kept next to the code it describes)."""

CHANGES = [
    ("src/wrap.py", "documented the width contract"),
    ("src/heap.py", "heapreplace keeps the invariant on equal keys"),
    ("src/tokens.py", "clarified the encoding detection comment"),
]


def summary() -> str:
    return "\\n".join(f"{path}: {why}" for path, why in CHANGES)
'''

SETTINGS = '''"""Settings for ledgerkit: one place for the knobs the modules read."""

WIDTH = 88
ENCODING = "utf-8"
HEAP_CHECKS = True
PRETTY_INDENT = 2
CSV_DIALECT = "excel"


def as_dict() -> dict[str, object]:
    return {k: v for k, v in globals().items() if k.isupper()}
'''


# --- what the model is shown ------------------------------------------------------------------

_ID = re.compile(r"^(?:toolu|call)_s(\d{3})(r?)$")
_NUMBERED = re.compile(r"^\s*(\d+)\t(.*)$")
_SED = re.compile(r"^sed -n '(\d+),(\d+)p' (\S+)$")
_HEAD = re.compile(r"^head -n (\d+) (\S+)$")


def call_id(client: Client, step: int, reread: bool = False) -> str:
    return f"{'toolu' if client == 'claude' else 'call'}_s{step:03d}{'r' if reread else ''}"


def parse_id(cid: str) -> tuple[int, bool] | None:
    """(step, forced re-read) of one of :class:`PlanModel`'s call ids."""
    m = _ID.match(cid)
    return (int(m.group(1)), m.group(2) == "r") if m else None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(b.get("text", "")) for b in content if isinstance(b, dict))
    return "" if content is None else str(content)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call and its result in one request (``result`` None: not answered in it)."""

    id: str
    name: str
    args: Mapping[str, Any]
    result: str | None


def tool_calls(body: Mapping[str, Any]) -> list[ToolCall]:
    """The tool calls of a Messages or Responses request, in order, with their results."""
    calls: list[tuple[str, str, Mapping[str, Any]]] = []
    results: dict[str, str] = {}
    if "messages" in body:
        for m in body["messages"]:
            if not isinstance(m.get("content"), list):
                continue
            for b in m["content"]:
                if b.get("type") == "tool_use":
                    calls.append((b["id"], b["name"], b.get("input") or {}))
                elif b.get("type") == "tool_result":
                    results[b["tool_use_id"]] = _text(b.get("content"))
    else:
        for item in body.get("input") or ():
            kind = item.get("type") if isinstance(item, dict) else None
            if kind == "function_call":
                try:
                    args = orjson.loads(item.get("arguments") or "{}")
                except orjson.JSONDecodeError:
                    args = {}
                calls.append((item["call_id"], item["name"], args))
            elif kind == "custom_tool_call":
                calls.append((item["call_id"], item["name"], {"input": item.get("input", "")}))
            elif kind in ("function_call_output", "custom_tool_call_output"):
                results[item["call_id"]] = _text(item.get("output"))
    return [ToolCall(cid, name, args, results.get(cid)) for cid, name, args in calls]


def shown_lines(client: Client, call: ToolCall, path: str) -> dict[int, str]:
    """The lines of ``path`` (relative) a read call's result shows, by line number."""
    if call.result is None:
        return {}
    if client == "claude":
        if call.name != "Read" or not str(call.args.get("file_path", "")).endswith("/" + path):
            return {}
        shown: dict[int, str] = {}
        for ln in call.result.split("\n"):
            m = _NUMBERED.match(ln)
            if m is None:
                break
            shown[int(m.group(1))] = m.group(2)
        return shown
    cmd = str(call.args.get("cmd", ""))
    body = call.result.split("Output:\n", 1)[1] if "Output:\n" in call.result else ""
    lines = body.split("\n")
    if cmd == f"cat {path}":
        return dict(enumerate(lines[:-1] if body.endswith("\n") else lines, 1))
    if cmd == f"nl -ba {path}":
        out: dict[int, str] = {}
        for ln in lines:
            m = _NUMBERED.match(ln)
            if m:
                out[int(m.group(1))] = m.group(2)
        return out
    if (m := _SED.match(cmd)) and m.group(3) == path:
        return {int(m.group(1)) + i: ln for i, ln in enumerate(lines[:-1])}
    if (m := _HEAD.match(cmd)) and m.group(2) == path:
        return {1 + i: ln for i, ln in enumerate(lines[:-1])}
    return {}


# --- the model --------------------------------------------------------------------------------


@dataclass
class PlanModel:
    """The fake's responder: plays ``plan`` for ``client`` in ``workdir`` (see the module
    docstring). ``forced`` lists the edit steps it had to re-read the file for; ``blind`` the
    ones whose line it still did not see (then it quotes the plan's text)."""

    client: Client
    plan: Sequence[Step]
    workdir: Path
    summaries: int = 0
    forced: list[int] = field(default_factory=list)
    blind: list[int] = field(default_factory=list)

    def __call__(self, body: dict[str, Any]) -> Reply:
        if self.client == "claude":
            if summarizer_request(body) or not body.get("tools"):
                self.summaries += summarizer_request(body)
                return Reply(content=SUMMARY if summarizer_request(body) else "ok")
        elif own_call(body) is not None:
            self.summaries += 1
            return Reply(content=SUMMARY)
        calls = tool_calls(body)
        newest = parse_id(calls[-1].id) if calls and calls[-1].result is not None else None
        if newest is None:
            n = 0
        else:
            n = newest[0] if newest[1] else newest[0] + 1
        if n >= len(self.plan):
            return Reply(content=FINAL, reasoning="every step of the checklist is done")
        step = self.plan[n]
        if step.kind == "edit":
            return self._edit(n, step, calls, reread=newest == (n, True))
        return self._call(n, step)

    def _call(self, n: int, step: Step, reread: bool = False) -> Reply:
        cid = call_id(self.client, n, reread)
        why = f"step {n}: {step.note or step.kind}"
        if self.client == "claude":
            if step.kind == "read":
                args: dict[str, Any] = {"file_path": str(self.workdir / step.path)}
                if step.start is not None and not reread:
                    args |= {"offset": step.start, "limit": (step.end or 0) - step.start + 1}
                call = {"name": "Read", "id": cid, "arguments": args}
            elif step.kind == "write":
                call = {"name": "Write", "id": cid, "arguments": {
                    "file_path": str(self.workdir / step.path), "content": step.content}}
            else:
                call = {"name": "Bash", "id": cid, "arguments": {
                    "command": step.command, "description": step.note or "run it"}}
            return Reply(content=None, reasoning=why, tool_calls=[call])
        if step.kind == "write" and step.new_file:
            patch = "".join(f"+{ln}\n" for ln in step.content.splitlines())
            return Reply(content=None, reasoning=why, tool_calls=[{
                "name": "apply_patch", "type": "custom", "id": cid,
                "arguments": f"*** Begin Patch\n*** Add File: {step.path}\n{patch}*** End Patch\n"}])
        if step.kind == "write":
            cmd = f"cat > {step.path} <<'EOF'\n{step.content}EOF"
        elif step.kind == "read":
            cmd = _read_command(step, reread)
        else:
            cmd = step.command
        return Reply(content=None, reasoning=why, tool_calls=[{
            "name": "exec_command", "id": cid,
            "arguments": {"cmd": cmd, "max_output_tokens": 100_000, "yield_time_ms": 10_000}}])

    def _edit(self, n: int, step: Step, calls: Sequence[ToolCall], reread: bool) -> Reply:
        shown: dict[int, str] = {}
        for call in reversed(calls):  # the newest read showing the line, as an agent would
            lines = shown_lines(self.client, call, step.path)
            if step.line in lines:
                shown = lines
                break
        if step.line not in shown:
            if not reread:
                self.forced.append(n)
                return self._call(n, Step("read", step.path, note="re-read to quote it"), True)
            self.blind.append(n)
            shown = {step.line: step.quote}
        old = shown[step.line]
        cid = call_id(self.client, n)
        why = f"step {n}: {step.note}"
        if self.client == "claude":
            return Reply(content=None, reasoning=why, tool_calls=[{
                "name": "Edit", "id": cid, "arguments": {
                    "file_path": str(self.workdir / step.path), "old_string": old,
                    "new_string": old + step.marker}}])
        before = [shown[k] for k in (step.line - 2, step.line - 1) if k in shown]
        after = [shown[k] for k in (step.line + 1,) if k in shown]
        hunk = ("".join(f" {ln}\n" for ln in before) + f"-{old}\n+{old}{step.marker}\n"
                + "".join(f" {ln}\n" for ln in after))
        patch = f"*** Begin Patch\n*** Update File: {step.path}\n@@\n{hunk}*** End Patch\n"
        return Reply(content=None, reasoning=why, tool_calls=[{
            "name": "apply_patch", "type": "custom", "id": cid, "arguments": patch}])


def _read_command(step: Step, reread: bool) -> str:
    if step.start is None or reread:
        return f"nl -ba {step.path}" if step.via == "nl" and not reread else f"cat {step.path}"
    if step.via == "head" and step.start == 1:
        return f"head -n {step.end} {step.path}"
    return f"sed -n '{step.start},{step.end}p' {step.path}"


# --- the session ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EditOutcome:
    """One edit or write step: whether its change is on disk, whether the client refused it
    (its tool result says so), whether the model had to re-read the file to quote it
    (``forced_reread``) and whether even then it did not see the line (``blind``: it quoted
    the plan's text)."""

    step: int
    path: str
    landed: bool
    refused: bool
    forced_reread: bool
    blind: bool
    result: str


@dataclass
class FileSession:
    """What one session did (see the module docstring)."""

    client: Client
    returncode: int
    stdout: str
    stderr: str
    plan: list[Step]
    files: dict[str, str]  # the project as the session left it
    sent: list[dict[str, Any]]  # the main requests as the client sent them
    forwarded: list[dict[str, Any]]  # ... and as the proxy forwarded them
    headers: list[dict[str, str]]  # x-ctxproxy-* of each answer to the client
    edits: list[EditOutcome] = field(default_factory=list)
    summaries: int = 0
    # forwarded_calls(), parsed once (the per-feature views ask for it per step).
    _calls: list[dict[str, ToolCall]] | None = field(default=None, init=False, repr=False,
                                                     compare=False)

    @property
    def finished(self) -> bool:
        return self.returncode == 0 and FINAL in self.stdout

    def sent_results(self) -> dict[str, str]:
        """Each call id's result as the client sent it (the first time it did)."""
        out: dict[str, str] = {}
        for body in self.sent:
            for c in tool_calls(body):
                if c.result is not None:
                    out.setdefault(c.id, c.result)
        return out

    def forwarded_calls(self) -> list[dict[str, ToolCall]]:
        """Per forwarded request: its calls by id."""
        if self._calls is None:
            self._calls = [{c.id: c for c in tool_calls(b)} for b in self.forwarded]
        return self._calls

    def first_forwarded(self, cid: str) -> int | None:
        """The first forwarded request carrying ``cid``'s result."""
        return next((i for i, calls in enumerate(self.forwarded_calls())
                     if cid in calls and calls[cid].result is not None), None)

    def compactions(self) -> list[int]:
        """The forwarded requests that carry a summary the previous one did not (the requests a
        compaction rewrote)."""
        out, seen = [], None
        for i, body in enumerate(self.forwarded):
            summary = _summary_in(body)
            if summary is not None and summary != seen:
                out.append(i)
            seen = summary
        return out

    def step_id(self, n: int) -> str:
        return call_id(self.client, n)

    def edits_between(self, path: str, after: int, before: int) -> list[int]:
        return [k for k in range(after + 1, before) if self.plan[k].kind in ("edit", "write")
                and self.plan[k].path == path]

    # -- per feature: where a file-aware proxy should have slimmed ---------------------------

    def _repeats(self, kind: str, sent: Mapping[str, str]) -> Iterator[tuple[int, Step, int, Any]]:
        """Each step of ``kind`` repeating an earlier one, with the first forwarded request
        carrying it and that request's calls, where the earlier step's result is still
        forwarded as the client sent it."""
        for n, step in enumerate(self.plan):
            if step.kind != kind or step.repeats is None:
                continue
            first = self.first_forwarded(self.step_id(n))
            if first is None:
                continue
            calls = self.forwarded_calls()[first]
            earlier = calls.get(self.step_id(step.repeats))
            if earlier is not None and earlier.result == sent.get(earlier.id):
                yield n, step, first, calls

    def rereads(self) -> list[Reread]:
        """Each re-read (same file, same range) in the first forwarded request carrying it,
        where the earlier read is still forwarded as the client sent it."""
        sent = self.sent_results()
        out: list[Reread] = []
        for n, step, first, calls in self._repeats("read", sent):
            assert step.repeats is not None
            marks = [self.plan[k].marker for k in self.edits_between(step.path, step.repeats, n)
                     if self.plan[k].kind == "edit"]
            out.append(Reread(n, step.repeats, first, sent[self.step_id(n)],
                              calls[self.step_id(n)].result or "", tuple(marks)))
        return out

    def duplicates(self) -> list[Duplicate]:
        """Each repeated command in the first forwarded request carrying it, where the earlier
        output is still forwarded as the client sent it; ``new_lines``: its output's lines
        the earlier output lacks (the client's own per-call headers aside)."""
        sent = self.sent_results()
        out: list[Duplicate] = []
        for n, step, first, calls in self._repeats("shell", sent):
            assert step.repeats is not None
            old = set(sent[self.step_id(step.repeats)].split("\n"))
            new = tuple(ln for ln in sent[self.step_id(n)].split("\n")
                        if ln not in old and not _VOLATILE.search(ln))
            out.append(Duplicate(n, step.repeats, first, step.command, sent[self.step_id(n)],
                                 calls[self.step_id(n)].result or "", new))
        return out

    def superseded(self) -> list[Superseded]:
        """At each compaction: the reads forwarded in that request which a later read of the
        same file forwarded there too covers, and which neither a later edit quotes nor are
        the newest read of their file (the ones the supersede rule must turn into markers)."""
        sent = self.sent_results()
        out: list[Superseded] = []
        for r in self.compactions():
            calls = self.forwarded_calls()[r]
            present = sorted(n for n, s in enumerate(self.plan) if s.kind == "read"
                             and self.step_id(n) in calls
                             and calls[self.step_id(n)].result is not None)
            now = max((p[0] for c in calls.values() if (p := parse_id(c.id))), default=0)
            for n in present:
                step = self.plan[n]
                later = [k for k in present if k > n and self.plan[k].path == step.path]
                by = next((k for k in later if self.plan[k].covers(step)), None)
                # Edits made by then (the proxy cannot know a later one) quoting a line of it.
                quoted = any(e.kind == "edit" and e.path == step.path
                             and (step.start is None or step.start <= e.line <= (step.end or 0))
                             for e in self.plan[n + 1:now + 1])
                if by is None or quoted:
                    continue
                out.append(Superseded(r, n, by, sent[self.step_id(n)],
                                      calls[self.step_id(n)].result or ""))
        return out


_VOLATILE = re.compile(r"^(Chunk ID|Wall time|Original token count): |<total_tokens>|"
                       r"tokens left</total_tokens>")


def _summary_in(body: Mapping[str, Any]) -> str | None:
    """The summary text a forwarded request carries (Messages: a text block of the first
    user turn; Responses: a developer item), if any."""
    items = body.get("messages") if "messages" in body else body.get("input")
    for item in items or ():
        if not isinstance(item, dict):
            continue
        content = item.get("content")
        if item.get("role") == "user" and isinstance(content, list):
            for block in content:
                if (isinstance(block, dict) and isinstance(block.get("text"), str)
                        and block["text"].startswith(SUMMARY_HEADING)):
                    return str(block["text"])
        elif item.get("role") in ("system", "developer"):
            text = _text(content)
            if SUMMARY_HEADING in text:
                return text
    return None


@dataclass(frozen=True, slots=True)
class Reread:
    step: int
    earlier: int
    request: int  # the forwarded request
    sent: str
    forwarded: str
    marks: tuple[str, ...]  # the edits' markers made between the two reads (changed: non-empty)


@dataclass(frozen=True, slots=True)
class Duplicate:
    step: int
    earlier: int
    request: int
    command: str
    sent: str
    forwarded: str
    new_lines: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Superseded:
    request: int
    step: int
    by: int
    sent: str
    forwarded: str


# --- running them -----------------------------------------------------------------------------


def session_config(data_dir: Path, fake_url: str, overrides: Mapping[str, Any] | None = None,
                   ) -> Config:
    """A proxy in front of the fake at ``fake_url`` (its root, no ``/v1``; both APIs), its data
    in ``data_dir``, with both sessions' models' windows; ``overrides``: sections, a section
    given as a mapping merged into the defaults' section (``offload: {dedupe: false}``)."""
    data: dict[str, Any] = {
        "upstream": {"base_url": fake_url + "/v1"},
        "anthropic": {"base_url": fake_url},
        "storage": {"data_dir": str(data_dir)},
        "compaction": {"context_windows": {CLAUDE_MODEL: CLAUDE_WINDOW,
                                           CODEX_MODEL: CODEX_WINDOW}},
    }
    for key, value in (overrides or {}).items():
        if isinstance(value, Mapping) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return config_from_mapping(data)


@dataclass
class _Workspace:
    root: Path
    work: Path
    home: Path
    files: dict[str, str]


@contextmanager
def _workspace() -> Iterator[_Workspace]:
    root = Path(tempfile.mkdtemp(prefix="ctxproxy-files-"))
    try:
        work, home = root / "work", root / "home"
        work.mkdir()
        home.mkdir()
        yield _Workspace(root, work, home, make_project(work))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _snapshot(work: Path) -> dict[str, str]:
    return {str(p.relative_to(work)): p.read_text(encoding="utf-8", errors="replace")
            for p in sorted(work.rglob("*")) if p.is_file()}


def _outcomes(client: Client, model: PlanModel, plan: Sequence[Step], files: Mapping[str, str],
              sent: Sequence[dict[str, Any]]) -> list[EditOutcome]:
    results: dict[str, str] = {}
    for body in sent:
        for c in tool_calls(body):
            if c.result is not None:
                results.setdefault(c.id, c.result)
    out = []
    for n, step in enumerate(plan):
        if step.kind not in ("edit", "write"):
            continue
        result = results.get(call_id(client, n), "")
        if step.kind == "edit":
            text = files.get(step.path, "")
            landed = step.quote + step.marker in text.splitlines()
        else:
            landed = files.get(step.path) == step.content
        refused = ("tool_use_error" in result or "Error" in result[:200] if client == "claude"
                   else not ("Success." in result or "Process exited with code 0" in result))
        out.append(EditOutcome(n, step.path, landed, refused, n in model.forced, n in model.blind,
                               result))
    return out


def _main_requests(fake: FakeUpstream, start: int, client: Client) -> list[dict[str, Any]]:
    out = []
    for rec in fake.received[start:]:
        if client == "claude" and rec.path.endswith("/messages"):
            body = rec.json()
            if body.get("tools") and not summarizer_request(body):
                out.append(body)
        elif client == "codex" and rec.path.endswith("/responses"):
            body = rec.json()
            if own_call(body) is None:
                out.append(body)
    return out


def run_claude_session(binary: Path, config: Config, fake: FakeUpstream, *,
                       timeout_s: float = 300) -> FileSession:
    """Claude Code plays the plan through a proxy built from ``config`` (its upstreams at the
    fake already: :func:`session_config`) in front of ``fake`` (served)."""
    with _workspace() as ws:
        plan = build_plan(ws.files)
        model = PlanModel("claude", plan, ws.work)
        fake.responder = model
        start = len(fake.received)
        app = Recording(create_app(config), path="/v1/messages")
        with serve_in_thread(app, lifespan="on") as srv:
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith(("ANTHROPIC_", "CLAUDE"))}
            env.update({
                "HOME": str(ws.home), "IS_SANDBOX": "1", "ANTHROPIC_BASE_URL": srv.url,
                "ANTHROPIC_API_KEY": "sk-ant-fake-files", "ANTHROPIC_MODEL": CLAUDE_MODEL,
                "ANTHROPIC_SMALL_FAST_MODEL": CLAUDE_MODEL, "DISABLE_TELEMETRY": "1",
                "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            })
            proc = subprocess.run(
                [str(binary), "-p", PROMPT, "--dangerously-skip-permissions"], cwd=ws.work,
                env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                timeout=timeout_s, check=False)
            srv.drain()
        return _session("claude", proc.returncode, proc.stdout, proc.stderr, model, plan, ws,
                        app, fake, start)


def run_codex_session(binary: Path, config: Config, fake: FakeUpstream, *,
                      timeout_s: float = 300) -> FileSession:
    """The Codex CLI plays the plan through a proxy built from ``config`` in front of
    ``fake`` (served)."""
    with _workspace() as ws:
        plan = build_plan(ws.files)
        model = PlanModel("codex", plan, ws.work)
        fake.responder = model
        start = len(fake.received)
        app = Recording(create_app(config))
        with serve_in_thread(app, lifespan="on") as srv:
            write_codex_home(ws.home, srv.url, CODEX_MODEL, websockets=False)
            with (ws.home / "config.toml").open("a") as f:
                # Codex's own cap on a tool output (10k tokens for this model) would cut the
                # whole-file reads before the proxy sees them.
                f.write("tool_output_token_limit = 60000\n")
            done = run_codex(binary, ws.home, ws.work, PROMPT, timeout=timeout_s)
            srv.drain()
        return _session("codex", done.returncode, done.stdout, done.stderr, model, plan, ws,
                        app, fake, start)


def _session(client: Client, returncode: int, stdout: str, stderr: str, model: PlanModel,
             plan: list[Step], ws: _Workspace, app: Recording, fake: FakeUpstream,
             start: int) -> FileSession:
    files = _snapshot(ws.work)
    sent = [t.body for t in app.turns if client == "codex" or t.body.get("tools")]
    session = FileSession(client, returncode, stdout, stderr, plan, files, sent,
                          _main_requests(fake, start, client), [t.headers for t in app.turns],
                          summaries=model.summaries)
    session.edits = _outcomes(client, model, plan, files, sent)
    return session
