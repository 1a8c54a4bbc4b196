"""Compaction end to end: the proxy in process, the fake upstream as model and summarizer,
real SQLite."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from harness.inprocess import InProcess
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.model import Message, RequestView, StageOutcome
from proxy.pipeline.validate import ValidateStage, is_valid
from proxy.store.dialog import read

from .conftest import InProcessFactory

SYSTEM = "You are a test agent working on the repo at /srv/app."
SUMMARY = """## Goal
Fix the build.
## Constraints & Preferences
- keep /srv/app/setup.cfg unchanged
## Progress
### Done
- ran the tests
### In Progress
- fixing tests/test_x.py
### Blocked
- none
## Key Decisions
- use pytest
## Next Steps
- rerun
## Critical Context
- ValueError: bad thing in /srv/app/x.py
"""
WINDOW = {"compaction": {"context_windows": {"gpt-4o": 4000}}}


def is_summarizer(body: dict[str, Any]) -> bool:
    first = body["messages"][0].get("content") or ""
    return isinstance(first, str) and not first.startswith(SYSTEM) and "summar" in first.lower()


class Script:
    """The fake's responder: a summarizer (optionally slow or failing) and a model."""

    def __init__(self, fake: FakeUpstream, *, delay: float = 0.0, replies: list[Reply] | None = None) -> None:
        self.summaries = 0
        self.delay = delay
        self.replies = list(replies or [])
        fake.responder = self

    def __call__(self, body: dict[str, Any]) -> Reply:
        if is_summarizer(body):
            self.summaries += 1
            if self.replies:
                return self.replies.pop(0)
            return Reply(content=SUMMARY, delay_s=self.delay)
        return Reply(content="ok")


def model_calls(fake: FakeUpstream) -> list[dict[str, Any]]:
    return [r.json() for r in fake.received if r.path.endswith("chat/completions") and not is_summarizer(r.json())]


def history(turns: int, words: int = 60) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"request {t}: " + "please do the thing " * (words // 4)})
        msgs.append({"role": "assistant", "content": f"answer {t}: " + "done with it " * (words // 3)})
    return msgs


def tool_loop(request: str, turns: int, words: int) -> list[dict[str, Any]]:
    """One user request, then `turns` agent turns of one `ls` call whose result is `words` words."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": request}]
    for t in range(turns):
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{t}", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]})
        msgs.append({"role": "tool", "tool_call_id": f"c{t}", "content": f"entry{t} " * words})
    return msgs


async def post(app: InProcess, messages: list[dict[str, Any]], sid: str = "s1",
               **extra: Any) -> httpx.Response:
    body = {"model": "gpt-4o", "messages": messages, **extra}
    return await app.client.post("/v1/chat/completions", content=orjson.dumps(body),
                                 headers={"authorization": "Bearer sk-t", "x-session-id": sid})


def archived_lines(data: Path) -> list[dict[str, Any]]:
    return [rec for f in sorted(data.rglob("dialog/*.jsonl")) for rec in read(f)]


async def test_compacts_over_threshold_and_reuses(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    script = Script(fake)
    app = await make_inproc(WINDOW)
    msgs = history(30)  # ~3,500 tokens, over 0.75 x 4000
    r = await post(app, msgs)
    assert r.status_code == 200
    assert r.headers["x-ctxproxy-compacted"] == "1"
    assert int(r.headers["x-ctxproxy-tokens-out"]) <= 3000 < int(r.headers["x-ctxproxy-tokens-in"])
    assert script.summaries == 1
    fwd = model_calls(fake)[-1]["messages"]
    assert fwd[0] == msgs[0]
    assert fwd[1]["role"] == "system" and fwd[1]["content"].startswith("# Summary of previous conversation")
    assert "## Goal" in fwd[1]["content"] and "dialog/" in fwd[1]["content"]
    assert fwd[2:] == msgs[len(msgs) - len(fwd) + 2 :]
    # The next turn reuses the cached summary: no summarizer call, same prefix bytes.
    nxt = msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    r2 = await post(app, nxt)
    assert r2.headers["x-ctxproxy-compacted"] == "1" and script.summaries == 1
    fwd2 = model_calls(fake)[-1]["messages"]
    assert [orjson.dumps(m) for m in fwd2[: len(fwd)]] == [orjson.dumps(m) for m in fwd]


async def test_under_threshold_passes_byte_for_byte(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    Script(fake)
    app = await make_inproc(WINDOW)
    body = orjson.dumps({"model": "gpt-4o", "messages": history(3)})
    r = await app.client.post("/v1/chat/completions", content=body)
    assert r.headers["x-ctxproxy-compacted"] == "0"
    assert fake.received[-1].body == body


async def test_single_flight_for_concurrent_requests(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    script = Script(fake, delay=0.5)
    app = await make_inproc(WINDOW)
    msgs = history(30)
    rs = await asyncio.gather(*(post(app, msgs, sid="flight") for _ in range(8)))
    assert [r.status_code for r in rs] == [200] * 8
    assert script.summaries == 1
    summaries = {orjson.dumps(c["messages"][1]) for c in model_calls(fake)}
    assert len(summaries) == 1  # all eight forwarded the same summary bytes


async def test_precompaction_prepares_the_summary_the_threshold_request_uses(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    """Past precompact_ratio the summary is asked for in the background; the request that
    crosses the threshold uses it. (How much latency that hides is bench/'s to measure.)"""
    script = Script(fake)
    app = await make_inproc(WINDOW)
    pre = history(19)  # past 0.6 x 4000, under 0.75 x 4000
    r = await post(app, pre)
    assert r.headers["x-ctxproxy-compacted"] == "0"
    # The background summary was answered.
    assert await fake.wait_for_async(
        lambda f: any(is_summarizer(c.json()) for c in f.completed), timeout=5)
    crossing = history(26)
    r = await post(app, crossing)
    assert r.headers["x-ctxproxy-compacted"] == "1"
    assert script.summaries == 1  # no new call: the prepared summary was used


async def test_large_turns_start_preparation_before_precompact_ratio(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    """Turns of ~600 tokens in a 3,000-token budget: from 1,900 tokens two more such turns
    cross the threshold, so the summary is prepared then, not only past 0.6 x window (2,400),
    which the next turn would jump over with one turn of warning."""
    script = Script(fake, delay=0.5)
    app = await make_inproc(WINDOW)
    msgs = tool_loop("go", turns=3, words=320)
    r = await post(app, msgs)
    tokens = int(r.headers["x-ctxproxy-tokens-out"])
    assert 1500 < tokens < 2400 and r.headers["x-ctxproxy-compacted"] == "0", tokens
    assert await fake.wait_for_async(lambda f: script.summaries == 1, timeout=5)


@pytest.mark.parametrize("failure", [Reply.error(500, "down"), Reply(content="no sections here")])
async def test_summarizer_failure_serves_with_fallback(
    make_inproc: InProcessFactory, fake: FakeUpstream, failure: Reply
) -> None:
    script = Script(fake, replies=[failure, failure])
    app = await make_inproc(WINDOW)
    r = await post(app, history(30))
    assert r.status_code == 200 and r.headers["x-ctxproxy-compacted"] == "1"
    summary = model_calls(fake)[-1]["messages"][1]["content"]
    assert "## Goal" in summary and "request 0" in summary  # deterministic, with the user's words
    assert script.summaries == (1 if failure.status == 500 else 2)  # invalid answers retried once


async def test_invalid_answer_retried_once(make_inproc: InProcessFactory, fake: FakeUpstream) -> None:
    script = Script(fake, replies=[Reply(content="garbage")])
    app = await make_inproc(WINDOW)
    await post(app, history(30))
    assert script.summaries == 2
    assert "Fix the build." in model_calls(fake)[-1]["messages"][1]["content"]


async def test_client_rewrite_follows_new_branch(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    script = Script(fake)
    app = await make_inproc(WINDOW)
    msgs = history(30)
    await post(app, msgs)
    edited = [msgs[0], {"role": "user", "content": "a different start"}, *msgs[2:]]
    r = await post(app, edited)
    assert r.headers["x-ctxproxy-compacted"] == "1"
    assert script.summaries == 2  # the old summary does not cover this history


async def test_tool_pairs_survive_compaction(make_inproc: InProcessFactory, fake: FakeUpstream) -> None:
    Script(fake)
    app = await make_inproc(WINDOW)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "go"}]
    for t in range(20):
        calls = [{"id": f"c{t}_{k}", "type": "function", "function": {"name": "ls", "arguments": "{}"}} for k in range(2)]
        msgs.append({"role": "assistant", "content": None, "tool_calls": calls})
        for k in (1, 0):
            msgs.append({"role": "tool", "tool_call_id": f"c{t}_{k}", "content": "file " * 80})
    assert (await post(app, msgs)).status_code == 200
    fwd = model_calls(fake)[-1]["messages"]
    assert fwd[1]["content"].startswith("# Summary") and is_valid(fwd)


async def test_agent_loop_keeps_only_the_newest_whole_turn_when_it_fills_the_budget(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    """One user request, then many tool turns: when the newest turn alone is over
    keep_recent_ratio x window, the kept suffix is that turn (a whole assistant turn), not
    everything since the user's request, which the summary carries verbatim instead."""
    Script(fake)
    app = await make_inproc({**WINDOW, "compaction": {"context_windows": {"gpt-4o": 4000},
                                                      "keep_recent_ratio": 0.05}})
    msgs = tool_loop("fix the failing build in /srv/app", turns=20, words=100)
    r = await post(app, msgs)
    assert r.status_code == 200 and r.headers["x-ctxproxy-compacted"] == "1"
    fwd = model_calls(fake)[-1]["messages"]
    assert fwd[1]["content"].startswith("# Summary")
    assert "fix the failing build in /srv/app" in fwd[1]["content"]
    assert fwd[2:] == msgs[-2:]


async def test_newest_turn_over_budget_is_recut_not_refused(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    Script(fake)
    app = await make_inproc({**WINDOW, "offload": {"recent_max_bytes": 20000, "old_max_bytes": 1000}})
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "go"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "cat", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "some log line here\n" * 1000}]
    r = await post(app, msgs)
    assert r.status_code == 200
    assert int(r.headers["x-ctxproxy-tokens-out"]) <= 3000


async def test_the_clients_own_pairing_is_forwarded_as_sent(
    inproc: InProcess, fake: FakeUpstream
) -> None:
    """An orphan result and an unanswered call the client sent are the provider's to judge:
    nothing dropped, no placeholder, the client's very bytes."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "nope", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]}]
    fake.strict = False  # the provider refuses this request: here it is what it receives
    raw = orjson.dumps({"model": "gpt-4o", "messages": msgs})
    r = await inproc.client.post("/v1/chat/completions", content=raw)
    assert r.status_code == 200
    assert fake.received[-1].body == raw and not is_valid(msgs)


class _EvictFirstCall:
    """A stage of the proxy's own that evicts the first assistant turn with calls (as a bad
    compaction would), orphaning its results."""

    name = "evict"

    def __call__(self, messages: list[Message], request: RequestView) -> StageOutcome:
        first = next(i for i, m in enumerate(messages) if m.get("tool_calls"))
        return StageOutcome([*messages[:first], *messages[first + 1:]], True, {})


async def test_only_what_the_proxy_broke_is_repaired(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]}
    mine = {"role": "tool", "tool_call_id": "c1", "content": "listing"}
    theirs = {"role": "tool", "tool_call_id": "gone", "content": "the client's orphan"}
    msgs = [{"role": "user", "content": "hi"}, call, mine, {"role": "user", "content": "and?"},
            theirs]
    fake.strict = False  # the client's orphan stays: the provider would refuse it
    app = await make_inproc(stages=[_EvictFirstCall(), ValidateStage()])
    assert (await post(app, msgs)).status_code == 200
    assert fake.received[-1].json()["messages"] == [msgs[0], msgs[3], theirs]


async def test_archive_one_line_per_distinct_message(
    inproc: InProcess, fake: FakeUpstream, data_dir: Path
) -> None:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for t in range(40):
        msgs.append({"role": "user", "content": f"turn {t}"})
        r = await post(inproc, msgs, sid="archive")
        msgs.append(r.json()["choices"][0]["message"])
    await inproc.drain()  # the last answer is archived after the response
    lines = archived_lines(data_dir)
    assert len(lines) == len(msgs) == 81
    assert [rec["message"] for rec in lines] == msgs
    assert all(rec["v"] == 1 for rec in lines)


async def test_streamed_answer_is_archived_assembled(
    inproc: InProcess, fake: FakeUpstream, data_dir: Path
) -> None:
    fake.script(Reply(content="streamed words arrive", stream_pieces=4,
                      tool_calls=[{"id": "call_9", "name": "ls", "arguments": {"path": "."}}]))
    msgs = [{"role": "user", "content": "stream please"}]
    body = orjson.dumps({"model": "gpt-4o", "messages": msgs, "stream": True,
                         "stream_options": {"include_usage": True}})
    r = await inproc.client.post("/v1/chat/completions", content=body,
                                 headers={"x-session-id": "streamed"})
    assert r.status_code == 200
    await inproc.drain()
    lines = archived_lines(data_dir)
    answer = lines[-1]["message"]
    assert answer["role"] == "assistant" and answer["content"] == "streamed words arrive"
    assert answer["tool_calls"][0]["function"] == {"name": "ls", "arguments": '{"path":"."}'}
    assert lines[-1]["parent"] == lines[0]["chain"]


async def test_token_headers_are_real_counts(inproc: InProcess, fake: FakeUpstream) -> None:
    from proxy.tokens.counter import TokenCounter

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo wörld " * 50}]
    r = await post(inproc, msgs)
    expected = TokenCounter().count_request(msgs, "gpt-4o")
    assert int(r.headers["x-ctxproxy-tokens-in"]) == expected == int(r.headers["x-ctxproxy-tokens-out"])


async def test_session_stats_are_recorded(
    make_inproc: InProcessFactory, fake: FakeUpstream, data_dir: Path
) -> None:
    from proxy.store.db import Database

    Script(fake)
    app = await make_inproc(WINDOW)
    await post(app, history(3), sid="stats")
    await post(app, history(30), sid="stats")
    await app.drain()  # counters are written in batches, about once a second
    db = Database.in_dir(data_dir)
    try:
        [row] = [s for s in db.sessions(None) if s.session == "stats"]
        assert row.turns == 2 and row.compactions == 1 and row.tokens_in > row.tokens_out > 0
    finally:
        db.close()


async def test_compaction_model_is_used_for_the_summary(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    Script(fake)
    app = await make_inproc({"compaction": {"context_windows": {"gpt-4o": 4000}, "model": "cheap-summarizer"}})
    await post(app, history(30))
    summarizer_calls = [r.json() for r in fake.received if is_summarizer(r.json())]
    assert [c["model"] for c in summarizer_calls] == ["cheap-summarizer"]
    assert fake.received[-1].headers["authorization"] == "Bearer sk-t"


def test_demo_runs_offline(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "proxy", "demo", "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "summarizer calls" in out and "/files" in out
    turns = [line for line in out.splitlines() if line.strip()[:1].isdigit() and "tok" in line]
    assert len(turns) >= 25
    assert list(tmp_path.rglob("tool_result/*.txt")) and list(tmp_path.rglob("dialog/*.jsonl"))
