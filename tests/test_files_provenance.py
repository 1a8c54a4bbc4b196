"""File provenance (proxy.filewise.provenance): which calls read which lines of which file, and which
wrote, edited, moved or deleted it, for every client's tools.

The Claude Code and Codex shapes are RECORDED: ``tests/fixtures/provenance/claude_code.json``
(``@anthropic-ai/claude-code`` 2.1.332) and ``codex.json`` (``@openai/codex`` 0.171.0, model
``gpt-5.5``: the one whose bundled metadata gives it the ``apply_patch`` custom tool), the
versions pinned in package.json. Each CLI ran headless straight against the fake upstream
(``python -m harness.recorded_calls tests/fixtures/provenance``: the fake asks for a
scripted list of tool calls on files seeded in ``/tmp/ctxproxy-recording/<cli>``, the CLI runs
them for real); a fixture is the conversation of the CLI's last request from the first tool
call on, exactly as the CLI sent it, read here with the format's own reader. The Responses
items Codex does not send (``apply_patch_call``, ``local_shell_call``, ``shell_call``) and the
chat clients' tools are written after the API's and the tools' documented shapes.
"""

from __future__ import annotations

import copy
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.config import config_from_mapping
from proxy.config.offload import ReadTool
from proxy.filewise.calls import WHOLE, FileEdit, FileRead, LineRange
from proxy.filewise.provenance import Provenance, call_files, provenance, same_file
from proxy.filewise.shell import shell_reads
from proxy.formats.messages.request import MESSAGES
from proxy.formats.responses.request import RESPONSES
from proxy.model import Message

from .conftest import examples

FIXTURES = Path(__file__).parent / "fixtures" / "provenance"
TOOLS = config_from_mapping({}).offload.read_tools


def fixture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = orjson.loads((FIXTURES / name).read_bytes())
    return data


def lines(start: int = 1, end: int | None = None, tail: int | None = None) -> LineRange:
    return LineRange(start, end, tail)


def summary(prov: Provenance) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """(call id, path, lines) of each read and (call id, kind, path, quotes, to) of each edit."""
    return ([(r.call_id, r.path, r.lines) for r in prov.reads],
            [(e.call_id, e.kind, e.path, e.quotes, e.to) for e in prov.edits])


def result_of(history: list[Message], call_id: str) -> int:
    return next(i for i, m in enumerate(history) if m.get("tool_call_id") == call_id)


def text_of(message: Message) -> str:
    content = message["content"]
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def numbers(text: str) -> list[int]:
    """The line numbers a ``cat -n``-style result shows (Claude Code: ``3\\tdef f2():``)."""
    return [int(m[1]) for m in re.finditer(r"^\s*(\d+)\t", text, re.M)]


# -- recorded: Claude Code -----------------------------------------------------------------


def test_claude_code_recorded_calls() -> None:
    rec = fixture("claude_code.json")
    assert rec["cli"] == "@anthropic-ai/claude-code" and rec["version"] == "2.1.332"
    # The tools as this version declares them: Read takes offset and limit; no MultiEdit.
    assert {"file_path", "offset", "limit"} <= set(rec["tools"]["Read"])
    assert set(rec["tools"]["Edit"]) >= {"file_path", "old_string", "new_string", "replace_all"}
    w = rec["workdir"]
    history = MESSAGES.parse(orjson.dumps(rec["body"]), 10_000).history
    prov = provenance(history, TOOLS)
    reads, edits = summary(prov)
    app, notes = f"{w}/src/app.py", f"{w}/notes.txt"
    assert reads == [
        ("toolu_rec_0", app, WHOLE),
        ("toolu_rec_1", app, lines(3, 4)),  # offset 3, limit 2
        ("toolu_rec_2", notes, lines(4)),  # offset 4, no limit: to the end
        # Bash has no working directory: its relative paths stay relative.
        ("toolu_rec_6", "src/app.py", lines(2, 4)),
        ("toolu_rec_6", "notes.txt", lines(1, 3)),  # cat -n notes.txt | head -n 3
        ("toolu_rec_7", "src/app.py", lines(1, 2)),
        ("toolu_rec_7", "notes.txt", lines(tail=1)),
        ("toolu_rec_7", "src/app.py", lines(5, 7)),  # nl -ba src/app.py | sed -n '5,7p'
        ("toolu_rec_9", f"{w}/data.ipynb", WHOLE),
    ]
    assert edits == [
        ("toolu_rec_3", "edit", app, ("def f2():\n    return 2",), None),
        ("toolu_rec_4", "edit", app, ("return 5",), None),  # replace_all: true
        ("toolu_rec_5", "write", f"{w}/src/new.py", (), None),
        ("toolu_rec_8", "edit", "notes.txt", (), None),  # echo extra >> notes.txt
        ("toolu_rec_8", "write", "out.txt", (), None),
        ("toolu_rec_8", "move", "out.txt", (), "moved.txt"),
        ("toolu_rec_8", "write", "moved.txt", (), None),
        ("toolu_rec_8", "write", "copy.txt", (), None),  # cp moved.txt copy.txt
        ("toolu_rec_8", "delete", "gone.txt", (), None),  # rm -f
        ("toolu_rec_8", "touch", "empty.txt", (), None),
        ("toolu_rec_8", "edit", "notes.txt", (), None),  # sed -i
        ("toolu_rec_8", "edit", "log.txt", (), None),  # tee -a
        ("toolu_rec_11", "edit", f"{w}/data.ipynb", (), None),  # NotebookEdit
    ]
    # Each read points at its own result, and Read's offset is 1-based: the result shows
    # exactly the lines the range says.
    for r in prov.reads:
        assert r.result_index == result_of(history, r.call_id)
        assert history[r.call_index]["tool_calls"][0]["id"] == r.call_id
    shown = {r.call_id: numbers(text_of(history[r.result_index or 0])) for r in prov.reads
             if r.tool == "Read" and r.path == app}
    assert shown == {"toolu_rec_0": list(range(1, 11)), "toolu_rec_1": [3, 4]}
    assert numbers(text_of(history[result_of(history, "toolu_rec_2")])) == [4, 5]
    assert prov.reads_of(result_of(history, "toolu_rec_7")) == prov.by_call["toolu_rec_7"]
    assert same_file("src/app.py", app) and same_file(app, "src/app.py")


# -- recorded: Codex -----------------------------------------------------------------------


def test_codex_recorded_calls() -> None:
    rec = fixture("codex.json")
    assert rec["cli"] == "@openai/codex" and rec["version"] == "0.171.0"
    assert "workdir" in rec["tools"]["exec_command"] and "apply_patch" in rec["tools"]
    w = rec["workdir"]
    items = rec["body"]["input"]
    kinds = {i["call_id"]: i["type"] for i in items if i.get("type", "").endswith("call")}
    assert kinds["call_rec_3"] == "custom_tool_call"  # apply_patch, its raw patch the input
    assert kinds["call_rec_4"] == "function_call"  # exec_command with an apply_patch heredoc
    history = RESPONSES.parse(orjson.dumps(rec["body"]), 10_000).history
    prov = provenance(history, TOOLS)
    reads, edits = summary(prov)
    assert reads == [
        ("call_rec_0", "src/app.py", lines(2, 4)),  # no workdir: relative to Codex's cwd
        ("call_rec_1", f"{w}/src/app.py", lines(1, 3)),  # nl -ba app.py | sed -n '1,3p'
        ("call_rec_2", f"{w}/notes.txt", WHOLE),
        ("call_rec_2", f"{w}/src/app.py", lines(1, 2)),
        ("call_rec_2", f"{w}/notes.txt", lines(tail=1)),
    ]
    assert edits == [
        ("call_rec_3", "edit", "src/app.py", ("    return 2",), None),
        ("call_rec_3", "write", "src/new.py", (), None),
        ("call_rec_3", "delete", "gone.txt", (), None),
        ("call_rec_3", "edit", "old.txt", ("old line",), None),
        ("call_rec_3", "move", "old.txt", (), "renamed.txt"),
        ("call_rec_3", "edit", "renamed.txt", (), None),
        ("call_rec_4", "edit", f"{w}/notes.txt", ("note 1\nnote 2\nnote 3",), None),
        ("call_rec_5", "write", "out.txt", (), None),
        ("call_rec_5", "edit", "notes.txt", (), None),
        ("call_rec_5", "move", "out.txt", (), "moved.txt"),
        ("call_rec_5", "write", "moved.txt", (), None),
        ("call_rec_5", "delete", "moved.txt", (), None),
        ("call_rec_5", "touch", "t.txt", (), None),
        ("call_rec_5", "edit", "notes.txt", (), None),
        ("call_rec_5", "write", "copy.txt", (), None),
    ]
    for r in prov.reads:
        assert r.result_index == result_of(history, r.call_id)
    # What the edits quote is what the reads showed, byte for byte.
    shown = {r.call_id: text_of(history[r.result_index or 0]) for r in prov.reads}
    assert "    return 2" in shown["call_rec_0"]
    assert "note 1\nnote 2\nnote 3" in shown["call_rec_2"]
    assert same_file("src/app.py", f"{w}/src/app.py")


# -- the tools, shape by shape -------------------------------------------------------------


def chat(*calls: tuple[str, str, Any], answered: bool = True) -> list[Message]:
    """One assistant message making ``calls`` (id, name, arguments: a dict as JSON, a string
    as it is), then their results."""
    out: list[Message] = [{"role": "user", "content": "go"}, {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {
                "name": name, "arguments": args if isinstance(args, str)
                else orjson.dumps(args).decode()}}
            for cid, name, args in calls]}]
    if answered:
        out += [{"role": "tool", "tool_call_id": cid, "content": "ok"} for cid, _, _ in calls]
    return out


def one(name: str, args: Any, tools: dict[str, ReadTool] | None = None) -> Provenance:
    return provenance(chat(("c", name, args)), TOOLS if tools is None else tools)


@pytest.mark.parametrize(("name", "args", "path", "expected"), [
    ("Read", {"file_path": "/r/a.py"}, "/r/a.py", WHOLE),
    ("Read", {"file_path": "/r/a.py", "offset": 10, "limit": 5}, "/r/a.py", lines(10, 14)),
    ("Read", {"file_path": "/r/a.py", "limit": 20}, "/r/a.py", lines(1, 20)),
    ("Read", {"file_path": "/r/a.py", "offset": 0}, "/r/a.py", WHOLE),
    ("Read", {"file_path": "/r/./x/../a.py"}, "/r/a.py", WHOLE),
    ("read_file", {"file_path": "a.py", "start_line": 5, "end_line": 9}, "a.py", lines(5, 9)),
    ("read_file", {"path": "b.py", "start_line": "7"}, "b.py", lines(7)),
    ("read_file", {"path": "b.py", "start_line": 7, "end_line": 3}, "b.py", lines(7)),
    ("mcp__fs__read_file", {"path": "/m.txt"}, "/m.txt", WHOLE),
    ("view", {"path": "v.py", "view_range": [3, 8]}, "v.py", lines(3, 8)),
    ("str_replace_based_edit_tool", {"command": "view", "path": "/e.py"}, "/e.py", WHOLE),
    ("str_replace_based_edit_tool", {"command": "view", "path": "/e.py", "view_range": [5, 9]},
     "/e.py", lines(5, 9)),
    ("str_replace_editor", {"command": "view", "path": "/e.py", "view_range": [5, -1]},
     "/e.py", lines(5)),
    ("Bash", {"command": "cat -n src/x.py", "description": "Show"}, "src/x.py", WHOLE),
    ("exec_command", {"cmd": "sed -n '40,80p' x.py", "workdir": "/repo"}, "/repo/x.py",
     lines(40, 80)),
    ("shell", {"command": ["bash", "-lc", "head -n 5 lib.py"], "workdir": "/w"}, "/w/lib.py",
     lines(1, 5)),
    ("shell", {"command": ["cat", "lib.py"]}, "lib.py", WHOLE),
    ("container.exec", {"cmd": ["sh", "-c", "tail -n 30 log.txt"], "workdir": "/c"},
     "/c/log.txt", lines(tail=30)),
    ("shell_command", {"command": "nl -ba a.rs | sed -n '10,20p'", "workdir": "/k"}, "/k/a.rs",
     lines(10, 20)),
])
def test_read_shapes(name: str, args: dict[str, Any], path: str, expected: LineRange) -> None:
    prov = one(name, args)
    assert [(r.path, r.lines, r.tool) for r in prov.reads] == [(path, expected, name)]
    assert prov.edits == ()


def test_configured_read_tools_and_their_arguments() -> None:
    tools = {"fetch_source": ReadTool(path_arg="target", line_arg="from")}
    assert summary(one("fetch_source", {"target": "/s/x.c", "from": 12}, tools))[0] == [
        ("c", "/s/x.c", lines(12))]
    assert summary(one("fetch_source", {"target": "/s/x.c", "from": 12, "limit": 3}, tools))[
        0] == [("c", "/s/x.c", lines(12, 14))]
    # Not configured: not a read (and Read/read_file are known whatever the config says).
    assert one("fetch_source", {"target": "/s/x.c"}).reads == ()
    assert one("Read", {"file_path": "/a"}, {}).reads[0].path == "/a"
    # A configured tool's own path argument wins over the usual names.
    own = {"Read": ReadTool(path_arg="p", line_arg="line")}
    assert summary(one("Read", {"p": "/x", "file_path": "/y", "line": 4}, own))[0] == [
        ("c", "/x", lines(4))]


PATCH = """*** Begin Patch
*** Update File: src/app.py
@@ def main():
 context one
-    return 1
+    return 2

@@ class B:
-    x = 1
+    x = 2
*** End of File
*** Add File: src/new.py
+print("new")
*** Delete File: old.py
*** Update File: src/a.py
*** Move to: src/b.py
@@
 keep
-drop
+add
*** End Patch
"""
PATCH_EDITS = [
    ("edit", "src/app.py", ("context one\n    return 1", "    x = 1"), None),
    ("write", "src/new.py", (), None),
    ("delete", "old.py", (), None),
    ("edit", "src/a.py", ("keep\ndrop",), None),
    ("move", "src/a.py", (), "src/b.py"),
    ("edit", "src/b.py", (), None),
]


@pytest.mark.parametrize(("name", "args", "base"), [
    ("apply_patch", PATCH, ""),  # Codex's custom tool: the patch is the raw input
    ("apply_patch", {"input": PATCH}, ""),  # as a JSON function (or Anthropic tool_use)
    ("apply_patch", {"patch": PATCH}, ""),
    ("exec_command", {"cmd": f"apply_patch <<'EOF'\n{PATCH}EOF\n", "workdir": "/repo"},
     "/repo/"),
    ("shell", {"command": ["apply_patch", PATCH], "workdir": "/w"}, "/w/"),
    ("shell", {"command": ["bash", "-lc", f"apply_patch <<'PATCH'\n{PATCH}PATCH"]}, ""),
])
def test_apply_patch_shapes(name: str, args: Any, base: str) -> None:
    edits = [(e.kind, e.path, e.quotes, e.to) for e in one(name, args).edits]
    assert edits == [(k, base + p, q, to if to is None else base + to)
                     for k, p, q, to in PATCH_EDITS]
    assert one(name, args).reads == ()  # the patched file is not read


def responses(*items: dict[str, Any]) -> list[Message]:
    body = {"model": "gpt-5.1-codex", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]},
        *items]}
    return RESPONSES.parse(orjson.dumps(body), 1000).history


def test_responses_items() -> None:
    history = responses(
        {"type": "apply_patch_call", "id": "apc_1", "call_id": "p1", "status": "completed",
         "operation": {"type": "update_file", "path": "src/x.py",
                       "diff": "@@ def f():\n-    return 1\n+    return 2\n"}},
        {"type": "apply_patch_call_output", "call_id": "p1", "output": "done"},
        {"type": "apply_patch_call", "id": "apc_2", "call_id": "p2", "status": "completed",
         "operation": {"type": "create_file", "path": "src/y.py", "diff": "+x\n"}},
        {"type": "apply_patch_call", "id": "apc_3", "call_id": "p3", "status": "completed",
         "operation": {"type": "delete_file", "path": "src/z.py"}},
        {"type": "local_shell_call", "id": "lsh_1", "call_id": "s1", "status": "completed",
         "action": {"type": "exec", "command": ["bash", "-lc", "sed -n '1,9p' a.py > b.py"],
                    "working_directory": "/w"}},
        {"type": "local_shell_call_output", "call_id": "s1", "output": ""},
        {"type": "shell_call", "id": "sh_1", "call_id": "s2", "status": "completed",
         "action": {"commands": ["cd sub", "head -n 3 c.py", "rm d.py"]}},
        {"type": "shell_call_output", "call_id": "s2", "output": []},
        {"type": "function_call", "id": "fc_1", "call_id": "f1", "name": "shell",
         "arguments": orjson.dumps({"command": ["cat", "e.py"], "workdir": "/w"}).decode()},
        {"type": "function_call_output", "call_id": "f1", "output": "e"},
    )
    reads, edits = summary(provenance(history, TOOLS))
    assert reads == [("s2", "sub/c.py", lines(1, 3)), ("f1", "/w/e.py", WHOLE)]
    assert edits == [
        ("p1", "edit", "src/x.py", ("    return 1",), None),
        ("p2", "write", "src/y.py", (), None),
        ("p3", "delete", "src/z.py", (), None),
        ("s1", "write", "/w/b.py", (), None),  # printed into a file: no read of a.py
        ("s2", "delete", "sub/d.py", (), None),
    ]


@pytest.mark.parametrize(("name", "args", "expected"), [
    # Claude Code (MultiEdit: older versions)
    ("Write", {"file_path": "/a.py", "content": "x"}, [("write", "/a.py", ())]),
    ("Edit", {"file_path": "/a.py", "old_string": "a\nb", "new_string": "c"},
     [("edit", "/a.py", ("a\nb",))]),
    ("MultiEdit", {"file_path": "/m.py", "edits": [
        {"old_string": "one", "new_string": "1"}, {"old_string": "two", "new_string": "2"}]},
     [("edit", "/m.py", ("one", "two"))]),
    ("NotebookEdit", {"notebook_path": "/n.ipynb", "new_source": "x"}, [("edit", "/n.ipynb", ())]),
    # chat clients
    ("write_file", {"path": "w.txt", "content": "x"}, [("write", "w.txt", ())]),
    ("create_file", {"file_path": "c.txt"}, [("write", "c.txt", ())]),
    ("edit_file", {"path": "e.py", "old_str": "x", "new_str": "y"}, [("edit", "e.py", ("x",))]),
    ("edit_file", {"path": "e.py", "edits": [{"oldText": "p", "newText": "q"}]},
     [("edit", "e.py", ("p",))]),
    ("str_replace", {"path": "s.py", "old_string": "o", "new_string": "n"},
     [("edit", "s.py", ("o",))]),
    ("delete_file", {"path": "d.py"}, [("delete", "d.py", ())]),
    ("mcp__filesystem__write_file", {"path": "/tmp/q"}, [("write", "/tmp/q", ())]),
    # the text-editor tool
    ("str_replace_based_edit_tool", {"command": "create", "path": "/c.py", "file_text": "x"},
     [("write", "/c.py", ())]),
    ("str_replace_based_edit_tool", {"command": "str_replace", "path": "/c.py",
                                     "old_str": "a", "new_str": "b"}, [("edit", "/c.py", ("a",))]),
    ("str_replace_editor", {"command": "insert", "path": "/c.py", "insert_line": 3,
                            "new_str": "b"}, [("edit", "/c.py", ())]),
    # not a file change
    ("Read", {"file_path": "/a.py"}, []),
    ("Grep", {"pattern": "x", "path": "/src"}, []),
    ("Write", {"content": "no path"}, []),
    ("Edit", "{not json", []),
])
def test_edit_shapes(name: str, args: Any, expected: list[tuple[str, str, tuple[str, ...]]]
                     ) -> None:
    assert [(e.kind, e.path, e.quotes) for e in one(name, args).edits] == expected


def test_moves() -> None:
    assert [(e.kind, e.path, e.to) for e in one("move_file", {"source": "a", "destination": "b"}
                                                ).edits] == [("move", "a", "b"), ("write", "b", None)]
    shell = one("exec_command", {"cmd": "git mv a.py b.py && mv -t dir x y", "workdir": "/r"})
    assert [(e.kind, e.path, e.to) for e in shell.edits] == [
        ("move", "/r/a.py", "/r/b.py"), ("write", "/r/b.py", None)]


@pytest.mark.parametrize(("script", "expected"), [
    ("cat src/app.py", [("src/app.py", WHOLE)]),
    ("cat a.py b.py", [("a.py", WHOLE), ("b.py", WHOLE)]),
    ("nl -ba src/x.rs", [("src/x.rs", WHOLE)]),
    ("sed -n '1,200p' src/app.py", [("src/app.py", lines(1, 200))]),
    ("sed -n 17p a.py", [("a.py", lines(17, 17))]),
    ("sed -n -e 10,20p a.py", [("a.py", lines(10, 20))]),
    ("sed -ne '5,$p' a.py", [("a.py", lines(5))]),
    ("sed -n '$p' a.py", [("a.py", lines(tail=1))]),
    ("sed -n '1,5p;40,45p' a.py", [("a.py", lines(1, 5)), ("a.py", lines(40, 45))]),
    ("sed -n '1,100p;50q' a.py", [("a.py", lines(1, 50))]),
    ("sed 30q a.py", [("a.py", lines(1, 30))]),
    ("head -n 50 a.py && tail -n 20 b.py", [("a.py", lines(1, 50)), ("b.py", lines(tail=20))]),
    ("head -5 a.py; head a.py", [("a.py", lines(1, 5)), ("a.py", lines(1, 10))]),
    ("head --lines=7 a.py", [("a.py", lines(1, 7))]),
    ("tail -n +40 a.py", [("a.py", lines(40))]),
    ("tail -n 3 a.py b.py", [("a.py", lines(tail=3)), ("b.py", lines(tail=3))]),
    # the first stage of a pipe, narrowed by the stages that select lines
    ("nl -ba src/x.rs | sed -n '80,120p'", [("src/x.rs", lines(80, 120))]),
    ("cat -n a.py | head -n 3", [("a.py", lines(1, 3))]),
    ("head -n 100 a.py | tail -n 20", [("a.py", lines(81, 100))]),
    ("sed -n '100,200p' a.py | head -n 10", [("a.py", lines(100, 109))]),
    ("cat a.py | tail -n 5", [("a.py", lines(tail=5))]),
    ("tail -n 20 a.py | tail -n 5 | cat", [("a.py", lines(tail=5))]),
    ("cat a.py 2>/dev/null | head", [("a.py", lines(1, 10))]),
    ("sed -n '10,20p' a.py | sed -n '2,3p'", [("a.py", lines(11, 12))]),
    ("cat a.py | tee copy.py", [("a.py", WHOLE)]),
    # chains, newlines, prefixes
    ("cd /repo && FOO=1 cat x.py\nsudo head -n 2 y.py", [("x.py", WHOLE), ("y.py", lines(1, 2))]),
    ("cat a.py || cat b.py & cat c.py", [("a.py", WHOLE), ("b.py", WHOLE), ("c.py", WHOLE)]),
    ("cat a.py 2>err.log", [("a.py", WHOLE)]),
    # not reads: other filters, the output into a file, byte counts, no file, not a reader
    ("cat a.py | grep foo", []),
    ("cat a.py | wc -l", []),
    ("cat a.py b.py | head -n 3", []),
    ("tail -n 5 a.py | head -n 2", []),
    ("cat a.py > b.py", []),
    ("cat a.py | head -n 3 > out.txt", []),
    ("head -c 100 a.py", []),
    ("head -n -5 a.py", []),
    ("tail -f log.txt", []),
    ("sed 's/a/b/' a.py", []),
    ("sed -n '/start/,/end/p' a.py", []),
    ("sed -n '1,5p' a.py b.py", []),
    ("sed -i 's/a/b/' a.py", []),
    ("cat > out.txt <<EOF\nbody\nEOF", []),
    ("cat 'unterminated", []),
    ("cat *.py $F", []),
    ("rg -n foo src; ls -la; grep -n x a.py", []),
    ("echo '*** Begin Patch' && cat a.py", []),
])
def test_shell_reads(script: str, expected: list[tuple[str, LineRange]]) -> None:
    assert shell_reads(script) == expected


def test_relative_paths_join_the_workdir_and_each_cd() -> None:
    prov = one("exec_command", {"cmd": "cat a.py && cd src && cat b.py; cd /abs && cat ../c.py"
                                       "; cd ~ && cat d.py", "workdir": "/repo"})
    assert [r.path for r in prov.reads] == ["/repo/a.py", "/repo/src/b.py", "/c.py", "d.py"]
    written = one("exec_command", {"cmd": "cd out && echo x > ./log.txt", "workdir": "/r/"})
    assert [e.path for e in written.edits] == ["/r/out/log.txt"]
    # Paths as written, for whoever wants them so (the compaction guard's ledger).
    raw = call_files("exec_command", orjson.dumps(
        {"cmd": "cd out && cat ./x.py > ./y.py", "workdir": "/r"}).decode(), resolve=False)
    assert [e.path for e in raw[1]] == ["./y.py"]


@pytest.mark.parametrize(("script", "expected"), [
    ("echo hi > out.txt; cat x >> log.txt", [("write", "out.txt"), ("edit", "log.txt")]),
    ("make 2> err.log &> all.log", [("write", "err.log"), ("write", "all.log")]),
    ("pytest -q 2>/dev/null | tee -a run.log", [("edit", "run.log")]),
    ("echo x | tee one.txt two.txt", [("write", "one.txt"), ("write", "two.txt")]),
    ("sed -i 's/a/b/' f1.py f2.py", [("edit", "f1.py"), ("edit", "f2.py")]),
    ("sed -i.bak -e 's/a/b/' g.py", [("edit", "g.py")]),
    ("rm -rf build/tmp && unlink x", [("delete", "build/tmp"), ("delete", "x")]),
    ("cp a.py b.py", [("write", "b.py")]),
    ("mv a.py b.py", [("move", "a.py"), ("write", "b.py")]),
    ("touch a.md b.md", [("touch", "a.md"), ("touch", "b.md")]),
    ("cat > conf.ini <<EOF\nrm -rf /\nEOF", [("write", "conf.ini")]),
    ("ls *.py; rm $TMP/x; rm *.pyc; echo > /dev/null", []),
    ("echo 'unclosed", []),
])
def test_shell_edits(script: str, expected: list[tuple[str, str]]) -> None:
    raw = orjson.dumps({"command": script}).decode()
    assert [(e.kind, e.path) for e in call_files("Bash", raw)[1]] == expected


def test_results_parallel_calls_and_unanswered_ones() -> None:
    history = chat(("a", "Read", {"file_path": "/x.py"}),
                   ("b", "exec_command", {"cmd": "cat y.py z.py", "workdir": "/w"}),
                   ("c", "Read", {"file_path": "/q.py"}), answered=False)
    history += [{"role": "tool", "tool_call_id": "b", "content": "yz"},
                {"role": "tool", "tool_call_id": "a", "content": "x"}]
    prov = provenance(history, TOOLS)
    assert [(r.call_id, r.path, r.call_index, r.result_index) for r in prov.reads] == [
        ("a", "/x.py", 1, 3), ("b", "/w/y.py", 1, 2), ("b", "/w/z.py", 1, 2), ("c", "/q.py", 1, None)]
    assert [r.path for r in prov.by_call["b"]] == ["/w/y.py", "/w/z.py"]
    assert prov.reads_of(2) == prov.by_call["b"] and prov.reads_of(4) == ()
    # A custom call in the chat shape (``custom: {name, input}``) counts too.
    custom: list[Message] = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "p", "type": "custom", "custom": {"name": "apply_patch", "input": PATCH}}]}]
    assert [e.path for e in provenance(custom, TOOLS).edits][:2] == ["src/app.py", "src/new.py"]


# -- properties ----------------------------------------------------------------------------

PATHS = ["/repo/a.py", "src/a.py", "b.txt", "/repo/src/b.txt", "c/d.md"]
CALL = st.one_of(
    st.builds(lambda p, o, n: ("Read", {"file_path": p, "offset": o, "limit": n}),
              st.sampled_from(PATHS), st.integers(0, 50), st.integers(1, 50)),
    st.builds(lambda p: ("Read", {"file_path": p}), st.sampled_from(PATHS)),
    st.builds(lambda p, a, b: ("exec_command", {"cmd": f"sed -n '{a},{a + b}p' {p}",
                                                "workdir": "/repo"}),
              st.sampled_from(PATHS), st.integers(1, 40), st.integers(0, 40)),
    st.builds(lambda p, q, n: ("Bash", {"command": f"cat {p} && head -n {n} {q} | tail -n 2"}),
              st.sampled_from(PATHS), st.sampled_from(PATHS), st.integers(1, 30)),
    st.builds(lambda p: ("Edit", {"file_path": p, "old_string": "x", "new_string": "y"}),
              st.sampled_from(PATHS)),
    st.builds(lambda p, q: ("apply_patch", f"*** Begin Patch\n*** Update File: {p}\n@@\n-x\n+y\n"
                                           f"*** Delete File: {q}\n*** End Patch\n"),
              st.sampled_from(PATHS), st.sampled_from(PATHS)),
    st.builds(lambda p, q: ("shell", {"command": ["bash", "-lc", f"mv {p} {q}; touch {p}"]}),
              st.sampled_from(PATHS), st.sampled_from(PATHS)),
)
# A turn: parallel calls, which of them are answered (in some order), then maybe user words.
TURN = st.tuples(st.lists(CALL, min_size=0, max_size=3), st.lists(st.booleans(), max_size=3),
                 st.booleans(), st.booleans())


def build(turns: list[tuple[list[tuple[str, Any]], list[bool], bool, bool]]) -> list[Message]:
    history: list[Message] = [{"role": "user", "content": "work"}]
    for t, (calls, answered, backwards, user) in enumerate(turns):
        ids = [f"c{t}_{k}" for k in range(len(calls))]
        history.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": (
                args if isinstance(args, str) else orjson.dumps(args).decode())}}
            for cid, (name, args) in zip(ids, calls, strict=True)]} if calls else
            {"role": "assistant", "content": "thinking aloud"})
        done = [cid for cid, yes in zip(ids, answered, strict=False) if yes]
        for cid in reversed(done) if backwards else done:
            history.append({"role": "tool", "tool_call_id": cid, "content": "out"})
        if user:
            history.append({"role": "user", "content": "go on"})
    return history


@settings(max_examples=examples(150), deadline=None)
@given(turns=st.lists(TURN, max_size=12), k=st.integers(0, 80))
def test_provenance_is_deterministic_and_prefix_stable(
    turns: list[tuple[list[tuple[str, Any]], list[bool], bool, bool]], k: int
) -> None:
    history = build(turns)
    whole = provenance(history, TOOLS)
    assert provenance(copy.deepcopy(history), TOOLS) == whole
    k = min(k, len(history))
    part = provenance(history[:k], TOOLS)

    def cut(r: FileRead) -> FileRead:
        late = r.result_index is not None and r.result_index >= k
        return replace(r, result_index=None) if late else r

    assert part.reads == tuple(cut(r) for r in whole.reads if r.call_index < k)
    assert part.edits == tuple(e for e in whole.edits if e.call_index < k)
    assert part.by_call == {cid: tuple(cut(r) for r in reads)
                            for cid, reads in whole.by_call.items()
                            if reads[0].call_index < k}
    for r in whole.reads:  # every answered read points at its own call's result
        if r.result_index is not None:
            assert history[r.result_index]["tool_call_id"] == r.call_id > ""
            assert r.call_index < r.result_index
    assert all(isinstance(e, FileEdit) for e in whole.edits)


RANGE = st.one_of(
    st.builds(lambda s, n: LineRange(s, None if n is None else s + n),
              st.integers(1, 40), st.one_of(st.none(), st.integers(0, 40))),
    st.builds(lambda n: LineRange(tail=n), st.integers(1, 10)),
)


@settings(max_examples=examples(300), deadline=None)
@given(a=RANGE, b=RANGE, c=RANGE)
def test_covers_is_reflexive_and_transitive(a: LineRange, b: LineRange, c: LineRange) -> None:
    assert a.covers(a)
    if a.covers(b) and b.covers(c):
        assert a.covers(c)
    assert WHOLE.covers(a)


SEGMENT = st.sampled_from(["src", "a.py", "lib", "x", "repo", ".."])


@settings(max_examples=examples(300), deadline=None)
@given(a=st.lists(SEGMENT, min_size=1, max_size=4), b=st.lists(SEGMENT, min_size=1, max_size=4),
       abs_a=st.booleans(), abs_b=st.booleans())
def test_same_file_is_symmetric(a: list[str], b: list[str], abs_a: bool, abs_b: bool) -> None:
    x = ("/" if abs_a else "") + "/".join(a)
    y = ("/" if abs_b else "") + "/".join(b)
    assert same_file(x, y) == same_file(y, x)
    assert same_file(x, x)
