"""Long-term memory (docs/memory.md): facts recorded in the compaction's own summarizer call,
the daily fold, the pinned injection, isolation, bad cases, quota and retention.

The scenario tests run the real server in front of the fake upstream, which plays the model,
the summarizer (whose scripted answer carries the durable-facts section) and the folder (which
builds MEMORY.md from the notes it is sent, so what reaches session 2 went through the notes).
"""

from __future__ import annotations

import os
import re
import time
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.compaction.facts import split_facts, stamp_facts
from proxy.config import config_from_mapping
from proxy.demo.fake.own_calls import instructions_of, last_text, own_call
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.servers import ServerThread
from proxy.formats.chat.request import CHAT
from proxy.history.turns import leading_system_count
from proxy.memory.fold import cap, clean_fold, fold_prompt
from proxy.memory.inject import inject, is_memory_message, memory_message
from proxy.retrieval.tool import ReadTool
from proxy.session import Identity, resolve, tenant_of
from proxy.store.db import Database
from proxy.store.gc import collect
from proxy.store.memory import MemoryFiles
from proxy.store.tool_results import ToolResultStore
from proxy.store.usage import DiskUsage

from .conftest import ProxyFactory

SYSTEM = "You are a test agent working on the repo at /srv/app."
PREF_1 = "always answer in French"
PREF_2 = "never run pytest with -x, I want to see every failure"
ERROR = "error: externally-managed-environment"
FIX = "python -m venv .venv"
SUMMARY = """## Goal
Install foo and keep the build green.
## Constraints & Preferences
- answer in French
## Progress
### Done
- installed foo in a venv
### In Progress
- none
### Blocked
- none
## Key Decisions
- use a venv
## Next Steps
- run the tests
## Critical Context
- /srv/app/.venv
"""
FACTS = f"""## Durable Facts
- Preference: "{PREF_1}"
- Preference: "{PREF_2}"
- Lesson: `pip install foo` failed with `{ERROR}`; fixed by running `{FIX}` first
"""
ON = {"compaction": {"context_windows": {"gpt-4o": 4000}}, "memory": {"enabled": True}}
KEY = "sk-mem-test"
KEY_A, KEY_B = "sk-mem-alpha-1c", "sk-mem-bravo-2d"


def is_fold(body: dict[str, Any]) -> bool:
    """The proxy's fold call, in any format (a session's fold goes in its own)."""
    return own_call(body) == "fold"


def is_summarizer(body: dict[str, Any]) -> bool:
    return own_call(body) == "summarizer"


def fold_answer(body: dict[str, Any]) -> str:
    """MEMORY.md made of the note bullets the fold was sent (so the facts must have gone
    through the daily notes to get there)."""
    user = last_text(body)
    notes = user.split("<notes>", 1)[1].split("</notes>", 1)[0]
    bullets = [line for line in notes.split("\n") if line.startswith("- [")]
    prefs = [b for b in bullets if "Preference:" in b]
    lessons = [b for b in bullets if "Lesson:" in b]
    return ("## Preferences & Standing Instructions\n" + "\n".join(prefs)
            + "\n## Lessons\n" + "\n".join(lessons) + "\n")


class Script:
    """The fake's responder: summarizer, folder and model."""

    def __init__(self, fake: FakeUpstream, *, facts: str | None = FACTS,
                 fold: Reply | None = None) -> None:
        self.facts = facts
        self.fold = fold
        self.summaries = 0
        self.folds = 0
        self.summarizer_prompts: list[str] = []
        fake.responder = self

    def __call__(self, body: dict[str, Any]) -> Reply:
        if is_fold(body):
            self.folds += 1
            return self.fold or Reply(content=fold_answer(body))
        if is_summarizer(body):
            self.summaries += 1
            self.summarizer_prompts.append(instructions_of(body))
            return Reply(content=SUMMARY + (self.facts or ""))
        return Reply(content="ok")


def model_calls(fake: FakeUpstream) -> list[list[dict[str, Any]]]:
    return [r.json()["messages"] for r in fake.received
            if r.path.endswith("chat/completions")
            and not is_summarizer(r.json()) and not is_fold(r.json())]


def filler(turns: int, tag: str = "") -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for t in range(turns):
        out.append({"role": "user", "content": f"request {t}{tag}: " + "please do the thing " * 15})
        out.append({"role": "assistant", "content": f"answer {t}: " + "done with it " * 20})
    return out


def session_one() -> list[dict[str, Any]]:
    """Two preferences, a failure and its fix, then enough turns to be compacted."""
    def call(cid: str, command: str) -> dict[str, Any]:
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function",
             "function": {"name": "bash", "arguments": orjson.dumps({"command": command}).decode()}}]}

    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Please {PREF_1}."},
        {"role": "assistant", "content": "D'accord."},
        {"role": "user", "content": f"Also: {PREF_2}."},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "install foo"},
        call("c1", "pip install foo"),
        {"role": "tool", "tool_call_id": "c1", "content": ERROR},
        call("c2", f"{FIX} && .venv/bin/pip install foo"),
        {"role": "tool", "tool_call_id": "c2", "content": "Successfully installed foo"},
        *filler(30),
    ]


def chat(srv: ServerThread, messages: list[dict[str, Any]], session: str, key: str = KEY,
         **headers: str) -> httpx.Response:
    r = httpx.post(srv.url + "/v1/chat/completions",
                   content=orjson.dumps({"model": "gpt-4o", "messages": messages}),
                   headers={"authorization": f"Bearer {key}", "x-session-id": session, **headers},
                   timeout=30)
    assert r.status_code == 200, r.text
    return r


def memory_dir(data: Path, key: str = KEY, scope: str = "default") -> Path:
    return data / tenant_of(key) / "memory" / scope


def new_session(tag: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"hello {tag}"}]


# --- the scenario -------------------------------------------------------------------------------


def test_two_sessions_preferences_and_lesson_reach_the_next_session(
    make_proxy: ProxyFactory, fake: FakeUpstream, tmp_path: Path
) -> None:
    script = Script(fake)
    srv = make_proxy(ON)
    data = tmp_path / "data"
    one = session_one()
    r = chat(srv, one, "s1")
    assert r.headers["x-ctxproxy-compacted"] == "1"
    srv.drain()  # the fold runs in the background on the scope's next request
    # Memory added no summarizer call to the compaction: the facts came with the summary.
    assert script.summaries == 1
    assert "## Durable Facts" in script.summarizer_prompts[0]
    assert script.folds == 1
    first = model_calls(fake)[-1]
    summary = next(m for m in first if m["content"] and "# Summary of previous" in m["content"])
    assert "Durable Facts" not in summary["content"]
    # The day's notes: each fact dated and with its session.
    today = datetime.now(UTC).date().isoformat()
    notes = (memory_dir(data) / "memory" / f"{today}.md").read_text()
    for fact in (PREF_1, PREF_2, ERROR):
        assert re.search(rf"^- \[{today} · session s1\] .*{re.escape(fact)}", notes, re.M)
    assert (memory_dir(data) / "MEMORY.md").is_file()

    # Session 1 keeps the version it had (none) until its next compaction, also on a second
    # replica sharing the store (the pin is the store's, not one process's).
    replica = make_proxy(ON)
    more = [*one, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
    for proxy in (srv, replica):
        chat(proxy, more, "s1")
        assert not any(is_memory_message(m) for m in model_calls(fake)[-1])

    # Session 2's first forwarded request carries all three facts, after the system message.
    two = new_session("again")
    chat(srv, two, "s2")
    fwd = model_calls(fake)[-1]
    assert fwd[0] == two[0] and is_memory_message(fwd[1]) and fwd[2:] == two[1:]
    for fact in (PREF_1, PREF_2, ERROR, FIX):
        assert fact in fwd[1]["content"]
    # ... and its prefix does not change between turns of one cycle.
    two_b = [*two, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}]
    for proxy in (srv, replica):
        chat(proxy, two_b, "s2")
        fwd_b = model_calls(fake)[-1]
        assert [orjson.dumps(m) for m in fwd_b[:3]] == [orjson.dumps(m) for m in fwd]
    assert script.summaries == 1 and script.folds == 1


def test_fold_at_most_daily_and_previous_version_kept(
    make_proxy: ProxyFactory, fake: FakeUpstream, tmp_path: Path
) -> None:
    script = Script(fake)
    srv = make_proxy(ON)
    data = tmp_path / "data"
    chat(srv, session_one(), "s1")
    srv.drain()
    assert script.folds == 1
    # A second session is compacted the same day: its facts are noted, no second fold.
    script.facts = FACTS.replace(PREF_1, "always use tabs")
    chat(srv, [{"role": "system", "content": SYSTEM}, *filler(30, " of s3")], "s3")
    srv.drain()
    chat(srv, new_session("later"), "s4")
    srv.drain()
    assert script.summaries == 2 and script.folds == 1
    today = datetime.now(UTC).date().isoformat()
    assert "always use tabs" in (memory_dir(data) / "memory" / f"{today}.md").read_text()
    # The next day's fold (the gate moved back a day) folds again; v1 is kept as a version.
    with Database.in_dir(data) as db:
        with db.transaction() as conn:
            conn.execute("UPDATE memory_scopes SET folded_at = ?",
                         ((datetime.now(UTC) - timedelta(days=2)).isoformat(timespec="milliseconds"),))
    srv.stop()
    srv = make_proxy(ON)
    chat(srv, new_session("tomorrow"), "s5")
    srv.drain()
    assert script.folds == 2
    assert (memory_dir(data) / "versions" / "MEMORY-v0001.md").is_file()
    assert "always use tabs" in (memory_dir(data) / "MEMORY.md").read_text()
    chat(srv, new_session("day after"), "s6")
    assert "always use tabs" in model_calls(fake)[-1][1]["content"]


def test_responses_request_carries_memory_as_a_developer_item(
    make_proxy: ProxyFactory, fake: FakeUpstream, tmp_path: Path
) -> None:
    """Format-neutral: the pipeline inserts a system message, the Responses writer makes it a
    developer item after the instructions (which stay in their field)."""
    Script(fake)
    srv = make_proxy(ON)
    chat(srv, session_one(), "s1")
    srv.drain()
    body = {"model": "gpt-4o", "instructions": SYSTEM,
            "input": [{"type": "message", "role": "user", "content": "hello"}]}
    r = httpx.post(srv.url + "/v1/responses", content=orjson.dumps(body), timeout=30,
                   headers={"authorization": f"Bearer {KEY}", "x-session-id": "r1"})
    assert r.status_code == 200, r.text
    sent = next(x.json() for x in reversed(fake.received) if x.path.endswith("/responses")
                and own_call(x.json()) is None)
    assert sent["instructions"] == SYSTEM
    first, rest = sent["input"][0], sent["input"][1:]
    assert first["role"] == "developer" and PREF_1 in first["content"][0]["text"]
    assert first["content"][0]["text"].startswith("# Long-term memory")
    assert rest == body["input"]


# --- bad cases -----------------------------------------------------------------------------------


def test_summary_without_facts_section_writes_nothing(
    make_proxy: ProxyFactory, fake: FakeUpstream, tmp_path: Path
) -> None:
    script = Script(fake, facts=None)
    srv = make_proxy(ON)
    r = chat(srv, session_one(), "s1")
    srv.drain()
    assert r.headers["x-ctxproxy-compacted"] == "1" and script.summaries == 1
    assert not (tmp_path / "data" / tenant_of(KEY) / "memory").exists()
    assert script.folds == 0
    chat(srv, new_session("x"), "s2")
    assert not any(is_memory_message(m) for m in model_calls(fake)[-1])


@pytest.mark.parametrize("fold", [Reply.error(500, "boom"), Reply(content="I cannot help.")])
def test_failed_fold_writes_nothing_and_fails_no_request(
    make_proxy: ProxyFactory, fake: FakeUpstream, tmp_path: Path, fold: Reply
) -> None:
    script = Script(fake, fold=fold)
    srv = make_proxy(ON)
    chat(srv, session_one(), "s1")
    srv.drain()
    assert script.folds == 1
    scope = memory_dir(tmp_path / "data")
    assert (scope / "memory").is_dir() and not (scope / "MEMORY.md").exists()
    chat(srv, new_session("x"), "s2")  # served; the lease spaces the retry: no second call
    srv.drain()
    assert script.folds == 1
    assert not any(is_memory_message(m) for m in model_calls(fake)[-1])
    with Database.in_dir(tmp_path / "data") as db:
        assert MemoryFiles(db).versions(tenant_of(KEY), "default") == []


def test_memory_off_by_default(make_proxy: ProxyFactory, fake: FakeUpstream,
                               tmp_path: Path) -> None:
    assert config_from_mapping({}).memory.enabled is False
    script = Script(fake)
    srv = make_proxy({"compaction": ON["compaction"]})
    chat(srv, session_one(), "s1")
    srv.drain()
    assert script.summaries == 1 and "Durable Facts" not in script.summarizer_prompts[0]
    assert not (tmp_path / "data" / tenant_of(KEY) / "memory").exists()


# --- isolation ---------------------------------------------------------------------------------


def test_tenants_and_scopes_never_see_each_others_memory(
    make_proxy: ProxyFactory, fake: FakeUpstream, tmp_path: Path
) -> None:
    script = Script(fake)
    srv = make_proxy(ON)
    marks = {KEY_A: "ALPHA-PREF-7d1e", KEY_B: "BRAVO-PREF-3c9f"}
    for key, mark in marks.items():
        script.facts = f'## Durable Facts\n- Preference: "{mark}"\n'
        chat(srv, session_one(), "s1", key)
        srv.drain()
    # A narrower scope of tenant A: its own memory, not the tenant-wide one.
    script.facts = '## Durable Facts\n- Preference: "SCOPED-PREF-5e2"\n'
    chat(srv, session_one(), "p1", KEY_A, **{"x-ctxproxy-memory-scope": "proj-x"})
    srv.drain()
    assert script.folds == 3
    seen: dict[tuple[str, str | None], str] = {}
    for key in (KEY_A, KEY_B):
        for scope in (None, "proj-x", "proj-y"):
            headers = {"x-ctxproxy-memory-scope": scope} if scope else {}
            chat(srv, new_session(f"{key}{scope}"), f"n-{scope}", key, **headers)
            seen[key, scope] = orjson.dumps(model_calls(fake)[-1]).decode()
    assert marks[KEY_A] in seen[KEY_A, None] and marks[KEY_B] not in seen[KEY_A, None]
    assert marks[KEY_B] in seen[KEY_B, None] and marks[KEY_A] not in seen[KEY_B, None]
    assert "SCOPED-PREF-5e2" in seen[KEY_A, "proj-x"]
    assert marks[KEY_A] not in seen[KEY_A, "proj-x"]
    assert "SCOPED-PREF-5e2" not in seen[KEY_B, "proj-x"] and "Long-term memory" not in (
        seen[KEY_B, "proj-x"])
    assert "Long-term memory" not in seen[KEY_A, "proj-y"]
    # /files: the own memory is shown, the other tenant's answers as a path that does not exist.
    ta, tb = tenant_of(KEY_A), tenant_of(KEY_B)
    own = httpx.get(f"{srv.url}/files/{ta}/memory/default", headers={
        "authorization": f"Bearer {KEY_A}", "accept": "application/json"})
    assert own.status_code == 200 and marks[KEY_A] in own.text
    page = httpx.get(f"{srv.url}/files/{ta}/memory/default", headers={
        "authorization": f"Bearer {KEY_A}", "accept": "text/html"})
    assert page.status_code == 200 and "MEMORY-v0001.md" in page.text
    assert "&#34;ALPHA-PREF-7d1e&#34;" in page.text  # escaped, as every value
    version = httpx.get(f"{srv.url}/files/{ta}/memory/default/versions/MEMORY-v0001.md",
                        headers={"authorization": f"Bearer {KEY_A}"})
    day = own.json()["days"][0]["url"]
    note = httpx.get(srv.url + day, headers={"authorization": f"Bearer {KEY_A}"})
    assert marks[KEY_A] in version.text and marks[KEY_A] in note.text
    assert version.headers["content-type"].startswith("text/plain")
    theirs = httpx.get(f"{srv.url}/files/{tb}/memory/default", headers={
        "authorization": f"Bearer {KEY_A}", "accept": "application/json"})
    ghost = httpx.get(f"{srv.url}/files/{ta}/memory/no-such-scope", headers={
        "authorization": f"Bearer {KEY_A}", "accept": "application/json"})
    assert theirs.status_code == ghost.status_code == 404 and theirs.content == ghost.content
    index = httpx.get(f"{srv.url}/files", headers={"authorization": f"Bearer {KEY_B}",
                                                   "accept": "application/json"}).json()
    assert {(m["tenant"], m["scope"]) for m in index["memory"]} == {(tb, "default")}


def test_read_tool_reads_the_scopes_daily_notes_only(tmp_path: Path) -> None:
    data = tmp_path / "data"
    config = config_from_mapping({"storage": {"data_dir": str(data)}})
    with Database.in_dir(data) as db:
        store = MemoryFiles(db, data, fsync=False)
        store.append("t1", "default", date(2026, 12, 1), "- [2026-12-01 · session a] Lesson: X\n")
        store.append("t2", "default", date(2026, 12, 1), "- secret of t2\n")
        tool = ReadTool(config, ToolResultStore(data, 5), memory=store)
        args = '{"file_path": "memory/2026-12-01.md"}'
        assert "Lesson: X" in tool.run(Identity("t1", "s", None), args)
        other = tool.run(Identity("t1", "s", None, "proj"), args)
        assert other.startswith("error:") and "secret" not in other
        assert "secret" not in tool.run(Identity("t1", "s", None), args)
        assert tool.run(Identity("t1", "s", None), '{"file_path": "memory/../x.md"}').startswith(
            "error:")
        assert tool.needed([memory_message("- x", tool_name=tool.name)])


def test_scope_names_are_validated_like_session_names() -> None:
    ident = resolve({"x-ctxproxy-memory-scope": "../etc", "x-session-id": "memory"}, {})
    assert ident.memory_scope.startswith("h-") and ident.session.startswith("h-")
    assert resolve({}, {"metadata": {"memory_scope": "proj-1"}}).memory_scope == "proj-1"
    assert resolve({}, {}).memory_scope == "default"


# --- quota and retention --------------------------------------------------------------------------


def test_over_quota_no_facts_are_written(
    make_proxy: ProxyFactory, fake: FakeUpstream, tmp_path: Path
) -> None:
    Script(fake)
    data = tmp_path / "data"
    junk = data / tenant_of(KEY) / "other"
    junk.mkdir(parents=True)
    (junk / "big.txt").write_bytes(b"x" * 20_000)  # measured by the gc at start-up
    srv = make_proxy({**ON, "storage": {"max_tenant_mb": 0.01}})
    r = chat(srv, session_one(), "s1")
    srv.drain()
    assert r.headers["x-ctxproxy-quota"] == "exceeded"
    assert r.headers["x-ctxproxy-compacted"] == "1"
    assert not (data / tenant_of(KEY) / "memory").exists()


def test_memory_files_count_against_quota_and_expire(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with Database.in_dir(data) as db:
        store = MemoryFiles(db, data, fsync=False)
        old = datetime.now(UTC) - timedelta(days=10)
        written = store.append("t1", "default", old.date(), "- old fact\n", now=old)
        claim = store.claim_fold("t1", "default", now=old, min_interval_s=0, lease_s=60)
        assert claim is not None
        assert store.finish_fold(claim, "## Lessons\n- old fact\n", now=old) is not None
        assert store.pin("t1", "default", "s", "", now=old) == 1
        usage = DiskUsage(data)
        assert usage.measure()["t1"] >= written + len("## Lessons\n- old fact\n")
        base = memory_dir(data, scope="default").parent.parent.parent / "t1" / "memory" / "default"
        stamp = time.time() - 10 * 86400
        for f in base.rglob("*.md"):
            os.utime(f, (stamp, stamp))
        report = collect(data, db, ToolResultStore(data, 5), usage, dialog_ttl_days=5)
        assert report.memory_files == 2 and report.expired
        assert not any(base.rglob("*.md"))
        assert store.versions("t1", "default") == []
        assert usage.used("t1") == 0
        # The number is never reused: a new fold is version 2, a new pin finds it.
        store.append("t1", "default", date.today(), "- new fact\n")
        claim = store.claim_fold("t1", "default", min_interval_s=0, lease_s=60)
        assert claim is not None
        stored = store.finish_fold(claim, "## Lessons\n- new fact\n")
        assert stored is not None and stored.version == 2


# --- the store's fold lock -----------------------------------------------------------------------


def test_fold_claim_is_one_at_a_time_and_gated(tmp_path: Path) -> None:
    with Database.in_dir(tmp_path) as db:
        store = MemoryFiles(db, tmp_path, fsync=False)
        assert store.claim_fold("t", "s", min_interval_s=0, lease_s=60) is None  # no facts
        t0 = datetime(2026, 12, 2, 10, tzinfo=UTC)
        store.append("t", "s", t0.date(), "- a\n", now=t0)
        first = store.claim_fold("t", "s", now=t0, min_interval_s=86400, lease_s=60)
        assert first is not None
        # A second process (same database) while the lease runs: refused.
        with Database.in_dir(tmp_path) as other:
            assert MemoryFiles(other, tmp_path).claim_fold(
                "t", "s", now=t0 + timedelta(seconds=30), min_interval_s=86400, lease_s=60) is None
        # The lease ran out: another fold takes over, and the first can no longer commit.
        second = store.claim_fold("t", "s", now=t0 + timedelta(seconds=61),
                                  min_interval_s=86400, lease_s=60)
        assert second is not None
        assert store.finish_fold(first, "- a\n") is None
        assert store.finish_fold(second, "- a\n") is not None
        later = t0 + timedelta(hours=2)
        assert store.claim_fold("t", "s", now=later, min_interval_s=86400, lease_s=60) is None
        store.append("t", "s", later.date(), "- b\n", now=later)
        assert store.claim_fold("t", "s", now=later, min_interval_s=86400, lease_s=60) is None
        assert store.claim_fold("t", "s", now=t0 + timedelta(days=1, seconds=62),
                                min_interval_s=86400, lease_s=60) is not None


def test_pin_first_writer_wins(tmp_path: Path) -> None:
    with Database.in_dir(tmp_path) as db:
        store = MemoryFiles(db, tmp_path, fsync=False)
        assert store.pin("t", "s", "sess", "") == 0
        store.append("t", "s", date.today(), "- a\n")
        claim = store.claim_fold("t", "s", min_interval_s=0, lease_s=60)
        assert claim is not None and store.finish_fold(claim, "- a\n") is not None
        assert store.pin("t", "s", "sess", "") == 0  # the session keeps what it started with
        assert store.pin("t", "s", "sess", "chain-2") == 1  # its next compaction moves on
        assert store.pin("t", "s", "other", "") == 1


# --- pure parts ------------------------------------------------------------------------------------


_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60)
_MESSAGE = st.builds(lambda role, content: {"role": role, "content": content},
                     st.sampled_from(["system", "developer", "user", "assistant", "tool"]), _TEXT)


@given(st.lists(_MESSAGE, max_size=12), _TEXT, st.sampled_from([None, "read_offloaded"]))
def test_injection_is_deterministic(history: list[dict[str, Any]], memory: str,
                                    tool: str | None) -> None:
    """Same memory version and same history: the same bytes, whoever builds them."""
    head = leading_system_count(history)
    raw = orjson.dumps({"model": "m", "messages": history})

    def forwarded() -> bytes:  # parse the client's bytes, inject, write the forwarded body
        parsed = CHAT.parse(raw, 1000)
        note = memory_message(memory, tool_name=tool)
        return CHAT.write(raw, parsed, inject(parsed.history, note,
                                              leading_system_count(parsed.history)))

    assert forwarded() == forwarded()
    a = inject(history, memory_message(memory, tool_name=tool), head)
    assert orjson.loads(forwarded())["messages"] == a
    assert a[:head] == history[:head] and a[head + 1 :] == history[head:]
    assert is_memory_message(a[head]) and memory.strip() in a[head]["content"]


def test_facts_split_and_stamp() -> None:
    body, facts = split_facts(SUMMARY + FACTS)
    assert facts is not None and PREF_1 in facts and "Durable" not in body
    assert body.strip() == SUMMARY.strip()
    assert split_facts(SUMMARY) == (SUMMARY, None)
    assert split_facts(SUMMARY + "## Durable Facts\nNone\n")[1] is None
    stamped = stamp_facts("- a\n  more of a\n- b", datetime(2026, 12, 2, tzinfo=UTC), "s9")
    assert stamped == "- [2026-12-02 · session s9] a\n  more of a\n- [2026-12-02 · session s9] b\n"


def test_fold_prompt_keeps_newest_notes_and_answer_is_capped() -> None:
    notes = [(f"2026-12-0{d}", f"- [2026-12-0{d} · session s] fact {d} " + "x" * 600)
             for d in range(1, 10)]
    prompt = fold_prompt("## Lessons\n- old", notes, max_bytes=1000, input_chars=2000)
    user = prompt[1]["content"]
    assert "fact 9" in user and "fact 1 " not in user and "- old" in user
    answer = "```markdown\n## Lessons\n" + "".join(f"- lesson {i}\n" for i in range(500)) + "```"
    text = clean_fold(answer, 1000)
    assert text is not None and len(text.encode()) <= 1000 and text.startswith("## Lessons")
    assert text.endswith(text.split("\n")[-1]) and "```" not in text
    assert clean_fold("I cannot do that.", 1000) is None
    assert cap("é" * 10, 5) == "éé"
