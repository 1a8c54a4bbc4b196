"""Bounded disk: expiry of offloaded files and of the dialog archive, and the usage the quota
reads (docs/security.md#bounded-disk). Run by the server at start-up and hourly, and by
``ctxproxy gc``.

* Offloaded originals older than ``storage.tool_result_ttl_days`` are deleted
  (:meth:`ToolResultStore.gc`); the archive still holds every one of them.
* With ``storage.dialog_ttl_days``, archive files last written before the cutoff are deleted with
  their index rows, summaries created before it with their ``.md`` copies, and session rows not
  seen since then. A client that resends an expired history has it archived (and compacted)
  again, as new.
* Long-term memory follows the same retention: daily notes, MEMORY files, versions and pins
  older than ``storage.dialog_ttl_days`` go too (:func:`proxy.store.memory.expire_memory`).
* So do the cost ledger's entries recorded before the cutoff, their sessions' totals
  recomputed from what remains (:meth:`proxy.store.ledger.SqlLedger.expire`).
* Every tenant's files are measured for the quota (:class:`DiskUsage`), memory included; the
  ledger is not (it lives in the database, and a quota must not stop cost accounting).

Blocking: call :func:`collect` from a worker thread when on the event loop.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from proxy.store import fs
from proxy.store.db import Database
from proxy.store.ledger import SqliteLedger
from proxy.store.memory import expire_memory
from proxy.store.paths import DIALOG_DIR, MEMORY_DIR, SUMMARIES_DIR
from proxy.store.times import format_ts
from proxy.store.tool_results import ToolResultStore
from proxy.store.usage import DiskUsage

__all__ = ["GcReport", "collect", "expire_archive"]

log = logging.getLogger("proxy.store")


@dataclass(frozen=True, slots=True)
class GcReport:
    tool_results: int = 0  # offloaded files deleted
    dialog_files: int = 0  # archive files deleted
    memory_files: int = 0  # memory notes and MEMORY files deleted
    summaries: int = 0  # summaries deleted (rows)
    sessions: int = 0  # session rows deleted
    usage: dict[str, int] = field(default_factory=dict)  # bytes per tenant after the run
    ledger_entries: int = 0  # cost ledger entries deleted

    @property
    def expired(self) -> bool:
        return bool(self.dialog_files or self.summaries or self.sessions or self.memory_files
                    or self.ledger_entries)


def collect(
    data_dir: Path,
    db: Database | None,
    tool_results: ToolResultStore,
    usage: DiskUsage,
    *,
    dialog_ttl_days: float | None,
    now: float | None = None,
) -> GcReport:
    now = time.time() if now is None else now
    deleted = tool_results.gc(now)
    files = summaries = sessions = memory = ledger = 0
    if dialog_ttl_days is not None:
        cutoff = now - dialog_ttl_days * 86400
        memory = expire_memory(data_dir, db, cutoff)
        files, summaries, sessions = expire_archive(data_dir, db, cutoff)
        if db is not None:
            ledger = SqliteLedger(db).expire(cutoff)
    report = GcReport(deleted, files, memory, summaries, sessions, usage.measure(), ledger)
    if report.expired:
        log.info("gc expired %d dialog files, %d summaries, %d sessions, %d memory files, "
                 "%d ledger entries", files, summaries, sessions, memory, ledger)
    return report


def expire_archive(data_dir: Path, db: Database | None, cutoff: float) -> tuple[int, int, int]:
    """Delete archive files, summaries and session rows older than ``cutoff`` (epoch seconds);
    returns how many of each."""
    files = 0
    stamp = format_ts(datetime.fromtimestamp(cutoff, UTC))
    for tenant in fs.subdirs(data_dir):
        for session in fs.subdirs(data_dir, (tenant,)):
            if session == MEMORY_DIR:  # memory scopes, not a session: expire_memory's
                continue
            for entry in fs.list_files(data_dir, (tenant, session, DIALOG_DIR), ".jsonl"):
                if entry.mtime >= cutoff:
                    continue
                # Index rows first: a crash in between leaves a file nobody points at (gone at
                # the next run), never rows pointing at nothing.
                if db is not None:
                    rel = f"{DIALOG_DIR}/{entry.name}"
                    with db.transaction() as conn:
                        for table in ("messages", "dialog_files"):
                            conn.execute(
                                f"DELETE FROM {table} WHERE tenant = ? AND session = ? AND file = ?",
                                (tenant, session, rel),
                            )
                if fs.unlink(data_dir, (tenant, session, DIALOG_DIR, entry.name)):
                    files += 1
            for entry in fs.list_files(data_dir, (tenant, session, SUMMARIES_DIR), ".md"):
                if entry.mtime < cutoff:
                    fs.unlink(data_dir, (tenant, session, SUMMARIES_DIR, entry.name))
    summaries = sessions = 0
    if db is not None:
        with db.transaction() as conn:
            summaries = conn.execute(
                "DELETE FROM summaries WHERE created_at < ?", (stamp,)
            ).rowcount
            sessions = conn.execute("DELETE FROM sessions WHERE last_seen < ?", (stamp,)).rowcount
            # Read rounds go with the archive they belong to (their answers age out with it).
            conn.execute("DELETE FROM rounds WHERE created_at < ?", (stamp,))
    _remove_empty_dirs(data_dir)
    return files, summaries, sessions


def _remove_empty_dirs(data_dir: Path) -> None:
    """Session and tenant directories left empty by expiry (rmdir fails on anything else)."""
    for tenant in fs.subdirs(data_dir):
        for session in fs.subdirs(data_dir, (tenant,)):
            for kind in fs.subdirs(data_dir, (tenant, session)):
                if session == MEMORY_DIR:  # kind is a memory scope: its notes and versions
                    for sub in fs.subdirs(data_dir, (tenant, session, kind)):
                        _rmdir(data_dir, (tenant, session, kind), sub)
                _rmdir(data_dir, (tenant, session), kind)
            _rmdir(data_dir, (tenant,), session)
        _rmdir(data_dir, (), tenant)


def _rmdir(data_dir: Path, parent: tuple[str, ...], name: str) -> None:
    try:
        fd = fs.open_dir(data_dir, parent)
    except fs.Hidden:
        return
    try:
        os.rmdir(name, dir_fd=fd)
    except OSError:
        pass  # not empty (or gone): kept
    finally:
        os.close(fd)
