"""Quote protection: the reads a coming edit will quote keep their stage-1 cut (pipeline.quotes).

The rule unit by unit (which calls are reads and edits, which read is kept, the cap), the stage
with it (a property: deterministic, the kept read byte-identical to its stage-1 form, every
original still saved), and a Claude-Code-shaped session through a real proxy that reads a file,
works on, compacts, and then edits quoting a line far into the read.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.compaction.message import SUMMARY_HEADING
from proxy.config import config_from_mapping
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.servers import ServerThread
from proxy.model import RequestView
from proxy.offload.quotes import (
    edited_paths,
    file_reads,
    patch_paths,
    protected_reads,
    shell_read_paths,
)
from proxy.offload.stage import Offloader, read_calls
from proxy.session import Identity

from . import test_epochs as epochs
from .conftest import ProxyFactory, examples
from .test_epochs import SUMMARY, is_summarizer

ID = Identity("t-tenant", "sess-q", None)
TOOLS = config_from_mapping({}).offload.read_tools


def call(cid: str, name: str, args: dict[str, Any] | str) -> dict[str, Any]:
    raw = args if isinstance(args, str) else orjson.dumps(args).decode()
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": name, "arguments": raw}}]}


def turn(cid: str, name: str, args: dict[str, Any] | str, output: str) -> list[dict[str, Any]]:
    return [call(cid, name, args), {"role": "tool", "tool_call_id": cid, "content": output}]


def numbered(path: str, lines: int) -> str:
    """What Claude Code's ``Read`` returns: ``cat -n`` lines."""
    return "".join(f"{i:>6}\t{path}: def function_{i}(x): return x + {i}  # padding\n"
                   for i in range(1, lines + 1))


def log(tag: str, size: int) -> str:
    return "".join(f"{tag} {i} " + "z" * 56 + "\n" for i in range(size // 64 + 1))


def view(messages: list[dict[str, Any]]) -> RequestView:
    return RequestView(model="gpt-4o", body={"messages": messages}, identity=ID)


def index_of(messages: list[dict[str, Any]], cid: str) -> int:
    return next(i for i, m in enumerate(messages) if m.get("tool_call_id") == cid)


# -- which calls are reads and edits -------------------------------------------------------


def test_codex_shell_reads() -> None:
    assert shell_read_paths("cat src/app.py") == ["src/app.py"]
    assert shell_read_paths("sed -n '1,200p' src/app.py") == ["src/app.py"]
    assert shell_read_paths("sed -n -e 10,20p a.py") == ["a.py"]
    assert shell_read_paths("head -n 50 a.py && tail -n 20 b.py") == ["a.py", "b.py"]
    assert shell_read_paths("nl -ba src/x.rs | sed -n '1,80p'") == ["src/x.rs"]
    assert shell_read_paths("cat a.py b.py") == ["a.py", "b.py"]
    assert shell_read_paths("rg -n foo src; ls -la") == []
    assert shell_read_paths("cat > out.txt <<EOF") == []
    assert shell_read_paths("cat 'unterminated") == []
    msgs = [
        *turn("c1", "exec_command", {"cmd": "sed -n '1,120p' src/app.py", "workdir": "/repo"}, "x"),
        *turn("c2", "shell", {"command": ["bash", "-lc", "cat lib/util.py"]}, "y"),
        *turn("c3", "local_shell_call", {"type": "local_shell_call", "action": {
            "type": "exec", "command": ["head", "-n", "40", "README.txt"],
            "working_directory": "/w"}}, "z"),
        *turn("c4", "exec_command", {"cmd": "pytest -q"}, "ok"),
        *turn("c5", "Read", {"file_path": "/repo/src/./app.py", "offset": 10}, "r"),
        *turn("c6", "str_replace_based_edit_tool", {"command": "view", "path": "/r/a.py"}, "v"),
    ]
    assert file_reads(msgs, TOOLS) == {
        "c1": ("/repo/src/app.py",), "c2": ("lib/util.py",), "c3": ("/w/README.txt",),
        "c5": ("/repo/src/app.py",), "c6": ("/r/a.py",),
    }


PATCH = """*** Begin Patch
*** Update File: src/app.py
@@ def main():
-    return 1
+    return 2
*** Add File: src/new.py
+print("new")
*** Delete File: old.py
*** End Patch
"""


def test_apply_patch_paths() -> None:
    assert patch_paths(PATCH) == ["src/app.py"]
    msgs = [
        call("p1", "apply_patch", PATCH),  # Codex's custom tool: the patch is the input
        call("p2", "apply_patch", {"input": PATCH.replace("src/app.py", "src/json.py")}),
        call("p3", "apply_patch_call", {"type": "apply_patch_call", "call_id": "p3",
                                        "operation": {"type": "update_file", "path": "x/op.py",
                                                      "diff": "@@\n-a\n+b\n"}}),
        call("p4", "exec_command", {"cmd": "apply_patch <<'EOF'\n" + PATCH.replace(
            "src/app.py", "sh/p.py") + "EOF\n", "workdir": "/repo"}),
        call("e1", "Edit", {"file_path": "/abs/e.py", "old_string": "a", "new_string": "b"}),
        call("e2", "MultiEdit", {"file_path": "/abs/m.py", "edits": [
            {"old_string": "a", "new_string": "b"}]}),
        call("e3", "str_replace_based_edit_tool", {"command": "str_replace", "path": "/s.py",
                                                   "old_str": "a", "new_str": "b"}),
        call("e4", "edit_file", {"path": "ef.py", "old_str": "a", "new_str": "b"}),
        call("n1", "str_replace_based_edit_tool", {"command": "view", "path": "/v.py"}),
        call("n2", "Write", {"file_path": "/w.py", "content": "x"}),
    ]
    assert edited_paths(msgs) == {
        "src/app.py", "src/json.py", "x/op.py", "/repo/sh/p.py",
        "/abs/e.py", "/abs/m.py", "/s.py", "ef.py",
    }
    # The exec_command heredoc is an edit, not a read of the patched file.
    assert file_reads(msgs, TOOLS) == {"n1": ("/v.py",)}


# -- the rule ------------------------------------------------------------------------------


def session(*, edit: bool, fillers: int = 3) -> list[dict[str, Any]]:
    """Read a.py twice and b.py once, run ``fillers`` commands, maybe edit a.py."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "fix it"}]
    msgs += turn("r1", "Read", {"file_path": "/p/a.py"}, numbered("a", 600))
    msgs += turn("r2", "Read", {"file_path": "/p/b.py"}, numbered("b", 600))
    msgs += turn("r3", "Read", {"file_path": "/p/a.py"}, numbered("a", 500))
    for n in range(fillers):
        msgs += turn(f"f{n}", "Bash", {"command": "make"}, log(f"f{n}", 20_000))
    if edit:
        msgs.append(call("e1", "Edit", {"file_path": "/p/a.py", "old_string": "x",
                                        "new_string": "y"}))
        msgs.append({"role": "tool", "tool_call_id": "e1", "content": "ok"})
    return msgs


def candidates(msgs: list[dict[str, Any]], size: int = 30_000) -> dict[int, int]:
    return {i: size for i, m in enumerate(msgs) if m.get("role") == "tool"}


def test_the_newest_read_of_an_edited_path_is_kept_an_older_one_is_not() -> None:
    msgs = session(edit=True, fillers=12)  # every read is far older than the recent turns
    kept = protected_reads(msgs, len(msgs), candidates(msgs), TOOLS, recent_turns=10,
                           budget=10**6)
    assert kept == {index_of(msgs, "r3")}  # not r1 (older read of a.py), not b.py (not edited)


def test_reads_in_the_recent_turns_count_as_being_worked_on() -> None:
    msgs = session(edit=False, fillers=3)
    kept = protected_reads(msgs, len(msgs), candidates(msgs), TOOLS, recent_turns=10,
                           budget=10**6)
    assert kept == {index_of(msgs, "r2"), index_of(msgs, "r3")}
    far = session(edit=False, fillers=12)
    assert protected_reads(far, len(far), candidates(far), TOOLS, recent_turns=10,
                           budget=10**6) == set()


def test_the_budget_caps_protection_and_the_oldest_lose_it_first() -> None:
    msgs = session(edit=False, fillers=3)
    r2, r3 = index_of(msgs, "r2"), index_of(msgs, "r3")
    def kept(budget: int) -> frozenset[int]:
        return protected_reads(msgs, len(msgs), candidates(msgs), TOOLS, recent_turns=10,
                               budget=budget)
    assert kept(60_000) == {r2, r3}
    assert kept(59_999) == {r3}
    assert kept(29_999) == set()
    assert kept(0) == set()


def test_only_results_stage_2_would_cut_are_considered() -> None:
    msgs = session(edit=True, fillers=12)
    r1 = index_of(msgs, "r1")
    # r3 (the newest read of a.py) is not a candidate: nothing falls back to r1.
    assert protected_reads(msgs, len(msgs), {r1: 100}, TOOLS, recent_turns=10,
                           budget=10**6) == set()


def test_decided_on_the_history_at_the_compaction() -> None:
    """An edit (or a newer read) after ``seen`` changes nothing until the next compaction."""
    before = session(edit=False, fillers=12)
    seen = len(before)
    after = [*before, call("e1", "Edit", {"file_path": "/p/b.py", "old_string": "x",
                                          "new_string": "y"}),
             {"role": "tool", "tool_call_id": "e1", "content": "ok"}]
    args = {"recent_turns": 10, "budget": 10**6}
    assert protected_reads(after, seen, candidates(after), TOOLS, **args) == set()
    assert protected_reads(after, len(after), candidates(after), TOOLS, **args) == {
        index_of(after, "r2")}
    # A newer read of a protected path during the epoch leaves the protected one kept.
    edited = session(edit=True, fillers=12)
    newer = [*edited, *turn("r9", "Read", {"file_path": "/p/a.py"}, numbered("a", 10))]
    assert protected_reads(newer, len(edited), candidates(newer), TOOLS, **args) == {
        index_of(newer, "r3")}


def test_a_relative_patch_path_matches_an_absolute_read() -> None:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    msgs += turn("r1", "exec_command", {"cmd": "cat src/app.py", "workdir": "/repo"},
                 numbered("app", 400))
    for n in range(12):
        msgs += turn(f"f{n}", "exec_command", {"cmd": "make"}, log(f"f{n}", 10_000))
    msgs.append(call("p1", "apply_patch", PATCH))
    kept = protected_reads(msgs, len(msgs), candidates(msgs), TOOLS, recent_turns=2,
                           budget=10**6)
    assert kept == {index_of(msgs, "r1")}


# -- the stage -----------------------------------------------------------------------------


def offloader(tmp_path: Path, **offload: Any) -> Offloader:
    """Quote protection alone: no per-tool policies (tests/test_policies.py)."""
    offload.setdefault("policies", [])
    cfg = config_from_mapping({"offload": offload, "storage": {"data_dir": str(tmp_path)}})
    return Offloader(cfg.offload, cfg.retrieval, tmp_path)


def test_stage_2_spares_the_protected_read(tmp_path: Path) -> None:
    msgs = session(edit=True, fillers=12)
    stage = offloader(tmp_path)
    first = stage.run(msgs, view(msgs), aged_turns=0)  # stage 1 only
    aged = stage.run(msgs, view(msgs), aged_turns=100, seen=len(msgs))
    r1, r3 = index_of(msgs, "r1"), index_of(msgs, "r3")
    assert aged.messages[r3] == first.messages[r3] == msgs[r3]  # 30 KB: kept whole
    assert len(aged.messages[r1]["content"]) < 4_000  # the older read is aged
    assert aged.stats["quotes_protected"] == 1
    off = offloader(tmp_path, protect_edit_bytes=0).run(msgs, view(msgs), aged_turns=100,
                                                        seen=len(msgs))
    assert len(off.messages[r3]["content"]) < 4_000
    # The last resort's first pass spares it too.
    spare = stage.protected(msgs, view(msgs), aged_turns=100, seen=len(msgs))
    assert spare == {"r3"}
    hard = stage.harder(first.messages, ID, 3000, spare)
    assert hard.messages[r3] is first.messages[r3]
    assert len(hard.messages[r1]["content"]) < 4_000


READS = ["/p/a.py", "/p/b.py", "/p/c.md", "src/d.py"]
STEP = st.one_of(
    st.tuples(st.just("read"), st.sampled_from(READS), st.integers(50, 1500)),
    st.tuples(st.just("cat"), st.sampled_from(READS), st.integers(50, 1500)),
    st.tuples(st.just("edit"), st.sampled_from(READS), st.just(0)),
    st.tuples(st.just("patch"), st.sampled_from(READS), st.just(0)),
    st.tuples(st.just("run"), st.just(""), st.integers(100, 90_000)),
)


def build(steps: list[tuple[str, str, int]]) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "work"}]
    for n, (kind, path, size) in enumerate(steps):
        cid = f"c{n}"
        if kind == "read":
            msgs += turn(cid, "Read", {"file_path": path}, numbered(f"{n}{path}", size))
        elif kind == "cat":
            msgs += turn(cid, "exec_command", {"cmd": f"cat {path}"}, numbered(f"{n}", size))
        elif kind == "edit":
            msgs += turn(cid, "Edit", {"file_path": path, "old_string": "a", "new_string": "b"},
                         "ok")
        elif kind == "patch":
            msgs += turn(cid, "apply_patch", f"*** Begin Patch\n*** Update File: {path}\n"
                         "@@\n-a\n+b\n*** End Patch\n", "Done")
        else:
            msgs += turn(cid, "Bash", {"command": "make"}, log(f"run{n}", size))
    return msgs


@settings(max_examples=examples(60), deadline=None)
@given(steps=st.lists(STEP, min_size=1, max_size=24), cut=st.floats(0, 1),
       budget=st.integers(0, 200_000), recent=st.integers(0, 12))
def test_protection_is_deterministic_exact_and_loses_nothing(
    tmp_path_factory: Any, steps: list[tuple[str, str, int]], cut: float, budget: int,
    recent: int,
) -> None:
    msgs = build(steps)
    seen = int(cut * len(msgs))
    tmp = tmp_path_factory.mktemp("q")
    stage = offloader(tmp, protect_edit_bytes=budget, protect_recent_turns=recent)
    first = stage.run(msgs, view(msgs), aged_turns=0)
    args = {"aged_turns": 1000, "seen": seen}
    out = stage.run(msgs, view(msgs), **args)
    again = offloader(tmp, protect_edit_bytes=budget, protect_recent_turns=recent).run(
        msgs, view(msgs), **args)
    assert orjson.dumps(again.messages) == orjson.dumps(out.messages)  # same history, same bytes
    assert again.files == out.files
    spare = stage.protected(msgs, view(msgs), **args)
    spent = 0
    for i, m in enumerate(msgs):
        if m.get("tool_call_id") in spare:
            assert out.messages[i] == first.messages[i]  # byte-identical to its stage-1 form
            spent += len(first.messages[i]["content"].encode())
    assert spent <= budget
    # Every result forwarded cut has its original among the files to keep.
    saved = {f.index: f.text for f in out.files}
    for i, (a, b) in enumerate(zip(msgs, out.messages, strict=True)):
        if a is not b:
            assert saved[i] == a["content"]
    # Protection only concerns reads.
    reads = read_calls(msgs, TOOLS).keys() | file_reads(msgs, TOOLS).keys()
    assert spare <= reads


# -- end to end: Claude Code shape, a real proxy --------------------------------------------

WINDOW = 40_000
FILE = "/repo/src/service.py"
MODEL = "claude-sonnet-4-5"


def _messages_session(srv_url: str, fake: FakeUpstream) -> tuple[dict[str, Any], str, int]:
    """Read a 30 KB file, run commands until the proxy compacts, go on; the request the model
    answers with an ``Edit`` quoting line 400 of the read, the quoted line, summarizer calls."""
    content = numbered(FILE, 450)
    quoted = content.splitlines()[399].split("\t", 1)[1]  # what Edit.old_string quotes
    sid = f"quotes-{uuid.uuid4().hex[:10]}"
    history: list[dict[str, Any]] = [{"role": "user", "content": "refactor service.py"}]

    def tool(n: int, name: str, args: dict[str, Any], out: str) -> None:
        history.append({"role": "assistant", "content": [
            {"type": "text", "text": f"step {n}"},
            {"type": "tool_use", "id": f"toolu_{n}", "name": name, "input": args}]})
        history.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{n}", "content": out}]})

    first = len(fake.received)
    headers = {"x-api-key": "sk-ant-test", "anthropic-version": "2023-06-01",
               "x-session-id": sid}
    body: dict[str, Any] = {}
    with httpx.Client(timeout=60) as client:
        def post() -> None:
            nonlocal body
            body = {"model": MODEL, "max_tokens": 1024, "system": "You are Claude Code.",
                    "messages": history,
                    "tools": [{"name": n, "input_schema": {"type": "object"}}
                              for n in ("Read", "Edit", "Bash")]}
            r = client.post(srv_url + "/v1/messages", content=orjson.dumps(body),
                            headers=headers)
            assert r.status_code == 200, r.text[:300]

        for n, size in enumerate((24_000, 4_000)):  # earlier work the compaction summarizes
            tool(n, "Bash", {"command": f"pytest -k part{n}"}, log(f"t{n}", size))
            post()
        tool(10, "Read", {"file_path": FILE}, content)
        post()
        for n in range(11, 18):  # working on: the read ages, the window fills, compaction
            tool(n, "Bash", {"command": f"grep -n helper{n}"}, log(f"g{n}", 2_000))
            post()
        # The model now answers with Edit(old_string=quoted): what it was sent is the last body.
    received = [rec.json() for rec in fake.received[first:] if rec.path == "/v1/messages"]
    forwarded = [r for r in received if not is_summarizer(r)]
    return forwarded[-1], quoted, len(received) - len(forwarded)


def _results(request: dict[str, Any]) -> str:
    texts = []
    for m in request["messages"]:
        for block in m["content"] if isinstance(m["content"], list) else ():
            if block.get("type") == "tool_result":
                c = block["content"]
                texts.append(c if isinstance(c, str) else "".join(p["text"] for p in c))
    return "\n".join(texts)


def test_an_edit_after_a_compaction_finds_its_quote_byte_exact(
    make_proxy: ProxyFactory, fake: FakeUpstream
) -> None:
    fake.responder = lambda req: Reply(content=SUMMARY if is_summarizer(req) else "ok")
    compaction = {"context_windows": {MODEL: WINDOW}, "keep_recent_ratio": 0.45}
    for protect, found in ((131072, True), (0, False)):
        # The file is not edited yet: protected as one read in the newest turns.
        srv = make_proxy({"compaction": compaction, "offload": {"protect_edit_bytes": protect,
                                                               "protect_recent_turns": 10}})
        request, quoted, summaries = _messages_session(srv.url, fake)
        text = orjson.dumps(request).decode()
        assert summaries >= 1 and SUMMARY_HEADING in orjson.loads(text)["messages"][0][
            "content"][0]["text"], "the session compacted"
        results = _results(request)
        assert FILE + ": def function_1(x)" in results  # the read is among the kept turns
        assert (quoted in results) is found, f"protect_edit_bytes={protect}"


# -- the epoch rule holds with protection at work -------------------------------------------

EPOCH_PATHS = ["/repo/a.py", "/repo/b.py", "/repo/c.py"]


def epoch_turn(fmt: str, n: int, step: tuple[str, str, int]) -> list[dict[str, Any]]:
    kind, path, size = step
    if kind == "read":
        name, args, text = "Read", {"file_path": path}, numbered(f"{n}{path}", size)
        if fmt == "responses":  # Codex reads with the shell
            name, args = "exec_command", {"cmd": f"sed -n '1,{size}p' {path}"}
    elif kind == "edit":
        name, args, text = "Edit", {"file_path": path, "old_string": "a", "new_string": "b"}, "ok"
        if fmt == "responses":
            name, args = "apply_patch", {"input": f"*** Begin Patch\n*** Update File: {path}\n"
                                                  "@@\n-a\n+b\n*** End Patch\n"}
    else:
        name, args, text = "bash", {"cmd": "step"}, log(f"s{n}", size)
    raw = orjson.dumps(args).decode()
    if fmt == "chat":
        return [call(f"call_{n}", name, raw),
                {"role": "tool", "tool_call_id": f"call_{n}", "content": text}]
    if fmt == "responses":
        return [{"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}", "name": name,
                 "arguments": raw, "status": "completed"},
                {"type": "function_call_output", "call_id": f"call_{n}", "output": text}]
    return [{"role": "assistant", "content": [
                {"type": "thinking", "thinking": f"step {n}", "signature": f"sig-{n}"},
                {"type": "tool_use", "id": f"toolu_{n}", "name": name, "input": args}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": f"toolu_{n}", "content": text}]}]


EPOCH_STEP = st.one_of(
    st.tuples(st.just("read"), st.sampled_from(EPOCH_PATHS), st.integers(100, 900)),
    st.tuples(st.just("edit"), st.sampled_from(EPOCH_PATHS), st.just(0)),
    st.tuples(st.just("run"), st.just(""), st.sampled_from([300, 6_000, 20_000, 70_000])),
)


@pytest.fixture
def quotes_proxy(make_proxy: ProxyFactory, fake: FakeUpstream) -> ServerThread:
    fake.responder = lambda req: Reply(content=SUMMARY if is_summarizer(req) else "ok")
    return make_proxy({"compaction": {"context_windows": {m: 40_000
                                                          for m in epochs.MODELS.values()}}})


@settings(max_examples=examples(30), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(fmt=st.sampled_from(["chat", "responses", "messages"]),
       steps=st.lists(EPOCH_STEP, min_size=2, max_size=18))
def test_protection_keeps_epochs_append_only(
    quotes_proxy: ServerThread, fake: FakeUpstream, fmt: str, steps: list[tuple[str, str, int]]
) -> None:
    sid = f"quotes-epoch-{fmt}-{uuid.uuid4().hex[:10]}"
    history: list[dict[str, Any]] = [epochs.user(fmt, "work on the repo")]
    first = len(fake.received)
    headers = {"authorization": "Bearer sk-test", "x-api-key": "sk-ant-test",
               "anthropic-version": "2023-06-01", "x-session-id": sid}
    with httpx.Client(timeout=60) as client:
        for n, step in enumerate(steps):
            history += epoch_turn(fmt, n, step)
            r = client.post(quotes_proxy.url + epochs.PATHS[fmt],
                            content=orjson.dumps(epochs.body(fmt, history)), headers=headers)
            assert r.status_code == 200, r.text[:300]
    received = fake.received[first:]
    forwarded = [rec.json() for rec in received if rec.path == epochs.PATHS[fmt]
                 and not is_summarizer(rec.json())]
    summaries = sum(1 for rec in received if is_summarizer(rec.json()))
    epochs.check_epochs(fmt, forwarded, summaries)
