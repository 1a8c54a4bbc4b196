"""The dialog archive in PostgreSQL (the ``DialogStore`` Protocol).

The archive keeps the shape of the files backend so a summary's pointer ("dialog/2026-12-02.jsonl
lines 1-240") means the same on every replica and in both backends: each line is a row of
``dialog_lines`` under its virtual file ``dialog/YYYY-MM-DD.jsonl`` (UTC day of the write) and
line number, with exactly the bytes the files backend would have appended; ``dialog_files``
counts each file's lines and bytes; ``messages`` maps a chain to its file and line.

:meth:`PgDialog.record` is one transaction holding a per-session advisory lock: the check for
archived chains, the line numbering and the inserts cannot interleave with another replica
recording the same session, so every message is archived once even when two replicas receive
the same history at the same moment (the files backend gets the same from SQLite's write lock).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Final

from proxy.store.chains import DigestCacheLike
from proxy.store.dialog import FileSpan, LineRef, RecordResult, line_of, pending, role_of
from proxy.store.fs import Entry
from proxy.store.paths import DIALOG_DIR, check_name, dialog_filename
from proxy.store.postgres.pool import PgPool
from proxy.store.times import format_ts, utc

__all__ = ["PgDialog", "session_lock"]

log = logging.getLogger("proxy.store")

# Serialises writers of one session across replicas, for the transaction's lifetime.
_LOCK: Final = "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))"


def session_lock(tenant: str, session: str) -> tuple[str, tuple[str]]:
    return _LOCK, (f"dialog/{tenant}/{session}",)


class PgDialog:
    def __init__(self, pool: PgPool, *, digest_cache: DigestCacheLike | None = None) -> None:
        self.pool = pool
        self.digest_cache = digest_cache

    def record(
        self,
        tenant: str,
        session: str,
        messages: Sequence[Any],
        *,
        chains: Sequence[str] | None = None,
        answer: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
        now: datetime | None = None,
        incomplete: bool = False,
    ) -> RecordResult:
        """As :meth:`proxy.store.dialog.DialogArchive.record` (same lines, same numbering)."""
        check_name(tenant, "tenant")
        check_name(session, "session")
        moment = utc(now)
        items, frozen, answer_chain = pending(messages, chains, answer, self.digest_cache,
                                              incomplete=incomplete)
        if not items:
            return RecordResult(0, None, None, frozen, answer_chain, False)
        rel = f"{DIALOG_DIR}/{dialog_filename(moment.date())}"
        ts = format_ts(moment)
        with self.pool.connection() as conn, conn.transaction():
            conn.execute(*session_lock(tenant, session))
            known = {r[0] for r in conn.execute(
                "SELECT chain FROM messages WHERE tenant = %s AND session = %s "
                "AND chain = ANY(%s)", (tenant, session, [it.chain for it in items]))}
            new = [it for it in items if it.chain not in known]
            if not new:
                return RecordResult(0, None, None, frozen, answer_chain, False)
            row = conn.execute("SELECT last_chain, thinking_dropped_at IS NOT NULL FROM sessions "
                               "WHERE tenant = %s AND session = %s", (tenant, session)).fetchone()
            last = row[0] if row is not None else None
            dropped = row is not None and bool(row[1])
            branched = last is not None and new[0].parent != last
            bodies = [line_of(it, session, ts) for it in new]
            row = conn.execute("SELECT lines FROM dialog_files WHERE tenant = %s AND "
                               "session = %s AND file = %s", (tenant, session, rel)).fetchone()
            first = (int(row[0]) if row is not None else 0) + 1
            numbers = list(range(first, first + len(new)))
            written = sum(len(b) + 1 for b in bodies)
            conn.execute(
                """INSERT INTO dialog_lines (tenant, session, file, line, body)
                   SELECT %s, %s, %s, unnest(%s::int[]), unnest(%s::bytea[])""",
                (tenant, session, rel, numbers, bodies),
            )
            conn.execute(
                """INSERT INTO messages (tenant, session, chain, position, parent, role, file,
                                         line, ts)
                   SELECT %s, %s, c, p, par, r, %s, l, %s
                   FROM unnest(%s::text[], %s::int[], %s::text[], %s::text[], %s::int[])
                        AS u(c, p, par, r, l)""",
                (tenant, session, rel, moment,
                 [it.chain for it in new], [it.pos for it in new], [it.parent for it in new],
                 [role_of(it.message) for it in new], numbers),
            )
            conn.execute(
                """INSERT INTO dialog_files (tenant, session, file, lines, size, updated_at)
                   VALUES (%s, %s, %s, %s, %s, %s)
                   ON CONFLICT (tenant, session, file) DO UPDATE SET
                       lines = dialog_files.lines + excluded.lines,
                       size = dialog_files.size + excluded.size,
                       updated_at = excluded.updated_at""",
                (tenant, session, rel, len(new), written, moment),
            )
            conn.execute(
                """INSERT INTO sessions (tenant, session, messages, first_seen, last_seen,
                                         last_chain)
                   VALUES (%s, %s, %s, %s, %s, %s)
                   ON CONFLICT (tenant, session) DO UPDATE SET
                       messages = sessions.messages + excluded.messages,
                       first_seen = least(sessions.first_seen, excluded.first_seen),
                       last_seen = greatest(sessions.last_seen, excluded.last_seen),
                       last_chain = excluded.last_chain""",
                (tenant, session, len(new), moment, moment, new[-1].chain),
            )
        if branched:
            log.info("session %s/%s: history branched at position %d", tenant, session, new[0].pos)
        return RecordResult(written=len(new), first=LineRef(rel, first),
                            last=LineRef(rel, numbers[-1]), chains=frozen,
                            answer_chain=answer_chain, branched=branched, bytes_written=written,
                            thinking_dropped=dropped)

    def span(self, tenant: str, session: str, chains: Sequence[str], *,
             exact: bool = False) -> list[FileSpan]:
        if not chains:
            return []
        with self.pool.connection() as conn:
            rows = conn.execute(
                """SELECT file, line FROM messages WHERE tenant = %s AND session = %s
                   AND chain = ANY(%s) ORDER BY file, line""",
                (tenant, session, list(chains)),
            ).fetchall()
        spans: list[FileSpan] = []
        for file, line in rows:
            if spans and spans[-1].file == file and (not exact or line == spans[-1].last_line + 1):
                spans[-1] = spans[-1]._replace(last_line=line)
            else:
                spans.append(FileSpan(file, line, line))
        return spans

    def known(self, tenant: str, session: str, chains: Sequence[str]) -> set[str]:
        with self.pool.connection() as conn:
            rows = conn.execute("SELECT chain FROM messages WHERE tenant = %s AND session = %s "
                                "AND chain = ANY(%s)", (tenant, session, list(chains))).fetchall()
        return {r[0] for r in rows}

    # --- files (/files, the read tool) -----------------------------------------------------

    def listing(self, tenant: str, session: str) -> list[Entry]:
        """``YYYY-MM-DD.jsonl`` entries of a session, newest first."""
        with self.pool.connection() as conn:
            rows = conn.execute(
                """SELECT file, size, updated_at FROM dialog_files
                   WHERE tenant = %s AND session = %s ORDER BY updated_at DESC, file""",
                (tenant, session),
            ).fetchall()
        return [Entry(f.removeprefix(f"{DIALOG_DIR}/"), int(size), at.timestamp())
                for f, size, at in rows]

    def read_file(self, tenant: str, session: str, name: str) -> bytes | None:
        """One virtual file's bytes, as the files backend would have it; None: no such file."""
        rel = f"{DIALOG_DIR}/{name}"
        with self.pool.connection() as conn:
            rows = conn.execute(
                """SELECT body FROM dialog_lines WHERE tenant = %s AND session = %s AND file = %s
                   ORDER BY line""",
                (tenant, session, rel),
            ).fetchall()
        if not rows:
            return None
        return b"".join(bytes(r[0]) + b"\n" for r in rows)
