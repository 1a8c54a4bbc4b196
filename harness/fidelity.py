"""Fidelity harness (issue 20): what an agent still knows after ctxproxy slims its context.

A long synthetic coding-agent session (:func:`build_script`) made of real text -- files of this
Python's standard library served as the project's files, pytest-style logs built from their
function names -- with **typed canaries** planted at known steps (:data:`KINDS`): the goal, user
constraints and a standing preference, user requests and an open to-do, an exact path, an
identifier, a number, an error message and its fix, a decision with its reason, a file created
then deleted, a file edited after it was read (``Edit(old_string)`` quoting a line of that read).

:func:`replay` renders the script in one wire format (``chat``; ``responses`` as Codex speaks
it: reasoning items, ``shell`` and ``apply_patch`` calls; ``messages`` as Claude Code speaks it:
thinking blocks, ``Read``/``Edit``/``Write``/``Bash``) and posts the growing history, one request
per step, to the real app in process (:class:`~proxy.testing.inprocess.InProcess`) in front of
the fake upstream, with a small window so the session compacts many times. The fake answers the
agent's requests with "ok" (the client scripts the session, not the model) and the summarizer
per :data:`MODES`: ``fallback`` fails every summarizer call (the proxy's deterministic summary is
used), ``weak`` answers like a weak model (:func:`weak_summary`: the required sections, half of
what it is given dropped, deterministically).

After every compaction (a summary never forwarded before) and at the end, every canary planted so
far is classified (:func:`locate`), first match wins:

* ``context``: verbatim in the forwarded request outside the summary;
* ``summary``: verbatim in the summary message;
* ``reachable``: one read call names it -- a ``read_offloaded`` pointer (a truncation notice's
  ``file_path``, or the summary's dialog pointer) is in the forwarded request and running the
  proxy's :class:`~proxy.retrieval.tool.ReadTool` with the proxy's own data dir, at the position
  the pointer suggests, returns text holding the canary; or a notice points at the client's own
  read tool (``read_file``, ``Read``) and the file, as it is at that step, holds it from the line
  the notice names (2,000 lines, as Claude Code's Read);
* ``lost``.

Also measured: for every edit, whether its ``old_string`` quote is byte-exact in the forwarded
request the edit answers (the request just before the edit is appended).

**Seam for model-in-the-loop probes** (``harness/probes.py``): :attr:`Run.checkpoints` is
a list of :class:`Checkpoint` ``(format, turn, full_body, forwarded_body, canaries, compaction)``:
``full_body`` is the request the client sent (its whole history, in its wire format),
``forwarded_body`` what the proxy forwarded for it (the slimmed request), ``canaries`` those
planted up to that turn. Ask a model the same probe with each body to compare.

The guard (``compaction: {guard: {enabled: ...}}``) is switched by ``guard`` where the config
knows the key (:func:`guard_supported`); elsewhere both settings replay the same tree.
"""

from __future__ import annotations

import hashlib
import re
import sysconfig
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import orjson

from harness.inprocess import InProcess
from proxy.app import create_app
from proxy.compaction.message import SUMMARY_HEADING
from proxy.compaction.prompt import SECTIONS
from proxy.config import Config, config_from_mapping
from proxy.config.compaction import CompactionConfig
from proxy.demo.fake.replies import Reply
from proxy.demo.fake.upstream import FakeUpstream
from proxy.demo.servers import serve_in_thread
from proxy.retrieval.tool import ReadTool
from proxy.session import Identity, safe_name, tenant_of

__all__ = [
    "FORMATS", "GUARDED", "KINDS", "MODES", "OUTCOMES", "Canary", "Checkpoint", "EditQuote",
    "Outcome", "Run", "Script", "Step", "build_script", "guard_supported", "locate", "replay",
    "replay_all", "responder", "weak_summary",
]

Fmt = Literal["chat", "responses", "messages"]
Where = Literal["context", "summary", "reachable", "lost"]
FORMATS: Final[tuple[Fmt, ...]] = ("chat", "responses", "messages")
MODES: Final = ("fallback", "weak")
OUTCOMES: Final[tuple[Where, ...]] = ("context", "summary", "reachable", "lost")
KINDS: Final = ("goal", "constraint", "preference", "request", "todo", "path", "identifier",
                "number", "error", "fix", "decision", "deleted_file", "edited_file")
#: What the guard carries into every summary: the goal, constraints, files touched.
GUARDED: Final = frozenset({"goal", "constraint", "preference", "deleted_file", "edited_file"})

MODELS: Final[Mapping[str, str]] = {
    "chat": "gpt-4o", "responses": "gpt-5.1-codex", "messages": "claude-sonnet-4-5"}
PATHS: Final[Mapping[str, str]] = {
    "chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
KEY: Final = "sk-fidelity"
SYSTEM: Final = ("You are a coding agent working in the repository at /repo. Use the tools to "
                 "read, edit and test code.")
SUMMARIZER_MARK: Final = b"You summarize a long-running conversation"
CLIENT_READ_LINES: Final = 2000  # what one Read call returns (Claude Code's default limit)


@dataclass(frozen=True)
class Canary:
    """A fact the agent must keep: ``text`` is matched verbatim (no quotes, backslashes or
    non-ASCII, so JSON encoding never hides it). ``pattern`` (a regex) also counts as a match:
    for file states, which a summary or a ledger states in its own words ("deleted
    scratch/x.py")."""

    kind: str
    text: str
    step: int = -1  # the step that plants it (set by the script builder)
    pattern: str = ""

    def found(self, haystack: str) -> bool:
        return self.text in haystack or bool(self.pattern and re.search(self.pattern, haystack))


def file_fact(path: str, verbs: str) -> str:
    """A regex: ``path`` and one of ``verbs`` (an alternation) on one line, in either order."""
    p = re.escape(path)
    return rf"{p}[^\n]*\b(?:{verbs})\b|\b(?:{verbs})\b[^\n]*{p}"


DELETED_VERBS: Final = "deleted|removed|rm|Delete File"
EDITED_VERBS: Final = "edited|modified|updated|changed|Edit|edit_file|Update File"


@dataclass(frozen=True)
class Step:
    """One step of the neutral script: a user message, or one agent tool call and its result
    (``note``: the assistant's text before the call)."""

    kind: Literal["user", "read", "bash", "edit", "write"]
    text: str = ""
    path: str = ""
    command: str = ""
    output: str = ""
    old: str = ""
    new: str = ""
    canaries: tuple[Canary, ...] = ()


@dataclass(frozen=True)
class Script:
    steps: tuple[Step, ...]
    #: the project's files as they are after each step: (step, path, content or None=deleted)
    versions: tuple[tuple[int, str, str | None], ...]

    @property
    def canaries(self) -> list[Canary]:
        return [c for s in self.steps for c in s.canaries]

    def file_at(self, path: str, step: int) -> str | None:
        text: str | None = None
        for at, p, content in self.versions:
            if p == path and at <= step:
                text = content
        return text


@dataclass(frozen=True)
class Checkpoint:
    """One request of a replayed session: after a compaction (``compaction`` = how many so far)
    or the last one. ``full_body``: what the client sent; ``forwarded_body``: what the proxy
    forwarded for it; ``canaries``: those planted up to ``turn`` (0-based step index)."""

    format: str
    turn: int
    full_body: dict[str, Any]
    forwarded_body: dict[str, Any]
    canaries: tuple[Canary, ...]
    compaction: int

    @property
    def full_messages(self) -> list[Any]:
        """The client's whole conversation (``messages`` or ``input``)."""
        return conversation(self.full_body)

    @property
    def forwarded_messages(self) -> list[Any]:
        """The slimmed conversation the provider was sent."""
        return conversation(self.forwarded_body)


@dataclass(frozen=True)
class Outcome:
    canary: Canary
    turn: int
    compaction: int
    where: Where
    final: bool  # the session's last request


@dataclass(frozen=True)
class EditQuote:
    """An edit's ``old_string`` vs the request it answers: ``present`` byte-exact; else ``why``:
    ``cut`` (the read it quotes is still forwarded, cut by ageing) or ``evicted`` (that read
    was compacted into the summary)."""

    step: int
    quote: str
    present: bool
    why: Literal["present", "cut", "evicted"] = "present"


@dataclass
class Run:
    format: str
    mode: str
    guard: bool
    compactions: int = 0
    summarizer_calls: int = 0
    checkpoints: list[Checkpoint] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    quotes: list[EditQuote] = field(default_factory=list)


# --- the script ------------------------------------------------------------------------------

# Project paths served with the text of a standard-library module (real code, real sizes).
_FILES: Final = (
    ("src/billing/quota/settings.py", "configparser.py"),
    ("src/billing/ledger.py", "shutil.py"),
    ("src/billing/quota/refill.py", "textwrap.py"),
    ("src/billing/cli.py", "argparse.py"),
    ("src/billing/models.py", "dataclasses.py"),
    ("src/billing/cache.py", "functools.py"),
    ("src/billing/export.py", "csv.py"),
    ("src/billing/http.py", "http/client.py"),
    ("src/billing/diffing.py", "difflib.py"),
    ("src/billing/tmp.py", "tempfile.py"),
    ("src/billing/mail.py", "email/message.py"),
    ("src/billing/log.py", "logging/__init__.py"),
)


def _stdlib_text(rel: str) -> str:
    return (Path(sysconfig.get_paths()["stdlib"]) / rel).read_text(encoding="utf-8")


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


class _Builder:
    def __init__(self, scale: int) -> None:
        self.steps: list[Step] = []
        self.versions: list[tuple[int, str, str | None]] = []
        self.scale = scale
        self.files: dict[str, str] = {}
        for path, rel in _FILES:
            lines = _stdlib_text(rel).splitlines()
            # 120-700 lines: 4-30 KB per read, so reads are cut by stage 2 and compactions come
            # every few steps in a small window.
            n = min(len(lines), 120 + _digest(path) % 580) * scale // 2
            self.put(path, "\n".join(lines[: max(n, 60)]) + "\n")
        self.fillers = 0

    def put(self, path: str, content: str | None) -> None:
        if content is None:
            self.files.pop(path, None)
        else:
            self.files[path] = content
        self.versions.append((len(self.steps), path, content))

    def add(self, step: Step) -> None:
        stamped = tuple(Canary(c.kind, c.text, len(self.steps), c.pattern) for c in step.canaries)
        self.steps.append(Step(step.kind, step.text, step.path, step.command, step.output,
                               step.old, step.new, stamped))

    def user(self, text: str, *canaries: Canary) -> None:
        self.add(Step("user", text=text, canaries=canaries))

    def read(self, path: str, note: str = "", *canaries: Canary) -> None:
        self.add(Step("read", text=note, path=path, output=self.files[path], canaries=canaries))

    def plant_line(self, path: str, line: str) -> None:
        """Put ``line`` into the middle of ``path`` (before it is read)."""
        lines = self.files[path].splitlines()
        at = len(lines) // 2
        self.put(path, "\n".join([*lines[:at], line, *lines[at:]]) + "\n")
        self.versions.pop()
        self.versions.append((0, path, self.files[path]))  # it was always there

    def bash(self, command: str, output: str, note: str = "", *canaries: Canary) -> None:
        self.add(Step("bash", text=note, command=command, output=output, canaries=canaries))

    def edit(self, path: str, old: str, new: str, note: str = "", *canaries: Canary) -> None:
        text = self.files[path]
        assert text.count(old) >= 1, (path, old)
        self.add(Step("edit", text=note, path=path, old=old, new=new, output="The file "
                      f"{path} has been updated.", canaries=canaries))
        self.put(path, text.replace(old, new, 1))

    def write(self, path: str, content: str, note: str = "") -> None:
        self.add(Step("write", text=note, path=path, new=content,
                      output=f"File created successfully at: {path}"))
        self.put(path, content)

    def quotable(self, path: str) -> str:
        """A line of ``path`` an edit can quote: long, unique in the session's files."""
        every = "\n".join(self.files.values())
        lines = [ln for ln in self.files[path].splitlines()
                 if 30 <= len(ln) <= 100 and '"' not in ln and "\\" not in ln and ln.isascii()
                 and every.count(ln) == 1]
        return lines[_digest(path) % len(lines)]

    def filler(self) -> None:
        """A step of ordinary work: a file read or a test/grep log."""
        n = self.fillers
        self.fillers += 1
        paths = list(self.files)
        if n % 3 == 2:
            self.bash("pytest -q tests/", pytest_log(n, failing=None))
        elif n % 3 == 1:
            path = paths[(n * 7) % len(paths)]
            self.bash(f"grep -rn 'def ' {path}", grep_log(path, self.files[path]))
        else:
            self.read(paths[(n * 5) % len(paths)])


def pytest_log(seed: int, failing: str | None, extra: str = "") -> str:
    """A pytest run over test names made from the standard library's function names."""
    names = re.findall(r"^def (\w+)", _stdlib_text(_FILES[seed % len(_FILES)][1]), re.M)
    lines = ["============================= test session starts ==============================",
             "platform linux -- Python 3.11.7, pytest-8.3.2, pluggy-1.5.0",
             "rootdir: /repo", "configfile: pyproject.toml", f"collected {len(names) * 3} items",
             ""]
    for i, name in enumerate(names):
        mark = "FAILED" if failing and i == len(names) // 2 else "PASSED"
        lines.append(f"tests/test_{name.strip('_')}.py::test_{name.strip('_')}_{seed} {mark}"
                     f" [{(i + 1) * 100 // len(names):3d}%]")
    if failing:
        lines += ["", "=================================== FAILURES ===================================",
                  "_________________________ test_refill_is_idempotent __________________________",
                  "", "    def test_refill_is_idempotent(ledger):",
                  ">       bucket = settings.bucket_for(ledger.tenant)", "",
                  "src/billing/quota/settings.py:212: in bucket_for",
                  "    return cfg['tenant_quota_bucket']", f"E       {failing}", "",
                  "=========================== short test summary info ============================",
                  f"FAILED tests/test_quota.py::test_refill_is_idempotent - {failing}"]
    if extra:
        lines += ["", extra]
    passed = len(names) - (1 if failing else 0)
    lines.append(f"{'1 failed, ' if failing else ''}{passed} passed in {1.5 + seed % 7 / 3:.2f}s")
    return "\n".join(lines) + "\n"


def grep_log(path: str, text: str, extra: str = "") -> str:
    hits = [f"{path}:{i}:{ln}" for i, ln in enumerate(text.splitlines(), 1)
            if ln.lstrip().startswith("def ")]
    if extra:
        hits.insert(len(hits) // 2, extra)
    return "\n".join(hits) + "\n"


# The canaries, two of each kind where a second makes sense (an early and a late one).
GOAL = Canary("goal", "stop the nightly billing job from double-charging tenants on retried refills")
C1 = Canary("constraint", "never touch `migrations/`")
C2 = Canary("constraint", "do not change the public signature of `Ledger.post_entry()`")
PREF = Canary("preference", "run tests with `pytest -q -p no:cacheprovider`")
PREF2 = Canary("preference", "commit messages in the imperative, under 60 chars")
REQ = Canary("request", "also make `billing-cli refill --dry-run` print the bucket it would use")
TODO = Canary("todo", "add a regression test for the leap-second refill window")
PATH = Canary("path", "src/billing/quota/refill_window_v2.py")
PATH2 = Canary("path", "deploy/cron/nightly-billing.timer")
IDENT = Canary("identifier", "_reconcile_bucket_epochs")
IDENT2 = Canary("identifier", "LEDGER_SHARD_AFFINITY_SALT")
NUM = Canary("number", "p99 refill latency 4817.3 ms")
NUM2 = Canary("number", "ledger shard count 1931")
ERR = Canary("error", "KeyError: 'tenant_quota_bucket'")
ERR2 = Canary("error", "sqlite3.OperationalError: database is locked (refill_epochs)")
FIX = Canary("fix", "cfg.get('tenant_quota_bucket', DEFAULT_BUCKET)")
FIX2 = Canary("fix", "open the refill store with `timeout=30` and WAL mode")
DEC = Canary("decision", "keep the retry token in Redis, not Postgres, because the refill path "
                         "must not take a row lock")
DEC2 = Canary("decision", "drop the in-process cache, because two workers served stale buckets")
DELETED = Canary("deleted_file", "rm scratch/repro_double_charge.py",
                 pattern=file_fact("scratch/repro_double_charge.py", DELETED_VERBS))
DELETED2 = Canary("deleted_file", "rm scratch/bench_refill.sh",
                  pattern=file_fact("scratch/bench_refill.sh", DELETED_VERBS))


def edited(path: str, new: str) -> Canary:
    """The file's new line verbatim, or the summary saying ``path`` was edited."""
    return Canary("edited_file", new, pattern=file_fact(path, EDITED_VERBS))


def build_script(scale: int = 2, fillers: int = 3) -> Script:
    """The session: canaries planted among ``fillers`` ordinary steps each; ``scale`` sizes the
    file reads (2: 4-30 KB each, 1: half). Deterministic for a given Python."""
    b = _Builder(scale)
    b.plant_line("src/billing/quota/refill.py",
                 f"def {IDENT.text}(ledger, *, grace=0):  # merges overlapping refill epochs")
    b.plant_line("src/billing/ledger.py", f"{IDENT2.text} = 'c2a7e1'  # shard placement salt")

    def pad() -> None:
        for _ in range(fillers):
            b.filler()

    b.user(f"Goal: {GOAL.text}. The bug report is BILL-2207; start by reading the quota code.",
           GOAL)
    pad()
    b.user(f"Hard rule: {C1.text}, the DBA team owns that directory.", C1)
    b.bash("grep -rn 'refill' src/ deploy/", grep_log(
        "src/billing/quota/refill.py", b.files["src/billing/quota/refill.py"],
        f"{PATH.text}:14:def refill_window(tenant, now):  # the v2 window, used by the job"),
        "", PATH)
    b.read("src/billing/quota/refill.py", "Reading the refill module.", IDENT)
    pad()
    b.user(f"Preference: {PREF.text}, the cache plugin breaks on our CI.", PREF)
    b.bash("pytest -q -p no:cacheprovider tests/test_quota.py", pytest_log(1, ERR.text),
           "Running the quota tests first.", ERR)
    b.read("src/billing/quota/settings.py")
    quote = b.quotable("src/billing/quota/settings.py")
    pad()
    b.edit("src/billing/quota/settings.py", quote, f"    bucket = {FIX.text}",
           f"The KeyError comes from a missing default; fix: `{FIX.text}`.", FIX)
    b.bash("pytest -q -p no:cacheprovider tests/", pytest_log(2, None, f"{NUM.text} over 12000 "
           "refills (budget 5000 ms)"), "Re-running the suite with timings.", NUM)
    b.write("scratch/repro_double_charge.py", "from billing.quota import refill\n"
            "refill.run(tenant='t-42', retries=3)\n", "A scratch reproduction.")
    pad()
    b.bash("python scratch/repro_double_charge.py", "charged twice: t-42 (refill epoch 7)\n",
           f"Decision: {DEC.text}.", DEC)
    b.user(f"Before you finish: {TODO.text}.", TODO)
    b.bash(DELETED.text, "", "The reproduction is no longer needed.", DELETED)
    pad()
    b.read("src/billing/ledger.py", "Reading the ledger.", IDENT2)
    ledger_quote = b.quotable("src/billing/ledger.py")
    pad()
    pad()
    b.user(f"And {C2.text}: other teams import it.", C2)
    b.edit("src/billing/ledger.py", ledger_quote,
           "    return self._post(entry, idempotency_key=key)  # idempotent refills",
           "Making post_entry idempotent.",
           edited("src/billing/ledger.py", "idempotency_key=key)  # idempotent refills"))
    pad()
    b.user(f"Please {REQ.text}.", REQ)
    b.bash("ls deploy/cron", f"{PATH2.text}\ndeploy/cron/nightly-billing.service\n", "", PATH2)
    b.bash("python -m billing.stats --shards", f"{NUM2.text}, 3 replicas each\n", "", NUM2)
    pad()
    b.user(f"One more: {PREF2.text}.", PREF2)
    b.write("scratch/bench_refill.sh", "#!/bin/sh\nfor i in 1 2 3; do billing-cli refill; done\n")
    b.bash("sh scratch/bench_refill.sh", pytest_log(3, ERR2.text), "Benchmarking the refill.",
           ERR2)
    pad()
    b.read("src/billing/cache.py")
    cache_quote = b.quotable("src/billing/cache.py")
    b.edit("src/billing/cache.py", cache_quote, "    return None  # no in-process bucket cache",
           f"Fix: {FIX2.text}. Decision: {DEC2.text}.", FIX2, DEC2,
           edited("src/billing/cache.py", "return None  # no in-process bucket cache"))
    b.bash(DELETED2.text, "", "", DELETED2)
    pad()
    pad()
    # Late edits of files read long ago: is the quoted line still in front of the model?
    for path in ("src/billing/cli.py", "src/billing/export.py"):
        if any(s.kind == "read" and s.path == path for s in b.steps):
            b.edit(path, b.quotable(path), f"    pass  # edited late: {path}", "")
        pad()
    b.user("Wrap up: summarize what changed.")
    return Script(tuple(b.steps), tuple(b.versions))


# --- wire formats ----------------------------------------------------------------------------

def _numbered(text: str, sep: str) -> str:
    return "\n".join(f"{i:6}{sep}{ln}" for i, ln in enumerate(text.splitlines(), 1))


def _call(fmt: Fmt, step: Step) -> tuple[str, dict[str, Any], str]:
    """The tool name, its arguments and its result, as the format's agent would have them."""
    if fmt == "responses":  # Codex: a shell for everything but edits, apply_patch for those
        if step.kind == "read":
            return ("shell", {"command": ["bash", "-lc", f"sed -n '1,2000p' {step.path}"],
                              "workdir": "/repo"}, step.output)
        if step.kind == "bash":
            return "shell", {"command": ["bash", "-lc", step.command], "workdir": "/repo"}, step.output
        if step.kind == "edit":
            patch = (f"*** Begin Patch\n*** Update File: {step.path}\n@@\n-{step.old}\n"
                     f"+{step.new}\n*** End Patch\n")
            return "apply_patch", {"input": patch}, f"Success. Updated the following files:\nM {step.path}\n"
        patch = f"*** Begin Patch\n*** Add File: {step.path}\n" + "".join(
            f"+{ln}\n" for ln in step.new.splitlines()) + "*** End Patch\n"
        return "apply_patch", {"input": patch}, f"Success. Updated the following files:\nA {step.path}\n"
    claude = fmt == "messages"
    if step.kind == "read":
        return ("Read" if claude else "read_file", {"file_path": "/repo/" + step.path},
                _numbered(step.output, "\u2192" if claude else "\t"))
    if step.kind == "bash":
        args = {"command": step.command, "description": "run"} if claude else {"command": step.command}
        return "Bash" if claude else "bash", args, step.output or "(no output)"
    if step.kind == "edit":
        return ("Edit" if claude else "edit_file", {"file_path": "/repo/" + step.path,
                "old_string": step.old, "new_string": step.new}, step.output)
    return ("Write" if claude else "write_file", {"file_path": "/repo/" + step.path,
            "content": step.new}, step.output)


def _user(fmt: Fmt, text: str) -> dict[str, Any]:
    if fmt == "responses":
        return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    if fmt == "messages":
        return {"role": "user", "content": [{"type": "text", "text": text}]}
    return {"role": "user", "content": text}


def _assistant_text(fmt: Fmt, text: str) -> dict[str, Any]:
    if fmt == "responses":
        return {"type": "message", "role": "assistant", "id": f"msg_{_digest(text):x}",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}
    if fmt == "messages":
        return {"role": "assistant", "content": [{"type": "text", "text": text}]}
    return {"role": "assistant", "content": text}


def render_step(fmt: Fmt, n: int, step: Step, first: bool) -> list[dict[str, Any]]:
    """The history items one step adds."""
    if step.kind == "user":
        lead = [] if first else [_assistant_text(fmt, "Done; anything else?")]
        return [*lead, _user(fmt, step.text)]
    name, args, result = _call(fmt, step)
    cid = f"call_{n:03d}"
    if fmt == "chat":
        return [{"role": "assistant", "content": step.text or None, "tool_calls": [
                    {"id": cid, "type": "function",
                     "function": {"name": name, "arguments": orjson.dumps(args).decode()}}]},
                {"role": "tool", "tool_call_id": cid, "content": result}]
    if fmt == "responses":
        items: list[dict[str, Any]] = [{"type": "reasoning", "id": f"rs_{n:03d}", "summary": [],
                                        "encrypted_content": f"gAAAA-opaque-{n}"}]
        if step.text:
            items.append(_assistant_text(fmt, step.text))
        return [*items, {"type": "function_call", "id": f"fc_{n:03d}", "call_id": cid,
                         "name": name, "arguments": orjson.dumps(args).decode(),
                         "status": "completed"},
                {"type": "function_call_output", "call_id": cid, "output": result}]
    blocks: list[dict[str, Any]] = [{"type": "thinking", "thinking": f"Step {n}: next action.",
                                     "signature": f"sig-{n}"}]
    if step.text:
        blocks.append({"type": "text", "text": step.text})
    blocks.append({"type": "tool_use", "id": f"toolu_{n:03d}", "name": name, "input": args})
    return [{"role": "assistant", "content": blocks},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{n:03d}",
                                          "content": result}]}]


def _tools(fmt: Fmt) -> list[dict[str, Any]]:
    names = {"chat": ("read_file", "bash", "edit_file", "write_file"),
             "responses": ("shell", "apply_patch"),
             "messages": ("Read", "Bash", "Edit", "Write")}[fmt]
    schema = {"type": "object", "properties": {}, "additionalProperties": True}
    if fmt == "chat":
        return [{"type": "function", "function": {"name": n, "description": n,
                                                  "parameters": schema}} for n in names]
    if fmt == "responses":
        return [{"type": "function", "name": n, "description": n, "parameters": schema,
                 "strict": False} for n in names]
    return [{"name": n, "description": n, "input_schema": schema} for n in names]


def request_body(fmt: Fmt, history: list[dict[str, Any]]) -> dict[str, Any]:
    model = MODELS[fmt]
    if fmt == "chat":
        return {"model": model, "messages": [{"role": "system", "content": SYSTEM}, *history],
                "tools": _tools(fmt)}
    if fmt == "responses":
        return {"model": model, "instructions": SYSTEM, "input": history, "tools": _tools(fmt),
                "store": False, "include": ["reasoning.encrypted_content"]}
    # Claude Code's moving cache marker: on the last block of the last message.
    last = history[-1]
    marked = [*history[:-1], {**last, "content": [
        *last["content"][:-1], {**last["content"][-1], "cache_control": {"type": "ephemeral"}}]}]
    return {"model": model, "max_tokens": 8192,
            "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
            "messages": marked, "tools": _tools(fmt)}


# --- the summarizer --------------------------------------------------------------------------

def _prompt_text(body: Mapping[str, Any]) -> str:
    msgs = body.get("messages") or []
    content = msgs[-1].get("content") if msgs else ""
    if isinstance(content, list):
        content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


def _between(text: str, tag: str) -> str:
    start = text.find(f"<{tag}>")
    end = text.rfind(f"</{tag}>")
    return text[start + len(tag) + 2 : end] if 0 <= start < end else ""


def weak_summary(body: Mapping[str, Any], budget_chars: int = 6000) -> str:
    """A weak model's summary: the required sections, holding half of the items it is given
    (the previous summary's bullets and the transcript's lines, each kept or dropped by a hash
    of its text), the kept previous bullets first, cut at ``budget_chars``. An item that
    survives one compaction is tossed again at the next: what it keeps decays as a weak model's
    summary does."""
    prompt = _prompt_text(body)
    prev = [ln.strip()[2:] for ln in _between(prompt, "previous_summary").splitlines()
            if ln.strip().startswith("- ")]
    new = []
    for ln in _between(prompt, "transcript").splitlines():
        ln = ln.strip()
        if ln and not re.fullmatch(r"\[\d+\] [A-Z ()\w]+:", ln) and not ln.startswith("[..."):
            new.append(ln[:200])
    kept: list[str] = []
    size = 0
    for item in [*prev, *new]:
        if _digest(item) % 2 or item in kept:
            continue
        if size + len(item) > budget_chars:
            break
        kept.append(item)
        size += len(item) + 3
    bullets = "\n".join(f"- {k}" for k in kept) or "None"
    out = []
    for heading in SECTIONS:
        body_text = bullets if heading == "## Critical Context" else (
            "- Continue the task." if heading == "## Goal" else "None")
        if heading == "## Progress":
            out.append(heading)
            continue
        out += [heading, body_text]
    return "\n".join(out) + "\n"


def responder(mode: str) -> Any:
    """The fake's responder for ``mode``: agent requests answered "ok"; summarizer calls failed
    (``fallback``) or answered by :func:`weak_summary` (``weak``)."""

    def answer(body: dict[str, Any]) -> Reply:
        if SUMMARIZER_MARK in orjson.dumps(body.get("system") or body.get("messages", [])[:1]):
            if mode == "fallback":
                return Reply.error(500, "the summarizer is down (fidelity bench)")
            return Reply(content=weak_summary(body))
        return Reply(content="ok")

    return answer


# --- locating canaries -----------------------------------------------------------------------

_NOTICE_CALL: Final = re.compile(
    r"call `([\w.-]+)` with (\w+)=(\S+) (\w+)=(\d+)(?: (\w+)=(\d+))? to read more")
_DIALOG_CALL: Final = re.compile(
    r"call `([\w.-]+)` with file_path=(\S+) and a start_line near the end \(e\.g\. start_line=(\d+)\)")


def _leaves(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)


def conversation(body: Mapping[str, Any]) -> list[Any]:
    return list(body.get("messages") or body.get("input") or [])


def split_body(body: Mapping[str, Any]) -> tuple[str, str]:
    """(everything forwarded but the summary and the tool definitions, the summary)."""
    summary: list[str] = []
    context: list[str] = []
    for key, value in body.items():
        if key in ("messages", "input"):
            # By text: in Messages the summary is a block of the first user turn, beside the
            # user's own text.
            for text in _leaves(value):
                (summary if text.startswith(SUMMARY_HEADING) else context).append(text)
        elif key != "tools":
            context.extend(_leaves(value))
    return "\n".join(context), "\n".join(summary)


@dataclass
class _Reader:
    tool: ReadTool
    identity: Identity
    script: Script
    cache: dict[tuple[str, int, int], str] = field(default_factory=dict)

    def pointed(self, text: str, step: int) -> list[str]:
        """What one call to each pointer in ``text`` returns."""
        out = []
        for m in _NOTICE_CALL.finditer(text):
            out.append(self.call(m[1], m[3], int(m[5]), int(m[7] or 0), step))
        for m in _DIALOG_CALL.finditer(text):
            out.append(self.call(m[1], m[2], int(m[3]), 0, step))
        return out

    def call(self, tool: str, path: str, line: int, byte: int, step: int) -> str:
        if tool != self.tool.name:  # the client's own read tool: the file as it is now
            text = self.script.file_at(path.removeprefix("/repo/"), step) or ""
            return "\n".join(text.splitlines()[line - 1 : line - 1 + CLIENT_READ_LINES])
        key = (path, line, byte)
        if key not in self.cache:
            self.cache[key] = self.tool.run(self.identity, orjson.dumps(
                {"file_path": path, "start_line": line, "start_byte": byte}).decode())
        return self.cache[key]


def locate(canary: Canary, context: str, summary: str, reads: Sequence[str]) -> Where:
    if canary.found(context):
        return "context"
    if canary.found(summary):
        return "summary"
    if any(canary.found(r) for r in reads):
        return "reachable"
    return "lost"


# --- replaying -------------------------------------------------------------------------------

def guard_supported() -> bool:
    """Whether this tree's config knows ``compaction.guard``."""
    return "guard" in CompactionConfig.model_fields


def proxy_config(upstream_url: str, data_dir: Path, window: int, guard: bool,
                 offload: Mapping[str, Any] | None = None) -> Config:
    """``offload``: settings of the offload section over its defaults (the file-aware
    switches, to measure them off and on: bench/file_sessions.py)."""
    compaction: dict[str, Any] = {"context_windows": {m: window for m in MODELS.values()}}
    if guard_supported():
        compaction["guard"] = {"enabled": guard}
    return config_from_mapping({
        "upstream": {"base_url": upstream_url},
        "anthropic": {"base_url": upstream_url.removesuffix("/v1")},
        "storage": {"data_dir": str(data_dir)},
        "compaction": compaction,
        "offload": dict(offload or {}),
    })


def _is_summarizer(raw: bytes) -> bool:
    return SUMMARIZER_MARK in raw


def _quote(fmt: Fmt, script: Script, n: int, old: str, forwarded: Mapping[str, Any]) -> EditQuote:
    leaves = list(_leaves(forwarded))
    if any(old in leaf for leaf in leaves):
        return EditQuote(n, old, True)
    path = script.steps[n].path
    read = max((i for i, s in enumerate(script.steps[:n]) if s.kind == "read" and s.path == path),
               default=-1)
    call_id = f"{'toolu' if fmt == 'messages' else 'call'}_{read:03d}"
    return EditQuote(n, old, False, "cut" if call_id in leaves else "evicted")


async def replay(
    fmt: Fmt, mode: str, *, fake: FakeUpstream, upstream_url: str, data_dir: Path,
    script: Script, window: int = 24_000, guard: bool = False, drop: frozenset[str] = frozenset(),
    offload: Mapping[str, Any] | None = None,
) -> Run:
    """Post ``script`` in ``fmt`` through a proxy in process (its data in ``data_dir``) in front
    of ``fake`` (at ``upstream_url``, ending in ``/v1``), the summarizer acting per ``mode``;
    the figures and checkpoints. ``drop``: canary texts the client never sends (its step's
    text and output have them blanked): the harness must then report them lost."""
    fake.responder = responder(mode)
    config = proxy_config(upstream_url, data_dir, window, guard, offload)
    session = f"fidelity-{fmt}-{mode}-{'guard' if guard else 'plain'}"
    identity = Identity(tenant_of(KEY), safe_name(session), KEY)
    headers = {"authorization": f"Bearer {KEY}", "x-api-key": KEY,
               "anthropic-version": "2023-06-01", "x-session-id": session}
    run = Run(fmt, mode, guard)
    history: list[dict[str, Any]] = []
    seen: list[str] = []
    previous: dict[str, Any] = {}
    first_summarizer = sum(1 for r in fake.received if _is_summarizer(r.body))
    async with InProcess(create_app(config)) as app:
        services = app.state["services"]
        reader = _Reader(ReadTool(config, services.originals, services.files), identity, script)
        for n, step in enumerate(script.steps):
            for text in drop:
                step = Step(step.kind, step.text.replace(text, "[redacted]"), step.path,
                            step.command.replace(text, "[redacted]"),
                            step.output.replace(text, "[redacted]"), step.old,
                            step.new.replace(text, "[redacted]"), step.canaries)
            if step.kind == "edit" and previous:
                run.quotes.append(_quote(fmt, script, n, step.old, previous))
            history += render_step(fmt, n, step, first=n == 0)
            body = request_body(fmt, history)
            before = len(fake.received)
            r = await app.client.post(PATHS[fmt], content=orjson.dumps(body), headers=headers,
                                      timeout=120)
            if r.status_code != 200:
                raise RuntimeError(f"{fmt} step {n}: {r.status_code} {r.text[:300]}")
            forwarded = [rec for rec in fake.received[before:]
                         if rec.path == PATHS[fmt] and not _is_summarizer(rec.body)]
            previous = forwarded[-1].json()
            context, summary = split_body(previous)
            last = n == len(script.steps) - 1
            new_summary = bool(summary) and (not seen or seen[-1] != summary)
            if new_summary:
                seen.append(summary)
            if not (new_summary or last):
                continue
            await app.drain()  # the dialog archive is written after the response
            planted = tuple(c for s in script.steps[: n + 1] for c in s.canaries)
            run.checkpoints.append(Checkpoint(fmt, n, body, previous, planted, len(seen)))
            reads = reader.pointed(context + "\n" + summary, n)
            for c in planted:
                run.outcomes.append(Outcome(c, n, len(seen), locate(c, context, summary, reads),
                                            last))
    run.compactions = len(seen)
    run.summarizer_calls = sum(1 for r in fake.received if _is_summarizer(r.body)) - first_summarizer
    return run


async def replay_all(
    script: Script, *, formats: Sequence[Fmt] = FORMATS, modes: Sequence[str] = MODES,
    guards: Sequence[bool] = (False,), window: int = 24_000,
    offload: Mapping[str, Any] | None = None,
) -> list[Run]:
    """Every (guard, mode, format) replay of ``script``, each on a fresh proxy with its own data
    dir, in front of one fake upstream on loopback. Where the tree has no guard, ``guards`` is
    cut to its first setting (both would replay the same proxy)."""
    if not guard_supported():
        guards = guards[:1]
    runs: list[Run] = []
    fake = FakeUpstream(models=tuple(MODELS.values()))
    with serve_in_thread(fake) as upstream, tempfile.TemporaryDirectory() as tmp:
        for guard in guards:
            for mode in modes:
                for fmt in formats:
                    runs.append(await replay(
                        fmt, mode, fake=fake, upstream_url=upstream.url + "/v1",
                        data_dir=Path(tmp) / f"{fmt}-{mode}-{guard}", script=script,
                        window=window, guard=guard, offload=offload))
    return runs
