"""Offloaded originals in PostgreSQL (the ``Originals`` Protocol): one row per
(tenant, session, id), written once (``ON CONFLICT DO NOTHING``: the id is a digest of the
content, so a second writer has the same bytes), read by the read tool on any replica."""

from __future__ import annotations

import logging
import secrets
import time
from datetime import UTC, datetime

from proxy.errors import OffloadedFileMissing
from proxy.lru import LRU
from proxy.store.fs import Entry
from proxy.store.paths import check_name
from proxy.store.postgres.pool import PgPool
from proxy.store.tool_results import relative_path

__all__ = ["PgOriginals"]

log = logging.getLogger("proxy.store")

_KNOWN = 200_000  # ids known to be stored, per replica (a cache: the table is the truth)


def _utf8(content: str) -> bytes:
    return content.encode("utf-8", "surrogatepass")


class PgOriginals:
    def __init__(self, pool: PgPool, ttl_days: float) -> None:
        self.pool = pool
        self.ttl_s = ttl_days * 86400
        self._known: LRU[tuple[str, str, str], bool] = LRU(_KNOWN)

    def needs_write(self, tenant: str, session: str, rid: str, content: str) -> bool:
        """Called on the event loop for every cut of a resent history, so no query: an id this
        replica stored or saw stored is known; anything else is written (an idempotent insert,
        a no-op for an original another replica stored)."""
        return self._known.get((tenant, session, rid)) is None

    def write(self, tenant: str, session: str, rid: str, content: str) -> int:
        check_name(tenant, "tenant")
        check_name(session, "session")
        check_name(rid, "id")
        data = _utf8(content)
        with self.pool.connection() as conn:
            cur = conn.execute(
                """INSERT INTO originals (tenant, session, rid, content, size)
                   VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING""",
                (tenant, session, rid, data, len(data)),
            )
            written = len(data) if cur.rowcount else 0
        self._known.put((tenant, session, rid), True)
        return written

    def stage(self, rid: str, content: str) -> tuple[str, int]:
        token = secrets.token_hex(8)
        data = _utf8(content)
        with self.pool.connection() as conn:
            conn.execute("INSERT INTO staged (token, rid, content) VALUES (%s, %s, %s)",
                         (token, rid, data))
        return token, len(data)

    def promote(self, tenant: str, session: str, rid: str, token: str) -> None:
        with self.pool.connection() as conn, conn.transaction():
            conn.execute(
                """INSERT INTO originals (tenant, session, rid, content, size)
                   SELECT %s, %s, rid, content, length(content) FROM staged
                   WHERE token = %s AND rid = %s ON CONFLICT DO NOTHING""",
                (tenant, session, token, rid),
            )
            conn.execute("DELETE FROM staged WHERE token = %s", (token,))
        self._known.put((tenant, session, rid), True)

    def discard(self, token: str) -> None:
        with self.pool.connection() as conn:
            conn.execute("DELETE FROM staged WHERE token = %s", (token,))

    def read(self, tenant: str, session: str, rid: str) -> str:
        data = self.read_bytes(tenant, session, rid)
        if data is None:
            days = self.ttl_s / 86400
            raise OffloadedFileMissing(
                f"{relative_path(rid)} is no longer available: offloaded files are kept "
                f"{days:g} days. The full original is still in this session's dialog archive "
                f"(dialog/*.jsonl)."
            )
        return data.decode("utf-8", "surrogatepass")

    def read_bytes(self, tenant: str, session: str, rid: str) -> bytes | None:
        with self.pool.connection() as conn:
            row = conn.execute(
                "SELECT content FROM originals WHERE tenant = %s AND session = %s AND rid = %s",
                (tenant, session, rid),
            ).fetchone()
        return None if row is None else bytes(row[0])

    def listing(self, tenant: str, session: str) -> list[Entry]:
        """``<id>.txt`` entries of a session, newest first (as :func:`fs.list_files`)."""
        with self.pool.connection() as conn:
            rows = conn.execute(
                """SELECT rid, size, created_at FROM originals
                   WHERE tenant = %s AND session = %s ORDER BY created_at DESC, rid""",
                (tenant, session),
            ).fetchall()
        return [Entry(f"{rid}.txt", int(size), at.timestamp()) for rid, size, at in rows]

    def gc(self, now: float | None = None) -> int:
        """Delete originals older than the TTL (and staged ones older than an hour)."""
        moment = time.time() if now is None else now
        cutoff = datetime.fromtimestamp(moment - self.ttl_s, UTC)
        with self.pool.connection() as conn:
            deleted = conn.execute("DELETE FROM originals WHERE created_at < %s",
                                   (cutoff,)).rowcount
            conn.execute("DELETE FROM staged WHERE created_at < %s",
                         (datetime.fromtimestamp(moment - 3600, UTC),))
        if deleted:
            self._known.clear()
            log.info("gc deleted %d expired offloaded originals", deleted)
        return max(0, deleted)
