"""The proxy's read rounds on PostgreSQL (proxy.store.postgres.rounds): the store's bytes and
first writer, its migration, and two replicas on one database forwarding the same bytes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from harness.inprocess import InProcess
from proxy.app import create_app
from proxy.demo.fake.upstream import FakeUpstream
from proxy.store.db import Database
from proxy.store.postgres import PgPool, PostgresBackend, upgrade
from proxy.store.postgres.copy import copy_data_dir
from proxy.store.postgres.schema import SCHEMA_VERSION, schema_version
from proxy.store.rounds import RoundsRecord, SqliteRounds
from tests.conftest import proxy_config
from tests.pg import pg_url, postgres

from .test_replay import WIRES, Model, client_copy, items_of, post

__all__ = ["pg_url", "postgres"]  # fixtures


@pytest.fixture
def backend(pg_url: str, tmp_path: Path) -> Iterator[PostgresBackend]:
    config = proxy_config("http://127.0.0.1:9/v1", tmp_path, {"storage": {"url": pg_url}})
    b = PostgresBackend(config.storage, digest_cache_bytes=1 << 20)
    yield b
    b.close()


def test_a_version_3_database_gains_the_table(pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert upgrade(conn, target=3) == [1, 2, 3]
        assert upgrade(conn, target=4) == [4] and schema_version(conn) == 4
        assert upgrade(conn) == list(range(5, SCHEMA_VERSION + 1))
        row = conn.execute("SELECT to_regclass('rounds') IS NOT NULL").fetchone()
        assert row is not None and row[0]


def test_the_store_keeps_the_bytes_and_the_first_record(backend: PostgresBackend) -> None:
    store = backend.rounds
    rec = RoundsRecord("t", "s", "c" * 32, "b" * 32, "messages",
                       before=(b'{"role":"assistant","content":[ {"x":1.50,"s":"\\u00e9"} ]}',
                               b'{"role":"user","content":[]}'),
                       answer=(b'{"role":"assistant","content":[]}',), after=(b'{"a":1}',))
    store.put(rec)
    store.put(RoundsRecord("t", "s", "c" * 32, "", "chat", before=(b"{}",), answer=None))
    [got] = store.find("t", "s", ["c" * 32, "d" * 32])
    assert (got.before, got.answer, got.after, got.parent, got.api) == (
        rec.before, rec.answer, rec.after, rec.parent, "messages")
    assert store.find("t", "other", ["c" * 32]) == [] and store.find("t", "s", []) == []


@pytest.mark.parametrize("api", ["messages", "responses", "chat"])
async def test_two_replicas_forward_the_same_bytes(
    pg_url: str, fake: FakeUpstream, fake_url: str, tmp_path: Path, api: str
) -> None:
    """Turn 1 (with a read round) on replica A; turn 2 on B, which never saw the session,
    then on A: the same forwarded bytes, the round in them."""
    wire = WIRES[api]
    model = Model(fake, wire)
    async with contextlib.AsyncExitStack() as stack:
        apps = []
        for name in ("a", "b"):
            config = proxy_config(fake_url, tmp_path / name, {"storage": {"url": pg_url}})
            apps.append(await stack.enter_async_context(InProcess(create_app(config))))
        a, b = apps
        history = wire.history()
        model.reads = 1
        r = await post(a, wire, history, "s1")
        first, again = (items_of(wire, fake.received[i].body) for i in (0, 1))
        internal = again[len(first):]
        turn2: list[Any] = [*history, *wire.answer_items(client_copy(wire, r.content, False)),
                            wire.user("and now?")]
        await post(b, wire, turn2, "s1")
        on_b = fake.received[-1].body
        await post(a, wire, turn2, "s1")
        on_a = fake.received[-1].body
        assert on_a == on_b
        sent = items_of(wire, on_b)
        assert sent[len(first):len(first) + len(internal)] == internal
        assert orjson.loads(sent[-1]) == wire.user("and now?")


def test_migrate_storage_copies_the_rounds(backend: PostgresBackend, pg_url: str,
                                           tmp_path: Path) -> None:
    rec = RoundsRecord("t", "s", "c" * 32, "b" * 32, "messages",
                       before=(b'{"role":"assistant","content":[ ]}',), answer=None)
    data = tmp_path / "data"
    with Database.in_dir(data) as db:
        SqliteRounds(db).put(rec)
    pool = PgPool(pg_url)
    pool.open()
    try:
        assert copy_data_dir(data, pool).rounds == 1
        assert copy_data_dir(data, pool).rounds == 0  # safe to run again
    finally:
        pool.close()
    [got] = backend.rounds.find("t", "s", ["c" * 32])
    assert got.before == rec.before and got.parent == rec.parent
