"""The ledger through the proxy: every billed call recorded from the provider's own usage, in
the three formats, stream and not, against a fake that caches prompts as providers do; the
counterfactual and the cache-break reasons on real sessions (compaction, client edit, TTL)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from harness.inprocess import InProcess
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.store.ledger_entry import LedgerEntry
from proxy.usage import Usage

from .conftest import InProcessFactory

PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
HEADERS = {
    "chat": {"authorization": "Bearer sk-ledger", "x-ctxproxy-session": "s1"},
    "responses": {"authorization": "Bearer sk-ledger", "x-ctxproxy-session": "s1"},
    "messages": {"x-api-key": "sk-ant-ledger", "anthropic-version": "2023-06-01",
                 "x-ctxproxy-session": "s1"},
}
MODEL = {"chat": "gpt-4o", "responses": "gpt-4o", "messages": "claude-sonnet-4-5"}
PAD = "the quick brown fox jumps over the lazy dog. " * 120  # ~1,350 tokens a turn


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def body(api: str, turns: int, *, stream: bool = False, first: str = "start") -> dict[str, Any]:
    """A growing conversation of ``turns`` user turns (each answered), in ``api``'s shape,
    with Claude Code's cache markers for Messages (system, and the last block)."""
    msgs: list[dict[str, Any]] = []
    for i in range(turns):
        text = (first if i == 0 else f"turn {i}") + " " + PAD
        msgs.append({"role": "user", "content": text})
        if i < turns - 1:
            msgs.append({"role": "assistant", "content": f"answer {i}"})
    if api == "chat":
        out: dict[str, Any] = {"model": MODEL[api], "messages": [
            {"role": "system", "content": "You are terse."}, *msgs]}
        if stream:
            out["stream_options"] = {"include_usage": True}
    elif api == "responses":
        out = {"model": MODEL[api], "instructions": "You are terse.", "input": [
            {"type": "message", "role": m["role"], "content": m["content"]} for m in msgs]}
    else:
        msgs = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
                for m in msgs]
        msgs[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
        out = {"model": MODEL[api], "max_tokens": 100, "messages": msgs, "system": [
            {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]}
    return {**out, "stream": stream}


async def start(make_inproc: InProcessFactory, fake: FakeUpstream, clock: Clock,
                overrides: dict[str, Any] | None = None) -> InProcess:
    app = await make_inproc(overrides)
    fake.prompt_cache = True
    fake.clock = clock
    app.state["services"].ledger.clock = clock
    return app


async def send(app: InProcess, api: str, payload: dict[str, Any]) -> None:
    r = await app.client.post(PATHS[api], content=orjson.dumps(payload), headers=HEADERS[api])
    assert r.status_code == 200, r.text[:300]
    await app.drain()


def entries(app: InProcess, tenant: str | None = None) -> list[LedgerEntry]:
    store = app.state["services"].store.ledger
    rows = store.totals(tenant)
    assert len(rows) == 1
    return store.entries(rows[0].tenant, rows[0].session)  # type: ignore[no-any-return]


def provider(fake: FakeUpstream, i: int) -> Usage:
    """What the fake billed for its ``i``-th model request."""
    p = fake.received[i].prompt
    assert p is not None
    return Usage(input=p.tokens - p.read - p.write_5m - p.write_1h, cache_read=p.read,
                 cache_write_5m=p.write_5m, cache_write_1h=p.write_1h)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_every_request_is_recorded_with_the_providers_usage(
    make_inproc: InProcessFactory, fake: FakeUpstream, api: str, stream: bool
) -> None:
    clock = Clock()
    app = await start(make_inproc, fake, clock)
    for turns in (1, 2, 3):
        await send(app, api, body(api, turns, stream=stream))
        clock.now += 10
    rows = entries(app)
    assert [e.kind for e in rows] == ["request"] * 3
    for i, e in enumerate(rows):
        assert e.usage is not None and not e.estimated
        billed = provider(fake, i)
        assert (e.usage.input, e.usage.cache_read, e.usage.cache_write) == (
            billed.input, billed.cache_read, billed.cache_write)
        assert e.usage.output > 0 and e.cost is not None and e.cost > 0
        assert e.cache_reason is None
        assert e.tokens_sent > 0 and e.tokens_forwarded > 0
    # Caching held: each request read what the previous one left, and so would the client.
    assert rows[1].usage is not None and rows[1].usage.cache_read > 0
    assert rows[2].usage is not None and rows[1].usage.cache_read < rows[2].usage.cache_read
    assert rows[2].direct is not None and rows[2].direct.cache_read > 0
    assert rows[2].gap_s == 10
    metrics = (await app.client.get("/metrics")).text
    assert 'ctxproxy_billed_tokens_total{call="request",part="cache_read"}' in metrics
    assert 'ctxproxy_cache_breaks_total{reason="ttl"} 0.0' in metrics


async def test_a_lapsed_ttl_and_a_client_edit_are_told_apart(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    clock = Clock()
    app = await start(make_inproc, fake, clock)
    await send(app, "messages", body("messages", 1))
    clock.now += 30
    await send(app, "messages", body("messages", 2))
    clock.now += 400  # over the 5-minute TTL: the provider's cache is gone
    await send(app, "messages", body("messages", 3))
    clock.now += 30
    await send(app, "messages", body("messages", 4, first="a rewritten first request"))
    rows = entries(app)
    assert [e.cache_reason for e in rows] == [None, None, "ttl", "client"]
    ttl, edit = rows[2], rows[3]
    assert ttl.usage is not None and ttl.usage.cache_read < 100  # only system, if anything
    assert ttl.direct is not None and ttl.direct.cache_read == 0  # the client pays it too
    assert edit.direct is not None and edit.direct.cache_read == 0
    metrics = (await app.client.get("/metrics")).text
    assert 'ctxproxy_cache_breaks_total{reason="ttl"} 1.0' in metrics
    assert 'ctxproxy_cache_breaks_total{reason="client"} 1.0' in metrics


@pytest.mark.parametrize("api", ["chat", "messages"])
async def test_a_compaction_is_the_proxys_own_break_and_the_summarizer_a_cost(
    make_inproc: InProcessFactory, fake: FakeUpstream, api: str
) -> None:
    clock = Clock()
    window = {MODEL[api]: 9000}
    app = await start(make_inproc, fake, clock, {"compaction": {"context_windows": window}})
    for turns in range(1, 7):
        await send(app, api, body(api, turns))
        clock.now += 20
    rows = entries(app)
    requests = [e for e in rows if e.kind == "request"]
    summaries = [e for e in rows if e.kind == "summarizer"]
    assert summaries and all(e.usage is not None and e.cost for e in summaries)
    compacted = [e for e in requests if e.compaction]
    assert compacted, [e.epoch for e in requests]
    assert all(e.cache_reason == "compaction" for e in compacted)
    assert any(c.what == "summary" for c in compacted[0].changes)
    assert any(c.what == "evicted" for c in compacted[0].changes)
    # Within an epoch the forwarded history only grows: no other break.
    assert all(e.cache_reason is None for e in requests if not e.compaction)
    totals = app.state["services"].store.ledger.totals()[0]
    assert totals.breaks == {"compaction": len(compacted)}
    assert totals.cost == pytest.approx(sum(e.cost or 0 for e in rows))


async def test_read_rounds_are_recorded_as_costs(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    clock = Clock()
    app = await start(make_inproc, fake, clock)
    read = {"name": "read_offloaded", "arguments": {"file_path": "tool_result/none.txt"}}
    fake.script(Reply(content=None, tool_calls=[{**read, "id": "r1"}]), Reply(content="done"))
    payload = {**body("chat", 1), "tools": [{"type": "function", "function": {
        "name": "bash", "parameters": {"type": "object", "properties": {}}}}]}
    await send(app, "chat", payload)
    rows = entries(app)
    assert [e.kind for e in rows] == ["request", "read_round"]
    assert rows[1].request == rows[0].id and rows[0].rounds == 1
    assert rows[1].usage is not None and rows[1].usage.cache_read > 0  # the same prefix again


async def test_a_stream_without_usage_is_estimated(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    clock = Clock()
    app = await start(make_inproc, fake, clock)
    await send(app, "chat", {**body("chat", 1, stream=True), "stream_options": None})
    [e] = entries(app)
    assert e.usage is None and e.estimated and e.estimate is not None
    assert e.estimate.prompt == e.tokens_forwarded


async def test_a_rejected_key_records_nothing(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    clock = Clock()
    app = await start(make_inproc, fake, clock)
    fake.script(Reply.error(401, "bad key", type="invalid_request_error"))
    r = await app.client.post(PATHS["chat"], content=orjson.dumps(body("chat", 1)),
                              headers=HEADERS["chat"])
    assert r.status_code == 401
    await app.drain()
    assert app.state["services"].store.ledger.totals() == []


async def test_the_ledger_can_be_turned_off(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    app = await make_inproc({"ledger": {"enabled": False}})
    await send(app, "chat", body("chat", 1))
    assert app.state["services"].store.ledger.totals() == []
    assert not app.state["services"].ledger.enabled
