"""The proxy's read rounds in PostgreSQL (the ``RoundStore`` Protocol; see
:mod:`proxy.store.rounds`): one row per answer, first writer wins, so every replica replays the
same bytes."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Final

from proxy.store.paths import check_name
from proxy.store.postgres.pool import PgPool
from proxy.store.rounds import RoundsRecord, decode_body, encode_body
from proxy.store.times import utc

__all__ = ["PgRounds"]

_COLUMNS: Final = "tenant, session, answer_key, body, created_at"


class PgRounds:
    def __init__(self, pool: PgPool) -> None:
        self.pool = pool

    def put(self, record: RoundsRecord, *, now: datetime | None = None) -> None:
        check_name(record.tenant, "tenant")
        check_name(record.session, "session")
        with self.pool.connection() as conn:
            conn.execute(
                f"INSERT INTO rounds ({_COLUMNS}) VALUES (%s, %s, %s, %s, %s) "
                "ON CONFLICT (tenant, session, answer_key) DO NOTHING",
                (record.tenant, record.session, record.answer_key, encode_body(record),
                 utc(now)))

    def find(self, tenant: str, session: str, keys: Sequence[str]) -> list[RoundsRecord]:
        if not keys:
            return []
        with self.pool.connection() as conn:
            rows = conn.execute(
                f"SELECT {_COLUMNS} FROM rounds WHERE tenant = %s AND session = %s "
                "AND answer_key = ANY(%s)", (tenant, session, list(keys))).fetchall()
        return [decode_body(t, s, c, bytes(b), utc(at)) for t, s, c, b, at in rows]
