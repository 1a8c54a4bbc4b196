"""The storage backends and the choice between them (``storage.url``).

:class:`FilesBackend` is the embedded default: offloaded originals, the dialog archive and the
``.md`` copies of summaries as files under ``data_dir``, their index, summaries and session
counters in one SQLite database there (one process, or several on one machine).
:class:`proxy.store.postgres.PostgresBackend` keeps all of it in PostgreSQL, for many replicas.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from proxy.config.storage import StorageConfig
from proxy.store import fs
from proxy.store.chains import DigestCache
from proxy.store.db import Database
from proxy.store.dialog import DialogArchive
from proxy.store.gc import GcReport, collect
from proxy.store.interfaces import (
    FileKind,
    LedgerStore,
    MemoryStore,
    RoundStore,
    SessionIndex,
    SharedSummaries,
    StoreBackend,
    Summaries,
)
from proxy.store.ledger import SqliteLedger
from proxy.store.memory import MemoryFiles
from proxy.store.rounds import SqliteRounds
from proxy.store.summaries import SummaryStore
from proxy.store.tool_results import ToolResultStore
from proxy.store.usage import DiskUsage

__all__ = ["DiskFiles", "FilesBackend", "open_backend"]

log = logging.getLogger("proxy")

_SUFFIX = {"dialog": ".jsonl", "tool_result": ".txt", "summaries": ".md"}


class DiskFiles:
    """A session's files under ``data_dir`` (every open through :mod:`proxy.store.fs`)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir)

    def exists(self, tenant: str, session: str) -> bool:
        try:
            fd = fs.open_dir(self.data_dir, [tenant, session])
        except fs.Hidden:
            return False
        os.close(fd)
        return True

    def listing(self, tenant: str, session: str, kind: FileKind) -> list[fs.Entry]:
        return fs.list_files(self.data_dir, [tenant, session, kind], _SUFFIX[kind])

    def open(self, tenant: str, session: str, kind: FileKind,
             name: str) -> tuple[int, os.stat_result]:
        return fs.open_file(self.data_dir, [tenant, session, kind, name])

    def tenant_known(self, tenant: str) -> bool:
        return fs.lstat(self.data_dir, (tenant,)) is not None


class FilesBackend:
    """Files plus SQLite under ``data_dir``. A database that cannot be opened leaves
    ``dialog``, ``summaries``, ``sessions``, ``memory``, ``rounds`` and ``ledger`` None: the
    proxy forwards without them."""

    name = "files"
    shared: SharedSummaries | None = None

    def __init__(self, storage: StorageConfig, *, digest_cache_bytes: int) -> None:
        self.data_dir = Path(storage.data_dir)
        self.originals = ToolResultStore(self.data_dir, storage.tool_result_ttl_days)
        self.files = DiskFiles(self.data_dir)
        self.database = _open_db(self.data_dir)
        self.dialog: DialogArchive | None = None
        self.summaries: Summaries | None = None
        self.sessions: SessionIndex | None = None
        if self.database is not None:
            self.dialog = DialogArchive(self.data_dir, self.database,
                                        digest_cache=DigestCache(max_bytes=digest_cache_bytes))
            self.summaries = SummaryStore(self.database, self.data_dir)
            self.sessions = self.database
        self.memory: MemoryStore | None = (
            MemoryFiles(self.database, self.data_dir) if self.database is not None else None)
        self.rounds: RoundStore | None = (
            SqliteRounds(self.database) if self.database is not None else None)
        self.ledger: LedgerStore | None = (
            SqliteLedger(self.database) if self.database is not None else None)

    @property
    def failures(self) -> int:
        return 0  # disk failures are counted where they happen (ctxproxy_disk_errors)

    def tenant_sizes(self) -> dict[str, int]:
        return DiskUsage(self.data_dir).measure()

    def collect(self, usage: DiskUsage, *, dialog_ttl_days: float | None,
                now: float | None = None) -> GcReport:
        return collect(self.data_dir, self.database, self.originals, usage,
                       dialog_ttl_days=dialog_ttl_days, now=now)

    def ready(self) -> bool:
        return self.database is not None

    def close(self) -> None:
        if self.database is not None:
            self.database.close()


def _open_db(data_dir: Path) -> Database | None:
    try:
        return Database.in_dir(data_dir)
    except Exception as exc:  # a broken disk must not stop the proxy: it forwards without
        log.error("cannot open the database under %s (%s): dialog archive and compaction are "
                  "off", data_dir, exc)
        return None


def open_backend(storage: StorageConfig, *, digest_cache_bytes: int) -> StoreBackend:
    """The backend ``storage`` names (blocking: opens files or connects)."""
    if storage.url is None:
        return FilesBackend(storage, digest_cache_bytes=digest_cache_bytes)
    from proxy.store.postgres import PostgresBackend  # psycopg only when it is used

    return PostgresBackend(storage, digest_cache_bytes=digest_cache_bytes)
