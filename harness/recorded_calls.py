"""Record the file tool calls real agent CLIs send: the fixtures of the provenance tests
(``tests/fixtures/provenance/``, read by ``tests/test_files_provenance.py``).

Each CLI (the versions pinned in package.json) runs one headless session straight against the
fake upstream (no proxy: what is recorded is what the client itself sends). The fake plays a
model that asks for a scripted list of tool calls, one a turn, on files seeded in a fixed work
directory; each CLI executes them for real and sends them back, with their results, in its next
request. The fixture is that last request's conversation from the first tool call on, exactly
as the CLI sent it (its system prompt, tool schemas and opening user message left out: they
are large and say nothing about the calls), plus the CLI's version and, for each tool used,
its parameter names as the CLI declared them.

Run ``python -m harness.recorded_calls tests/fixtures/provenance`` to record them again
(needs ``npm ci``; the work directories are under ``/tmp/ctxproxy-recording``).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from harness.claude_code import claude_binary, run_claude
from harness.codex import codex_binary, run_codex, write_codex_home
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.servers import serve_in_thread

__all__ = ["CLAUDE_WORK", "CODEX_WORK", "Script", "claude_calls", "codex_calls", "main",
           "record_claude", "record_codex"]

ROOT = Path("/tmp/ctxproxy-recording")
CLAUDE_WORK = ROOT / "claude"
CODEX_WORK = ROOT / "codex"
CLAUDE_MODEL = "claude-sonnet-4-5"
CODEX_MODEL = "gpt-5.5"  # one whose bundled metadata gives Codex its apply_patch tool
FINAL = "Recorded."
PROMPT = "Work on the files."

APP = "".join(f"def f{i}():\n    return {i}\n" for i in range(1, 6))  # ten lines
NOTES = "".join(f"note {i}\n" for i in range(1, 6))
NOTEBOOK = json.dumps({
    "cells": [{"cell_type": "code", "id": "c1", "metadata": {}, "execution_count": None,
               "outputs": [], "source": ["print(1)\n"]}],
    "metadata": {}, "nbformat": 4, "nbformat_minor": 5,
}, indent=1) + "\n"
SEED = {"src/app.py": APP, "notes.txt": NOTES, "old.txt": "old line\n", "gone.txt": "bye\n",
        "data.ipynb": NOTEBOOK}


def claude_calls(work: Path) -> list[dict[str, Any]]:
    """What the fake asks Claude Code for, in order (``Read`` and the editing tools take
    absolute paths; ``NotebookEdit`` is a deferred tool, loaded with ``ToolSearch`` first)."""
    app, w = str(work / "src/app.py"), str(work)
    return [
        {"name": "Read", "arguments": {"file_path": app}},
        {"name": "Read", "arguments": {"file_path": app, "offset": 3, "limit": 2}},
        {"name": "Read", "arguments": {"file_path": w + "/notes.txt", "offset": 4}},
        {"name": "Edit", "arguments": {"file_path": app, "old_string": "def f2():\n    return 2",
                                       "new_string": "def f2():\n    return 22"}},
        {"name": "Edit", "arguments": {"file_path": app, "old_string": "return 5",
                                       "new_string": "return 55", "replace_all": True}},
        {"name": "Write", "arguments": {"file_path": w + "/src/new.py",
                                        "content": "print('new')\n"}},
        {"name": "Bash", "arguments": {
            "command": "sed -n '2,4p' src/app.py && cat -n notes.txt | head -n 3",
            "description": "Show parts of two files"}},
        {"name": "Bash", "arguments": {
            "command": "head -n 2 src/app.py; tail -n 1 notes.txt\nnl -ba src/app.py | sed -n "
                       "'5,7p'", "description": "Show file heads and tails"}},
        {"name": "Bash", "arguments": {
            "command": "echo extra >> notes.txt && printf 'a\\n' > out.txt && mv out.txt "
                       "moved.txt && cp moved.txt copy.txt && rm -f gone.txt && touch empty.txt "
                       "&& sed -i 's/note 1/note one/' notes.txt && echo x | tee -a log.txt",
            "description": "Change files from the shell"}},
        {"name": "Read", "arguments": {"file_path": w + "/data.ipynb"}},
        {"name": "ToolSearch", "arguments": {"query": "select:NotebookEdit"}},
        {"name": "NotebookEdit", "arguments": {"notebook_path": w + "/data.ipynb",
                                               "cell_id": "c1", "new_source": "print(2)",
                                               "edit_mode": "replace"}},
    ]


PATCH = """*** Begin Patch
*** Update File: src/app.py
@@ def f2():
-    return 2
+    return 22
*** Add File: src/new.py
+print('new')
*** Delete File: gone.txt
*** Update File: old.txt
*** Move to: renamed.txt
@@
-old line
+new line
*** End Patch
"""
HEREDOC = """apply_patch <<'EOF'
*** Begin Patch
*** Update File: notes.txt
@@
 note 1
-note 2
+note two
 note 3
*** End Patch
EOF
"""


def codex_calls(work: Path) -> list[dict[str, Any]]:
    """What the fake asks Codex for, in order: shell reads through ``exec_command`` (with and
    without ``workdir``), ``apply_patch`` as its custom tool and as a shell heredoc, shell
    writes."""
    def run(cmd: str, workdir: str | None = None) -> dict[str, Any]:
        args: dict[str, Any] = {"cmd": cmd, "yield_time_ms": 10_000}
        if workdir is not None:
            args["workdir"] = workdir
        return {"name": "exec_command", "arguments": args}

    return [
        run("sed -n '2,4p' src/app.py"),
        run("nl -ba app.py | sed -n '1,3p'", str(work / "src")),
        run("cat notes.txt && head -n 2 src/app.py; tail -n 1 notes.txt", str(work)),
        {"name": "apply_patch", "type": "custom", "arguments": PATCH},
        run(HEREDOC, str(work)),
        run("printf 'x\\n' > out.txt && echo more >> notes.txt && mv out.txt moved.txt && "
            "rm moved.txt && touch t.txt && sed -i 's/note/NOTE/' notes.txt && "
            "cp notes.txt copy.txt"),
    ]


@dataclass
class Script:
    """The fake model: the next of ``calls`` after the newest result the client sent back
    (call ids ``<prefix><n>``), then a final text. Requests without tools (a client's side
    requests) get a short text."""

    calls: Sequence[Mapping[str, Any]]
    prefix: str
    answered: list[dict[str, Any]] = field(default_factory=list)  # the final answer's requests

    def step(self, body: Mapping[str, Any]) -> int:
        text = orjson.dumps(body.get("messages", body.get("input"))).decode()
        done = [int(n) for n in re.findall(re.escape(self.prefix) + r"(\d+)", text)]
        return max(done, default=-1) + 1

    def __call__(self, body: dict[str, Any]) -> Reply:
        if not body.get("tools"):
            return Reply(content="ok")
        n = self.step(body)
        if n >= len(self.calls):
            self.answered.append(body)
            return Reply(content=FINAL)
        call = {**self.calls[n], "id": f"{self.prefix}{n}"}
        return Reply(content=None, reasoning=f"step {n}", tool_calls=[call])


def _seed(work: Path) -> None:
    shutil.rmtree(work, ignore_errors=True)
    for name, text in SEED.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(text)


def _tools(body: Mapping[str, Any], used: set[str]) -> dict[str, list[str]]:
    """tool name -> its parameter names, for the tools the session used."""
    out: dict[str, list[str]] = {}
    for tool in body.get("tools") or ():
        name = tool.get("name")
        if name in used:
            schema = tool.get("input_schema") or tool.get("parameters") or {}
            out[name] = sorted(schema.get("properties", {})) if isinstance(schema, dict) else []
    return out


def _package_version(root: Path, package: str) -> str:
    meta = json.loads((root / "node_modules" / package / "package.json").read_text())
    return str(meta["version"])


def _session(
    work: Path, calls: Sequence[Mapping[str, Any]], prefix: str,
    run: Callable[[str, Path], int],
) -> tuple[dict[str, Any], Script]:
    """``run(fake's url, a fresh home)`` against the fake playing ``calls`` in ``work`` (seeded
    anew): the request the final answer went to, and the script."""
    _seed(work)
    script = Script(calls, prefix)
    fake = FakeUpstream()
    fake.responder = script
    with serve_in_thread(fake) as srv, tempfile.TemporaryDirectory() as home:
        code = run(srv.url, Path(home))
    if code != 0 or not script.answered:
        raise RuntimeError(f"the session did not finish (exit {code})")
    return script.answered[-1], script


def _fixture(
    root: Path, package: str, work: Path, body: Mapping[str, Any], script: Script,
    conversation: dict[str, Any],
) -> dict[str, Any]:
    return {"cli": package, "version": _package_version(root, package), "workdir": str(work),
            "tools": _tools(body, {str(c["name"]) for c in script.calls}), "body": conversation}


def record_claude(root: Path, out: Path) -> Path:
    """Claude Code's session, saved as ``out/claude_code.json``."""
    binary = claude_binary(root)
    if binary is None:
        raise RuntimeError("Claude Code is not installed (npm ci)")

    def run(url: str, home: Path) -> int:
        return run_claude(binary, CLAUDE_WORK, home, url, PROMPT, model=CLAUDE_MODEL).returncode

    body, script = _session(CLAUDE_WORK, claude_calls(CLAUDE_WORK), "toolu_rec_", run)
    messages = body["messages"]
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    conversation = {"model": body["model"], "max_tokens": body.get("max_tokens", 1024),
                    "messages": [{"role": "user", "content": PROMPT}, *messages[first:]]}
    return _write(out / "claude_code.json", _fixture(
        root, "@anthropic-ai/claude-code", CLAUDE_WORK, body, script, conversation))


def record_codex(root: Path, out: Path) -> Path:
    """Codex's session, saved as ``out/codex.json``."""
    binary = codex_binary()
    if binary is None:
        raise RuntimeError("Codex is not installed (npm ci)")

    def run(url: str, home: Path) -> int:
        write_codex_home(home, url, CODEX_MODEL, websockets=False)
        return run_codex(binary, home, CODEX_WORK, PROMPT).returncode

    body, script = _session(CODEX_WORK, codex_calls(CODEX_WORK), "call_rec_", run)
    items = body["input"]
    first = next(i for i, item in enumerate(items) if item.get("call_id"))
    prompt = {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": PROMPT}]}
    conversation = {"model": body["model"], "input": [prompt, *items[first:]]}
    return _write(out / "codex.json", _fixture(
        root, "@openai/codex", CODEX_WORK, body, script, conversation))


def _write(path: Path, fixture: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(fixture, option=orjson.OPT_INDENT_2) + b"\n")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0]) if args else Path("tests/fixtures/provenance")
    root = Path(__file__).resolve().parents[1]
    record_claude(root, out)
    record_codex(root, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
