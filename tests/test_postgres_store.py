"""The PostgreSQL backend's stores against a real server (proxy.store.postgres): schema
migrations under a lock, each kind of state, first-writer-wins summaries and claims, the same
archive lines and numbering as the files backend, faults, and copying a data_dir over."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from harness.postgres import PostgresServer
from proxy.errors import OffloadedFileMissing, SchemaError, StoreUnavailable
from proxy.store.db import Database
from proxy.store.dialog import DialogArchive, chain_hashes
from proxy.store.postgres import PgPool, PostgresBackend, upgrade
from proxy.store.postgres.copy import copy_data_dir
from proxy.store.postgres.schema import SCHEMA_VERSION, schema_version
from proxy.store.summaries import SummaryRecord, SummaryStore
from proxy.store.tool_results import ToolResultStore, result_id
from proxy.store.usage import DiskUsage
from tests.conftest import proxy_config
from tests.pg import pg_url, postgres

__all__ = ["pg_url", "postgres"]  # fixtures

T, S = "acme", "sess-1"
NOW = datetime(2026, 12, 2, 10, 0, 0, tzinfo=UTC)


@pytest.fixture
def backend(pg_url: str, tmp_path: Path) -> Iterator[PostgresBackend]:
    config = proxy_config("http://127.0.0.1:9/v1", tmp_path, {"storage": {"url": pg_url}})
    b = PostgresBackend(config.storage, digest_cache_bytes=1 << 20)
    yield b
    b.close()


def history(n: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "sys"}]
    for i in range(n):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i} \u0000é"})
    return msgs


def summary(chains: list[str], upto: int, **kw: Any) -> SummaryRecord:
    fields: dict[str, Any] = {
        "tenant": T, "session": S, "chain": chains[upto - 1], "head": 1, "upto": upto,
        "text": f"## Goal\nsummary up to {upto}\n", "source": "model", "model": "m",
        "created_at": NOW + timedelta(minutes=upto), "tokens_before": 10 * upto,
        "tokens_after": upto,
    }
    fields.update(kw)
    return SummaryRecord(**fields)


# --- schema ------------------------------------------------------------------------------------


def test_replicas_starting_together_migrate_once(pg_url: str) -> None:
    applied: list[list[int]] = []
    errors: list[BaseException] = []

    def start() -> None:
        try:
            with psycopg.connect(pg_url, autocommit=True) as conn:
                applied.append(upgrade(conn))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(applied, key=len) == [[]] * 5 + [list(range(1, SCHEMA_VERSION + 1))]
    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert schema_version(conn) == SCHEMA_VERSION


def test_a_newer_schema_is_refused(pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        upgrade(conn)
        conn.execute("UPDATE ctxproxy_schema SET version = %s", (SCHEMA_VERSION + 1,))
        with pytest.raises(SchemaError):
            upgrade(conn)


# --- originals -----------------------------------------------------------------------------------


def test_originals_written_once_read_anywhere(backend: PostgresBackend, pg_url: str,
                                              tmp_path: Path) -> None:
    text = "line one\nligne deux é\n" * 100
    rid = result_id(T, S, text)
    o = backend.originals
    assert o.needs_write(T, S, rid, text)
    assert o.write(T, S, rid, text) == len(text.encode())
    assert not o.needs_write(T, S, rid, text)
    assert o.write(T, S, rid, text) == 0  # another replica's write: nothing new
    # A second replica (its own pool, its own cache) reads it and lists it.
    config = proxy_config("http://127.0.0.1:9/v1", tmp_path, {"storage": {"url": pg_url}})
    other = PostgresBackend(config.storage, digest_cache_bytes=0)
    try:
        assert other.originals.read(T, S, rid) == text
        assert [e.name for e in other.files.listing(T, S, "tool_result")] == [f"{rid}.txt"]
        fd, info = other.files.open(T, S, "tool_result", f"{rid}.txt")
        assert info.st_size == len(text.encode())
        assert os.pread(fd, info.st_size, 0) == text.encode()
        os.close(fd)
    finally:
        other.close()
    with pytest.raises(OffloadedFileMissing):
        o.read(T, S, result_id(T, S, "never written"))
    staged = result_id(T, S, "staged text")
    token, size = o.stage(staged, "staged text")
    assert size == len("staged text")
    o.promote(T, S, staged, token)
    assert o.read(T, S, staged) == "staged text"
    assert o.gc(time.time() + 6 * 86400) == 2  # past the 5-day TTL


# --- dialog ------------------------------------------------------------------------------------


def test_archive_lines_match_the_files_backend(backend: PostgresBackend, tmp_path: Path) -> None:
    """Same lines, same numbering, same spans: a summary's pointer means the same in both."""
    db = Database.in_dir(tmp_path / "files")
    files = DialogArchive(tmp_path / "files", db)
    msgs = history(12)
    answer = {"role": "assistant", "content": "done"}
    for store in (files, backend.dialog):
        r1 = store.record(T, S, msgs[:5], now=NOW)
        r2 = store.record(T, S, msgs, answer=answer, now=NOW)
        r3 = store.record(T, S, msgs, now=NOW)
        assert (r1.written, r2.written, r3.written) == (5, 9, 0)
        assert r2.first is not None and r2.first.line == 6
    on_disk = (tmp_path / "files" / T / S / "dialog" / "2026-12-02.jsonl").read_bytes()
    assert backend.dialog.read_file(T, S, "2026-12-02.jsonl") == on_disk
    chains = chain_hashes(msgs)
    assert backend.dialog.span(T, S, chains[3:9]) == files.span(T, S, chains[3:9])
    stats = backend.sessions.session_stats(T, S)
    assert stats is not None and stats.messages == 14
    db.close()


def test_concurrent_replicas_archive_each_message_once(backend: PostgresBackend, pg_url: str,
                                                       tmp_path: Path) -> None:
    config = proxy_config("http://127.0.0.1:9/v1", tmp_path, {"storage": {"url": pg_url}})
    others = [PostgresBackend(config.storage, digest_cache_bytes=0) for _ in range(3)]
    msgs = history(40)
    barrier = threading.Barrier(4)

    def replay(store: Any) -> None:
        barrier.wait()
        for n in range(2, 42, 3):  # up to all 41 messages
            store.record(T, S, msgs[:n], now=NOW)

    threads = [threading.Thread(target=replay, args=(b.dialog,)) for b in [backend, *others]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for b in others:
        b.close()
    data = backend.dialog.read_file(T, S, "2026-12-02.jsonl")
    assert data is not None
    lines = data.splitlines()
    assert len(lines) == 41  # messages 0..40, each once
    assert len(set(lines)) == 41


# --- summaries and claims ----------------------------------------------------------------------


def test_first_writer_wins_across_replicas(backend: PostgresBackend) -> None:
    chains = chain_hashes(history(20))
    s = backend.summaries
    first = summary(chains, 8, text="## first\n")
    assert s.put(first) == first
    assert s.put(summary(chains, 8, text="## second\n")) == first
    fallback = summary(chains, 12, source="fallback", model=None)
    assert s.put(fallback) == fallback
    better = summary(chains, 12, text="## model\n")
    assert s.put(better) == better  # a model summary replaces a fallback one
    assert s.find_latest(T, S, chains) == better
    assert s.find_latest(T, S, chains[:10]) == first
    assert s.find_latest(T, S, chains[:5]) is None
    assert [r.upto for r in s.history(T, S)] == [8, 12]
    assert s.markdown(T, S, first.md_name) is not None


def test_a_fallback_keeps_its_reason(backend: PostgresBackend) -> None:
    chains = chain_hashes(history(20))
    why = "summarizer HTTP 400: Unsupported value: 'temperature' (code=unsupported_value)"
    fallback = summary(chains, 8, source="fallback", model=None, error=why)
    assert backend.summaries.put(fallback) == fallback
    assert backend.summaries.get(T, S, fallback.chain) == fallback
    md = backend.summaries.markdown(T, S, fallback.md_name)
    assert md is not None and f"the summarizer failed: {why}".encode() in md


def test_a_database_from_before_the_fallback_reasons_upgrades(pg_url: str) -> None:
    """Schema 5 had no summaries.error: its rows are kept, their reason unknown (NULL)."""
    chains = chain_hashes(history(20))
    from proxy.store.postgres.schema import MIGRATIONS
    before = next(i for i, step in enumerate(MIGRATIONS)
                  if any("summaries ADD COLUMN error" in s for s in step))
    with psycopg.connect(pg_url, autocommit=True) as conn:
        upgrade(conn, target=before)
        conn.execute("INSERT INTO summaries (tenant, session, chain, v, head, upto, text, "
                     "source, created_at, tokens_before, tokens_after, span, seen) VALUES "
                     "(%s, %s, %s, 1, 1, 8, '## Goal', 'fallback', now(), 1, 0, '[]', 8)",
                     (T, S, chains[7]))
        assert upgrade(conn)[0] == before + 1
    pool = PgPool(pg_url)
    pool.open()
    try:
        from proxy.store.postgres.summaries import PgSummaries
        got = PgSummaries(pool, owner="r").get(T, S, chains[7])
        assert got is not None and got.source == "fallback" and got.error is None
    finally:
        pool.close()


def test_claims_one_holder_and_expiry(backend: PostgresBackend, pg_url: str,
                                      tmp_path: Path) -> None:
    from proxy.store.postgres.summaries import PgSummaries

    a = backend.summaries
    b = PgSummaries(backend.pool, owner="replica-b")
    assert a.claim(T, S, "c" * 32, ttl_s=0.3)
    assert not b.claim(T, S, "c" * 32, ttl_s=0.3)
    assert b.claimed(T, S, "c" * 32)
    with psycopg.connect(pg_url, autocommit=True) as conn:  # the holder died; time passed
        conn.execute("UPDATE claims SET expires_at = now() - interval '1 second'")
    assert b.claim(T, S, "c" * 32, ttl_s=5)
    assert not a.claim(T, S, "c" * 32, ttl_s=5)
    b.release(T, S, "c" * 32)
    assert a.claim(T, S, "c" * 32, ttl_s=5)


def test_session_counters_add_up_across_replicas(backend: PostgresBackend) -> None:
    def add() -> None:
        for _ in range(20):
            backend.sessions.update_session_stats(T, S, turns=1, tokens_in=10)

    threads = [threading.Thread(target=add) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    row = backend.sessions.session_stats(T, S)
    assert row is not None and (row.turns, row.tokens_in) == (80, 800)
    assert backend.files.tenant_known(T) and not backend.files.tenant_known("other")


def test_gc_applies_ttl_retention_and_measures(backend: PostgresBackend, tmp_path: Path) -> None:
    backend.dialog.record(T, S, history(4), now=NOW)
    backend.originals.write(T, S, result_id(T, S, "x" * 5000), "x" * 5000)
    usage = DiskUsage(tmp_path, backend.tenant_sizes)
    report = backend.collect(usage, dialog_ttl_days=1.0, now=NOW.timestamp() + 2 * 86400)
    assert report.dialog_files == 1 and report.sessions == 1  # NOW is long past a day ago
    assert report.tool_results == 0  # within its 5 days
    assert usage.used(T) == 5000
    assert backend.dialog.read_file(T, S, "2026-12-02.jsonl") is None


# --- faults ------------------------------------------------------------------------------------


def test_database_down_fails_fast_and_recovers(pg_url: str, tmp_path: Path) -> None:
    """Its own server: stopping the shared one would disturb the other tests of this worker."""
    with PostgresServer() as server:
        url = server.create_database("faults")
        config = proxy_config("http://127.0.0.1:9/v1", tmp_path,
                              {"storage": {"url": url, "statement_timeout_s": 2}})
        b = PostgresBackend(config.storage, digest_cache_bytes=0)
        try:
            b.sessions.update_session_stats(T, S, turns=1)
            server.stop("immediate")
            with pytest.raises(StoreUnavailable):
                b.sessions.update_session_stats(T, S, turns=1)
            began = time.perf_counter()
            for _ in range(20):
                with pytest.raises(StoreUnavailable):
                    b.originals.read(T, S, result_id(T, S, "x"))
            assert time.perf_counter() - began < 0.5  # no wait per call while down
            assert not b.ready() and b.failures >= 21
            server.start()
            assert b.pool.wait_up(15), "the pool did not reconnect"
            assert b.ready()
            row = b.sessions.update_session_stats(T, S, turns=1)
            assert row.turns == 2  # nothing stored before the outage was lost
        finally:
            b.close()


def test_a_slow_database_costs_a_call_at_most_the_timeout(pg_url: str, tmp_path: Path) -> None:
    """A query stuck behind a lock is cut off at statement_timeout_s; calls then fail at once
    until the probe finds the database answering again."""
    config = proxy_config("http://127.0.0.1:9/v1", tmp_path,
                          {"storage": {"url": pg_url, "statement_timeout_s": 0.5}})
    b = PostgresBackend(config.storage, digest_cache_bytes=0)
    try:
        with psycopg.connect(pg_url) as blocker:
            blocker.execute("LOCK TABLE summaries IN ACCESS EXCLUSIVE MODE")
            began = time.perf_counter()
            with pytest.raises(StoreUnavailable):
                b.summaries.get(T, S, "c" * 32)
            assert time.perf_counter() - began < 2.0
            began = time.perf_counter()
            with pytest.raises(StoreUnavailable):
                b.sessions.session_stats(T, S)  # another table, but the pool is marked down
            assert time.perf_counter() - began < 0.1
            blocker.rollback()
        assert b.pool.wait_up(10), "the pool did not come back"
        assert b.ready()
        assert b.summaries.get(T, S, "c" * 32) is None
    finally:
        b.close()


# --- migrate-storage -----------------------------------------------------------------------------


def test_copy_a_data_dir(backend: PostgresBackend, tmp_path: Path) -> None:
    data = tmp_path / "old"
    db = Database.in_dir(data)
    dialog = DialogArchive(data, db)
    msgs = history(10)
    dialog.record(T, S, msgs, now=NOW)
    chains = chain_hashes(msgs)
    rec = summary(chains, 6, span=tuple(dialog.span(T, S, chains[1:6])))
    SummaryStore(db, data).put(rec)
    db.update_session_stats(T, S, turns=3)
    text = "original " * 1000
    ToolResultStore(data, 5).write(T, S, result_id(T, S, text), text)
    db.close()
    pool = PgPool(backend.pool.url)
    pool.open()
    try:
        first = copy_data_dir(data, pool)
        again = copy_data_dir(data, pool)
    finally:
        pool.close()
    assert (first.originals, first.dialog_lines, first.messages, first.summaries,
            first.sessions) == (1, 11, 11, 1, 1)
    assert (again.originals, again.messages, again.summaries) == (0, 0, 0)
    on_disk = (data / T / S / "dialog" / "2026-12-02.jsonl").read_bytes()
    assert backend.dialog.read_file(T, S, "2026-12-02.jsonl") == on_disk
    assert backend.summaries.find_latest(T, S, chains) == rec
    assert backend.originals.read(T, S, result_id(T, S, text)) == text
    row = backend.sessions.session_stats(T, S)
    assert row is not None and row.turns == 3 and row.messages == 11
    # New messages continue the copied file's numbering.
    more = backend.dialog.record(T, S, history(12), now=NOW)
    assert more.first is not None and more.first.line == 12


# --- configuration, command line, readiness --------------------------------------------------


def test_storage_url_is_postgres_and_may_come_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from proxy.config import config_from_mapping
    from proxy.errors import ConfigError

    with pytest.raises(ConfigError, match="storage.url"):
        config_from_mapping({"storage": {"url": "mysql://db/x"}})
    monkeypatch.setenv("CTXPROXY_TEST_DB", "postgresql://u@h/db")
    config = config_from_mapping({"storage": {"url": "os.environ/CTXPROXY_TEST_DB"}})
    assert config.storage.url == "postgresql://u@h/db"
    assert config_from_mapping({}).storage.url is None  # the default: files + SQLite


def test_cli_db_upgrade_and_migrate_storage(pg_url: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from proxy.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"storage: {{url: '{pg_url}', data_dir: '{tmp_path / 'old'}'}}\n")
    assert main(["db", "upgrade", "--config", str(cfg)]) == 0
    assert main(["db", "upgrade", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out.splitlines()
    steps = ", ".join(str(v) for v in range(1, SCHEMA_VERSION + 1))
    assert out == [f"schema version {SCHEMA_VERSION} (applied {steps})",
                   f"schema version {SCHEMA_VERSION} (already current)"]
    db = Database.in_dir(tmp_path / "old")
    DialogArchive(tmp_path / "old", db).record(T, S, history(3), now=NOW)
    db.close()
    assert main(["migrate-storage", "--config", str(cfg)]) == 0
    assert "4 dialog line(s), 4 index row(s)" in capsys.readouterr().out
    assert main(["gc", "--config", str(cfg)]) == 0
    assert "from the database" in capsys.readouterr().out


async def test_readyz_and_healthz(make_inproc: Any, pg_url: str) -> None:
    files = await make_inproc()
    r = await files.client.get("/readyz")
    assert (r.status_code, r.json()) == (200, {"status": "ok", "store": "up",
                                               "backend": "files"})
    pg = await make_inproc({"storage": {"url": pg_url}})
    r = await pg.client.get("/readyz")
    assert r.status_code == 200 and r.json()["backend"] == "postgres"
    assert (await pg.client.get("/healthz")).status_code == 200
    # (503 while the database is away: tests/test_scale_out.py::test_database_stopped_mid_run)
