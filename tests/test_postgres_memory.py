"""Long-term memory in the store, on both backends (issue 16): the ``MemoryStore`` contract run
against the files + SQLite store and the PostgreSQL one (two store instances on one database
are two replicas), PostgreSQL's retention and quota, copying a data_dir's memory over, and the
two-session scenario on two proxy replicas sharing PostgreSQL."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import httpx
import psycopg
import pytest

from proxy.demo.fake.upstream import FakeUpstream
from proxy.demo.servers import ServerThread
from proxy.memory.inject import is_memory_message
from proxy.session import tenant_of
from proxy.store.db import Database
from proxy.store.interfaces import MemoryStore
from proxy.store.memory import FoldClaim, MemoryFiles
from proxy.store.postgres import PgPool, PostgresBackend, upgrade
from proxy.store.postgres.copy import copy_data_dir
from proxy.store.postgres.memory import PgMemory
from proxy.store.usage import DiskUsage
from tests.conftest import ProxyFactory, proxy_config
from tests.pg import pg_url, postgres
from tests.test_memory import (
    ERROR,
    FIX,
    KEY,
    ON,
    PREF_1,
    PREF_2,
    Script,
    chat,
    model_calls,
    new_session,
    session_one,
)

__all__ = ["pg_url", "postgres"]  # fixtures

T0 = datetime(2026, 12, 2, 10, 0, 0, tzinfo=UTC)
DAY = 86400.0

Replica = Callable[[], MemoryStore]  # a new store instance on the shared state


@pytest.fixture(params=["files", "postgres"])
def replicas(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Replica]:
    """Each call: one more process's store on the same state (files: its own SQLite connection
    on the shared data_dir; PostgreSQL: its own pool on the shared database)."""
    closers: list[Callable[[], None]] = []
    if request.param == "files":
        def files() -> MemoryStore:
            db = Database.in_dir(tmp_path)
            closers.append(db.close)
            return MemoryFiles(db, tmp_path, fsync=False)

        yield files
    else:
        url: str = request.getfixturevalue("pg_url")
        with psycopg.connect(url, autocommit=True) as conn:
            upgrade(conn)

        def pg() -> MemoryStore:
            pool = PgPool(url, max_size=4)
            pool.open()
            closers.append(pool.close)
            return PgMemory(pool)

        yield pg
    for close in closers:
        close()


def fold(store: MemoryStore, tenant: str, scope: str, text: str, at: datetime) -> int:
    claim = store.claim_fold(tenant, scope, now=at, min_interval_s=0, lease_s=60)
    assert claim is not None
    stored = store.finish_fold(claim, text, now=at)
    assert stored is not None
    return stored.version


# --- the contract, both backends -----------------------------------------------------------------


def test_notes_append_per_day_and_read_back(replicas: Replica) -> None:
    a, b = replicas(), replicas()
    d1, d2 = date(2026, 12, 1), date(2026, 12, 2)
    assert a.append("t", "s", d2, "- second day\n", now=T0) == len("- second day\n")
    assert b.append("t", "s", d1, "- first é\n", now=T0) == len("- first é".encode()) + 1
    assert a.append("t", "s", d2, "- again\n", now=T0 + timedelta(minutes=1)) == 8
    assert b.append("t", "s", d2, "", now=T0) == 0  # nothing written
    for store in (a, b):
        assert store.days("t", "s") == ["2026-12-01", "2026-12-02"]
        assert store.read_day("t", "s", "2026-12-02") == "- second day\n- again\n"
        assert store.read_day("t", "s", "2026-12-01") == "- first é\n"
        assert store.read_day("t", "s", "2026-11-30") is None
        assert store.days("t", "other") == [] and store.days("u", "s") == []
        [row] = store.scopes("t")
        assert (row.scope, row.version, row.folded_at) == ("s", 0, None)
        assert row.last_entry_at == T0 + timedelta(minutes=1)
        assert store.scopes("u") == [] and len(store.scopes()) == 1


def test_versions_are_numbered_immutable_and_shared(replicas: Replica) -> None:
    a, b = replicas(), replicas()
    a.append("t", "s", T0.date(), "- a\n", now=T0)
    assert fold(a, "t", "s", "## v1\n- a\n", T0) == 1
    later = T0 + timedelta(hours=1)
    b.append("t", "s", later.date(), "- b\n", now=later)
    assert fold(b, "t", "s", "## v2\n- a\n- b\n", later) == 2
    for store in (a, b):
        assert [(v.version, v.text) for v in store.versions("t", "s")] == [
            (1, "## v1\n- a\n"), (2, "## v2\n- a\n- b\n")]
        one = store.version("t", "s", 1)
        assert one is not None and one.text == "## v1\n- a\n" and one.created_at == T0
        assert store.version("t", "s", 3) is None and store.version("u", "s", 1) is None
        [row] = store.scopes("t")
        assert row.version == 2 and row.folded_at == later


def test_pins_first_writer_wins_across_replicas(replicas: Replica) -> None:
    a, b = replicas(), replicas()
    assert a.pin("t", "s", "sess", "", now=T0) == 0
    a.append("t", "s", T0.date(), "- a\n", now=T0)
    fold(a, "t", "s", "- a\n", T0)
    assert b.pin("t", "s", "sess", "", now=T0) == 0  # pinned by A before the fold
    assert b.pin("t", "s", "sess", "chain-2", now=T0) == 1  # the next compaction moves on
    # Many replicas pinning a new (session, epoch) at once all get the one pinned first.
    stores = [a, b]
    got: list[int] = []
    barrier = threading.Barrier(8)

    def pin(i: int) -> None:
        barrier.wait()
        got.append(stores[i % 2].pin("t", "s", "racer", "", now=T0))

    threads = [threading.Thread(target=pin, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [1] * 8


def test_fold_claim_exclusive_across_replicas(replicas: Replica) -> None:
    a, b = replicas(), replicas()
    assert a.claim_fold("t", "s", now=T0, min_interval_s=DAY, lease_s=60) is None  # no facts
    a.append("t", "s", T0.date(), "- a\n", now=T0)
    # Replicas claiming at the same moment: exactly one holds the lease.
    stores = [a, b] * 4
    claims: list[FoldClaim | None] = []
    barrier = threading.Barrier(len(stores))

    def claim(store: MemoryStore) -> None:
        barrier.wait()
        claims.append(store.claim_fold("t", "s", now=T0, min_interval_s=DAY, lease_s=60))

    threads = [threading.Thread(target=claim, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    held = [c for c in claims if c is not None]
    assert len(held) == 1
    assert b.claim_fold("t", "s", now=T0 + timedelta(seconds=59), min_interval_s=DAY,
                        lease_s=60) is None
    # The lease ran out: another replica takes over; the first one's finish writes nothing.
    second = b.claim_fold("t", "s", now=T0 + timedelta(seconds=61), min_interval_s=DAY,
                          lease_s=60)
    assert second is not None and second.version == 0 and second.since is None
    first = held[0]
    assert first is not None
    assert a.finish_fold(first, "- stale\n") is None
    assert a.versions("t", "s") == [] and a.scopes("t")[0].version == 0
    done = b.finish_fold(second, "- a\n", now=T0 + timedelta(seconds=70))
    assert done is not None and done.version == 1
    assert b.finish_fold(second, "- twice\n") is None  # the lease is cleared: once only
    assert [v.text for v in a.versions("t", "s")] == ["- a\n"]
    # The gate: no new facts -> no fold; new facts within the interval -> no fold; after it, one.
    later = T0 + timedelta(hours=2)
    assert a.claim_fold("t", "s", now=later, min_interval_s=DAY, lease_s=60) is None
    a.append("t", "s", later.date(), "- b\n", now=later)
    assert b.claim_fold("t", "s", now=later, min_interval_s=DAY, lease_s=60) is None
    next_day = second.at + timedelta(seconds=DAY)
    third = b.claim_fold("t", "s", now=next_day, min_interval_s=DAY, lease_s=60)
    assert third is not None and third.version == 1 and third.since == second.at


# --- PostgreSQL: the migration, retention, quota, copy ---------------------------------------------


def test_a_version_1_database_gains_memory(pg_url: str) -> None:
    """A database made before memory (schema version 1, with data) upgrades in place."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert upgrade(conn, target=1) == [1]
        conn.execute("INSERT INTO sessions (tenant, session, first_seen, last_seen) "
                     "VALUES ('t', 's', now(), now())")
        assert upgrade(conn, target=2) == [2]
        row = conn.execute("SELECT count(*) FROM sessions").fetchone()
        assert row is not None and row[0] == 1
    pool = PgPool(pg_url)
    pool.open()
    try:
        store = PgMemory(pool)
        store.append("t", "s", T0.date(), "- a\n", now=T0)
        assert fold(store, "t", "s", "- a\n", T0) == 1
    finally:
        pool.close()


@pytest.fixture
def backend(pg_url: str, tmp_path: Path) -> Iterator[PostgresBackend]:
    config = proxy_config("http://127.0.0.1:9/v1", tmp_path, {"storage": {"url": pg_url}})
    b = PostgresBackend(config.storage, digest_cache_bytes=1 << 20)
    yield b
    b.close()


def test_pg_memory_counts_against_quota_and_expires(backend: PostgresBackend,
                                                   tmp_path: Path) -> None:
    store = backend.memory
    assert store is not None
    old = datetime.now(UTC) - timedelta(days=10)
    note, text = "- old fact é\n", "## Lessons\n- old fact é\n"
    written = store.append("t1", "default", old.date(), note, now=old)
    assert fold(store, "t1", "default", text, old) == 1
    assert store.pin("t1", "default", "s", "", now=old) == 1
    store.append("t2", "default", date.today(), "- fresh\n")  # young: stays
    usage = DiskUsage(tmp_path, backend.tenant_sizes)
    assert usage.measure()["t1"] == written + len(text.encode())
    report = backend.collect(usage, dialog_ttl_days=5)
    assert report.memory_files == 2 and report.expired  # the note and the version
    assert store.days("t1", "default") == [] and store.versions("t1", "default") == []
    assert usage.used("t1") == 0 and store.days("t2", "default") == [date.today().isoformat()]
    # The scope row stays: the number is never reused, a new pin finds the new version.
    store.append("t1", "default", date.today(), "- new fact\n")
    assert fold(store, "t1", "default", "- new fact\n", datetime.now(UTC)) == 2
    assert store.pin("t1", "default", "s", "") == 2  # the old pin expired with its version


def test_copy_a_data_dirs_memory(backend: PostgresBackend, tmp_path: Path) -> None:
    data = tmp_path / "old"
    with Database.in_dir(data) as db:
        files = MemoryFiles(db, data, fsync=False)
        files.append("t", "s", T0.date(), "- a\n", now=T0)
        fold(files, "t", "s", "- a\n", T0)
        files.append("t", "s", T0.date() + timedelta(days=1), "- b\n", now=T0 + timedelta(days=1))
        files.pin("t", "s", "sess", "", now=T0)
        expected = (files.days("t", "s"), files.versions("t", "s"), files.scopes())
    pool = PgPool(backend.pool.url)
    pool.open()
    try:
        first = copy_data_dir(data, pool)
        again = copy_data_dir(data, pool)
    finally:
        pool.close()
    assert (first.memory_days, first.memory_versions) == (2, 1)
    assert (again.memory_days, again.memory_versions) == (0, 0)
    store = backend.memory
    assert store is not None
    assert (store.days("t", "s"), store.versions("t", "s"), store.scopes()) == expected
    assert store.read_day("t", "s", "2026-12-03") == "- b\n"
    assert store.pin("t", "s", "sess", "") == 1
    # The copied scope folds on: facts since the last fold, version 2.
    claim = store.claim_fold("t", "s", now=T0 + timedelta(days=2), min_interval_s=DAY,
                             lease_s=60)
    assert claim is not None and claim.version == 1 and claim.since == T0


# --- two replicas sharing PostgreSQL -------------------------------------------------------------


def test_two_sessions_on_two_replicas_sharing_postgres(
    make_proxy: ProxyFactory, fake: FakeUpstream, pg_url: str, tmp_path: Path
) -> None:
    """Session 1 on replica A is compacted and its facts folded; session 2's first request, on
    replica B (its own empty data_dir), carries all of them; nothing of memory is on disk."""
    script = Script(fake)

    def replica(name: str) -> ServerThread:
        return make_proxy({**ON, "storage": {"url": pg_url,
                                             "data_dir": str(tmp_path / name)}})

    a, b = replica("a"), replica("b")
    one = session_one()
    r = chat(a, one, "s1")
    assert r.headers["x-ctxproxy-compacted"] == "1"
    a.drain()
    assert script.summaries == 1 and script.folds == 1
    # Session 1 keeps the version it had (none) on either replica until its next compaction.
    more = [*one, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
    for proxy in (b, a):
        chat(proxy, more, "s1")
        assert not any(is_memory_message(m) for m in model_calls(fake)[-1])
    # Session 2's first forwarded request, on replica B, carries the three facts.
    two = new_session("again")
    chat(b, two, "s2")
    b.drain()
    fwd = model_calls(fake)[-1]
    assert fwd[0] == two[0] and is_memory_message(fwd[1]) and fwd[2:] == two[1:]
    for fact in (PREF_1, PREF_2, ERROR, FIX):
        assert fact in fwd[1]["content"]
    two_b = [*two, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}]
    for proxy in (a, b):
        chat(proxy, two_b, "s2")
        assert model_calls(fake)[-1][:3] == fwd
    assert script.summaries == 1 and script.folds == 1  # no second fold on replica B
    # /files on replica B shows the memory replica A wrote: versions and notes, from the store.
    tenant = tenant_of(KEY)
    auth = {"authorization": f"Bearer {KEY}"}
    page = httpx.get(f"{b.url}/files/{tenant}/memory/default",
                     headers={**auth, "accept": "application/json"})
    assert page.status_code == 200, page.text
    payload = page.json()
    assert [v["version"] for v in payload["versions"]] == [1]
    assert PREF_1 in payload["versions"][0]["text"]
    today = datetime.now(UTC).date().isoformat()
    assert [d["day"] for d in payload["days"]] == [today]
    note = httpx.get(b.url + payload["days"][0]["url"], headers=auth)
    version = httpx.get(f"{b.url}/files/{tenant}/memory/default/versions/MEMORY-v0001.md",
                        headers=auth)
    assert note.status_code == version.status_code == 200
    assert ERROR in note.text and PREF_2 in version.text
    assert not [p for p in tmp_path.rglob("*") if "memory" in p.parts]
