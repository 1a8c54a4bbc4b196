"""The cost ledger in PostgreSQL (the ``LedgerStore`` Protocol): the same tables and SQL as
the files backend's (:mod:`proxy.store.ledger`), so every replica adds to one set of totals.

A retried or duplicated write adds nothing (``ON CONFLICT DO NOTHING`` on the id, the totals
added by the rows actually inserted, in that transaction); replicas adding to one session at
once sum in the database (``x = ledger_sessions.x + excluded.x``). While the database is away
every call raises :class:`proxy.errors.StoreUnavailable` at once (:mod:`.pool`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from proxy.store.ledger import PG_SQL, Execute, SqlLedger
from proxy.store.postgres.pool import PgPool

__all__ = ["PgLedger"]


class PgLedger(SqlLedger):
    """Insertion order is the ``seq`` identity column's."""

    sql = PG_SQL

    def __init__(self, pool: PgPool) -> None:
        self.pool = pool

    @contextmanager
    def _reading(self) -> Iterator[Execute]:
        with self.pool.connection() as conn:
            yield conn.execute

    @contextmanager
    def _writing(self) -> Iterator[Execute]:
        with self.pool.connection() as conn, conn.transaction():
            yield conn.execute
