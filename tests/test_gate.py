"""The gate (docs/security.md): inbound keys, the secure default, a provider-judged key that leaves
nothing on disk when rejected, the per-tenant quota and the archive's retention. The proxy runs
in process, but where the wire matters (a refusal before the body arrives, a client that leaves)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import socket
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from harness.inprocess import InProcess
from proxy import cli
from proxy.auth import Gate
from proxy.config import config_from_mapping, exposure_problem
from proxy.config.auth import key_digest
from proxy.demo.fake.upstream import FakeUpstream, Reply
from proxy.errors import AuthRequired

from .conftest import InProcessFactory, ProxyFactory
from .test_upstream_failures import _abandon_once_forwarded

KEY_A, KEY_B, MASTER = "ck-alpha-0aa1f3", "ck-bravo-77b20e", "mk-master-5c1d9e"
UPSTREAM_KEY = "sk-operator-9f8e7d"
KEYS = {
    "auth": {
        "keys": [
            {"key": KEY_A, "tenant": "team-a"},
            {"key": "os.environ/CTXPROXY_TEST_KEY_B", "tenant": "team-b", "max_disk_mb": 64},
        ],
        "master_key": MASTER,
    },
    "upstream": {"api_key": UPSTREAM_KEY},
}
CHAT = "/v1/chat/completions"


def big_output(mark: str = "x", lines: int = 1500) -> str:
    return "".join(f"{mark} line {i}: " + "y" * 60 + "\n" for i in range(1, lines + 1))


def tool_history(mark: str = "x") -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "Agent."},
        {"role": "user", "content": f"run the build {mark}"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": big_output(mark)},
        {"role": "user", "content": "what failed?"},
    ]


def chat_body(messages: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o", "messages": messages or tool_history(), **extra}


async def post(app: InProcess, headers: dict[str, str], body: Any = None, path: str = CHAT,
               **extra: Any) -> httpx.Response:
    return await app.client.post(path, content=orjson.dumps(body or chat_body(**extra)),
                                 headers=headers)


def stored_files(data: Path) -> list[str]:
    """Everything under data_dir but the database (which exists from start-up)."""
    if not data.exists():
        return []
    return sorted(str(p.relative_to(data)) for p in data.rglob("*")
                  if p.is_file() and not p.name.startswith("_index.sqlite3"))


def rows(data: Path, table: str) -> int:
    with sqlite3.connect(data / "_index.sqlite3") as conn:
        return int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])


@pytest.fixture
def env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CTXPROXY_TEST_KEY_B", KEY_B)


@pytest.fixture
async def closed(make_inproc: InProcessFactory, env_key: None) -> InProcess:
    return await make_inproc(KEYS)


# --- inbound keys -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, "/chat/completions", "/v1/embeddings", "/v1/models",
                                  "/v1/responses", "/v1/files/file-1"])
@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer ck-wrong"},
                                     {"x-api-key": KEY_A + "x"}, {"authorization": "Bearer"},
                                     {"authorization": f"Bearer {UPSTREAM_KEY}"}])
async def test_a_missing_or_wrong_key_gets_401_and_nothing_happens(
    closed: InProcess, fake: FakeUpstream, data_dir: Path, path: str, headers: dict[str, str]
) -> None:
    method = "GET" if path in ("/v1/models", "/v1/files/file-1") else "POST"
    r = await closed.client.request(method, path, headers=headers,
                                    content=orjson.dumps(chat_body()) if method == "POST" else None)
    assert r.status_code == 401
    error = r.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert fake.request_count == 0
    assert stored_files(data_dir) == []


@pytest.mark.parametrize("path", [CHAT, "/v1/messages", "/files"])
async def test_a_key_header_sent_twice_is_refused_everywhere(
    closed: InProcess, fake: FakeUpstream, data_dir: Path, path: str
) -> None:
    """Which copy the gate, /files and the provider would read differs (first, last): the
    request is refused before anything happens."""
    headers = [("authorization", f"Bearer {KEY_A}"), ("authorization", f"Bearer {MASTER}")]
    method = "GET" if path == "/files" else "POST"
    r = await closed.client.request(method, path, headers=headers,
                                    content=orjson.dumps(chat_body()) if method == "POST" else None)
    assert r.status_code == 400
    assert "more than one 'authorization' header" in r.text
    assert fake.request_count == 0 and stored_files(data_dir) == []


def test_401_comes_before_the_body_is_read(make_proxy: ProxyFactory, env_key: None) -> None:
    """Headers announcing a 50 MB body, then nothing: the refusal does not wait for it."""
    closed = make_proxy(KEYS)
    host, port = closed.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/json\r\ncontent-length: 50000000\r\n\r\n")
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 401")


@pytest.mark.parametrize("header", ["authorization", "x-api-key", "api-key"])
async def test_a_configured_key_is_its_tenant_and_never_goes_upstream(
    closed: InProcess, fake: FakeUpstream, data_dir: Path, header: str
) -> None:
    value = f"Bearer {KEY_A}" if header == "authorization" else KEY_A
    r = await post(closed, {header: value, "x-session-id": "build-1"})
    assert r.status_code == 200 and r.headers["x-ctxproxy-offloaded"] == "1"
    got = fake.received[-1]
    assert got.headers["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert KEY_A not in str(got.raw_headers) and "x-api-key" not in got.headers
    await closed.stop()
    assert (data_dir / "team-a" / "build-1" / "tool_result").is_dir()
    assert {p.name for p in data_dir.iterdir() if not p.name.startswith("_")} == {"team-a"}


async def test_keys_from_the_environment_and_each_tenant_sees_its_own(
    closed: InProcess, data_dir: Path
) -> None:
    client = closed.client
    assert (await post(closed, {"authorization": f"Bearer {KEY_A}", "x-session-id": "s-a"})).status_code == 200
    assert (await post(closed, {"x-api-key": KEY_B, "x-session-id": "s-b"})).status_code == 200
    mine = (await client.get("/files", headers={"authorization": f"Bearer {KEY_B}",
                                                "accept": "application/json"})).json()
    assert [s["session"] for s in mine["sessions"]] == ["s-b"] and mine["tenant"] == "team-b"
    assert (await client.get("/files/team-a/s-a", headers={"x-api-key": KEY_B})).status_code == 404
    everyone = (await client.get("/files", headers={"authorization": f"Bearer {MASTER}",
                                                    "accept": "application/json"})).json()
    assert sorted(s["tenant"] for s in everyone["sessions"]) == ["team-a", "team-b"]
    assert (await client.get("/files")).status_code == 401


async def test_the_master_key_calls_everything_as_its_own_tenant(
    closed: InProcess, fake: FakeUpstream, data_dir: Path
) -> None:
    r = await post(closed, {"authorization": f"Bearer {MASTER}", "x-session-id": "ops"})
    assert r.status_code == 200
    assert (await closed.client.get("/v1/models", headers={"x-api-key": MASTER})).status_code == 200
    await closed.stop()
    assert (data_dir / "master" / "ops").is_dir()


def test_only_digests_are_kept_and_compared_in_constant_time(
    env_key: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = config_from_mapping(KEYS)
    assert KEY_A not in repr(config) and KEY_B not in repr(config) and MASTER not in repr(config)
    assert config.auth.keys[0].key == key_digest(KEY_A)
    assert config.auth.master_key == key_digest(MASTER)
    gate = Gate(config.auth)
    compared: list[bytes] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append(a)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    for key, tenant in ((KEY_A, "team-a"), (KEY_B, "team-b")):
        compared.clear()
        assert gate.caller({"authorization": f"Bearer {key}"}).tenant == tenant
        # The master key and then every configured key, whichever matched: no early exit.
        assert compared == [hashlib.sha256(key.encode()).digest()] * 3
    with pytest.raises(AuthRequired):
        gate.caller({"x-api-key": "nope"})


def test_a_key_may_be_configured_as_its_digest() -> None:
    config = config_from_mapping({"auth": {"keys": [{"key": key_digest(KEY_A), "tenant": "t"}]}})
    assert Gate(config.auth).caller({"api-key": KEY_A}).tenant == "t"


@pytest.mark.parametrize("bad", [
    {"keys": [{"key": "a", "tenant": "../x"}]},
    {"keys": [{"key": "a", "tenant": "master"}]},
    {"keys": [{"key": "a", "tenant": "t"}, {"key": "a", "tenant": "u"}]},
    {"keys": [{"key": "a", "tenant": "t", "max_disk_mb": 1}, {"key": "b", "tenant": "t"}]},
    {"keys": [{"key": "", "tenant": "t"}]},
])
def test_bad_key_lists_are_config_errors(bad: dict[str, Any]) -> None:
    with pytest.raises(Exception, match="auth"):
        config_from_mapping({"auth": bad})


async def test_keys_never_reach_a_log_line_or_a_file(
    closed: InProcess, data_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="proxy")
    await post(closed, {"authorization": f"Bearer {KEY_A}"})
    await post(closed, {"authorization": "Bearer ck-not-a-key"})
    await closed.client.get("/files", headers={"authorization": f"Bearer {MASTER}"})
    await closed.stop()
    blobs = [p.read_bytes() for p in data_dir.rglob("*") if p.is_file()]
    for secret in (KEY_A, KEY_B, MASTER, UPSTREAM_KEY, "ck-not-a-key"):
        assert secret not in caplog.text
        assert not any(secret.encode() in b for b in blobs)


# --- the secure default ---------------------------------------------------------------------------


def test_an_operator_key_beyond_loopback_without_keys_refuses_to_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"upstream: {{api_key: {UPSTREAM_KEY}}}\nstorage: {{data_dir: {tmp_path}}}\n")
    assert cli.main(["serve", "--config", str(config), "--host", "0.0.0.0", "--port", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "auth.keys" in err and "allow_unauthenticated" in err
    assert UPSTREAM_KEY not in err


@pytest.mark.parametrize(("data", "refused"), [
    ({"server": {"host": "0.0.0.0"}, "upstream": {"api_key": "k"}}, True),
    ({"server": {"host": "::"}, "upstream": {"api_key": "k"}}, True),
    ({"server": {"host": "10.1.2.3"}, "model_list": [{"model_name": "c", "litellm_params": {
        "model": "anthropic/x", "api_key": "k"}}]}, True),
    ({"server": {"host": "127.0.0.1"}, "upstream": {"api_key": "k"}}, False),
    ({"server": {"host": "::1"}, "upstream": {"api_key": "k"}}, False),
    ({"server": {"host": "localhost"}, "upstream": {"api_key": "k"}}, False),
    ({"server": {"host": "0.0.0.0"}}, False),  # the client's own key goes upstream
    ({"server": {"host": "0.0.0.0"}, "upstream": {"api_key": "k"},
      "auth": {"keys": [{"key": "a", "tenant": "t"}]}}, False),
    ({"server": {"host": "0.0.0.0"}, "upstream": {"api_key": "k"},
      "auth": {"allow_unauthenticated": True}}, False),
])
def test_exposure_rule(data: dict[str, Any], refused: bool) -> None:
    assert (exposure_problem(config_from_mapping(data)) is not None) is refused


# --- without keys: the provider judges the client's own key ---------------------------------------


SUMMARY = """## Goal
Finish the build of the service and explain what failed.
## Constraints & Preferences
- keep the current toolchain
## Progress
### Done
- ran the build and read its output
### In Progress
- reading the failures one by one
### Blocked
- nothing at the moment
## Key Decisions
- fix the linker step first
## Next Steps
- rerun the build after the fix
## Critical Context
- the error is in core.o at line 1280
"""


def is_summary_call(body: dict[str, Any]) -> bool:
    return "summar" in str(body["messages"][0].get("content", "")).lower()


def summarizing(body: dict[str, Any]) -> Reply:
    if is_summary_call(body):
        return Reply(content=SUMMARY)
    return Reply(content="ok")


def long_history(turns: int = 40) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": "Agent."}]
    for t in range(turns):
        out += [{"role": "user", "content": f"request {t}: " + "please do it " * 20},
                {"role": "assistant", "content": f"answer {t}: " + "did it " * 25}]
    return out + tool_history()[1:]


@pytest.fixture
async def judged(make_inproc: InProcessFactory) -> InProcess:
    """No auth.keys, no upstream.api_key, a small window: offload and compaction both happen
    on the first request."""
    return await make_inproc({"compaction": {"context_windows": {"gpt-4o": 6000}}})


@pytest.mark.parametrize("status", [401, 403])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_the_provider_rejects_leaves_nothing_on_disk(
    judged: InProcess, fake: FakeUpstream, data_dir: Path, status: int, stream: bool
) -> None:
    fake.default = Reply.error(status)
    r = await post(judged, {"authorization": "Bearer sk-stolen-or-typo"},
                   chat_body(long_history(), stream=stream))
    assert r.status_code == status
    assert fake.request_count >= 1  # forwarded (and the summarizer asked), then rejected
    await judged.stop()
    assert stored_files(data_dir) == []
    assert [rows(data_dir, t) for t in ("sessions", "messages", "summaries")] == [0, 0, 0]


async def test_an_accepted_key_is_known_from_then_on(
    judged: InProcess, fake: FakeUpstream, data_dir: Path
) -> None:
    headers = {"authorization": "Bearer sk-real", "x-session-id": "s1"}
    first = await post(judged, headers, chat_body(tool_history("first")))
    assert first.status_code == 200 and first.headers["x-ctxproxy-offloaded"] == "1"
    # Known now: even an answer the provider rejects later keeps what was received.
    fake.default = Reply.error(401)
    assert (await post(judged, headers, chat_body(tool_history("second")))).status_code == 401
    await judged.stop()
    files = stored_files(data_dir)
    assert len([f for f in files if "/tool_result/" in f]) == 2
    assert not any(f.startswith("_staging") for f in files)
    assert rows(data_dir, "messages") >= 6


async def test_a_summary_with_the_clients_key_proves_it_and_points_into_the_archive(
    judged: InProcess, fake: FakeUpstream, data_dir: Path
) -> None:
    fake.responder = summarizing
    r = await post(judged, {"authorization": "Bearer sk-new", "x-session-id": "s2"},
             chat_body(long_history()))
    assert r.status_code == 200 and r.headers["x-ctxproxy-compacted"] == "1"
    summary = fake.received[-1].json()["messages"][1]["content"]
    assert summary.startswith("# Summary") and "dialog/" in summary


def test_a_client_that_leaves_before_the_verdict_leaves_nothing(
    make_proxy: ProxyFactory, fake: FakeUpstream, data_dir: Path
) -> None:
    judged = make_proxy()
    fake.script(Reply(delay_s=20))
    asyncio.run(_abandon_once_forwarded(judged.url + CHAT, orjson.dumps(chat_body()), fake,
                                        headers={"authorization": "Bearer sk-impatient"}))
    assert fake.wait_for(lambda f: f.cancelled_count == 1, timeout=10)
    judged.stop()
    assert stored_files(data_dir) == []


# --- the quota ------------------------------------------------------------------------------------


async def test_over_quota_requests_are_forwarded_and_write_nothing(
    make_inproc: InProcessFactory, fake: FakeUpstream, data_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = await make_inproc({"storage": {"max_tenant_mb": 0.05}, "upstream": {"api_key": UPSTREAM_KEY}})
    headers = {"authorization": "Bearer sk-q", "x-session-id": "q1"}
    first = await post(app, headers, chat_body(tool_history("one")))  # a ~100 KB original: over 50 KB
    assert first.status_code == 200 and "x-ctxproxy-quota" not in first.headers
    assert first.headers["x-ctxproxy-offloaded"] == "1"
    nxt = tool_history("one") + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c2", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c2", "content": big_output("two")}]
    with caplog.at_level(logging.WARNING, logger="proxy.store"):
        r = await post(app, headers, chat_body(nxt))
        again = await post(app, headers, chat_body(nxt))
    for answer in (r, again):
        assert answer.status_code == 200 and answer.headers["x-ctxproxy-quota"] == "exceeded"
        # Forwarded: the saved result stays cut, the new one goes uncut (its original is not
        # saved, so it may not be cut).
        assert answer.headers["x-ctxproxy-offloaded"] == "1"
    # The last model call (a compaction may be prepared in the background meanwhile).
    forwarded = [r.json()["messages"] for r in fake.received if not is_summary_call(r.json())][-1]
    assert forwarded[-1]["content"] == big_output("two")
    assert "tool result" not in caplog.text and caplog.text.count("over its disk quota") == 1
    assert "ctxproxy_quota_exceeded_total 2.0" in (await app.client.get("/metrics")).text
    await app.stop()
    files = stored_files(data_dir)
    assert len([f for f in files if "/tool_result/" in f]) == 1
    archived = b"".join((data_dir / f).read_bytes() for f in files if f.endswith(".jsonl"))
    assert b"two line 1:" not in archived and b"one line 1:" in archived


async def test_a_keys_own_quota_overrides_the_default(
    make_inproc: InProcessFactory, fake: FakeUpstream
) -> None:
    app = await make_inproc({"storage": {"max_tenant_mb": 1000}, "upstream": {"api_key": UPSTREAM_KEY},
                      "auth": {"keys": [{"key": KEY_A, "tenant": "small", "max_disk_mb": 0.05},
                                        {"key": KEY_B, "tenant": "big"}]}})
    for key, over in ((KEY_A, True), (KEY_B, False)):
        headers = {"authorization": f"Bearer {key}"}
        assert "x-ctxproxy-quota" not in (await post(app, headers)).headers
        assert ("x-ctxproxy-quota" in (await post(app, headers)).headers) is over


# --- gc: retention and the quota report -----------------------------------------------------------


async def test_gc_expires_old_dialogs_and_summaries_and_reports_usage(
    make_inproc: InProcessFactory, fake: FakeUpstream, data_dir: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fake.responder = summarizing
    overrides = {"upstream": {"api_key": UPSTREAM_KEY},
                 "compaction": {"context_windows": {"gpt-4o": 6000}}}
    app = await make_inproc(overrides)
    headers = {"authorization": "Bearer sk-g", "x-session-id": "old"}
    assert (await post(app, headers, chat_body(long_history()))).headers["x-ctxproxy-compacted"] == "1"
    await app.stop()
    session = next(data_dir.glob("*/old"))
    long_ago = time.time() - 40 * 86400
    for f in session.rglob("*"):
        os.utime(f, (long_ago, long_ago))
    with sqlite3.connect(data_dir / "_index.sqlite3") as conn:
        conn.execute("UPDATE summaries SET created_at = '2020-01-01T00:00:00.000+00:00'")
        conn.execute("UPDATE sessions SET last_seen = '2020-01-01T00:00:00.000+00:00'")
    config = tmp_path / "gc.yaml"
    config.write_text(f"storage: {{data_dir: {data_dir}, dialog_ttl_days: 30, max_tenant_mb: 1}}\n")
    assert cli.main(["gc", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "deleted 1 dialog file(s), 1 summary(ies), 1 session(s) and 0 memory file(s)" in out
    assert [rows(data_dir, t) for t in ("sessions", "messages", "summaries", "dialog_files")] == [0, 0, 0, 0]
    assert not list(session.rglob("*.jsonl")) and not list(session.rglob("*.md"))
    assert "tenant " not in out  # everything expired: nobody uses any disk
    # The same history comes back: archived (and compacted) again, as new.
    app = await make_inproc(overrides)
    assert (await post(app, headers, chat_body(long_history()))).headers["x-ctxproxy-compacted"] == "1"
    await app.stop()
    assert list(session.rglob("*.jsonl")) and rows(data_dir, "summaries") == 1
    assert cli.main(["gc", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert f"tenant {session.parent.name}: 0." in out and "MiB (quota 1 MiB)" in out
