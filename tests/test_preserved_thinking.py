"""Preserved thinking through the whole proxy: an Anthropic agent loop on a model that binds
every signed thinking block to its prefix, in front of the fake that enforces the check as the
API does (proxy.demo.fake.prefix_check). The client sends every answer back exactly as it got it,
thinking included, as Claude Code and the SDKs do; ctxproxy offloads, ages, compacts, injects
memory and runs its read tool in between. Not one request may be refused.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.app import create_app
from proxy.compaction.message import SUMMARY_HEADING
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.demo.servers import ServerThread, serve_in_thread
from proxy.memory.inject import MEMORY_HEADING
from tests.pg import pg_url, postgres

from .conftest import proxy_config

__all__ = ["pg_url", "postgres"]  # fixtures

MODEL = "claude-opus-5-5"
SIZES = {"small": 400, "medium": 8_000, "large": 24_000, "huge": 80_000}
SUMMARY = """## Goal
Run every step and keep the totals right.
## Constraints & Preferences
- never touch migrations/
## Progress
### Done
- the first steps
### In Progress
- the next step
### Blocked
- nothing
## Key Decisions
- one step at a time
## Next Steps
- the remaining steps
## Critical Context
- outputs repeat per step
"""
FACTS = """## Durable Facts
- Preference: "never touch migrations/"
"""
TOOLS = [{"name": "Bash", "description": "Run a command.",
          "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]


def is_fold(body: dict[str, Any]) -> bool:
    return not body.get("tools") and "You maintain MEMORY.md" in str(body)


def is_summarizer(body: dict[str, Any]) -> bool:
    first = (body.get("messages") or [{}])[0]
    return not body.get("tools") and not is_fold(body) and "summar" in (
        str(body.get("system", "")) + str(first.get("content", ""))).lower()


class Model:
    """The fake's responder: a thinking model that runs Bash once per turn, reads an offloaded
    output with the proxy's tool when ``reads`` says so, summarizes and folds."""

    def __init__(self, fake: FakeUpstream, *, reads: bool = False) -> None:
        self.reads = reads
        self.summaries = 0
        self.folds = 0
        self.read_calls = 0
        fake.responder = self

    def __call__(self, body: dict[str, Any]) -> Reply:
        if is_fold(body):
            self.folds += 1
            return Reply(content='## Preferences & Standing Instructions\n- "never touch '
                                 'migrations/"\n')
        if is_summarizer(body):
            self.summaries += 1
            return Reply(content=SUMMARY + FACTS)
        messages = body["messages"]
        n = len(messages)
        last = messages[-1]["content"]
        notice = next((b for b in last if isinstance(b, dict) and b.get("type") == "tool_result"
                       and not str(b.get("tool_use_id")).startswith("toolu_r")
                       and "read_offloaded" in str(b.get("content"))), None) if isinstance(
            last, list) else None
        if self.reads and notice is not None:  # once per output: not its read's result
            self.read_calls += 1
            path = str(notice["content"]).split("file_path=", 1)[1].split()[0]
            return Reply(content=None, reasoning=f"I read more of {path}", tool_calls=[
                {"name": "read_offloaded", "id": f"toolu_r{n}",
                 "arguments": {"file_path": path, "start_line": 2}}])
        return Reply(content=None, reasoning=f"next I run step {n}", tool_calls=[
            {"name": "Bash", "id": f"toolu_{n}_{uuid.uuid4().hex[:6]}",
             "arguments": {"cmd": f"step {n}"}}])


def output(n: int, size: str) -> str:
    return "\n".join(f"step {n} record {i}: total={i * 7 % 1000}"
                     for i in range(1, SIZES[size] // 30 + 2))


def run(urls: list[str], sizes: list[str], *, stream: bool = False,
        memory_scope: str | None = None) -> list[dict[str, Any]]:
    """The agent loop, one request per step (alternating over ``urls``: replicas); the
    answers as the client got them."""
    session = f"pt-{uuid.uuid4().hex[:12]}"
    history: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "run the steps"}]}]
    headers = {"x-api-key": "sk-ant-test", "anthropic-version": "2023-06-01",
               "x-claude-code-session-id": session}
    if memory_scope is not None:
        headers["x-ctxproxy-memory-scope"] = memory_scope
    answers = []
    with httpx.Client(timeout=60) as client:
        for n, size in enumerate(sizes):
            payload = {"model": MODEL, "max_tokens": 2048, "system": [
                {"type": "text", "text": "You run steps.", "cache_control": {"type": "ephemeral"}}],
                "tools": TOOLS, "messages": history, "stream": False,
                "thinking": {"type": "adaptive"}}
            r = client.post(urls[n % len(urls)] + "/v1/messages", json=payload, headers=headers)
            assert r.status_code == 200, r.text[:500]
            answer = r.json()
            answers.append(answer)
            history.append({"role": "assistant", "content": answer["content"]})
            uses = [b for b in answer["content"] if b.get("type") == "tool_use"]
            assert uses and all(b["name"] == "Bash" for b in uses)  # the proxy's reads hidden
            history.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b["id"], "content": output(n, size)}
                for b in uses]})
    return answers


def forwarded(fake: FakeUpstream) -> list[dict[str, Any]]:
    return [r.json() for r in fake.received if r.path == "/v1/messages"
            and r.json().get("tools")]


@pytest.fixture
def checking() -> Iterator[tuple[FakeUpstream, str]]:
    """A prefix-checking fake of this test's own."""
    fake = FakeUpstream(prefix_check=True)
    with serve_in_thread(fake) as upstream:
        yield fake, upstream.url


def proxies(fake_url: str, data: Path, n: int = 1, window: int = 30_000,
            **overrides: Any) -> Iterator[ServerThread]:
    for i in range(n):
        config = proxy_config(fake_url + "/v1", data / f"r{i}", {
            "compaction": {"context_windows": {MODEL: window}}, **overrides})
        yield serve_in_thread(create_app(config), lifespan="on")


def no_refusals(fake: FakeUpstream) -> None:
    assert [v.message for v in fake.refused] == []
    assert fake.dropped == []


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(sizes=st.lists(st.sampled_from(list(SIZES)), min_size=3, max_size=14))
def test_no_request_is_refused_across_ageing_and_compaction(
    checking: tuple[FakeUpstream, str], tmp_path_factory: pytest.TempPathFactory,
    sizes: list[str],
) -> None:
    fake, url = checking
    Model(fake)
    fake.refused.clear()
    [srv] = proxies(url, tmp_path_factory.mktemp("pt"))
    with srv:
        run([srv.url], sizes)
    no_refusals(fake)


def test_a_long_session_compacts_often_and_nothing_is_refused(
    checking: tuple[FakeUpstream, str], tmp_path: Path
) -> None:
    fake, url = checking
    model = Model(fake)
    [srv] = proxies(url, tmp_path)
    with srv:
        run([srv.url], ["huge", "large", "medium", "huge", "large", "small", "huge", "large",
                        "huge", "medium", "large", "huge"])
    no_refusals(fake)
    sent = forwarded(fake)
    # The summary leads the first user turn (a system role there is refused by the API).
    assert all(b["messages"][0]["role"] == "user" for b in sent)
    summaries = {blk["text"] for b in sent for blk in b["messages"][0]["content"]
                 if blk.get("type") == "text" and SUMMARY_HEADING in blk["text"]}
    assert model.summaries >= 2 and len(summaries) >= 2  # several epochs
    # Thinking went back within epochs (the check had work) and the system field never changed.
    assert sum(any(blk.get("type") == "thinking" for m in b["messages"]
                   if m["role"] == "assistant" for blk in m["content"]) for b in sent) >= 4
    assert len({str(b["system"]) for b in sent}) == 1 and len({str(b["tools"]) for b in sent}) == 1


def test_memory_folds_refuse_nothing(checking: tuple[FakeUpstream, str], tmp_path: Path) -> None:
    """A fold changes MEMORY.md in the background: a session keeps its pinned version until
    its next compaction, so the memory message never changes mid-epoch."""
    fake, url = checking
    model = Model(fake)
    [srv] = proxies(url, tmp_path, memory={"enabled": True})
    with srv:
        run([srv.url], ["huge", "large", "huge", "large", "medium"], memory_scope="team")
        srv.drain()
        assert model.folds >= 1
        run([srv.url], ["huge", "large", "huge", "large", "huge", "large"], memory_scope="team")
    no_refusals(fake)
    sent = forwarded(fake)
    assert all(b["messages"][0]["role"] == "user" for b in sent)
    assert any(blk.get("type") == "text" and blk["text"].startswith(MEMORY_HEADING)
               for b in sent for blk in b["messages"][0]["content"])


def test_two_replicas_on_postgres_forward_the_same_bytes(
    checking: tuple[FakeUpstream, str], tmp_path: Path, pg_url: str
) -> None:
    """Requests alternate between two replicas sharing PostgreSQL: the summary, its epoch and
    the thinking each one drops are the store's, so either replica forwards the same bytes."""
    fake, url = checking
    Model(fake)
    a, b = proxies(url, tmp_path, 2, storage={"url": pg_url})
    with a, b:
        run([a.url, b.url], ["huge", "large", "huge", "medium", "large", "huge", "large",
                             "huge", "large"])
    no_refusals(fake)


def test_the_read_tools_rounds_refuse_nothing(
    checking: tuple[FakeUpstream, str], tmp_path: Path
) -> None:
    """The model reads offloaded outputs with the proxy's tool: the client never sees those
    rounds, so the next turn's history lacks them, and the answer's thinking was produced
    after them. The proxy puts them back (pipeline.replay) within an epoch, and leaves them
    out, with the answer's thinking, once a compaction began a new one."""
    fake, url = checking
    model = Model(fake, reads=True)
    # A kept share large enough that a compaction keeps reads and their re-reads (markers).
    [srv] = proxies(url, tmp_path, compaction={"context_windows": {MODEL: 40_000},
                                               "keep_recent_ratio": 0.6})  # epochs of a few turns
    with srv:
        run([srv.url], ["huge", "small", "huge", "medium", "huge", "small", "huge", "medium",
                        "huge", "small", "huge", "medium"])
    no_refusals(fake)
    assert model.read_calls >= 4 and model.summaries >= 1
    # Some turn carried a replayed round of an earlier answer: the proxy's call, then the answer.
    assert any(any(b.get("name") == "read_offloaded" for m in body["messages"][:-2]
                   if m["role"] == "assistant" for b in m["content"])
               for body in forwarded(fake))


# -- file-aware forms (issue 22): re-reads, edits, repeated outputs ------------------------------

FILES = {p: "".join(f"def {p[1]}_{i}(x):\n    return x * {i}  # {p}\n" for i in range(n))
         for p, n in (("/a.py", 400), ("/b.py", 300), ("/c.py", 900))}
LOG = "".join(f"tests/test_{k}.py::test_{j} PASSED\n" for k in range(6) for j in range(60))
# Each step: the call the model makes; the client answers it as Claude Code would.
PLAN: list[tuple[str, dict[str, Any]]] = [
    ("Read", {"file_path": "/a.py"}), ("Read", {"file_path": "/b.py"}),
    ("Bash", {"cmd": "pytest -q"}), ("Read", {"file_path": "/a.py"}),
    ("Edit", {"file_path": "/a.py", "old_string": "return x * 7  # /a.py",
              "new_string": "return -x  # /a.py"}),
    ("Read", {"file_path": "/a.py"}), ("Bash", {"cmd": "pytest -q"}),
    ("Read", {"file_path": "/c.py"}), ("Read", {"file_path": "/b.py"}),
    ("Read", {"file_path": "/c.py"}), ("Bash", {"cmd": "pytest -q"}),
    ("Read", {"file_path": "/a.py"}), ("Read", {"file_path": "/c.py"}),
    ("Read", {"file_path": "/b.py"}),
]


class FileModel(Model):
    """A thinking model working through PLAN, one call per turn."""

    def __call__(self, body: dict[str, Any]) -> Reply:
        if is_fold(body) or is_summarizer(body):
            return super().__call__(body)
        n = sum(1 for m in body["messages"] if m["role"] == "assistant"
                and any(b.get("type") == "tool_use" and not str(b.get("id")).startswith(
                    "toolu_r") for b in m["content"]))
        name, args = PLAN[min(n, len(PLAN) - 1)]
        return Reply(content=None, reasoning=f"step {n}: {name}", tool_calls=[
            {"name": name, "id": f"toolu_{n}_{uuid.uuid4().hex[:6]}", "arguments": args}])


def _answer(name: str, args: dict[str, Any], files: dict[str, str], n: int) -> str:
    reminder = f"\n\n<system-reminder>\n<total_tokens>{10**6 - n} tokens left</total_tokens>"
    reminder += "\n</system-reminder>"
    if name == "Read":
        lines = files[args["file_path"]].split("\n")
        return "\n".join(f"{i}\t{line}" for i, line in enumerate(lines, 1)) + reminder
    if name == "Edit":
        files[args["file_path"]] = files[args["file_path"]].replace(
            args["old_string"], args["new_string"])
        return f"The file {args['file_path']} has been updated successfully." + reminder
    return LOG + reminder


def test_file_aware_forms_refuse_nothing(
    checking: tuple[FakeUpstream, str], tmp_path: Path
) -> None:
    """Re-reads forwarded as deltas, repeats as references, superseded reads as markers at
    the compactions: every signed thinking block still finds the prefix it was made with."""
    fake, url = checking
    model = FileModel(fake)
    files = dict(FILES)
    # A kept share large enough that a compaction keeps reads and their re-reads (markers).
    [srv] = proxies(url, tmp_path, compaction={"context_windows": {MODEL: 40_000},
                                               "keep_recent_ratio": 0.6})
    history: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "fix a.py"}]}]
    headers = {"x-api-key": "sk-ant-test", "anthropic-version": "2023-06-01",
               "x-claude-code-session-id": f"pt-{uuid.uuid4().hex[:12]}"}
    tools = [{"name": n, "input_schema": {"type": "object"}} for n in ("Read", "Edit", "Bash")]
    with srv, httpx.Client(timeout=60) as client:
        for n in range(len(PLAN)):
            payload = {"model": MODEL, "max_tokens": 2048, "tools": tools, "messages": history,
                       "system": [{"type": "text", "text": "You fix files.",
                                   "cache_control": {"type": "ephemeral"}}],
                       "thinking": {"type": "adaptive"}}
            r = client.post(srv.url + "/v1/messages", json=payload, headers=headers)
            assert r.status_code == 200, r.text[:500]
            answer = r.json()
            history.append({"role": "assistant", "content": answer["content"]})
            history.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b["id"],
                 "content": _answer(b["name"], b["input"], files, n)}
                for b in answer["content"] if b.get("type") == "tool_use"]})
    no_refusals(fake)
    sent = forwarded(fake)
    texts = [str(blk.get("content")) for b in sent for m in b["messages"] if m["role"] == "user"
             for blk in m["content"] if isinstance(blk, dict) and blk.get("type") == "tool_result"]
    assert model.summaries >= 1  # an epoch boundary with markers
    assert any("[ctxproxy: unchanged since" in t for t in texts)
    assert any("[ctxproxy: changed since" in t for t in texts)
    assert any("[ctxproxy: identical to the output" in t for t in texts)
    assert any(" superseded by the Read" in t or "stale:" in t for t in texts)
