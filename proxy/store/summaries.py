"""Summary cache records.

See docs/compaction.md#cache and docs/compaction.md#client-side-edits.

Clients resend the whole history every turn, so a compaction is remembered under the chain hash
(:func:`proxy.store.dialog.chain_hashes`, computed over the messages *as the client sent them*)
of the last message it replaced. A later request computes the chains of its own history and asks
:meth:`SummaryStore.find_latest`: the summary keyed by the largest ``i`` with a record is the one
to reuse, and it replaces messages ``head .. upto-1`` (``upto == i + 1``). A history that
no longer contains that chain (the client edited or compacted it itself) simply finds nothing
newer, so the proxy follows the new branch instead of summarising a summary again.

Besides the database row, every stored summary is written for people to read as
``data_dir/<tenant>/<session>/summaries/<YYYYMMDDTHHMMSSZ>-<chain[:12]>.md`` (atomically).

Replacement policy of :meth:`SummaryStore.put` for a chain that already has a summary: the first
model-written summary wins (concurrent compactions of the same prefix then converge on one text,
which keeps the forwarded prefix byte-stable for the provider's prompt cache); a ``fallback``
summary is replaced by a ``model`` one; ``replace=True`` forces the new record.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Final, Literal

import orjson

from proxy.store import fs
from proxy.store.db import Database
from proxy.store.dialog import FileSpan, format_spans, is_chain
from proxy.store.paths import SUMMARIES_DIR, check_name, summaries_dir
from proxy.store.times import format_ts, parse_ts, utc

__all__ = ["SUMMARY_VERSION", "SummaryRecord", "SummarySource", "SummaryStore", "markdown_size"]

log = logging.getLogger("proxy.store")

SUMMARY_VERSION: Final = 1
SummarySource = Literal["model", "fallback"]
_SOURCES: Final = frozenset({"model", "fallback"})


@dataclass(frozen=True, slots=True)
class SummaryRecord:
    tenant: str
    session: str
    chain: str  # chain hash of the LAST message this summary replaced
    head: int  # index of the first replaced message (after the leading system messages)
    upto: int  # index after the last replaced message
    text: str  # markdown
    source: SummarySource
    model: str | None  # summarizer model (None for a deterministic fallback)
    created_at: datetime
    tokens_before: int
    tokens_after: int
    previous_chain: str | None = None  # the summary this one merged, if any
    span: tuple[FileSpan, ...] = ()  # dialog lines of the replaced messages
    v: int = SUMMARY_VERSION
    seen: int = 0  # messages in the history when this compaction was made
    # Why a fallback is one (the summarizer's failure, redacted: "summarizer HTTP 400: ...");
    # None for a model summary. A fallback never passes for a model's summary.
    error: str | None = None

    def __post_init__(self) -> None:
        check_name(self.tenant, "tenant")
        check_name(self.session, "session")
        if not is_chain(self.chain):
            raise ValueError(f"invalid chain: {self.chain!r}")
        if self.previous_chain is not None and not is_chain(self.previous_chain):
            raise ValueError(f"invalid previous_chain: {self.previous_chain!r}")
        if not 0 <= self.head <= self.upto:
            raise ValueError(f"invalid range head={self.head} upto={self.upto}")
        if self.source not in _SOURCES:
            raise ValueError(f"invalid source: {self.source!r}")
        # Normalise so equality and the .md name do not depend on the caller's timezone, and a
        # list passed as span still gives a hashable, immutable record.
        object.__setattr__(self, "created_at", utc(self.created_at))
        object.__setattr__(self, "span", tuple(FileSpan(*s) for s in self.span))

    @property
    def md_name(self) -> str:
        return f"{self.created_at:%Y%m%dT%H%M%SZ}-{self.chain[:12]}.md"

    @property
    def md_relpath(self) -> str:
        """Relative to the session directory."""
        return f"{SUMMARIES_DIR}/{self.md_name}"

    @property
    def pointer(self) -> str:
        """The dialog files and lines of the replaced messages, for the inserted summary."""
        return format_spans(self.span)


def _markdown(rec: SummaryRecord) -> bytes:
    lines = [
        f"<!-- ctxproxy summary v{rec.v} -->",
        f"- session: `{rec.tenant}/{rec.session}`",
        f"- replaces messages {rec.head}..{rec.upto - 1} (chain `{rec.chain}`)",
        f"- merges: `{rec.previous_chain}`" if rec.previous_chain else "- merges: nothing",
        f"- source: {rec.source}" + (f" (`{rec.model}`)" if rec.model else "")
        + (f", the summarizer failed: {rec.error}" if rec.error else ""),
        f"- created: {format_ts(rec.created_at)}",
        f"- tokens: {rec.tokens_before} -> {rec.tokens_after}",
        f"- dialog: {rec.pointer or 'n/a'}",
        "",
        "---",
        "",
        rec.text.rstrip("\n"),
        "",
    ]
    return "\n".join(lines).encode("utf-8", "surrogatepass")


def markdown_size(rec: SummaryRecord) -> int:
    """Bytes of the ``.md`` copy of ``rec`` (what it costs the tenant's disk quota)."""
    return len(_markdown(rec))


_COLUMNS: Final = (
    "tenant, session, chain, v, head, upto, previous_chain, text, source, model, created_at, "
    "tokens_before, tokens_after, span, seen, error"
)
_MARKS: Final = ", ".join(["?"] * len(_COLUMNS.split(",")))


def _row(rec: SummaryRecord) -> tuple[object, ...]:
    return (
        rec.tenant,
        rec.session,
        rec.chain,
        rec.v,
        rec.head,
        rec.upto,
        rec.previous_chain,
        rec.text,
        rec.source,
        rec.model,
        format_ts(rec.created_at),
        rec.tokens_before,
        rec.tokens_after,
        orjson.dumps([list(s) for s in rec.span]).decode(),
        rec.seen,
        rec.error,
    )


def _record(row: sqlite3.Row) -> SummaryRecord:
    source = row["source"]
    return SummaryRecord(
        tenant=row["tenant"],
        session=row["session"],
        chain=row["chain"],
        head=row["head"],
        upto=row["upto"],
        text=row["text"],
        source="model" if source == "model" else "fallback",
        model=row["model"],
        created_at=parse_ts(row["created_at"]),
        tokens_before=row["tokens_before"],
        tokens_after=row["tokens_after"],
        previous_chain=row["previous_chain"],
        span=tuple(FileSpan(str(f), int(a), int(b)) for f, a, b in orjson.loads(row["span"])),
        v=row["v"],
        seen=row["seen"],
        error=row["error"],
    )


def _replaces(existing: SummaryRecord, record: SummaryRecord, replace: bool) -> bool:
    """First writer wins, except that a model-written summary replaces a fallback one."""
    return replace or (existing.source == "fallback" and record.source == "model")


class SummaryStore:
    """Summary cache over the shared database, plus the human-readable ``.md`` copies."""

    def __init__(self, db: Database, data_dir: Path | None = None, *, fsync: bool = True) -> None:
        self.db = db
        # The database normally lives directly in data_dir (paths.db_path).
        self.data_dir = Path(data_dir) if data_dir is not None else db.path.parent
        self.fsync = fsync

    def md_path(self, rec: SummaryRecord) -> Path:
        return summaries_dir(self.data_dir, rec.tenant, rec.session) / rec.md_name

    @staticmethod
    def md_parts(rec: SummaryRecord) -> tuple[str, str, str, str]:
        return (rec.tenant, rec.session, SUMMARIES_DIR, rec.md_name)

    def get(self, tenant: str, session: str, chain: str) -> SummaryRecord | None:
        with self.db.connect() as conn:
            row = conn.execute(
                f"SELECT {_COLUMNS} FROM summaries WHERE tenant = ? AND session = ? AND chain = ?",
                (tenant, session, chain),
            ).fetchone()
        return None if row is None else _record(row)

    def chains(self, tenant: str, session: str) -> set[str]:
        """The chains of a session that have a summary (for an in-memory index)."""
        with self.db.connect() as conn:
            rows = conn.execute(
                "SELECT chain FROM summaries WHERE tenant = ? AND session = ?", (tenant, session)
            ).fetchall()
        return {r[0] for r in rows}

    def find_latest(self, tenant: str, session: str, chains: Sequence[str]) -> SummaryRecord | None:
        """The summary for the largest ``i`` such that ``chains[i]`` has one, in one query.

        ``json_each`` feeds the chains as one parameter (no bound-variable limit) and is forced
        as the outer loop (CROSS JOIN) so each chain is one primary-key probe; ordering by its
        array index picks the newest.
        """
        if not chains:
            return None
        with self.db.connect() as conn:
            row = conn.execute(
                f"""SELECT {", ".join("s." + c.strip() for c in _COLUMNS.split(","))}
                    FROM json_each(?) AS j
                    CROSS JOIN summaries AS s
                        ON s.tenant = ? AND s.session = ? AND s.chain = j.value
                    ORDER BY j.key DESC LIMIT 1""",
                (orjson.dumps(list(chains)).decode(), tenant, session),
            ).fetchone()
        return None if row is None else _record(row)

    def put(self, record: SummaryRecord, *, replace: bool = False) -> SummaryRecord:
        """Store ``record`` (see the module docstring for an existing chain); returns the
        record now stored, which is the existing one when it was kept.

        The ``.md`` copy is written (and fsynced) before the write transaction, not inside it:
        the database's writer is never held while a disk flushes. If the commit then fails, or
        a concurrent put wins, the file is removed again: never a row pointing at nothing.
        """
        existing = self.get(record.tenant, record.session, record.chain)
        if existing is not None and not _replaces(existing, record, replace):
            return existing
        fs.write_atomic(self.data_dir, self.md_parts(record), _markdown(record), fsync=self.fsync)
        try:
            with self.db.transaction() as conn:
                row = conn.execute(
                    f"SELECT {_COLUMNS} FROM summaries WHERE tenant = ? AND session = ? "
                    "AND chain = ?",
                    (record.tenant, record.session, record.chain),
                ).fetchone()
                existing = None if row is None else _record(row)
                if existing is None or _replaces(existing, record, replace):
                    conn.execute(
                        f"INSERT OR REPLACE INTO summaries ({_COLUMNS}) VALUES ({_MARKS})",
                        _row(record),
                    )
                    stored, dropped = record, existing
                else:
                    stored, dropped = existing, record  # another writer was first
        except BaseException:
            with contextlib.suppress(OSError):
                fs.unlink(self.data_dir, self.md_parts(record))
            raise
        if dropped is not None and dropped.md_name != stored.md_name:
            with contextlib.suppress(OSError):
                fs.unlink(self.data_dir, self.md_parts(dropped))
        return stored

    def history(self, tenant: str, session: str) -> list[SummaryRecord]:
        """All summaries of a session, oldest first."""
        with self.db.connect() as conn:
            rows = conn.execute(
                f"""SELECT {_COLUMNS} FROM summaries WHERE tenant = ? AND session = ?
                    ORDER BY created_at, upto, rowid""",
                (tenant, session),
            ).fetchall()
        return [_record(r) for r in rows]
