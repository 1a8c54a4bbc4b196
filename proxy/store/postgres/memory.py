"""Long-term memory in PostgreSQL (the ``MemoryStore`` Protocol), with the semantics of the files
backend (:mod:`proxy.store.memory`), shared by every replica:

* daily notes, ``memory_days``: one row per (tenant, scope, day), appended to in place
  (``content || new``); ``updated_at`` is the file's mtime (retention), ``size`` its bytes (quota);
* versions, ``memory_versions``: immutable, numbered from the scope's row, never reused (the scope
  row stays when versions expire), so a session pinned to ``n`` forwards the same bytes on any
  replica; ``MEMORY.md`` and ``versions/`` are views of these rows (``/files``), nothing on disk;
* pins, ``memory_pins``: insert-if-absent, then read back: the first writer wins;
* the fold lock: a lease in the scope's row. :meth:`PgMemory.claim_fold` is one ``UPDATE`` whose
  ``WHERE`` is the whole gate (new facts since the last fold, the interval passed, the lease free
  or expired): PostgreSQL re-checks it on the row a concurrent claim just updated, so of two
  replicas claiming together exactly one gets the row back. :meth:`PgMemory.finish_fold` is one
  statement too: the scope row moves to version ``n + 1`` only while the token is still the
  claim's, and the version row is inserted from what that update returned.

Times are the caller's (``now``), as in the files backend, so the gate is testable and every
replica compares the same kind of clock reading. Blocking: call from a worker thread.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from datetime import UTC, date, datetime, timedelta
from typing import Any

from proxy.store.memory import FoldClaim, MemoryVersion, ScopeRow
from proxy.store.paths import memory_day_parts
from proxy.store.postgres.pool import PgPool
from proxy.store.times import utc

__all__ = ["PgMemory"]

log = logging.getLogger("proxy.store")


def _day(tenant: str, scope: str, day: date | str) -> str:
    """``YYYY-MM-DD``, validated as the files backend validates a note's path."""
    return memory_day_parts(tenant, scope, day)[-1].removesuffix(".md")


def _aware(value: datetime | None) -> datetime | None:
    return None if value is None else value.astimezone(UTC)


def _version(tenant: str, scope: str, row: Sequence[Any]) -> MemoryVersion:
    return MemoryVersion(tenant, scope, int(row[0]), row[1], row[2].astimezone(UTC))


class PgMemory:
    def __init__(self, pool: PgPool) -> None:
        self.pool = pool

    # -- daily notes -----------------------------------------------------------------------

    def append(self, tenant: str, scope: str, day: date, text: str, *,
               now: datetime | None = None) -> int:
        """Append ``text`` to the scope's notes of ``day``; bytes written."""
        data = text.encode("utf-8", "surrogatepass")
        if not data:
            return 0
        at = utc(now)
        with self.pool.connection() as conn, conn.transaction():
            conn.execute(
                """INSERT INTO memory_days (tenant, scope, day, content, size, updated_at)
                   VALUES (%s, %s, %s, %s, %s, %s)
                   ON CONFLICT (tenant, scope, day) DO UPDATE SET
                       content = memory_days.content || excluded.content,
                       size = memory_days.size + excluded.size,
                       updated_at = excluded.updated_at""",
                (tenant, scope, _day(tenant, scope, day), data, len(data), at))
            conn.execute(
                """INSERT INTO memory_scopes (tenant, scope, last_entry_at) VALUES (%s, %s, %s)
                   ON CONFLICT (tenant, scope) DO UPDATE SET
                       last_entry_at = excluded.last_entry_at""",
                (tenant, scope, at))
        return len(data)

    def days(self, tenant: str, scope: str) -> list[str]:
        """The scope's note days (``YYYY-MM-DD``), oldest first."""
        with self.pool.connection() as conn:
            rows = conn.execute("SELECT day FROM memory_days WHERE tenant = %s AND scope = %s "
                                "ORDER BY day", (tenant, scope)).fetchall()
        return [str(r[0]) for r in rows]

    def read_day(self, tenant: str, scope: str, day: str) -> str | None:
        with self.pool.connection() as conn:
            row = conn.execute(
                "SELECT content FROM memory_days WHERE tenant = %s AND scope = %s AND day = %s",
                (tenant, scope, _day(tenant, scope, day))).fetchone()
        return None if row is None else bytes(row[0]).decode("utf-8", "replace")

    # -- versions --------------------------------------------------------------------------

    def version(self, tenant: str, scope: str, number: int) -> MemoryVersion | None:
        with self.pool.connection() as conn:
            row = conn.execute(
                "SELECT version, text, created_at FROM memory_versions "
                "WHERE tenant = %s AND scope = %s AND version = %s",
                (tenant, scope, number)).fetchone()
        return None if row is None else _version(tenant, scope, row)

    def versions(self, tenant: str, scope: str) -> list[MemoryVersion]:
        """Every stored version, oldest first (the last is the current one)."""
        with self.pool.connection() as conn:
            rows = conn.execute(
                "SELECT version, text, created_at FROM memory_versions "
                "WHERE tenant = %s AND scope = %s ORDER BY version", (tenant, scope)).fetchall()
        return [_version(tenant, scope, r) for r in rows]

    def scopes(self, tenant: str | None = None) -> list[ScopeRow]:
        sql = "SELECT tenant, scope, version, last_entry_at, folded_at FROM memory_scopes"
        args: tuple[str, ...] = ()
        if tenant is not None:
            sql += " WHERE tenant = %s"
            args = (tenant,)
        with self.pool.connection() as conn:
            rows = conn.execute(sql + " ORDER BY tenant, scope", args).fetchall()
        return [ScopeRow(t, s, int(v), _aware(last), _aware(folded))
                for t, s, v, last, folded in rows]

    # -- the version a session uses ------------------------------------------------------------

    def pin(self, tenant: str, scope: str, session: str, epoch: str, *,
            now: datetime | None = None) -> int:
        """The version this session uses in this epoch: the one pinned first (by any replica),
        else the scope's current version, pinned now (0: no memory yet)."""
        key = (tenant, scope, session, epoch)
        select = ("SELECT version FROM memory_pins "
                  "WHERE tenant = %s AND scope = %s AND session = %s AND epoch = %s")
        with self.pool.connection() as conn:
            row = conn.execute(select, key).fetchone()
            if row is not None:
                return int(row[0])
            conn.execute(
                """INSERT INTO memory_pins (tenant, scope, session, epoch, version, created_at)
                   SELECT %s, %s, %s, %s, COALESCE((SELECT version FROM memory_scopes
                                                    WHERE tenant = %s AND scope = %s), 0), %s
                   ON CONFLICT DO NOTHING""",
                (*key, tenant, scope, utc(now)))
            # A statement of its own: it sees a concurrent replica's pin that won the insert.
            row = conn.execute(select, key).fetchone()
        if row is None:  # expired between the two statements: nothing pinned, no memory
            return 0
        return int(row[0])

    # -- folding ---------------------------------------------------------------------------

    def claim_fold(self, tenant: str, scope: str, *, now: datetime | None = None,
                   min_interval_s: float, lease_s: float) -> FoldClaim | None:
        """Take the scope's fold lock if a fold is due: facts recorded since the last fold,
        ``min_interval_s`` passed since it, and no other fold holding the lease."""
        at = utc(now)
        token = secrets.token_hex(8)
        with self.pool.connection() as conn:
            row = conn.execute(
                """UPDATE memory_scopes SET lease_until = %(until)s, lease_token = %(token)s
                   WHERE tenant = %(tenant)s AND scope = %(scope)s
                     AND last_entry_at IS NOT NULL
                     AND (folded_at IS NULL OR (last_entry_at > folded_at
                                                AND folded_at <= %(at)s - %(interval)s))
                     AND (lease_until IS NULL OR lease_until <= %(at)s)
                   RETURNING version, folded_at""",
                {"until": at + timedelta(seconds=lease_s), "token": token, "tenant": tenant,
                 "scope": scope, "at": at, "interval": timedelta(seconds=min_interval_s)},
            ).fetchone()
        if row is None:
            return None
        return FoldClaim(tenant, scope, token, int(row[0]), _aware(row[1]), at)

    def finish_fold(self, claim: FoldClaim, text: str, *,
                    now: datetime | None = None) -> MemoryVersion | None:
        """Store ``text`` as the scope's next version if ``claim`` still holds the lock (None
        otherwise: the lease ran out and another fold took over)."""
        created = utc(now)
        with self.pool.connection() as conn:
            row = conn.execute(
                """WITH moved AS (
                       UPDATE memory_scopes SET version = version + 1, folded_at = %s,
                           lease_until = NULL, lease_token = NULL
                       WHERE tenant = %s AND scope = %s AND lease_token = %s
                       RETURNING version)
                   INSERT INTO memory_versions (tenant, scope, version, text, created_at)
                   SELECT %s, %s, version, %s, %s FROM moved
                   RETURNING version""",
                (claim.at, claim.tenant, claim.scope, claim.token, claim.tenant, claim.scope,
                 text, created)).fetchone()
        if row is None:
            return None
        return MemoryVersion(claim.tenant, claim.scope, int(row[0]), text, created)

    # -- retention and quota (PostgresBackend.collect, tenant_sizes) ----------------------------

    def expire(self, cutoff: datetime) -> int:
        """Retention, as :func:`proxy.store.memory.expire_memory`: notes last written, versions
        created and pins made before ``cutoff`` go (scope rows stay, so numbers are never
        reused). Returns the "files" deleted: notes plus versions (each was a file)."""
        with self.pool.connection() as conn, conn.transaction():
            days = conn.execute("DELETE FROM memory_days WHERE updated_at < %s",
                                (cutoff,)).rowcount
            versions = conn.execute("DELETE FROM memory_versions WHERE created_at < %s",
                                    (cutoff,)).rowcount
            conn.execute("DELETE FROM memory_pins WHERE created_at < %s", (cutoff,))
        return days + versions
