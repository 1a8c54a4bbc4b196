"""Upstream and summarizer faults: what the client gets, nothing hangs, the dialog is kept."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from proxy.store.dialog import read
from proxy.testing.fake_upstream import FakeUpstream, Reply

from .conftest import ProxyFactory
from .test_compaction import SYSTEM, Script, history, is_summarizer, model_calls

CHAT = "/v1/chat/completions"


def archived(root: Path, n: int, timeout: float = 5) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    lines: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        lines = [r for f in root.rglob("dialog/*.jsonl") for r in read(f)]
        if len(lines) >= n:
            break
        time.sleep(0.05)
    return lines


@pytest.mark.parametrize(
    "reply, status",
    [
        (Reply.error(429, "slow down", headers={"retry-after": "7"}), 429),
        (Reply.error(500, "boom"), 500),
        (Reply.error(503, "overloaded"), 503),
        (Reply(status=200, body=b'{"choices": [', headers={"content-type": "application/json"}), 200),
        (Reply(status=200, body=b"<html>not json</html>", headers={"content-type": "text/html"}), 200),
    ],
)
def test_upstream_answers_pass_through_and_dialog_is_kept(
    make_proxy: ProxyFactory, fake: FakeUpstream, tmp_path: Path, reply: Reply, status: int
) -> None:
    srv = make_proxy()
    fake.script(reply)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello there"}]
    r = httpx.post(srv.url + CHAT, content=orjson.dumps({"model": "gpt-4o", "messages": msgs}), timeout=10)
    assert r.status_code == status
    assert r.content == (reply.body if reply.body is not None else r.content)
    if status == 429:
        assert r.headers["retry-after"] == "7"
    assert [rec["message"] for rec in archived(tmp_path / "data", 2)][:2] == msgs


def test_slow_drip_stream_within_timeout_arrives_whole(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    srv = make_proxy({"upstream": {"timeout_s": 1.0}})
    fake.script(Reply(content="one two three four five six", stream_pieces=6, chunk_delay_s=0.3))
    body = orjson.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]})
    with httpx.stream("POST", srv.url + CHAT, content=body, timeout=10) as r:
        raw = b"".join(r.iter_raw())
    text = "".join(
        (orjson.loads(e[6:])["choices"][0]["delta"].get("content") or "")
        for e in raw.split(b"\n\n") if e.startswith(b"data: {") and b'"choices":[{' in e)
    assert text == "one two three four five six" and raw.endswith(b"data: [DONE]\n\n")


def test_stream_stalling_past_timeout_ends_cleanly(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    srv = make_proxy({"upstream": {"timeout_s": 0.4}})
    fake.script(Reply(content="a b c d", stream_pieces=4, chunk_delay_s=1.5))
    body = orjson.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]})
    t0 = time.monotonic()
    with httpx.stream("POST", srv.url + CHAT, content=body, timeout=10) as r:
        raw = b"".join(r.iter_raw())
    assert time.monotonic() - t0 < 5
    assert b'"code":"upstream_timeout"' in raw.split(b"\n\n")[-2]


def test_many_failures_leave_no_tasks_behind(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    srv = make_proxy({"upstream": {"timeout_s": 0.3}})

    async def go() -> list[int]:
        async with httpx.AsyncClient(timeout=10) as c:
            for _ in range(20):
                fake.script(Reply(delay_s=1))
            body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]})
            rs = await asyncio.gather(*(c.post(srv.url + CHAT, content=body) for _ in range(20)))
            return [r.status_code for r in rs]

    assert asyncio.run(go()) == [504] * 20
    loop = srv.loop
    assert loop is not None
    names = asyncio.run_coroutine_threadsafe(_task_names(), loop).result(5)
    assert names == []


async def _task_names() -> list[str]:
    await asyncio.sleep(0.2)
    me = asyncio.current_task()
    return [r for t in asyncio.all_tasks() if t is not me and not t.done()
            for r in [repr(t.get_coro())]
            if "ChatCompletions" in r or "run_until_disconnect" in r or "relay" in r]


def test_summarizer_timeout_serves_with_fallback(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    script = Script(fake, delay=3.0)
    srv = make_proxy({"compaction": {"context_windows": {"gpt-4o": 4000}, "summarizer_timeout_s": 0.5}})
    t0 = time.monotonic()
    r = httpx.post(srv.url + CHAT, content=orjson.dumps({"model": "gpt-4o", "messages": history(30)}),
                   headers={"x-session-id": "slow-summary"}, timeout=30)
    assert r.status_code == 200 and time.monotonic() - t0 < 2.5
    assert r.headers["x-ctxproxy-compacted"] == "1"
    summary = model_calls(fake)[-1]["messages"][1]["content"]
    assert "## Goal" in summary and "request 0" in summary
    assert script.summaries >= 1 and any(is_summarizer(x.json()) for x in fake.received)


def test_read_tool_cannot_reach_another_tenants_file(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    from .test_retrieval import big_output
    from .test_retrieval import history as read_history

    srv = make_proxy()
    # Tenant B offloads a file.
    httpx.post(srv.url + CHAT, headers={"authorization": "Bearer sk-b"}, timeout=10,
               content=orjson.dumps({"model": "gpt-4o", "messages": read_history(big_output())}))
    theirs = orjson.loads(fake.received[-1].body)["messages"][2]["content"]
    from proxy.pipeline.notice import parse_notice

    path = parse_notice(theirs).file_path  # type: ignore[union-attr]

    def responder(body: dict[str, Any]) -> Reply:
        if body["messages"][-1]["role"] == "tool":
            return Reply(content="done")
        return Reply(content=None, tool_calls=[{"name": "read_offloaded",
                                                "arguments": {"file_path": path, "start_line": 1}}])

    fake.responder = responder
    # Tenant A (same session name, other key) asks its model to read B's path.
    other = read_history("y\n" * 60000)
    httpx.post(srv.url + CHAT, headers={"authorization": "Bearer sk-a"}, timeout=10,
               content=orjson.dumps({"model": "gpt-4o", "messages": other}))
    result = fake.received[-1].json()["messages"][-1]["content"]
    assert result.startswith("error:") and "line 1:" not in result
