"""Long-term memory of a scope (docs/memory.md#scope), files plus the shared SQLite database.

A scope (a tenant, or a narrower name its client gives) keeps:

* daily notes, ``data_dir/<tenant>/memory/<scope>/memory/YYYY-MM-DD.md``: durable facts the
  summarizer recorded at compaction time, appended (:meth:`MemoryFiles.append`); the file is
  the record, the database only notes when the newest fact came in;
* folded versions: ``MEMORY.md`` is the current one and ``versions/MEMORY-vNNNN.md`` the earlier
  ones, copies for people. The text the proxy injects is read from the database
  (``memory_versions``), where each version is immutable, so a session pinned to version ``n``
  forwards the same bytes until its next compaction whatever happens to the files;
* pins (``memory_pins``): the version a session's prefix uses per *epoch* (the chain of the
  summary in use, ``""`` before the first), first writer wins, so every replica agrees.

The fold lock (:meth:`MemoryFiles.claim_fold`) is a lease in the scope's row, taken in a
``BEGIN IMMEDIATE`` transaction: one fold per scope at a time across every process sharing the
database. The gate (new facts since the last fold, the interval passed, no live lease) is
checked in the same transaction. :meth:`MemoryFiles.finish_fold` stores the new version only
while the lease is still its own.

Blocking: call from a worker thread when on the event loop.
"""

from __future__ import annotations

import logging
import os
import secrets
import sqlite3
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Final

from proxy.store import fs
from proxy.store.db import Database
from proxy.store.paths import (
    MEMORY_DAYS_DIR,
    MEMORY_DIR,
    MEMORY_FILE,
    MEMORY_VERSIONS_DIR,
    memory_day_parts,
    memory_parts,
    memory_version_name,
)
from proxy.store.times import format_ts, parse_ts, utc

__all__ = ["FoldClaim", "MemoryFiles", "MemoryVersion", "ScopeRow", "expire_memory"]

log = logging.getLogger("proxy.store")

_DAY_SUFFIX: Final = ".md"


@dataclass(frozen=True, slots=True)
class MemoryVersion:
    tenant: str
    scope: str
    version: int  # 1, 2, ...
    text: str
    created_at: datetime


@dataclass(frozen=True, slots=True)
class ScopeRow:
    tenant: str
    scope: str
    version: int  # current version, 0: never folded
    last_entry_at: datetime | None
    folded_at: datetime | None


@dataclass(frozen=True, slots=True)
class FoldClaim:
    """The lock on one scope's fold, and what the fold starts from."""

    tenant: str
    scope: str
    token: str
    version: int  # the current version when claimed (0: none)
    since: datetime | None  # the previous fold's claim time: notes from that day on are new
    at: datetime  # claim time: becomes the new version's folded_at


def _ts(value: str | None) -> datetime | None:
    return parse_ts(value) if value else None


class MemoryFiles:
    """The files + SQLite memory store."""

    def __init__(self, db: Database, data_dir: Path | None = None, *, fsync: bool = True) -> None:
        self.db = db
        self.data_dir = Path(data_dir) if data_dir is not None else db.path.parent
        self.fsync = fsync

    # -- daily notes -----------------------------------------------------------------------

    def append(self, tenant: str, scope: str, day: date, text: str, *,
               now: datetime | None = None) -> int:
        """Append ``text`` to the scope's notes of ``day``; bytes written."""
        data = text.encode("utf-8", "surrogatepass")
        if not data:
            return 0
        fd = fs.append_fd(self.data_dir, memory_day_parts(tenant, scope, day))
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        stamp = format_ts(utc(now))
        with self.db.transaction() as conn:
            conn.execute(
                """INSERT INTO memory_scopes (tenant, scope, last_entry_at) VALUES (?, ?, ?)
                   ON CONFLICT (tenant, scope) DO UPDATE SET last_entry_at = excluded.last_entry_at""",
                (tenant, scope, stamp),
            )
        return len(data)

    def days(self, tenant: str, scope: str) -> list[str]:
        """The scope's note days (``YYYY-MM-DD``), oldest first."""
        entries = fs.list_files(self.data_dir, memory_parts(tenant, scope, MEMORY_DAYS_DIR),
                                _DAY_SUFFIX)
        return sorted(e.name.removesuffix(_DAY_SUFFIX) for e in entries)

    def read_day(self, tenant: str, scope: str, day: str) -> str | None:
        try:
            data = fs.read_bytes(self.data_dir, memory_day_parts(tenant, scope, day))
        except fs.Hidden:
            return None
        return data.decode("utf-8", "replace")

    # -- versions --------------------------------------------------------------------------

    def version(self, tenant: str, scope: str, number: int) -> MemoryVersion | None:
        with self.db.connect() as conn:
            row = conn.execute(
                "SELECT version, text, created_at FROM memory_versions "
                "WHERE tenant = ? AND scope = ? AND version = ?",
                (tenant, scope, number),
            ).fetchone()
        return None if row is None else _version(tenant, scope, row)

    def versions(self, tenant: str, scope: str) -> list[MemoryVersion]:
        """Every stored version, oldest first (the last is the current one)."""
        with self.db.connect() as conn:
            rows = conn.execute(
                "SELECT version, text, created_at FROM memory_versions "
                "WHERE tenant = ? AND scope = ? ORDER BY version",
                (tenant, scope),
            ).fetchall()
        return [_version(tenant, scope, r) for r in rows]

    def scopes(self, tenant: str | None = None) -> list[ScopeRow]:
        sql = "SELECT tenant, scope, version, last_entry_at, folded_at FROM memory_scopes"
        args: tuple[str, ...] = ()
        if tenant is not None:
            sql += " WHERE tenant = ?"
            args = (tenant,)
        with self.db.connect() as conn:
            rows = conn.execute(sql + " ORDER BY tenant, scope", args).fetchall()
        return [ScopeRow(r["tenant"], r["scope"], r["version"], _ts(r["last_entry_at"]),
                         _ts(r["folded_at"])) for r in rows]

    # -- the version a session uses ------------------------------------------------------------

    def pin(self, tenant: str, scope: str, session: str, epoch: str, *,
            now: datetime | None = None) -> int:
        """The version this session uses in this epoch: the one pinned first, else the scope's
        current version, pinned now (0: no memory yet)."""
        with self.db.connect() as conn:
            row = conn.execute(
                "SELECT version FROM memory_pins "
                "WHERE tenant = ? AND scope = ? AND session = ? AND epoch = ?",
                (tenant, scope, session, epoch),
            ).fetchone()
        if row is not None:
            return int(row[0])
        with self.db.transaction() as conn:
            conn.execute(
                """INSERT OR IGNORE INTO memory_pins
                   (tenant, scope, session, epoch, version, created_at)
                   SELECT ?, ?, ?, ?, COALESCE(
                       (SELECT version FROM memory_scopes WHERE tenant = ? AND scope = ?), 0), ?""",
                (tenant, scope, session, epoch, tenant, scope, format_ts(utc(now))),
            )
            row = conn.execute(
                "SELECT version FROM memory_pins "
                "WHERE tenant = ? AND scope = ? AND session = ? AND epoch = ?",
                (tenant, scope, session, epoch),
            ).fetchone()
        return int(row[0])

    # -- folding ---------------------------------------------------------------------------

    def claim_fold(self, tenant: str, scope: str, *, now: datetime | None = None,
                   min_interval_s: float, lease_s: float) -> FoldClaim | None:
        """Take the scope's fold lock if a fold is due: facts recorded since the last fold,
        ``min_interval_s`` passed since it, and no other fold holding the lease."""
        at = utc(now)
        stamp = format_ts(at)
        with self.db.transaction() as conn:
            row = conn.execute(
                "SELECT version, last_entry_at, folded_at, lease_until FROM memory_scopes "
                "WHERE tenant = ? AND scope = ?",
                (tenant, scope),
            ).fetchone()
            if row is None or row["last_entry_at"] is None:
                return None
            folded = _ts(row["folded_at"])
            if folded is not None and (
                row["last_entry_at"] <= row["folded_at"]
                or at - folded < timedelta(seconds=min_interval_s)
            ):
                return None
            if row["lease_until"] is not None and row["lease_until"] > stamp:
                return None
            token = secrets.token_hex(8)
            conn.execute(
                "UPDATE memory_scopes SET lease_until = ?, lease_token = ? "
                "WHERE tenant = ? AND scope = ?",
                (format_ts(at + timedelta(seconds=lease_s)), token, tenant, scope),
            )
        return FoldClaim(tenant, scope, token, int(row["version"]), folded, at)

    def finish_fold(self, claim: FoldClaim, text: str, *,
                    now: datetime | None = None) -> MemoryVersion | None:
        """Store ``text`` as the scope's next version if ``claim`` still holds the lock (None
        otherwise: the lease ran out and another fold took over). The previous ``MEMORY.md``
        moves to ``versions/``; bytes written are the version's ``size`` for the quota."""
        created = utc(now)
        with self.db.transaction() as conn:
            row = conn.execute(
                "SELECT version, lease_token FROM memory_scopes WHERE tenant = ? AND scope = ?",
                (claim.tenant, claim.scope),
            ).fetchone()
            if row is None or row["lease_token"] != claim.token:
                return None
            number = int(row["version"]) + 1
            conn.execute(
                "INSERT INTO memory_versions (tenant, scope, version, text, created_at) "
                "VALUES (?, ?, ?, ?, ?)",
                (claim.tenant, claim.scope, number, text, format_ts(created)),
            )
            conn.execute(
                "UPDATE memory_scopes SET version = ?, folded_at = ?, lease_until = NULL, "
                "lease_token = NULL WHERE tenant = ? AND scope = ?",
                (number, format_ts(claim.at), claim.tenant, claim.scope),
            )
        self._write_files(claim.tenant, claim.scope, number, text)
        return MemoryVersion(claim.tenant, claim.scope, number, text, created)

    def _write_files(self, tenant: str, scope: str, number: int, text: str) -> None:
        """The people's copies: the previous MEMORY.md to versions/, the new one in place. The
        database is the record; a failure here is logged, never undoes the fold."""
        try:
            if number > 1 and fs.lstat(self.data_dir, memory_parts(tenant, scope, MEMORY_FILE)):
                fs.move(self.data_dir, memory_parts(tenant, scope, MEMORY_FILE), self.data_dir,
                        memory_parts(tenant, scope, MEMORY_VERSIONS_DIR,
                                     memory_version_name(number - 1)), fsync=self.fsync)
            fs.write_atomic(self.data_dir, memory_parts(tenant, scope, MEMORY_FILE),
                            text.encode("utf-8", "surrogatepass"), fsync=self.fsync)
        except (OSError, ValueError) as exc:
            log.warning("memory: cannot write MEMORY.md of %s/%s: %s", tenant, scope, exc)


def _version(tenant: str, scope: str, row: sqlite3.Row) -> MemoryVersion:
    return MemoryVersion(tenant, scope, int(row["version"]), row["text"],
                         parse_ts(row["created_at"]))


def expire_memory(data_dir: Path, db: Database | None, cutoff: float) -> int:
    """Retention (``storage.dialog_ttl_days``): daily notes and MEMORY files last written
    before ``cutoff`` (epoch seconds) are deleted, as are versions created and pins made before
    it; a scope whose current version expired has no memory until its next fold. Files deleted."""
    files = 0
    for tenant in fs.subdirs(data_dir):
        for scope in fs.subdirs(data_dir, (tenant, MEMORY_DIR)):
            base = (tenant, MEMORY_DIR, scope)
            for sub in (MEMORY_DAYS_DIR, MEMORY_VERSIONS_DIR):
                for entry in fs.list_files(data_dir, (*base, sub), _DAY_SUFFIX):
                    if entry.mtime < cutoff and fs.unlink(data_dir, (*base, sub, entry.name)):
                        files += 1
            info = fs.lstat(data_dir, (*base, MEMORY_FILE))
            if info is not None and info.st_mtime < cutoff and fs.unlink(
                data_dir, (*base, MEMORY_FILE)
            ):
                files += 1
    if db is not None:
        stamp = format_ts(datetime.fromtimestamp(cutoff, UTC))
        with db.transaction() as conn:
            # Version numbers are never reused (the scope rows stay): a pin to an expired
            # version finds no text and the session goes without memory until its next
            # compaction, never with another version's text.
            conn.execute("DELETE FROM memory_versions WHERE created_at < ?", (stamp,))
            conn.execute("DELETE FROM memory_pins WHERE created_at < ?", (stamp,))
    return files

