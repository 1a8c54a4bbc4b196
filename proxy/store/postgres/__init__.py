"""The PostgreSQL backend (``storage.url: postgresql://...``): every kind of state in one
database that many ``ctxproxy serve`` replicas share. One module per kind (``originals``,
``dialog``, ``summaries``, ``sessions``, ``memory``, ``rounds``, ``ledger``), the schema and its migrations in
``schema``, the connection pool and its fault handling in ``pool``. Nothing is kept on local disk; what a
replica holds in memory is only a cache.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import UTC, datetime

from proxy.config.storage import StorageConfig
from proxy.store.chains import DigestCache
from proxy.store.fs import Entry, Hidden
from proxy.store.gc import GcReport
from proxy.store.interfaces import FileKind, MemoryStore
from proxy.store.postgres.dialog import PgDialog
from proxy.store.postgres.ledger import PgLedger
from proxy.store.postgres.memory import PgMemory
from proxy.store.postgres.originals import PgOriginals
from proxy.store.postgres.pool import PgPool
from proxy.store.postgres.rounds import PgRounds
from proxy.store.postgres.schema import SCHEMA_VERSION, upgrade
from proxy.store.postgres.sessions import PgSessions
from proxy.store.postgres.summaries import PgSummaries
from proxy.store.usage import DiskUsage

__all__ = ["SCHEMA_VERSION", "PgFiles", "PgPool", "PostgresBackend", "upgrade"]

log = logging.getLogger("proxy.store")


def memory_file(data: bytes, mtime: float) -> tuple[int, os.stat_result]:
    """``data`` behind a descriptor (an anonymous memory file), so /files pages and streams a
    row exactly as they do a file on disk."""
    fd = os.memfd_create("ctxproxy", os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    info = os.fstat(fd)
    fields = list(info)[:10]
    fields[7] = fields[8] = fields[9] = int(mtime)  # atime, mtime, ctime: the row's time
    return fd, os.stat_result(fields)


class PgFiles:
    """A session's files, as rows: the archive's virtual files, originals, rendered summaries."""

    def __init__(self, dialog: PgDialog, originals: PgOriginals, summaries: PgSummaries,
                 sessions: PgSessions) -> None:
        self.dialog = dialog
        self.originals = originals
        self.summaries = summaries
        self.sessions = sessions

    def exists(self, tenant: str, session: str) -> bool:
        return (self.sessions.session_stats(tenant, session) is not None
                or bool(self.originals.listing(tenant, session)))

    def listing(self, tenant: str, session: str, kind: FileKind) -> list[Entry]:
        if kind == "dialog":
            return self.dialog.listing(tenant, session)
        if kind == "tool_result":
            return self.originals.listing(tenant, session)
        return [Entry(r.md_name, 0, r.created_at.timestamp())
                for r in self.summaries.history(tenant, session)]

    def open(self, tenant: str, session: str, kind: FileKind,
             name: str) -> tuple[int, os.stat_result]:
        data: bytes | None = None
        if kind == "dialog":
            data = self.dialog.read_file(tenant, session, name)
        elif kind == "tool_result" and name.endswith(".txt"):
            data = self.originals.read_bytes(tenant, session, name.removesuffix(".txt"))
        elif kind == "summaries":
            data = self.summaries.markdown(tenant, session, name)
        if data is None:
            raise Hidden(name, absent=True)
        return memory_file(data, time.time())

    def tenant_known(self, tenant: str) -> bool:
        return self.sessions.tenant_exists(tenant)


class PostgresBackend:
    name = "postgres"

    def __init__(self, storage: StorageConfig, *, digest_cache_bytes: int,
                 migrate: bool = True) -> None:
        if storage.url is None:
            raise ValueError("the PostgreSQL backend needs storage.url")
        self.pool = PgPool(storage.url, max_size=storage.pool_size,
                           timeout_s=storage.statement_timeout_s)
        self.pool.open(wait=True)
        try:
            if migrate:
                with self.pool.connection() as conn:
                    upgrade(conn)
        except BaseException:
            self.pool.close()
            raise
        owner = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
        self.originals = PgOriginals(self.pool, storage.tool_result_ttl_days)
        self.dialog = PgDialog(self.pool, digest_cache=DigestCache(max_bytes=digest_cache_bytes))
        self.summaries = self.shared = PgSummaries(self.pool, owner=owner)
        self.pg_memory = PgMemory(self.pool)  # typed as itself: collect() expires through it
        self.memory: MemoryStore | None = self.pg_memory
        self.sessions = PgSessions(self.pool)
        self.rounds = PgRounds(self.pool)
        self.ledger = PgLedger(self.pool)
        self.files = PgFiles(self.dialog, self.originals, self.summaries, self.sessions)

    @property
    def failures(self) -> int:
        return self.pool.failures

    def tenant_sizes(self) -> dict[str, int]:
        # The ledger is not counted, as in the files backend (proxy.store.ledger says why).
        with self.pool.connection() as conn:
            rows = conn.execute(
                """SELECT tenant, sum(n)::bigint FROM (
                       SELECT tenant, sum(size) AS n FROM originals GROUP BY tenant
                       UNION ALL
                       SELECT tenant, sum(size) FROM dialog_files GROUP BY tenant
                       UNION ALL
                       SELECT tenant, sum(octet_length(text)) FROM summaries GROUP BY tenant
                       UNION ALL
                       SELECT tenant, sum(size) FROM memory_days GROUP BY tenant
                       UNION ALL
                       SELECT tenant, sum(octet_length(text)) FROM memory_versions
                           GROUP BY tenant
                   ) AS t GROUP BY tenant""").fetchall()
        return {str(t): int(n) for t, n in rows}

    def collect(self, usage: DiskUsage, *, dialog_ttl_days: float | None,
                now: float | None = None) -> GcReport:
        """Expiry as the files backend does it (:mod:`proxy.store.gc`), in SQL: originals past
        their TTL; with ``dialog_ttl_days``, archive files last written before the cutoff (with
        their index rows), summaries created before it, sessions not seen since, ledger entries
        recorded before it (their sessions' totals recomputed), and long-term memory as
        :func:`proxy.store.memory.expire_memory` does."""
        moment = time.time() if now is None else now
        deleted = self.originals.gc(moment)
        files = summaries = sessions = memory = 0
        cutoff = (None if dialog_ttl_days is None
                  else datetime.fromtimestamp(moment - dialog_ttl_days * 86400, UTC))
        with self.pool.connection() as conn:
            conn.execute("DELETE FROM claims WHERE expires_at < now()")
            if cutoff is not None:
                with conn.transaction():
                    old = conn.execute("DELETE FROM dialog_files WHERE updated_at < %s "
                                       "RETURNING tenant, session, file", (cutoff,)).fetchall()
                    for tenant, session, file in old:
                        for table in ("dialog_lines", "messages"):
                            conn.execute(f"DELETE FROM {table} WHERE tenant = %s AND "
                                         "session = %s AND file = %s", (tenant, session, file))
                    files = len(old)
                    summaries = conn.execute("DELETE FROM summaries WHERE created_at < %s",
                                             (cutoff,)).rowcount
                    sessions = conn.execute("DELETE FROM sessions WHERE last_seen < %s",
                                            (cutoff,)).rowcount
                    conn.execute("DELETE FROM rounds WHERE created_at < %s", (cutoff,))
        ledger = 0
        if cutoff is not None:
            memory = self.pg_memory.expire(cutoff)
            ledger = self.ledger.expire(cutoff.timestamp())
        report = GcReport(tool_results=deleted, dialog_files=files, memory_files=memory,
                          summaries=summaries, sessions=sessions, usage=usage.measure(),
                          ledger_entries=ledger)
        if report.expired:
            log.info("gc expired %d dialog files, %d summaries, %d sessions, %d memory files, "
                     "%d ledger entries", files, summaries, sessions, memory, ledger)
        return report

    def ready(self) -> bool:
        return self.pool.ping()

    def close(self) -> None:
        self.pool.close()
