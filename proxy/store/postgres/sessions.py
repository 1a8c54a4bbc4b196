"""Per-session counters in PostgreSQL (the ``SessionIndex`` Protocol): increments are summed
by the database (``x = x + excluded.x``), so replicas adding at once never lose a count."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Final

from proxy.store.paths import check_name
from proxy.store.postgres.pool import PgPool
from proxy.store.sessions import SessionRow, check_counters
from proxy.store.times import utc

__all__ = ["PgSessions"]

_COLUMNS: Final = ("tenant, session, turns, tokens_in, tokens_out, compactions, offloads, "
                   "messages, first_seen, last_seen, last_chain")


def _row(r: Sequence[Any]) -> SessionRow:
    return SessionRow(tenant=r[0], session=r[1], turns=int(r[2]), tokens_in=int(r[3]),
                      tokens_out=int(r[4]), compactions=int(r[5]), offloads=int(r[6]),
                      messages=int(r[7]), first_seen=utc(r[8]), last_seen=utc(r[9]),
                      last_chain=r[10])


class PgSessions:
    def __init__(self, pool: PgPool) -> None:
        self.pool = pool

    def update_session_stats(
        self, tenant: str, session: str, *, now: datetime | None = None, **increments: int
    ) -> SessionRow:
        names = check_counters(tenant, session, increments)
        # Column names come only from the SESSION_COUNTERS whitelist checked above.
        cols = "".join(f", {n}" for n in names)
        marks = ", %s" * len(names)
        updates = "".join(f", {n} = sessions.{n} + excluded.{n}" for n in names)
        moment = utc(now)
        with self.pool.connection() as conn:
            row = conn.execute(
                f"""INSERT INTO sessions (tenant, session, first_seen, last_seen{cols})
                    VALUES (%s, %s, %s, %s{marks})
                    ON CONFLICT (tenant, session) DO UPDATE SET
                        last_seen = greatest(sessions.last_seen, excluded.last_seen){updates}
                    RETURNING {_COLUMNS}""",
                (tenant, session, moment, moment, *(increments[n] for n in names)),
            ).fetchone()
        assert row is not None  # INSERT ... RETURNING always returns the row
        return _row(row)

    def session_stats(self, tenant: str, session: str) -> SessionRow | None:
        with self.pool.connection() as conn:
            row = conn.execute(f"SELECT {_COLUMNS} FROM sessions WHERE tenant = %s AND "
                               "session = %s", (tenant, session)).fetchone()
        return None if row is None else _row(row)

    def thinking_dropped(self, tenant: str, session: str) -> bool:
        with self.pool.connection() as conn:
            row = conn.execute("SELECT thinking_dropped_at IS NOT NULL FROM sessions "
                               "WHERE tenant = %s AND session = %s", (tenant, session)).fetchone()
        return row is not None and bool(row[0])

    def mark_thinking_dropped(
        self, tenant: str, session: str, *, now: datetime | None = None
    ) -> None:
        """Set once: the first time stays (concurrent replicas agree by coalesce)."""
        check_name(tenant, "tenant")
        check_name(session, "session")
        moment = utc(now)
        with self.pool.connection() as conn:
            conn.execute(
                """INSERT INTO sessions (tenant, session, first_seen, last_seen,
                                         thinking_dropped_at)
                   VALUES (%s, %s, %s, %s, %s)
                   ON CONFLICT (tenant, session) DO UPDATE SET thinking_dropped_at =
                       coalesce(sessions.thinking_dropped_at, excluded.thinking_dropped_at)""",
                (tenant, session, moment, moment, moment),
            )

    def sessions(self, tenant: str | None = None) -> list[SessionRow]:
        with self.pool.connection() as conn:
            if tenant is None:
                rows = conn.execute(f"SELECT {_COLUMNS} FROM sessions "
                                    "ORDER BY last_seen DESC, tenant, session").fetchall()
            else:
                rows = conn.execute(f"SELECT {_COLUMNS} FROM sessions WHERE tenant = %s "
                                    "ORDER BY last_seen DESC, session", (tenant,)).fetchall()
        return [_row(r) for r in rows]

    def tenant_exists(self, tenant: str) -> bool:
        with self.pool.connection() as conn:
            row = conn.execute("SELECT 1 FROM sessions WHERE tenant = %s LIMIT 1",
                               (tenant,)).fetchone()
        return row is not None
