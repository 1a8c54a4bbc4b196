"""The one embedded SQLite database under ``data_dir`` (docs/sessions.md#the-index-database).

It holds the dialog message index, the per-file line counters of the archive, the summary cache,
per-session counters, long-term memory's index, the proxy's replayed read rounds and the cost
ledger. Files on disk are the record for people; this database is what makes
"has this message been written?" and "is there a summary for this prefix?" one indexed query.

Connection policy, and why:

* One writer connection per :class:`Database`, guarded by a ``threading.RLock`` (re-entrant so a
  store method can call another, e.g. ``update_session_stats``, inside its own transaction), and
  one read-only connection per thread that reads: with WAL, readers never wait for the writer,
  so ``/files`` and lookups never queue behind the archive write every chat request makes. A
  read from inside a write transaction of the same thread uses the writer (and sees its own
  uncommitted writes).
* ``isolation_level=None`` (autocommit) with explicit ``BEGIN IMMEDIATE`` in
  :meth:`Database.transaction`: Python's implicit transactions would start a deferred one that
  can fail to upgrade to a write lock under contention; IMMEDIATE takes the write lock up front
  and so also serialises writers in *other processes* sharing the data dir.
* ``journal_mode=WAL`` + ``synchronous=NORMAL``: readers never block the writer, and a commit
  costs no fsync (durability of the last commits is traded for speed, the database stays
  consistent after a crash). ``busy_timeout`` makes a second process wait instead of failing.
* Callers on the event loop should run the write paths through ``asyncio.to_thread``: holding
  the lock, a write may wait on disk.

Schema versions live in ``PRAGMA user_version``: opening the database runs the steps of
:data:`proxy.store.migrations.MIGRATIONS` from its version on, each in its own transaction. A
database newer than this code is refused rather than silently misread.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

from proxy.errors import SchemaError as SchemaError
from proxy.store.migrations import MIGRATIONS, SCHEMA_VERSION
from proxy.store.paths import check_name, db_path
from proxy.store.sessions import SessionRow, check_counters
from proxy.store.times import format_ts, parse_ts, utc

__all__ = [
    "Database",
    "SchemaError",
]

log = logging.getLogger("proxy.store")


def _session_row(row: sqlite3.Row) -> SessionRow:
    return SessionRow(
        tenant=row["tenant"],
        session=row["session"],
        turns=row["turns"],
        tokens_in=row["tokens_in"],
        tokens_out=row["tokens_out"],
        compactions=row["compactions"],
        offloads=row["offloads"],
        messages=row["messages"],
        first_seen=parse_ts(row["first_seen"]),
        last_seen=parse_ts(row["last_seen"]),
        last_chain=row["last_chain"],
    )


class Database:
    """The shared SQLite database; one instance per process, created by the app's lifespan."""

    def __init__(self, path: Path, *, busy_timeout_s: float = 10.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._closed = False
        self._busy_timeout_s = busy_timeout_s
        self._owner: int | None = None  # the thread inside a write transaction
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        conn = sqlite3.connect(
            self.path,
            timeout=busy_timeout_s,
            isolation_level=None,
            check_same_thread=False,
        )
        try:
            conn.row_factory = sqlite3.Row
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                # e.g. a filesystem without shared memory; still correct, just less concurrent.
                log.warning("sqlite WAL unavailable for %s (journal_mode=%s)", self.path, mode)
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
            self._conn = conn
            self._migrate()
        except BaseException:
            conn.close()
            raise

    @classmethod
    def in_dir(cls, data_dir: Path) -> Database:
        """The database at its standard place, ``data_dir/_index.sqlite3``."""
        return cls(db_path(data_dir))

    # --- connection access --------------------------------------------------------------

    @contextmanager
    def connect(self) -> Iterator[sqlite3.Connection]:
        """A connection for reads (autocommit): this thread's read-only one, or the writer when
        this thread is inside a write transaction."""
        if self._owner == threading.get_ident():
            yield self._conn
            return
        if self._closed:
            raise sqlite3.ProgrammingError("database is closed")
        reader: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if reader is None:
            reader = self._open_reader()
            self._local.conn = reader
        yield reader

    def _open_reader(self) -> sqlite3.Connection:
        uri = f"{self.path.resolve().as_uri()}?mode=ro"
        reader = sqlite3.connect(uri, uri=True, timeout=self._busy_timeout_s,
                                 isolation_level=None, check_same_thread=False)
        reader.row_factory = sqlite3.Row
        reader.execute("PRAGMA synchronous=NORMAL")  # as the writer's (readers never write)
        with self._lock:
            if self._closed:
                reader.close()
                raise sqlite3.ProgrammingError("database is closed")
            self._readers.append(reader)
        return reader

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """A write transaction (``BEGIN IMMEDIATE``) with the writer's lock held; commits on
        success.

        Nested use inside an open transaction of the same thread joins the outer one, so
        helpers can be composed; only the outermost commits or rolls back.
        """
        with self._lock:
            if self._closed:
                raise sqlite3.ProgrammingError("database is closed")
            conn = self._conn
            if conn.in_transaction:
                yield conn
                return
            conn.execute("BEGIN IMMEDIATE")
            self._owner = threading.get_ident()
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            finally:
                self._owner = None
            conn.execute("COMMIT")

    @property
    def schema_version(self) -> int:
        with self._lock:
            return int(self._conn.execute("PRAGMA user_version").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for reader in self._readers:
                reader.close()
            self._readers.clear()
            self._conn.close()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- schema -------------------------------------------------------------------------

    def _migrate(self) -> None:
        conn = self._conn
        while True:
            # Each step re-reads the version inside its write transaction, so two processes
            # opening a fresh data dir at once do not both run the same migration.
            conn.execute("BEGIN IMMEDIATE")
            try:
                version = int(conn.execute("PRAGMA user_version").fetchone()[0])
                if version > SCHEMA_VERSION:
                    raise SchemaError(
                        f"{self.path}: schema version {version} is newer than this ctxproxy "
                        f"understands ({SCHEMA_VERSION})"
                    )
                if version == SCHEMA_VERSION:
                    conn.execute("COMMIT")
                    return
                for statement in MIGRATIONS[version]:
                    conn.execute(statement)
                # user_version lives in the header page, so it commits (or rolls back) with
                # the migration itself.
                conn.execute(f"PRAGMA user_version={version + 1}")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            log.info("migrated %s to schema version %d", self.path, version + 1)

    # --- sessions -----------------------------------------------------------------------

    def touch_session(
        self,
        tenant: str,
        session: str,
        *,
        now: datetime | None = None,
        messages: int = 0,
        last_chain: str | None = None,
    ) -> None:
        """Create the session row if needed, move ``last_seen`` forward, count archived
        messages and remember the newest chain (``None`` leaves it unchanged)."""
        check_name(tenant, "tenant")
        check_name(session, "session")
        ts = format_ts(utc(now))
        with self.transaction() as conn:
            conn.execute(
                """INSERT INTO sessions (tenant, session, messages, first_seen, last_seen,
                                         last_chain)
                   VALUES (?, ?, ?, ?, ?, ?)
                   ON CONFLICT (tenant, session) DO UPDATE SET
                       messages = messages + excluded.messages,
                       first_seen = min(first_seen, excluded.first_seen),
                       last_seen = max(last_seen, excluded.last_seen),
                       last_chain = coalesce(excluded.last_chain, last_chain)""",
                (tenant, session, messages, ts, ts, last_chain),
            )

    def update_session_stats(
        self, tenant: str, session: str, *, now: datetime | None = None, **increments: int
    ) -> SessionRow:
        """Add ``increments`` to the named counters (``turns``, ``tokens_in``, ``tokens_out``,
        ``compactions``, ``offloads``), creating the row on first use; returns the new row."""
        names = check_counters(tenant, session, increments)
        ts = format_ts(utc(now))
        # Column names come only from the SESSION_COUNTERS whitelist checked above.
        cols = "".join(f", {n}" for n in names)
        marks = ", ?" * len(names)
        updates = "".join(f", {n} = {n} + excluded.{n}" for n in names)
        sql = f"""INSERT INTO sessions (tenant, session, first_seen, last_seen{cols})
                  VALUES (?, ?, ?, ?{marks})
                  ON CONFLICT (tenant, session) DO UPDATE SET
                      last_seen = max(last_seen, excluded.last_seen){updates}
                  RETURNING *"""
        with self.transaction() as conn:
            row = conn.execute(
                sql, (tenant, session, ts, ts, *(increments[n] for n in names))
            ).fetchone()
        return _session_row(row)

    def thinking_dropped(self, tenant: str, session: str) -> bool:
        """Whether the session's thinking blocks need drop_block (proxy.upstream.thinking)."""
        with self.connect() as conn:
            row = conn.execute(
                "SELECT thinking_dropped_at FROM sessions WHERE tenant = ? AND session = ?",
                (tenant, session),
            ).fetchone()
        return row is not None and row[0] is not None

    def mark_thinking_dropped(
        self, tenant: str, session: str, *, now: datetime | None = None
    ) -> None:
        """Remember that the session's thinking blocks need drop_block (the first time kept)."""
        check_name(tenant, "tenant")
        check_name(session, "session")
        ts = format_ts(utc(now))
        with self.transaction() as conn:
            conn.execute(
                """INSERT INTO sessions (tenant, session, first_seen, last_seen,
                                         thinking_dropped_at)
                   VALUES (?, ?, ?, ?, ?)
                   ON CONFLICT (tenant, session) DO UPDATE SET
                       thinking_dropped_at = coalesce(thinking_dropped_at,
                                                      excluded.thinking_dropped_at)""",
                (tenant, session, ts, ts, ts),
            )

    def session_stats(self, tenant: str, session: str) -> SessionRow | None:
        with self.connect() as conn:
            row = conn.execute(
                "SELECT * FROM sessions WHERE tenant = ? AND session = ?", (tenant, session)
            ).fetchone()
        return None if row is None else _session_row(row)

    def sessions(self, tenant: str | None = None) -> list[SessionRow]:
        """Sessions of one tenant (``None``: all, for the master key), most recent first."""
        with self.connect() as conn:
            if tenant is None:
                rows = conn.execute(
                    "SELECT * FROM sessions ORDER BY last_seen DESC, tenant, session"
                ).fetchall()
            else:
                rows = conn.execute(
                    "SELECT * FROM sessions WHERE tenant = ? ORDER BY last_seen DESC, session",
                    (tenant,),
                ).fetchall()
        return [_session_row(r) for r in rows]
