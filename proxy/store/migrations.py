"""The SQLite database's schema (:mod:`proxy.store.db`), as numbered steps.

Schema versions live in ``PRAGMA user_version``; :data:`MIGRATIONS` ``[i]`` upgrades version ``i``
to ``i + 1`` (:class:`proxy.store.db.Database` runs each in its own transaction when it opens
the database), and :data:`SCHEMA_VERSION` is the version this code writes.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "MIGRATIONS",
    "SCHEMA_VERSION",
]

# Each entry is the list of statements taking the schema from version i to i + 1. Never edit a
# released entry; append a new one (ALTER TABLE / new tables) instead.
MIGRATIONS: Final[tuple[tuple[str, ...], ...]] = (
    (
        # One row per distinct message of a session, keyed by its chain hash (which encodes the
        # whole prefix, so the same text at another position is another row). file is relative
        # to the session directory, line is 1-based.
        """CREATE TABLE messages (
            tenant   TEXT NOT NULL,
            session  TEXT NOT NULL,
            chain    TEXT NOT NULL,
            position INTEGER NOT NULL,
            parent   TEXT,
            role     TEXT,
            file     TEXT NOT NULL,
            line     INTEGER NOT NULL,
            ts       TEXT NOT NULL,
            PRIMARY KEY (tenant, session, chain)
        ) WITHOUT ROWID""",
        "CREATE INDEX messages_by_file ON messages (tenant, session, file, line)",
        # Line counter per archive file, so appends need not re-count; size detects files that
        # changed behind our back (a torn write, a restore) and triggers one re-count.
        """CREATE TABLE dialog_files (
            tenant  TEXT NOT NULL,
            session TEXT NOT NULL,
            file    TEXT NOT NULL,
            lines   INTEGER NOT NULL,
            size    INTEGER NOT NULL,
            PRIMARY KEY (tenant, session, file)
        ) WITHOUT ROWID""",
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
            created_at     TEXT NOT NULL,
            tokens_before  INTEGER NOT NULL,
            tokens_after   INTEGER NOT NULL,
            span           TEXT NOT NULL,
            PRIMARY KEY (tenant, session, chain)
        )""",
        "CREATE INDEX summaries_by_time ON summaries (tenant, session, created_at)",
        """CREATE TABLE sessions (
            tenant      TEXT NOT NULL,
            session     TEXT NOT NULL,
            turns       INTEGER NOT NULL DEFAULT 0,
            tokens_in   INTEGER NOT NULL DEFAULT 0,
            tokens_out  INTEGER NOT NULL DEFAULT 0,
            compactions INTEGER NOT NULL DEFAULT 0,
            offloads    INTEGER NOT NULL DEFAULT 0,
            messages    INTEGER NOT NULL DEFAULT 0,
            first_seen  TEXT NOT NULL,
            last_seen   TEXT NOT NULL,
            last_chain  TEXT,
            PRIMARY KEY (tenant, session)
        ) WITHOUT ROWID""",
        "CREATE INDEX sessions_by_last_seen ON sessions (tenant, last_seen)",
    ),
    (
        # How many messages the history held when the compaction was made: stage-2 ageing is
        # timed to compactions and recomputed from it.
        "ALTER TABLE summaries ADD COLUMN seen INTEGER NOT NULL DEFAULT 0",
    ),
    (
        # Long-term memory (proxy.store.memory): one row per scope (its current version, the
        # newest fact recorded, the last fold, and the fold lock), every folded version's
        # text, and the version each session's prefix is pinned to until its next compaction.
        """CREATE TABLE memory_scopes (
            tenant        TEXT NOT NULL,
            scope         TEXT NOT NULL,
            version       INTEGER NOT NULL DEFAULT 0,
            last_entry_at TEXT,
            folded_at     TEXT,
            lease_until   TEXT,
            lease_token   TEXT,
            PRIMARY KEY (tenant, scope)
        ) WITHOUT ROWID""",
        """CREATE TABLE memory_versions (
            tenant     TEXT NOT NULL,
            scope      TEXT NOT NULL,
            version    INTEGER NOT NULL,
            text       TEXT NOT NULL,
            created_at TEXT NOT NULL,
            PRIMARY KEY (tenant, scope, version)
        )""",
        """CREATE TABLE memory_pins (
            tenant     TEXT NOT NULL,
            scope      TEXT NOT NULL,
            session    TEXT NOT NULL,
            epoch      TEXT NOT NULL,
            version    INTEGER NOT NULL,
            created_at TEXT NOT NULL,
            PRIMARY KEY (tenant, scope, session, epoch)
        ) WITHOUT ROWID""",
    ),
    (
        # When a thinking block of the session was first refused by Anthropic's prefix check
        # (NULL: never): its requests then go with drop_block (proxy.upstream.thinking).
        "ALTER TABLE sessions ADD COLUMN thinking_dropped_at TEXT",
    ),
    (
        # The proxy's own read rounds of an answer, put back before it on later turns
        # (proxy.store.rounds): keyed by the answer as the client got it.
        """CREATE TABLE rounds (
            tenant     TEXT NOT NULL,
            session    TEXT NOT NULL,
            answer_key TEXT NOT NULL,
            body       BLOB NOT NULL,
            created_at TEXT NOT NULL,
            PRIMARY KEY (tenant, session, answer_key)
        ) WITHOUT ROWID""",
        "CREATE INDEX rounds_by_time ON rounds (created_at)",
    ),
    (
        # The cost ledger (proxy.store.ledger): one row per billed call (a rowid table: the
        # rowid is the insertion order, which breaks ties of ts), its columns what is summed or
        # searched and body the whole entry; the totals per session kept in step with the
        # rows, and the cache breaks per session and reason. ts: unix seconds.
        """CREATE TABLE ledger (
            tenant                TEXT NOT NULL,
            session               TEXT NOT NULL,
            id                    TEXT NOT NULL,
            request               TEXT NOT NULL,
            ts                    REAL NOT NULL,
            kind                  TEXT NOT NULL,
            api                   TEXT NOT NULL,
            model                 TEXT NOT NULL,
            status                INTEGER NOT NULL,
            tokens_sent           INTEGER NOT NULL,
            tokens_forwarded      INTEGER NOT NULL,
            input                 INTEGER NOT NULL,
            cache_read            INTEGER NOT NULL,
            cache_write_5m        INTEGER NOT NULL,
            cache_write_1h        INTEGER NOT NULL,
            output                INTEGER NOT NULL,
            reasoning             INTEGER NOT NULL,
            iterations            INTEGER NOT NULL,
            estimated             INTEGER NOT NULL,
            cost                  REAL,
            direct_input          INTEGER NOT NULL,
            direct_cache_read     INTEGER NOT NULL,
            direct_cache_write_5m INTEGER NOT NULL,
            direct_cache_write_1h INTEGER NOT NULL,
            direct_output         INTEGER NOT NULL,
            direct_reasoning      INTEGER NOT NULL,
            direct_iterations     INTEGER NOT NULL,
            direct_cost           REAL,
            cache_reason          TEXT,
            body                  BLOB NOT NULL,
            PRIMARY KEY (tenant, session, id)
        )""",
        "CREATE INDEX ledger_by_session_time ON ledger (tenant, session, ts)",
        "CREATE INDEX ledger_by_time ON ledger (ts)",
        """CREATE TABLE ledger_sessions (
            tenant                TEXT NOT NULL,
            session               TEXT NOT NULL,
            requests              INTEGER NOT NULL,
            calls                 INTEGER NOT NULL,
            estimated             INTEGER NOT NULL,
            tokens_sent           INTEGER NOT NULL,
            tokens_forwarded      INTEGER NOT NULL,
            input                 INTEGER NOT NULL,
            cache_read            INTEGER NOT NULL,
            cache_write_5m        INTEGER NOT NULL,
            cache_write_1h        INTEGER NOT NULL,
            output                INTEGER NOT NULL,
            reasoning             INTEGER NOT NULL,
            iterations            INTEGER NOT NULL,
            direct_input          INTEGER NOT NULL,
            direct_cache_read     INTEGER NOT NULL,
            direct_cache_write_5m INTEGER NOT NULL,
            direct_cache_write_1h INTEGER NOT NULL,
            direct_output         INTEGER NOT NULL,
            direct_reasoning      INTEGER NOT NULL,
            direct_iterations     INTEGER NOT NULL,
            cost                  REAL NOT NULL,
            direct_cost           REAL NOT NULL,
            unpriced              INTEGER NOT NULL,
            first_ts              REAL NOT NULL,
            last_ts               REAL NOT NULL,
            PRIMARY KEY (tenant, session)
        ) WITHOUT ROWID""",
        "CREATE INDEX ledger_sessions_by_time ON ledger_sessions (tenant, last_ts)",
        "CREATE INDEX ledger_sessions_by_time_all ON ledger_sessions (last_ts)",
        """CREATE TABLE ledger_breaks (
            tenant  TEXT NOT NULL,
            session TEXT NOT NULL,
            reason  TEXT NOT NULL,
            n       INTEGER NOT NULL,
            PRIMARY KEY (tenant, session, reason)
        ) WITHOUT ROWID""",
    ),
    (
        # Why a fallback summary is one (the summarizer's failure, redacted); NULL for a
        # model's summary and for fallbacks made before this column.
        "ALTER TABLE summaries ADD COLUMN error TEXT",
    ),
)
SCHEMA_VERSION: Final = len(MIGRATIONS)
