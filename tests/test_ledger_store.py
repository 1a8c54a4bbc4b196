"""The cost ledger's store (proxy.store.ledger, proxy.store.postgres.ledger): one contract run
against files + SQLite and against a real PostgreSQL. Entries round-trip whole, a retried write
adds nothing, the totals kept in step are LedgerTotals.of the rows (after expiry too), ordering,
search and tenant isolation; then retention by the gc, the migrations, migrate-storage, and
the database being away."""

from __future__ import annotations

import math
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.postgres import PostgresServer
from harness.process import free_port
from proxy.errors import InvalidName, SchemaError, StoreUnavailable
from proxy.store.backend import FilesBackend
from proxy.store.db import Database
from proxy.store.ledger import SqliteLedger, SqlLedger, like_pattern
from proxy.store.ledger_entry import (
    CACHE_REASONS,
    KINDS,
    Change,
    LedgerEntry,
    LedgerTotals,
    Prefix,
    decode_entry,
    encode_entry,
)
from proxy.store.migrations import MIGRATIONS, SCHEMA_VERSION
from proxy.store.postgres import PgPool, PostgresBackend, upgrade
from proxy.store.postgres.copy import copy_data_dir
from proxy.store.postgres.ledger import PgLedger
from proxy.store.postgres.schema import MIGRATIONS as PG_MIGRATIONS
from proxy.store.postgres.schema import SCHEMA_VERSION as PG_SCHEMA_VERSION
from proxy.store.usage import DiskUsage
from proxy.usage import Usage
from tests.conftest import proxy_config
from tests.pg import pg_url, postgres

__all__ = ["pg_url", "postgres"]  # fixtures

DAY = 86400.0
NOW = 1_800_000_000.0
BACKENDS = ["files", "postgres"]


def _added_in(migrations: Sequence[Sequence[str]]) -> int:
    """The schema version whose migration made the ledger table."""
    return next(i for i, step in enumerate(migrations)
                if any("CREATE TABLE ledger (" in s for s in step)) + 1


LEDGER_VERSION = _added_in(MIGRATIONS)
PG_LEDGER_VERSION = _added_in(PG_MIGRATIONS)


# --- fixtures: one SQLite database and one PostgreSQL database for the module -------------------


@pytest.fixture(scope="module")
def sqlite_ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SqliteLedger]:
    with Database.in_dir(tmp_path_factory.mktemp("ledger")) as db:
        yield SqliteLedger(db)


@pytest.fixture(scope="module")
def pg_pool(postgres: PostgresServer) -> Iterator[PgPool]:
    pool = PgPool(postgres.create_database("ledger_store"))
    pool.open()
    with pool.connection() as conn:
        upgrade(conn)
    yield pool
    pool.close()


@pytest.fixture(scope="module", params=BACKENDS)
def any_ledger(request: pytest.FixtureRequest) -> SqlLedger:
    """The module's store of either backend (PostgreSQL's skipped without its binaries)."""
    if request.param == "files":
        store: SqlLedger = request.getfixturevalue("sqlite_ledger")
    else:
        store = PgLedger(request.getfixturevalue("pg_pool"))
    return store


@pytest.fixture
def ledger(any_ledger: SqlLedger) -> SqlLedger:
    """That store, emptied."""
    wipe(any_ledger)
    return any_ledger


def wipe(store: SqlLedger) -> None:
    with store._writing() as execute:
        for table in ("ledger", "ledger_sessions", "ledger_breaks"):
            execute(f"DELETE FROM {table}", ())


def entry(id: str, ts: float = NOW, *, tenant: str = "t", session: str = "s",
          **kw: Any) -> LedgerEntry:
    kw.setdefault("kind", "request")
    return LedgerEntry(tenant=tenant, session=session, id=id, request=kw.pop("request", id),
                       ts=ts, api=kw.pop("api", "messages"), model=kw.pop("model", "m"), **kw)


def assert_totals(got: Sequence[LedgerTotals], want: Sequence[LedgerTotals]) -> None:
    """Equal field by field, the float sums up to rounding (SQL sums in another order)."""
    assert [(t.tenant, t.session) for t in got] == [(t.tenant, t.session) for t in want]
    for g, w in zip(got, want, strict=True):
        for f in fields(LedgerTotals):
            a, b = getattr(g, f.name), getattr(w, f.name)
            if f.name in ("cost", "direct_cost"):
                assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9), (f.name, a, b)
            else:
                assert a == b, (f.name, g.session, a, b)


def newest_first(totals: list[LedgerTotals]) -> list[LedgerTotals]:
    return sorted(totals, key=lambda t: (-t.last_ts, t.tenant, t.session))


# --- strategies ----------------------------------------------------------------------------------

NAMES = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,10}", fullmatch=True).filter(
    lambda s: ".." not in s)
IDS = st.text("0123456789abcdef", min_size=1, max_size=12)
COUNTS = st.integers(0, 10**7)
USAGES = st.builds(Usage, COUNTS, COUNTS, COUNTS, COUNTS, COUNTS, COUNTS, st.integers(0, 9))
FLOATS = st.floats(-1e9, 1e9, allow_nan=False)
PRICES = st.none() | st.floats(0, 50, allow_nan=False)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | FLOATS | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=6)
KNOWN = {f.name for f in fields(LedgerEntry)} | {"v"}
CHANGES = st.builds(
    Change, what=st.text(max_size=8), reason=st.text(max_size=30),
    at=st.none() | COUNTS, upto=st.none() | COUNTS, role=st.none() | st.text(max_size=6),
    call_id=st.none() | st.text(max_size=8), tool=st.none() | st.text(max_size=6),
    bytes_before=COUNTS, bytes_after=COUNTS, kept_bytes=st.none() | COUNTS,
    notice=st.none() | st.text(max_size=20), file=st.none() | st.text(max_size=20))
PREFIXES = st.builds(Prefix, items=COUNTS, last=st.text(max_size=12), head=st.text(max_size=12),
                     ttl_s=st.floats(0, 1e5, allow_nan=False), cacheable=st.booleans())
ENTRIES = st.builds(
    LedgerEntry, tenant=NAMES, session=NAMES, id=IDS, request=st.text(max_size=12),
    ts=st.floats(0, 4e9, allow_nan=False), kind=st.sampled_from(KINDS),
    api=st.sampled_from(["chat", "responses", "messages"]), model=st.text(max_size=12),
    usage=st.none() | USAGES, estimate=st.none() | USAGES, cost=PRICES,
    status=st.integers(100, 599), tokens_sent=COUNTS, tokens_forwarded=COUNTS,
    direct=st.none() | USAGES, direct_cost=PRICES,
    cache_reason=st.none() | st.sampled_from(CACHE_REASONS) | st.text(max_size=8),
    gap_s=st.none() | st.floats(0, 1e6, allow_nan=False), epoch=st.text(max_size=8),
    compacted=st.booleans(), compaction=st.booleans(), offloaded=COUNTS, rounds=COUNTS,
    changes=st.lists(CHANGES, max_size=3).map(tuple), prefix=st.none() | PREFIXES,
    extra=st.dictionaries(st.text(max_size=6).filter(lambda k: k not in KNOWN), JSON,
                          max_size=3),
)
# Few tenants, sessions and instants, so sessions share entries and ts ties happen.
SMALL = st.builds(
    LedgerEntry, tenant=st.sampled_from(["t1", "t2"]), session=st.sampled_from(["s1", "s_2"]),
    id=st.text("0123", min_size=1, max_size=3), request=st.just("r"),
    ts=st.sampled_from([NOW - 3 * DAY, NOW - DAY, NOW, NOW + 0.5]),
    kind=st.sampled_from(KINDS), api=st.just("messages"), model=st.just("m"),
    usage=st.none() | USAGES, estimate=st.none() | USAGES, cost=PRICES,
    tokens_sent=COUNTS, tokens_forwarded=COUNTS, direct=st.none() | USAGES,
    direct_cost=PRICES, cache_reason=st.none() | st.sampled_from((*CACHE_REASONS, "")))
PROPERTY = settings(max_examples=30, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


# --- the contract --------------------------------------------------------------------------------


@given(ENTRIES)
@settings(max_examples=200)
def test_an_entry_survives_its_body(e: LedgerEntry) -> None:
    assert decode_entry(encode_entry(e)) == e


@PROPERTY
@given(batch=st.lists(ENTRIES, min_size=1, max_size=4,
                      unique_by=lambda e: (e.tenant, e.session, e.id)))
def test_every_field_round_trips_through_the_store(any_ledger: SqlLedger,
                                                   batch: list[LedgerEntry]) -> None:
    wipe(any_ledger)
    assert any_ledger.insert(batch) == len(batch)
    for e in batch:
        assert any_ledger.entry(e.tenant, e.session, e.id) == e
        assert e in any_ledger.entries(e.tenant, e.session)


@PROPERTY
@given(batches=st.lists(st.lists(SMALL, max_size=6), min_size=1, max_size=4),
       repeat=st.booleans(), cutoff=st.sampled_from([NOW - 2 * DAY, NOW, NOW + 1]))
def test_totals_are_the_sums_of_the_rows(any_ledger: SqlLedger, batches: list[list[LedgerEntry]],
                                         repeat: bool, cutoff: float) -> None:
    wipe(any_ledger)
    kept: dict[tuple[str, str, str], LedgerEntry] = {}  # the first of each id, in order
    for batch in batches:
        new = 0
        for e in batch:
            if (e.tenant, e.session, e.id) not in kept:
                kept[e.tenant, e.session, e.id] = e
                new += 1
        assert any_ledger.insert(batch) == new
        if repeat:  # a retried write adds nothing
            assert any_ledger.insert(batch) == 0

    def check(rows: list[LedgerEntry]) -> None:
        groups: dict[tuple[str, str], list[LedgerEntry]] = {}
        for e in rows:
            groups.setdefault((e.tenant, e.session), []).append(e)
        want = newest_first([LedgerTotals.of(t, s, es) for (t, s), es in groups.items()])
        assert_totals(any_ledger.totals(), want)
        assert_totals(any_ledger.totals("t1"), [t for t in want if t.tenant == "t1"])
        assert_totals(any_ledger.totals(limit=1), want[:1])
        for (t, s), es in groups.items():
            ordered = sorted(es, key=lambda e: e.ts)  # stable: ties in insertion order
            assert any_ledger.entries(t, s) == ordered
            assert any_ledger.entries(t, s, limit=2) == ordered[-2:]
            assert any_ledger.entries(t, s, kind="read_round") == [
                e for e in ordered if e.kind == "read_round"]
            calls = [e for e in ordered if e.kind in ("request", "read_round")]
            assert any_ledger.last(t, s) == (calls[-1] if calls else None)

    check(list(kept.values()))
    expired = [e for e in kept.values() if e.ts < cutoff]
    assert any_ledger.expire(cutoff) == len(expired)
    check([e for e in kept.values() if e.ts >= cutoff])
    assert any_ledger.expire(cutoff) == 0


def test_an_id_kept_is_never_replaced(ledger: SqlLedger) -> None:
    first = entry("a1", cost=1.0, usage=Usage(input=10))
    ledger.add([first])
    ledger.add([replace(first, cost=5.0, usage=Usage(input=99))])  # a retry, changed
    assert ledger.entry("t", "s", "a1") == first
    [totals] = ledger.totals("t")
    assert (totals.calls, totals.cost, totals.billed.input) == (1, 1.0, 10)
    ledger.add([])
    assert ledger.insert([first, entry("a2")]) == 1


def test_an_empty_ledger(ledger: SqlLedger) -> None:
    assert ledger.entries("t", "s") == [] and ledger.entry("t", "s", "x") is None
    assert ledger.last("t", "s") is None and ledger.totals() == [] and ledger.expire(NOW) == 0
    assert ledger.entries("t", "s", limit=0) == []


def test_order_ties_and_limit(ledger: SqlLedger) -> None:
    # Inserted out of time order, two at the same instant: ts first, then insertion.
    rows = [entry("c", NOW + 2), entry("a", NOW), entry("b2", NOW + 1, kind="read_round"),
            entry("b1", NOW + 1, kind="summarizer")]
    ledger.add(rows[:2])
    ledger.add(rows[2:])
    assert [e.id for e in ledger.entries("t", "s")] == ["a", "b2", "b1", "c"]
    assert [e.id for e in ledger.entries("t", "s", limit=3)] == ["b2", "b1", "c"]
    assert [e.id for e in ledger.entries("t", "s", kind="request", limit=1)] == ["c"]
    ledger.add([entry("d", NOW + 9, kind="memory_fold")])  # not a call the cache compares with
    last = ledger.last("t", "s")
    assert last is not None and last.id == "c"
    ledger.add([entry("e", NOW + 2, kind="read_round")])  # ties with "c", inserted after it
    last = ledger.last("t", "s")
    assert last is not None and last.id == "e"


def test_totals_newest_session_first_and_search(ledger: SqlLedger) -> None:
    for i, session in enumerate(["run_1", "runx1", "Other", "RUN-2"]):
        ledger.add([entry(f"e{i}", NOW + i, session=session)])
    assert [t.session for t in ledger.totals("t")] == ["RUN-2", "Other", "runx1", "run_1"]
    assert [t.session for t in ledger.totals("t", limit=2)] == ["RUN-2", "Other"]

    def found(search: str) -> list[str]:
        return sorted(t.session for t in ledger.totals("t", search=search))

    assert found("run") == ["RUN-2", "run_1", "runx1"]  # case-insensitive
    assert found("_1") == ["run_1"]  # "_" is itself, not any character
    assert found("%") == [] and found("n%1") == [] and found("\\") == []
    assert found("") == found("r") == ["Other", "RUN-2", "run_1", "runx1"]
    assert like_pattern("A_b%\\") == "%a\\_b\\%\\\\%"


def test_one_tenant_never_sees_another(ledger: SqlLedger) -> None:
    ledger.add([entry("a", tenant="alice", cost=1.0), entry("b", tenant="bob", cost=2.0),
                entry("b2", tenant="bob", session="only-bob")])
    assert [e.id for e in ledger.entries("alice", "s")] == ["a"]
    assert ledger.entry("alice", "s", "b") is None and ledger.entries("alice", "only-bob") == []
    assert ledger.last("alice", "only-bob") is None
    assert [(t.tenant, t.session, t.cost) for t in ledger.totals("alice")] == [("alice", "s", 1.0)]
    assert ledger.totals("alice", search="only") == []
    assert {(t.tenant, t.session) for t in ledger.totals()} == {
        ("alice", "s"), ("bob", "s"), ("bob", "only-bob")}  # the master's view: everyone


def test_unsafe_names_are_refused_and_nothing_is_kept(ledger: SqlLedger) -> None:
    for bad in (entry("x", tenant="../x"), entry("x", session="a/b"), entry("")):
        with pytest.raises(InvalidName):
            ledger.add([entry("ok"), bad])
    assert ledger.totals() == []


def test_text_columns_take_any_string(ledger: SqlLedger) -> None:
    odd = entry("z", model="m\x00é", cache_reason="x\x00", request="r\x00")
    ledger.add([odd])
    assert ledger.entry("t", "s", "z") == odd  # the body keeps the exact strings
    [totals] = ledger.totals("t")
    assert sum(totals.breaks.values()) == 1


def test_expire_recomputes_and_forgets_emptied_sessions(ledger: SqlLedger) -> None:
    ledger.add([entry("old", NOW - 10 * DAY, session="gone", cost=1.0, cache_reason="ttl"),
                entry("o2", NOW - 10 * DAY, cost=2.0, cache_reason="client"),
                entry("new", NOW, cost=3.0, cache_reason="client")])
    assert ledger.expire(NOW - DAY) == 2
    [totals] = ledger.totals()
    assert_totals([totals], [LedgerTotals.of("t", "s", [entry("new", NOW, cost=3.0,
                                                                cache_reason="client")])])
    assert totals.breaks == {"client": 1} and totals.first_ts == NOW
    assert ledger.entries("t", "gone") == []


def test_writers_at_once_lose_nothing(ledger: SqlLedger) -> None:
    errors: list[BaseException] = []

    def write(w: int) -> None:
        try:
            for i in range(15):
                ledger.add([entry(f"{w}x{i}", NOW + i, cost=0.5, usage=Usage(input=1)),
                            entry(f"{w}y{i}", NOW + i, session=f"s{i % 3}",
                                  kind="read_round")])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    by_session = {t.session: t for t in ledger.totals("t")}
    assert (by_session["s"].calls, by_session["s"].billed.input) == (60, 60)
    assert math.isclose(by_session["s"].cost, 30.0)
    assert sum(t.calls for t in by_session.values()) == 120


# --- retention, quota --------------------------------------------------------------------------


@pytest.fixture
def files_backend(tmp_path: Path) -> Iterator[FilesBackend]:
    config = proxy_config("http://127.0.0.1:9/v1", tmp_path / "data")
    backend = FilesBackend(config.storage, digest_cache_bytes=0)
    yield backend
    backend.close()


@pytest.fixture
def pg_backend(pg_pool: PgPool, tmp_path: Path) -> Iterator[PostgresBackend]:
    config = proxy_config("http://127.0.0.1:9/v1", tmp_path / "data",
                          {"storage": {"url": pg_pool.url}})
    backend = PostgresBackend(config.storage, digest_cache_bytes=0)
    wipe(backend.ledger)
    yield backend
    backend.close()


@pytest.mark.parametrize("kind", BACKENDS)
def test_gc_expires_the_ledger_with_the_archive(kind: str, request: pytest.FixtureRequest,
                                                tmp_path: Path) -> None:
    backend = request.getfixturevalue(f"{'pg' if kind == 'postgres' else 'files'}_backend")
    store = backend.ledger
    assert store is not None
    now = time.time()
    store.add([entry("old", now - 10 * DAY, tenant="ten", cost=1.0),
               entry("new", now - DAY, tenant="ten", cost=2.0)])
    usage = DiskUsage(tmp_path / "data", backend.tenant_sizes)
    kept = backend.collect(usage, dialog_ttl_days=None)  # null: kept forever
    assert kept.ledger_entries == 0 and len(store.entries("ten", "s")) == 2
    assert "ten" not in kept.usage  # the ledger is not in the disk quota
    report = backend.collect(usage, dialog_ttl_days=5)
    assert report.ledger_entries == 1 and report.expired
    assert [e.id for e in store.entries("ten", "s")] == ["new"]
    [totals] = store.totals("ten")
    assert (totals.calls, totals.cost) == (1, 2.0)


# --- schema ------------------------------------------------------------------------------------


def test_a_sqlite_database_from_before_the_ledger_upgrades(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(path, isolation_level=None)
    for statement in (s for step in MIGRATIONS[:LEDGER_VERSION - 1] for s in step):
        conn.execute(statement)
    conn.execute(f"PRAGMA user_version={LEDGER_VERSION - 1}")
    conn.execute("INSERT INTO rounds VALUES ('t', 's', 'k', x'7b7d', '2026-01-01T00:00:00.000+00:00')")
    conn.close()
    with Database(path) as db:
        assert db.schema_version == SCHEMA_VERSION
        with db.connect() as c:
            assert c.execute("SELECT count(*) FROM rounds").fetchone()[0] == 1  # data kept
        SqliteLedger(db).add([entry("a")])
        assert len(SqliteLedger(db).totals()) == 1
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(SchemaError):
        Database(path)


def test_a_postgres_database_from_before_the_ledger_upgrades(pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        upgrade(conn, target=PG_LEDGER_VERSION - 1)
        conn.execute("INSERT INTO rounds VALUES ('t', 's', 'k', '{}', now())")
        assert upgrade(conn)[0] == PG_LEDGER_VERSION
        row = conn.execute("SELECT count(*) FROM rounds").fetchone()
        assert row is not None and row[0] == 1
        pool = PgPool(pg_url)
        pool.open()
        try:
            PgLedger(pool).add([entry("a")])
            assert len(PgLedger(pool).totals()) == 1
        finally:
            pool.close()
        conn.execute("UPDATE ctxproxy_schema SET version = %s", (PG_SCHEMA_VERSION + 1,))
        with pytest.raises(SchemaError):
            upgrade(conn)


# --- migrate-storage, faults -------------------------------------------------------------------


def test_migrate_storage_copies_the_ledger(pg_pool: PgPool, tmp_path: Path) -> None:
    pg = PgLedger(pg_pool)
    wipe(pg)
    data = tmp_path / "data"
    rows = [entry("b", NOW, cost=1.0, cache_reason="ttl"), entry("a", NOW, kind="read_round"),
            entry("c", NOW - 1, session="s2", tenant="u", usage=Usage(output=3))]
    with Database.in_dir(data) as db:
        SqliteLedger(db).add(rows)
        want = SqliteLedger(db).totals()
    assert copy_data_dir(data, pg_pool).ledger == 3
    assert copy_data_dir(data, pg_pool).ledger == 0  # safe to run again
    assert_totals(pg.totals(), want)
    assert [e.id for e in pg.entries("t", "s")] == ["b", "a"]  # the order they were recorded


def test_the_database_away_fails_fast(tmp_path: Path) -> None:
    pool = PgPool(f"postgresql://ctxproxy@127.0.0.1:{free_port()}/none", timeout_s=0.5)
    pool.open(wait=False)
    store = PgLedger(pool)
    try:
        with pytest.raises(StoreUnavailable):
            store.add([entry("a")])
        began = time.perf_counter()
        for call in (lambda: store.totals(), lambda: store.last("t", "s"),
                     lambda: store.expire(NOW)):
            with pytest.raises(StoreUnavailable):
                call()
        assert time.perf_counter() - began < 0.2  # marked down: no wait per call
    finally:
        pool.close()


def test_ties_keep_insertion_order_where_the_heap_does_not(pg_pool: PgPool) -> None:
    """PostgreSQL reuses a vacuumed slot: a later row can sit before an earlier one."""
    store = PgLedger(pg_pool)
    with pg_pool.connection() as conn:  # one fresh page, whatever earlier tests left
        conn.execute("TRUNCATE ledger, ledger_sessions, ledger_breaks")
    store.add([entry(f"r{i}", NOW - (10 * DAY if i == 1 else 0)) for i in range(4)])
    store.add([entry("x", NOW + 1)])
    assert store.expire(NOW - DAY) == 1
    with pg_pool.connection() as conn:
        conn.execute("VACUUM ledger")
    store.add([entry("y", NOW + 1)])
    with pg_pool.connection() as conn:
        physical = [r[0] for r in conn.execute("SELECT id FROM ledger").fetchall()]
    assert physical.index("y") < physical.index("x")  # the case this test is about
    assert [e.id for e in store.entries("t", "s")][-2:] == ["x", "y"]
    assert [e.id for e in store.entries("t", "s", limit=2)] == ["x", "y"]
