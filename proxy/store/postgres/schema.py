"""The PostgreSQL schema: a registry of numbered migrations, applied at start under a lock.

``ctxproxy_schema`` holds one row, the version; :data:`MIGRATIONS` ``[i]`` takes version ``i`` to
``i + 1`` in one transaction. :func:`upgrade` takes a session-level advisory lock first, so
replicas starting together (or ``ctxproxy db upgrade`` next to them) apply each step once: the
others wait on the lock and then find the version current. A database newer than this code is
refused rather than misread.

Adding a kind of state is one more entry appended to :data:`MIGRATIONS` plus its module in
this package (as version 2 added long-term memory); never edit a released entry.

Tables, one per kind (the module that owns it in brackets; the version that added it):
  -- version 1
  originals        offloaded tool outputs                                      [originals]
  staged           originals of a key the provider has not accepted yet        [originals]
  dialog_lines     the archive's lines, by virtual file dialog/YYYY-MM-DD.jsonl [dialog]
  dialog_files     line and byte counters of those files                       [dialog]
  messages         archive index: chain -> file and line                       [dialog]
  summaries        summary records, first writer wins                          [summaries]
  claims           who is making which summary (cross-replica single flight)   [summaries]
  sessions         per-session counters for /files                              [sessions]
  -- version 2
  memory_scopes    per scope: version, newest fact, last fold, the fold lease    [memory]
  memory_days      daily notes memory/YYYY-MM-DD.md, appended in place          [memory]
  memory_versions  folded MEMORY.md versions, immutable, numbers never reused    [memory]
  memory_pins      the version a session uses per epoch, first writer wins      [memory]
  -- version 3
  sessions.thinking_dropped_at  when Anthropic's prefix check first refused a thinking block
                   of the session (its requests then go with drop_block)        [sessions]
  -- version 4
  rounds           the proxy's read rounds of an answer, replayed later          [rounds]
  -- version 5
  ledger           the cost ledger: one row per billed call                     [ledger]
  ledger_sessions  its totals per session, kept in step with the rows           [ledger]
  ledger_breaks    its cache breaks per session and reason                      [ledger]
  -- version 6
  summaries.error  why a fallback summary is one (the summarizer's failure)     [summaries]
"""

from __future__ import annotations

import logging
from typing import Any, Final

import psycopg

from proxy.errors import SchemaError

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "schema_version", "upgrade"]

log = logging.getLogger("proxy.store")

# Any constant: the lock only has to be the same number in every replica.
_LOCK_KEY: Final = 0x637478_7072_6F78  # "ctxprox"

MIGRATIONS: Final[tuple[tuple[str, ...], ...]] = (
    (
        """CREATE TABLE originals (
            tenant     TEXT NOT NULL,
            session    TEXT NOT NULL,
            rid        TEXT NOT NULL,
            content    BYTEA NOT NULL,
            size       INTEGER NOT NULL,
            created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
            PRIMARY KEY (tenant, session, rid)
        )""",
        "CREATE INDEX originals_by_time ON originals (created_at)",
        """CREATE TABLE staged (
            token      TEXT NOT NULL,
            rid        TEXT NOT NULL,
            content    BYTEA NOT NULL,
            created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
            PRIMARY KEY (token, rid)
        )""",
        """CREATE TABLE dialog_lines (
            tenant  TEXT NOT NULL,
            session TEXT NOT NULL,
            file    TEXT NOT NULL,
            line    INTEGER NOT NULL,
            body    BYTEA NOT NULL,
            PRIMARY KEY (tenant, session, file, line)
        )""",
        """CREATE TABLE dialog_files (
            tenant     TEXT NOT NULL,
            session    TEXT NOT NULL,
            file       TEXT NOT NULL,
            lines      INTEGER NOT NULL,
            size       BIGINT NOT NULL,
            updated_at TIMESTAMPTZ NOT NULL,
            PRIMARY KEY (tenant, session, file)
        )""",
        """CREATE TABLE messages (
            tenant   TEXT NOT NULL,
            session  TEXT NOT NULL,
            chain    TEXT NOT NULL,
            position INTEGER NOT NULL,
            parent   TEXT,
            role     TEXT,
            file     TEXT NOT NULL,
            line     INTEGER NOT NULL,
            ts       TIMESTAMPTZ NOT NULL,
            PRIMARY KEY (tenant, session, chain)
        )""",
        """CREATE TABLE summaries (
            tenant         TEXT NOT NULL,
            session        TEXT NOT NULL,
            chain          TEXT NOT NULL,
            v              INTEGER NOT NULL,
            head           INTEGER NOT NULL,
            upto           INTEGER NOT NULL,
            previous_chain TEXT,
            text           TEXT NOT NULL,
            source         TEXT NOT NULL,
            model          TEXT,
            created_at     TIMESTAMPTZ NOT NULL,
            tokens_before  INTEGER NOT NULL,
            tokens_after   INTEGER NOT NULL,
            span           TEXT NOT NULL,
            seen           INTEGER NOT NULL,
            PRIMARY KEY (tenant, session, chain)
        )""",
        "CREATE INDEX summaries_by_time ON summaries (created_at)",
        """CREATE TABLE claims (
            tenant     TEXT NOT NULL,
            session    TEXT NOT NULL,
            chain      TEXT NOT NULL,
            owner      TEXT NOT NULL,
            expires_at TIMESTAMPTZ NOT NULL,
            PRIMARY KEY (tenant, session, chain)
        )""",
        """CREATE TABLE sessions (
            tenant      TEXT NOT NULL,
            session     TEXT NOT NULL,
            turns       BIGINT NOT NULL DEFAULT 0,
            tokens_in   BIGINT NOT NULL DEFAULT 0,
            tokens_out  BIGINT NOT NULL DEFAULT 0,
            compactions BIGINT NOT NULL DEFAULT 0,
            offloads    BIGINT NOT NULL DEFAULT 0,
            messages    BIGINT NOT NULL DEFAULT 0,
            first_seen  TIMESTAMPTZ NOT NULL,
            last_seen   TIMESTAMPTZ NOT NULL,
            last_chain  TEXT,
            PRIMARY KEY (tenant, session)
        )""",
        "CREATE INDEX sessions_by_last_seen ON sessions (tenant, last_seen)",
    ),
    (  # 2: long-term memory (issue 16)
        """CREATE TABLE memory_scopes (
            tenant        TEXT NOT NULL,
            scope         TEXT NOT NULL,
            version       INTEGER NOT NULL DEFAULT 0,
            last_entry_at TIMESTAMPTZ,
            folded_at     TIMESTAMPTZ,
            lease_until   TIMESTAMPTZ,
            lease_token   TEXT,
            PRIMARY KEY (tenant, scope)
        )""",
        """CREATE TABLE memory_days (
            tenant     TEXT NOT NULL,
            scope      TEXT NOT NULL,
            day        TEXT NOT NULL,
            content    BYTEA NOT NULL,
            size       BIGINT NOT NULL,
            updated_at TIMESTAMPTZ NOT NULL,
            PRIMARY KEY (tenant, scope, day)
        )""",
        "CREATE INDEX memory_days_by_time ON memory_days (updated_at)",
        """CREATE TABLE memory_versions (
            tenant     TEXT NOT NULL,
            scope      TEXT NOT NULL,
            version    INTEGER NOT NULL,
            text       TEXT NOT NULL,
            created_at TIMESTAMPTZ NOT NULL,
            PRIMARY KEY (tenant, scope, version)
        )""",
        "CREATE INDEX memory_versions_by_time ON memory_versions (created_at)",
        """CREATE TABLE memory_pins (
            tenant     TEXT NOT NULL,
            scope      TEXT NOT NULL,
            session    TEXT NOT NULL,
            epoch      TEXT NOT NULL,
            version    INTEGER NOT NULL,
            created_at TIMESTAMPTZ NOT NULL,
            PRIMARY KEY (tenant, scope, session, epoch)
        )""",
        "CREATE INDEX memory_pins_by_time ON memory_pins (created_at)",
    ),
    (  # 3: the sessions whose thinking blocks need drop_block (proxy.upstream.thinking)
        "ALTER TABLE sessions ADD COLUMN thinking_dropped_at TIMESTAMPTZ",
    ),
    (  # 4: the proxy's read rounds, replayed on later turns
        """CREATE TABLE rounds (
            tenant     TEXT NOT NULL,
            session    TEXT NOT NULL,
            answer_key TEXT NOT NULL,
            body       BYTEA NOT NULL,
            created_at TIMESTAMPTZ NOT NULL,
            PRIMARY KEY (tenant, session, answer_key)
        )""",
        "CREATE INDEX rounds_by_time ON rounds (created_at)",
    ),
    (  # 5: the cost ledger (issue 21); seq is the insertion order, which breaks ties of ts
        """CREATE TABLE ledger (
            tenant                TEXT NOT NULL,
            session               TEXT NOT NULL,
            id                    TEXT NOT NULL,
            seq                   BIGINT GENERATED ALWAYS AS IDENTITY,
            request               TEXT NOT NULL,
            ts                    DOUBLE PRECISION NOT NULL,
            kind                  TEXT NOT NULL,
            api                   TEXT NOT NULL,
            model                 TEXT NOT NULL,
            status                INTEGER NOT NULL,
            tokens_sent           BIGINT NOT NULL,
            tokens_forwarded      BIGINT NOT NULL,
            input                 BIGINT NOT NULL,
            cache_read            BIGINT NOT NULL,
            cache_write_5m        BIGINT NOT NULL,
            cache_write_1h        BIGINT NOT NULL,
            output                BIGINT NOT NULL,
            reasoning             BIGINT NOT NULL,
            iterations            BIGINT NOT NULL,
            estimated             BOOLEAN NOT NULL,
            cost                  DOUBLE PRECISION,
            direct_input          BIGINT NOT NULL,
            direct_cache_read     BIGINT NOT NULL,
            direct_cache_write_5m BIGINT NOT NULL,
            direct_cache_write_1h BIGINT NOT NULL,
            direct_output         BIGINT NOT NULL,
            direct_reasoning      BIGINT NOT NULL,
            direct_iterations     BIGINT NOT NULL,
            direct_cost           DOUBLE PRECISION,
            cache_reason          TEXT,
            body                  BYTEA NOT NULL,
            PRIMARY KEY (tenant, session, id)
        )""",
        "CREATE INDEX ledger_by_session_time ON ledger (tenant, session, ts, seq)",
        "CREATE INDEX ledger_by_time ON ledger (ts)",
        """CREATE TABLE ledger_sessions (
            tenant                TEXT NOT NULL,
            session               TEXT NOT NULL,
            requests              BIGINT NOT NULL,
            calls                 BIGINT NOT NULL,
            estimated             BIGINT NOT NULL,
            tokens_sent           BIGINT NOT NULL,
            tokens_forwarded      BIGINT NOT NULL,
            input                 BIGINT NOT NULL,
            cache_read            BIGINT NOT NULL,
            cache_write_5m        BIGINT NOT NULL,
            cache_write_1h        BIGINT NOT NULL,
            output                BIGINT NOT NULL,
            reasoning             BIGINT NOT NULL,
            iterations            BIGINT NOT NULL,
            direct_input          BIGINT NOT NULL,
            direct_cache_read     BIGINT NOT NULL,
            direct_cache_write_5m BIGINT NOT NULL,
            direct_cache_write_1h BIGINT NOT NULL,
            direct_output         BIGINT NOT NULL,
            direct_reasoning      BIGINT NOT NULL,
            direct_iterations     BIGINT NOT NULL,
            cost                  DOUBLE PRECISION NOT NULL,
            direct_cost           DOUBLE PRECISION NOT NULL,
            unpriced              BIGINT NOT NULL,
            first_ts              DOUBLE PRECISION NOT NULL,
            last_ts               DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (tenant, session)
        )""",
        "CREATE INDEX ledger_sessions_by_time ON ledger_sessions (tenant, last_ts)",
        "CREATE INDEX ledger_sessions_by_time_all ON ledger_sessions (last_ts)",
        """CREATE TABLE ledger_breaks (
            tenant  TEXT NOT NULL,
            session TEXT NOT NULL,
            reason  TEXT NOT NULL,
            n       BIGINT NOT NULL,
            PRIMARY KEY (tenant, session, reason)
        )""",
    ),
    (  # 6: why a fallback summary is one (the summarizer's failure, redacted)
        "ALTER TABLE summaries ADD COLUMN error TEXT",
    ),
)
SCHEMA_VERSION: Final = len(MIGRATIONS)

_BOOTSTRAP: Final = "CREATE TABLE IF NOT EXISTS ctxproxy_schema (version INTEGER NOT NULL)"


def schema_version(conn: psycopg.Connection[Any]) -> int:
    """The database's version (0: empty)."""
    row = conn.execute("SELECT to_regclass('ctxproxy_schema') IS NOT NULL").fetchone()
    if row is None or not row[0]:
        return 0
    got = conn.execute("SELECT version FROM ctxproxy_schema").fetchone()
    return 0 if got is None else int(got[0])


def upgrade(conn: psycopg.Connection[Any], target: int = SCHEMA_VERSION) -> list[int]:
    """Apply the missing migrations (autocommit connection); returns the versions reached."""
    applied: list[int] = []
    conn.execute("SELECT pg_advisory_lock(%s)", (_LOCK_KEY,))
    try:
        conn.execute(_BOOTSTRAP)
        while True:
            version = schema_version(conn)
            if version > SCHEMA_VERSION:
                raise SchemaError(f"database schema version {version} is newer than this "
                                  f"ctxproxy understands ({SCHEMA_VERSION})")
            if version >= target:
                return applied
            with conn.transaction():
                for statement in MIGRATIONS[version]:
                    conn.execute(statement)  # constants, not input
                conn.execute("DELETE FROM ctxproxy_schema")
                conn.execute("INSERT INTO ctxproxy_schema (version) VALUES (%s)", (version + 1,))
            applied.append(version + 1)
            log.info("migrated the database to schema version %d", version + 1)
    finally:
        conn.execute("SELECT pg_advisory_unlock(%s)", (_LOCK_KEY,))
