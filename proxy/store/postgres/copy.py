"""``ctxproxy migrate-storage``: copy a files + SQLite ``data_dir`` into PostgreSQL.

Every row is copied as it is (chains, positions, line numbers, timestamps), so summaries' pointers
into the archive keep their meaning; every archive line is copied with its physical line number
(a torn line too, so the numbering a pointer uses is the one a text viewer shows). Safe to run
again: rows that exist are left alone (``ON CONFLICT DO NOTHING``), files whose line count the
database already holds are skipped. Long-term memory comes too: every scope's row, versions and
pins from SQLite, its daily notes from ``<tenant>/memory/<scope>/memory/`` (a day the database
already has is left alone; the ``MEMORY.md`` files are copies of the versions). So do the read
rounds kept per answer, their bytes as they are, and the cost ledger's entries, in the order
they were recorded, through :meth:`PgLedger.insert` (an entry the database has is left alone,
and the totals grow by exactly what was copied).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from proxy.store import fs
from proxy.store.db import Database
from proxy.store.ledger_entry import decode_entry
from proxy.store.paths import DIALOG_DIR, MEMORY_DAYS_DIR, MEMORY_DIR, TOOL_RESULT_DIR, db_path
from proxy.store.postgres import PgPool
from proxy.store.postgres.ledger import PgLedger
from proxy.store.postgres.summaries import _COLUMNS as _SUMMARY_COLUMNS
from proxy.store.postgres.summaries import _MARKS as _SUMMARY_MARKS
from proxy.store.postgres.summaries import _row as _summary_row
from proxy.store.summaries import SummaryStore
from proxy.store.times import parse_ts

__all__ = ["CopyReport", "copy_data_dir"]

log = logging.getLogger("proxy.store")


@dataclass
class CopyReport:
    originals: int = 0
    dialog_lines: int = 0
    messages: int = 0
    summaries: int = 0
    sessions: int = 0
    memory_days: int = 0
    memory_versions: int = 0
    rounds: int = 0
    ledger: int = 0


def copy_data_dir(data_dir: Path, pool: PgPool) -> CopyReport:
    report = CopyReport()
    db = Database.in_dir(data_dir) if db_path(data_dir).exists() else None
    try:
        for tenant in fs.subdirs(data_dir):
            for session in fs.subdirs(data_dir, (tenant,)):
                if session == MEMORY_DIR:  # a reserved session name: the tenant's memory
                    _copy_memory_days(data_dir, pool, tenant, report)
                    continue
                _copy_originals(data_dir, pool, tenant, session, report)
                _copy_dialog(data_dir, pool, tenant, session, report)
        if db is not None:
            _copy_rows(db, pool, report)
            _copy_memory_rows(db, pool, report)
            _copy_rounds(db, pool, report)
            _copy_ledger(db, pool, report)
    finally:
        if db is not None:
            db.close()
    return report


def _copy_originals(data_dir: Path, pool: PgPool, tenant: str, session: str,
                    report: CopyReport) -> None:
    for entry in fs.list_files(data_dir, (tenant, session, TOOL_RESULT_DIR), ".txt"):
        data = fs.read_bytes(data_dir, (tenant, session, TOOL_RESULT_DIR, entry.name))
        with pool.connection() as conn:
            report.originals += conn.execute(
                """INSERT INTO originals (tenant, session, rid, content, size, created_at)
                   VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING""",
                (tenant, session, entry.name.removesuffix(".txt"), data, len(data),
                 datetime.fromtimestamp(entry.mtime, UTC))).rowcount


def _copy_dialog(data_dir: Path, pool: PgPool, tenant: str, session: str,
                 report: CopyReport) -> None:
    for entry in fs.list_files(data_dir, (tenant, session, DIALOG_DIR), ".jsonl"):
        data = fs.read_bytes(data_dir, (tenant, session, DIALOG_DIR, entry.name))
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        rel = f"{DIALOG_DIR}/{entry.name}"
        with pool.connection() as conn, conn.transaction():
            have = conn.execute("SELECT lines FROM dialog_files WHERE tenant = %s AND "
                                "session = %s AND file = %s", (tenant, session, rel)).fetchone()
            if have is not None and int(have[0]) >= len(lines):
                continue
            conn.execute(
                """INSERT INTO dialog_lines (tenant, session, file, line, body)
                   SELECT %s, %s, %s, unnest(%s::int[]), unnest(%s::bytea[])
                   ON CONFLICT DO NOTHING""",
                (tenant, session, rel, list(range(1, len(lines) + 1)), lines))
            conn.execute(
                """INSERT INTO dialog_files (tenant, session, file, lines, size, updated_at)
                   VALUES (%s, %s, %s, %s, %s, %s)
                   ON CONFLICT (tenant, session, file) DO UPDATE SET lines = excluded.lines,
                       size = excluded.size, updated_at = excluded.updated_at""",
                (tenant, session, rel, len(lines), len(data),
                 datetime.fromtimestamp(entry.mtime, UTC)))
            report.dialog_lines += len(lines)


def _copy_rows(db: Database, pool: PgPool, report: CopyReport) -> None:
    with db.connect() as src:
        messages = src.execute("SELECT tenant, session, chain, position, parent, role, file, "
                               "line, ts FROM messages").fetchall()
        sessions = src.execute("SELECT tenant, session, turns, tokens_in, tokens_out, "
                               "compactions, offloads, messages, first_seen, last_seen, "
                               "last_chain, thinking_dropped_at FROM sessions").fetchall()
    summaries = [rec for t, s in {(r[0], r[1]) for r in sessions}
                 for rec in SummaryStore(db).history(t, s)]
    with pool.connection() as conn, conn.transaction():
        for m in messages:
            report.messages += conn.execute(
                """INSERT INTO messages (tenant, session, chain, position, parent, role, file,
                                         line, ts)
                   VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING""",
                (*tuple(m)[:8], parse_ts(m[8]))).rowcount
        for s in sessions:
            report.sessions += conn.execute(
                """INSERT INTO sessions (tenant, session, turns, tokens_in, tokens_out,
                       compactions, offloads, messages, first_seen, last_seen, last_chain,
                       thinking_dropped_at)
                   VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)
                   ON CONFLICT DO NOTHING""",
                (*tuple(s)[:8], parse_ts(s[8]), parse_ts(s[9]), s[10],
                 parse_ts(s[11]) if s[11] is not None else None)).rowcount
        for rec in summaries:
            report.summaries += conn.execute(
                f"INSERT INTO summaries ({_SUMMARY_COLUMNS}) VALUES ({_SUMMARY_MARKS}) "
                "ON CONFLICT DO NOTHING", _summary_row(rec)).rowcount


def _copy_memory_days(data_dir: Path, pool: PgPool, tenant: str, report: CopyReport) -> None:
    for scope in fs.subdirs(data_dir, (tenant, MEMORY_DIR)):
        days = (tenant, MEMORY_DIR, scope, MEMORY_DAYS_DIR)
        for entry in fs.list_files(data_dir, days, ".md"):
            data = fs.read_bytes(data_dir, (*days, entry.name))
            with pool.connection() as conn:
                report.memory_days += conn.execute(
                    """INSERT INTO memory_days (tenant, scope, day, content, size, updated_at)
                       VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING""",
                    (tenant, scope, entry.name.removesuffix(".md"), data, len(data),
                     datetime.fromtimestamp(entry.mtime, UTC))).rowcount


def _copy_memory_rows(db: Database, pool: PgPool, report: CopyReport) -> None:
    def ts(value: str | None) -> datetime | None:
        return parse_ts(value) if value else None

    with db.connect() as src:
        scopes = src.execute("SELECT tenant, scope, version, last_entry_at, folded_at "
                             "FROM memory_scopes").fetchall()
        versions = src.execute("SELECT tenant, scope, version, text, created_at "
                               "FROM memory_versions").fetchall()
        pins = src.execute("SELECT tenant, scope, session, epoch, version, created_at "
                           "FROM memory_pins").fetchall()
    with pool.connection() as conn, conn.transaction():
        # A fold lease is the source process's: it is not copied (a fold may start anew).
        for t, s, v, last, folded in scopes:
            conn.execute(
                """INSERT INTO memory_scopes (tenant, scope, version, last_entry_at, folded_at)
                   VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING""",
                (t, s, v, ts(last), ts(folded)))
        for t, s, v, text, created in versions:
            report.memory_versions += conn.execute(
                """INSERT INTO memory_versions (tenant, scope, version, text, created_at)
                   VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING""",
                (t, s, v, text, parse_ts(created))).rowcount
        for t, s, session, epoch, v, created in pins:
            conn.execute(
                """INSERT INTO memory_pins (tenant, scope, session, epoch, version, created_at)
                   VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING""",
                (t, s, session, epoch, v, parse_ts(created)))


def _copy_rounds(db: Database, pool: PgPool, report: CopyReport) -> None:
    with db.connect() as src:
        rows = src.execute("SELECT tenant, session, answer_key, body, created_at FROM rounds").fetchall()
    with pool.connection() as conn, conn.transaction():
        for t, s, answer_key, body, created in rows:
            report.rounds += conn.execute(
                """INSERT INTO rounds (tenant, session, answer_key, body, created_at)
                   VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING""",
                (t, s, answer_key, bytes(body), parse_ts(created))).rowcount


def _copy_ledger(db: Database, pool: PgPool, report: CopyReport, batch: int = 500) -> None:
    store = PgLedger(pool)
    with db.connect() as src:
        rows = src.execute("SELECT body FROM ledger ORDER BY rowid")
        while chunk := rows.fetchmany(batch):
            report.ledger += store.insert([decode_entry(bytes(r[0])) for r in chunk])
