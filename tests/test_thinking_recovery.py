"""Preserved thinking (proxy.upstream.thinking): Anthropic's prefix-check 400 on a thinking
block is retried once with drop_block and the beta header, the body otherwise the forwarded
bytes; the session remembers it (in process and in the store, SQLite and PostgreSQL); what is
not that 400, or a client that chose its own binding, passes as it came; the read loop recovers
mid-loop and keeps drop_block; the anthropic SDK sees the 200."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest

from harness.inprocess import InProcess
from proxy import rawjson as json
from proxy.demo.fake.replies import ErrorDetail
from proxy.demo.fake.upstream import FakeUpstream, Received, Reply
from proxy.formats.messages.answer import MessagesTap
from proxy.metrics import Metrics
from proxy.session import Identity, tenant_of
from proxy.store.db import Database
from proxy.store.dialog import DialogArchive
from proxy.store.migrations import MIGRATIONS, SCHEMA_VERSION
from proxy.store.paths import db_path
from proxy.store.postgres import PostgresBackend, upgrade
from proxy.store.postgres.schema import MIGRATIONS as PG_MIGRATIONS
from proxy.store.postgres.schema import SCHEMA_VERSION as PG_SCHEMA_VERSION
from proxy.truncation.notice import parse_notice
from proxy.upstream.thinking import (
    BETA,
    ThinkingBindings,
    carries_blocks,
    prefix_mismatch,
    with_beta,
    with_drop_block,
)
from tests.conftest import InProcessFactory, ProxyFactory, proxy_config
from tests.pg import pg_url, postgres

from .test_messages import big, turn, user

__all__ = ["pg_url", "postgres"]  # fixtures

PATH = "/v1/messages"
MODEL = "claude-opus-4-7"
TENANT = tenant_of("sk-ant-think")
SESSION = "think-1"
MISMATCH = ("messages.1.content.0: Invalid `signature` in `thinking` block. The block is bound "
            "to a different conversation. Remove the block, or set "
            "`thinking.block_binding.prefix_mismatch_behavior` to \"drop_block\".")
DROP = {"prefix_mismatch_behavior": "drop_block"}

# The migrations that add the session's thinking flag (SQLite, PostgreSQL).
THINKING_VERSION = 4
PG_THINKING_VERSION = 3


def mismatch(where: str = "messages.1.content.0") -> Reply:
    message = MISMATCH.replace("messages.1.content.0", where)
    return Reply(status=400, error_detail=ErrorDetail(message=message,
                                                      type="invalid_request_error"))


def history(thinking: bool = True) -> list[dict[str, Any]]:
    answer: list[dict[str, Any]] = [{"type": "text", "text": "done"}]
    if thinking:
        answer.insert(0, {"type": "thinking", "thinking": "plan it",
                          "signature": "EqQBCkYIBxgCKkD-sig-" + "Q" * 40})
    return [user("start"), {"role": "assistant", "content": answer}, user("and now?")]


def request(messages: list[dict[str, Any]] | None = None, **extra: Any) -> bytes:
    return orjson.dumps({"model": MODEL, "max_tokens": 2048, "messages": messages or history(),
                         "thinking": {"type": "enabled", "budget_tokens": 1024}, **extra})


def headers(session: str = SESSION, **more: str) -> dict[str, str]:
    return {"x-api-key": "sk-ant-think", "anthropic-version": "2023-06-01",
            "content-type": "application/json", "x-claude-code-session-id": session, **more}


def calls(fake: FakeUpstream) -> list[Received]:
    return [r for r in fake.received if r.path == PATH]


def dropped_total(app: InProcess) -> float:
    value = app.state["services"].metrics.registry.get_sample_value(
        "ctxproxy_thinking_dropped_total")
    return float(value or 0.0)


def assert_retry_of(first: Received, again: Received) -> None:
    """``again`` is ``first`` with drop_block in ``thinking`` and the beta header, nothing
    else changed: every other member is the same bytes, in the same order."""
    assert BETA not in first.headers.get("anthropic-beta", "")
    assert again.body == with_drop_block(first.body)
    before, after = json.members(first.body), json.members(again.body)
    assert list(before) == list(after)
    for name in before:
        if name != "thinking":
            assert bytes(after[name]) == bytes(before[name]), name
    # The bodies here are compact JSON: byte for byte the same but for the thinking member.
    assert again.body == first.body.replace(bytes(before["thinking"]), bytes(after["thinking"]))
    thinking = orjson.loads(bytes(after["thinking"]))
    assert thinking == {**orjson.loads(bytes(before["thinking"])), "block_binding": DROP}
    assert BETA in again.headers["anthropic-beta"].split(",")
    same = {"anthropic-beta", "content-length"}
    assert {k: v for k, v in again.headers.items() if k not in same} == \
        {k: v for k, v in first.headers.items() if k not in same}


def text_of(r: httpx.Response) -> str:
    """The answer's text, whole or streamed."""
    if not r.headers["content-type"].startswith("text/event-stream"):
        return "".join(b.get("text", "") for b in r.json()["content"])
    tap = MessagesTap()
    tap.stream(r.content)
    answer = tap.answer()
    assert answer is not None
    return "".join(b.get("text", "") for b in answer["content"])


def sends_drop_block(rec: Received) -> bool:
    thinking = orjson.loads(rec.body).get("thinking") or {}
    return (thinking.get("block_binding") == DROP
            and BETA in rec.headers.get("anthropic-beta", "").split(","))


# --- the pieces ---------------------------------------------------------------------------------


def test_the_beta_joins_the_clients_values_once() -> None:
    assert with_beta([("x-api-key", "k")]) == [("x-api-key", "k"), ("anthropic-beta", BETA)]
    got = with_beta([("anthropic-beta", "a-1, b-2"), ("x", "y"), ("anthropic-beta", f"a-1,{BETA}")])
    assert got == [("anthropic-beta", f"a-1,b-2,{BETA}"), ("x", "y")]


def test_drop_block_replaces_only_the_thinking_member() -> None:
    raw = b'{"model":"m","thinking":{"type":"enabled","budget_tokens":1024},"x":[1.50,"\\u00e9"]}'
    assert with_drop_block(raw) == (
        b'{"model":"m","thinking":{"type":"enabled","budget_tokens":1024,"block_binding":'
        b'{"prefix_mismatch_behavior":"drop_block"}},"x":[1.50,"\\u00e9"]}')
    assert orjson.loads(with_drop_block(b'{"model":"m","thinking":null}'))["thinking"] == \
        orjson.loads(with_drop_block(b'{"model":"m"}'))["thinking"] == \
        {"type": "adaptive", "block_binding": DROP}


async def test_a_huge_body_is_edited_off_the_loop_to_the_same_bytes() -> None:
    from proxy.upstream.thinking import _HUGE_BODY, _dropping

    raw = request([user("x" * _HUGE_BODY), *history()[1:]])
    assert len(raw) > _HUGE_BODY and await _dropping(raw) == with_drop_block(raw)


def test_what_counts_as_the_prefix_check() -> None:
    body = orjson.dumps({"type": "error", "error": {"type": "invalid_request_error",
                                                    "message": MISMATCH}})
    assert prefix_mismatch(400, body) == MISMATCH
    assert prefix_mismatch(429, body) is None
    other = orjson.dumps({"type": "error", "error": {"type": "invalid_request_error",
                                                     "message": "max_tokens: too large"}})
    assert prefix_mismatch(400, other) is None
    assert prefix_mismatch(400, b"<html>") is None and prefix_mismatch(400, b"[]") is None
    assert carries_blocks(history()) and not carries_blocks(history(thinking=False))
    redacted = [user("a"), {"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "xyz"}]}, user("b")]
    assert carries_blocks(redacted) and not carries_blocks("text")


# --- forwarding ---------------------------------------------------------------------------------


async def test_a_refused_thinking_block_is_sent_again_with_drop_block(
    inproc: InProcess, fake: FakeUpstream
) -> None:
    fake.script(mismatch(), Reply(content="recovered"))
    raw = request()
    r = await inproc.client.post(PATH, content=raw, headers=headers(**{"anthropic-beta": "x-1"}))
    assert r.status_code == 200 and r.json()["content"][-1]["text"] == "recovered"
    assert r.headers["x-ctxproxy-thinking"] == "dropped"
    first, again = calls(fake)
    assert first.body == raw  # nothing else changed: the client's bytes
    assert_retry_of(first, again)
    assert again.headers["anthropic-beta"] == f"x-1,{BETA}"
    assert dropped_total(inproc) == 1
    # The session's next request goes with drop_block from the start: no 400 first.
    fake.script(Reply(content="again"))
    r = await inproc.client.post(PATH, content=raw, headers=headers())
    assert r.status_code == 200 and r.headers["x-ctxproxy-thinking"] == "drop_block"
    assert len(calls(fake)) == 3 and sends_drop_block(calls(fake)[-1])
    assert calls(fake)[-1].body == again.body
    # Another session (or the same one without thinking blocks) goes as it came.
    r = await inproc.client.post(PATH, content=raw, headers=headers("think-other"))
    assert "x-ctxproxy-thinking" not in r.headers and calls(fake)[-1].body == raw
    plain = request(history(thinking=False))
    await inproc.client.post(PATH, content=plain, headers=headers())
    assert calls(fake)[-1].body == plain and dropped_total(inproc) == 1


async def test_a_stream_recovers_before_its_first_event(
    inproc: InProcess, fake: FakeUpstream
) -> None:
    fake.script(mismatch(), Reply(content="streamed", reasoning="hm"))
    raw = request(stream=True)
    r = await inproc.client.post(PATH, content=raw, headers=headers("think-stream"))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-ctxproxy-thinking"] == "dropped"
    assert text_of(r) == "streamed" and "event: error" not in r.text
    first, again = calls(fake)
    assert first.body == raw
    assert_retry_of(first, again)
    assert dropped_total(inproc) == 1


async def test_a_client_without_a_thinking_object_gets_adaptive_thinking(
    inproc: InProcess, fake: FakeUpstream
) -> None:
    fake.script(mismatch(), Reply(content="ok"))
    raw = orjson.dumps({"model": MODEL, "max_tokens": 64, "messages": history()})
    r = await inproc.client.post(PATH, content=raw, headers=headers("think-none"))
    assert r.status_code == 200
    first, again = calls(fake)
    assert again.body == raw[:-1] + b',"thinking":{"type":"adaptive","block_binding":' \
        b'{"prefix_mismatch_behavior":"drop_block"}}}'


@pytest.mark.parametrize("case", ["other 400", "no thinking blocks", "client's own binding"])
async def test_what_is_not_the_prefix_check_passes_as_it_came(
    inproc: InProcess, fake: FakeUpstream, case: str
) -> None:
    raw = request()
    reply = mismatch()
    if case == "other 400":
        reply = Reply(status=400, error_detail=ErrorDetail(message="max_tokens: too large"))
    elif case == "no thinking blocks":
        raw = request(history(thinking=False))
    else:
        raw = request(thinking={"type": "enabled", "budget_tokens": 1024,
                                "block_binding": {"prefix_mismatch_behavior": "error"}})
    fake.script(reply, Reply(content="never asked"))
    r = await inproc.client.post(PATH, content=raw, headers=headers("think-" + case[:5]))
    assert r.status_code == 400 and "x-ctxproxy-thinking" not in r.headers
    assert r.json()["type"] == "error"
    [only] = calls(fake)
    assert only.body == raw and dropped_total(inproc) == 0


@pytest.mark.parametrize("second", [Reply.error(429, "slow down"), mismatch("messages.3.content.1")],
                         ids=["429", "400 again"])
async def test_a_retry_that_fails_is_the_clients_answer(
    inproc: InProcess, fake: FakeUpstream, second: Reply
) -> None:
    fake.script(mismatch(), second, Reply(content="later"))
    raw = request()
    r = await inproc.client.post(PATH, content=raw, headers=headers("think-fail"))
    assert r.status_code == second.status  # the provider's, as it gave it
    assert r.json()["type"] == "error" and r.json()["error"]["message"] == (
        "slow down" if second.status == 429
        else MISMATCH.replace("messages.1.content.0", "messages.3.content.1"))
    assert len(calls(fake)) == 2 and sends_drop_block(calls(fake)[1])  # once, never twice
    # Not accepted: the session is not sent with drop_block from the start.
    await inproc.client.post(PATH, content=raw, headers=headers("think-fail"))
    assert calls(fake)[2].body == raw


async def test_the_memory_reaches_another_replica_through_the_store(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    one, two = await make_inproc(), await make_inproc()  # the same data_dir and database
    fake.script(mismatch(), Reply(content="ok"), Reply(content="ok"))
    raw = request()
    assert (await one.client.post(PATH, content=raw, headers=headers("think-rep"))).status_code == 200
    await one.drain()
    r = await two.client.post(PATH, content=raw, headers=headers("think-rep"))
    assert r.status_code == 200 and r.headers["x-ctxproxy-thinking"] == "drop_block"
    assert len(calls(fake)) == 3 and sends_drop_block(calls(fake)[2])
    assert dropped_total(two) == 0


class Reads:
    """The app's flag store, counting the reads it is asked for."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.reads = 0

    def thinking_dropped(self, tenant: str, session: str) -> bool:
        self.reads += 1
        return bool(self.inner.thinking_dropped(tenant, session))

    def mark_thinking_dropped(self, tenant: str, session: str) -> None:
        self.inner.mark_thinking_dropped(tenant, session)


async def test_the_flag_comes_with_the_session_row_the_archive_reads(
    inproc: InProcess, fake: FakeUpstream
) -> None:
    svc = inproc.state["services"]
    reads = Reads(svc.thinking.flags)
    svc.thinking.flags = reads
    messages = history()
    for n in range(3):  # every turn has new messages: the archive reads the session row
        fake.script(Reply(content=f"turn {n}"))
        r = await inproc.client.post(PATH, content=request(messages), headers=headers("think-row"))
        assert "x-ctxproxy-thinking" not in r.headers
        # The tenant's first request waits for the provider to accept its key before anything
        # is written (proxy.writes): that one asks the store itself.
        assert reads.reads == 1
        messages = [*messages, {"role": "assistant", "content": [{"type": "text",
                                                                 "text": f"turn {n}"}]},
                    user(f"next {n}")]
    await inproc.drain()
    # Another replica recovered the session: the next turn's archive write brings the flag.
    await asyncio.to_thread(svc.store.sessions.mark_thinking_dropped, TENANT, "think-row")
    fake.script(Reply(content="with drop_block"))
    r = await inproc.client.post(PATH, content=request(messages), headers=headers("think-row"))
    assert r.headers["x-ctxproxy-thinking"] == "drop_block" and sends_drop_block(calls(fake)[-1])
    assert reads.reads == 1  # no query of its own
    # A resent request (nothing new to archive) asks the store itself, once per recheck_s.
    svc.thinking._known.clear()
    for _ in range(2):
        r = await inproc.client.post(PATH, content=request(messages), headers=headers("think-row"))
        assert r.headers["x-ctxproxy-thinking"] == "drop_block"
    assert reads.reads == 2


# --- the read loop ------------------------------------------------------------------------------


class MidLoop:
    """Round 1 reads the offloaded file; round 2 is refused by the prefix check; its retry
    reads again; the next round answers."""

    def __init__(self, fake: FakeUpstream) -> None:
        self.calls = 0
        fake.responder = self

    def __call__(self, req: dict[str, Any]) -> Reply:
        self.calls += 1
        if self.calls == 2:
            return mismatch()
        if self.calls == 4:
            return Reply(content="Line 1500 says y.", reasoning="read it")
        notice = next(parse_notice(b["content"]) for m in req["messages"] if m["role"] == "user"
                      for b in m["content"] if isinstance(b, dict) and b.get("type") == "tool_result"
                      and isinstance(b["content"], str) and parse_notice(b["content"]))
        assert notice is not None
        return Reply(content=None, reasoning="read more", tool_calls=[
            {"name": "read_offloaded", "id": f"toolu_read{self.calls}",
             "arguments": {"file_path": notice.file_path, "start_line": notice.next_line}}])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_the_read_loop_recovers_mid_loop_and_keeps_drop_block(
    inproc: InProcess, fake: FakeUpstream, stream: bool
) -> None:
    model = MidLoop(fake)
    messages = [user("run"), *turn(1, big("r")), user("what is on line 1500?")]
    raw = orjson.dumps({"model": MODEL, "max_tokens": 1024, "messages": messages,
                        "thinking": {"type": "adaptive"}, "stream": stream})
    r = await inproc.client.post(PATH, content=raw, headers=headers(f"think-loop-{stream}"))
    assert r.status_code == 200 and model.calls == 4
    assert text_of(r) == "Line 1500 says y." and "read_offloaded" not in r.text
    if not stream:  # a stream's headers went out with round 1, before the recovery
        assert r.headers["x-ctxproxy-thinking"] == "dropped"
        assert r.headers["x-ctxproxy-read-rounds"] == "2"
    one, refused, again, last = calls(fake)
    assert not sends_drop_block(one) and not sends_drop_block(refused)
    assert_retry_of(refused, again)
    assert sends_drop_block(last)  # the rest of the loop keeps it
    assert dropped_total(inproc) == 1


# --- the anthropic SDK over a socket ------------------------------------------------------------


def test_the_anthropic_sdk_sees_the_200(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    srv = make_proxy()
    client = anthropic.Anthropic(base_url=srv.url, api_key="sk-ant-sdk", max_retries=0,
                                 default_headers={"x-claude-code-session-id": "think-sdk"})
    fake.script(mismatch(), Reply(content="hello again"))
    raw = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=2048, messages=history(),  # type: ignore[arg-type]
        thinking={"type": "enabled", "budget_tokens": 1024})
    assert raw.headers["x-ctxproxy-thinking"] == "dropped"
    assert raw.parse().content[-1].text == "hello again"  # type: ignore[union-attr]
    fake.script(mismatch(), Reply(content="streamed again"))
    with client.messages.stream(model=MODEL, max_tokens=2048, messages=history(),  # type: ignore[arg-type]
                                extra_headers={"x-claude-code-session-id": "think-sdk-2"}) as s:
        assert s.get_final_text() == "streamed again"
    assert [sends_drop_block(c) for c in calls(fake)] == [False, True, False, True]
    assert httpx.get(srv.url + "/metrics").text.count("ctxproxy_thinking_dropped_total 2.0") == 1


# --- the session memory -------------------------------------------------------------------------


class Counted:
    """A flag store that counts its reads."""

    def __init__(self) -> None:
        self.marked: set[tuple[str, str]] = set()
        self.reads = 0

    def thinking_dropped(self, tenant: str, session: str) -> bool:
        self.reads += 1
        return (tenant, session) in self.marked

    def mark_thinking_dropped(self, tenant: str, session: str) -> None:
        self.marked.add((tenant, session))


async def test_the_store_is_read_once_per_session_and_rechecked_after_a_while() -> None:
    from proxy.background import Background

    store, now = Counted(), [0.0]
    flags = ThinkingBindings(store, Metrics(), Background(), recheck_s=30, clock=lambda: now[0])
    who = Identity("t-1", "s-1", None)
    assert [await flags.needed(who) for _ in range(5)] == [False] * 5
    assert store.reads == 1
    store.marked.add(("t-1", "s-1"))  # another replica recovered
    now[0] = 29.0
    assert not await flags.needed(who) and store.reads == 1
    now[0] = 31.0
    assert await flags.needed(who) and store.reads == 2
    now[0] = 1e9
    assert await flags.needed(who) and store.reads == 2  # a True is kept for good
    # A request without thinking blocks never asks.
    other = Identity("t-1", "s-2", None)
    binding = flags.binding(other, {"messages": history(thinking=False)})
    assert not binding.blocks() and store.reads == 2


async def test_a_store_that_fails_is_only_a_missed_shortcut() -> None:
    from proxy.background import Background

    class Down(Counted):
        def thinking_dropped(self, tenant: str, session: str) -> bool:
            raise sqlite3.OperationalError("disk I/O error")

        def mark_thinking_dropped(self, tenant: str, session: str) -> None:
            raise sqlite3.OperationalError("disk I/O error")

    background = Background()
    flags = ThinkingBindings(Down(), Metrics(), background)
    who = Identity("t-1", "s-1", None)
    assert not await flags.needed(who)
    flags.remember(who, persist=True)
    await background.drain()
    assert await flags.needed(who)  # this process knows


async def test_a_tenant_over_its_quota_is_remembered_in_process_only() -> None:
    from proxy.background import Background

    store, background = Counted(), Background()
    flags = ThinkingBindings(store, Metrics(), background)
    who = Identity("t-1", "s-1", None)
    flags.remember(who, persist=False)  # conversation.py: persist=writes.allowed
    await background.drain()
    assert await flags.needed(who) and not store.marked and store.reads == 0


def test_sqlite_keeps_the_flag_and_migrates_an_older_database(tmp_path: Path) -> None:
    path = db_path(tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = sqlite3.connect(path)
    for step in MIGRATIONS[:THINKING_VERSION - 1]:  # the database before the flag
        for statement in step:
            old.execute(statement)
    old.execute(f"PRAGMA user_version={THINKING_VERSION - 1}")
    old.execute("INSERT INTO sessions (tenant, session, turns, first_seen, last_seen) "
                "VALUES ('t', 'old', 7, '2026-01-01T00:00:00.000+00:00', "
                "'2026-01-01T00:00:00.000+00:00')")
    old.commit()
    old.close()
    with Database(path) as db:
        assert db.schema_version == SCHEMA_VERSION
        assert not db.thinking_dropped("t", "old") and not db.thinking_dropped("t", "new")
        db.mark_thinking_dropped("t", "old")
        db.mark_thinking_dropped("t", "new")
        db.mark_thinking_dropped("t", "new")  # idempotent
        row = db.session_stats("t", "old")
        assert row is not None and row.turns == 7  # the counters untouched
    with Database(path) as db:  # a restart, or another process on the same data_dir
        assert db.thinking_dropped("t", "old") and db.thinking_dropped("t", "new")
        assert not db.thinking_dropped("u", "old")  # per tenant
        # The archive's write reads the session row: the flag comes with it.
        archive = DialogArchive(tmp_path, db)
        assert archive.record("t", "new", history()).thinking_dropped is True
        assert archive.record("t", "other", history()).thinking_dropped is False
        assert archive.record("t", "new", history()).thinking_dropped is None  # nothing new


def test_postgres_keeps_the_flag_across_replicas_and_migrates(pg_url: str, tmp_path: Path) -> None:
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert upgrade(conn, PG_THINKING_VERSION - 1) == list(range(1, PG_THINKING_VERSION))
        conn.execute("INSERT INTO sessions (tenant, session, turns, first_seen, last_seen) "
                     "VALUES ('t', 'old', 7, now(), now())")
    config = proxy_config("http://127.0.0.1:9/v1", tmp_path, {"storage": {"url": pg_url}})
    one = PostgresBackend(config.storage, digest_cache_bytes=1 << 20)
    two = PostgresBackend(config.storage, digest_cache_bytes=1 << 20)
    try:
        assert len(PG_MIGRATIONS) == PG_SCHEMA_VERSION
        assert not two.sessions.thinking_dropped("t", "old")
        one.sessions.mark_thinking_dropped("t", "old")
        one.sessions.mark_thinking_dropped("t", "new")
        one.sessions.mark_thinking_dropped("t", "new")
        assert two.sessions.thinking_dropped("t", "old") and two.sessions.thinking_dropped("t", "new")
        assert not two.sessions.thinking_dropped("u", "new")
        row = two.sessions.session_stats("t", "old")
        assert row is not None and row.turns == 7
        assert two.dialog.record("t", "new", history()).thinking_dropped is True
        assert two.dialog.record("t", "other", history()).thinking_dropped is False
        assert two.dialog.record("t", "new", history()).thinking_dropped is None
    finally:
        one.close()
        two.close()


async def test_the_memory_survives_a_restart_on_postgres(
    make_inproc: InProcessFactory, fake: FakeUpstream, pg_url: str
) -> None:
    first = await make_inproc({"storage": {"url": pg_url}})
    fake.script(mismatch(), Reply(content="ok"), Reply(content="ok"))
    raw = request()
    assert (await first.client.post(PATH, content=raw, headers=headers("think-pg"))).status_code == 200
    await first.drain()
    await first.stop()
    second = await make_inproc({"storage": {"url": pg_url}})
    r = await second.client.post(PATH, content=raw, headers=headers("think-pg"))
    assert r.headers["x-ctxproxy-thinking"] == "drop_block" and len(calls(fake)) == 3
