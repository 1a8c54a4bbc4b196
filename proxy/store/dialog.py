"""Dialog archive: every message a session ever saw, once, as JSONL (docs/archive.md).

Chain hashes are defined in :mod:`proxy.store.chains`.

Archive lines
-------------
``data_dir/<tenant>/<session>/dialog/YYYY-MM-DD.jsonl`` (UTC date of the write), one object per
line::

    {"v": 1, "ts": "2026-12-02T10:15:30.123+00:00", "session": "...", "pos": 7,
     "chain": "<32 hex>", "parent": "<32 hex>" | null, "role": "user", "message": {...}}

``message`` is exactly what the client sent (or the assembled answer of the model). A message is
written only if its chain is not yet in the session's index, so resending a history writes only
the new tail. When the first new message does not continue the session's newest archived
message, the client edited or rewound its history: that is a branch, its ``parent`` links it to
the prefix it continues and the old lines stay as they are. (A client that resends the model's
answer in a different shape than the recorded one, e.g. with extra ``null`` fields, therefore
shows up as a one-message branch each turn: the caller should record the answer the way clients
echo it back.)

Crash behaviour: lines are appended (``O_APPEND``) with one ``writev`` per call (per 512 lines)
and the index row is
committed *after* the write. A crash in between leaves lines that the index does not know; they
are written again on the next request (readers may therefore see a chain twice; :meth:`read_dialog`
drops repeats), which is preferred to the opposite order that could lose a message for good. A
torn last line is skipped on read, and the next append first writes ``\\n`` so the new line is not
glued onto it; the torn fragment keeps its (physical) line number so line numbers stay what a text
viewer shows.

Reading policy: any line that does not parse as a JSON object is skipped. A torn *last* line is
expected after a crash and logged at DEBUG; an unparsable line in the middle (usually a torn
line that later appends closed off, or outside damage) is logged at WARNING with file and line.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import date, datetime
from pathlib import Path
from typing import Any, Final, NamedTuple

import orjson

from proxy.store import fs
from proxy.store.chains import (
    CHAIN_HEX,
    DigestCache,
    DigestCacheLike,
    canonical,
    chain_hashes,
    chain_step,
    is_chain,
    message_digest,
)
from proxy.store.db import Database
from proxy.store.dialog_read import DialogLine, read, read_handle, read_lines, unique
from proxy.store.jsonl import count_newlines, line_json, write_all
from proxy.store.paths import (
    DIALOG_DIR,
    check_name,
    dialog_file,
    dialog_filename,
    dialog_parts,
)
from proxy.store.sessions import SessionRow
from proxy.store.times import format_ts, parse_ts, utc

__all__ = [
    "ARCHIVE_VERSION",
    "CHAIN_HEX",
    "DialogArchive",
    "DialogLine",
    "DigestCache",
    "DigestCacheLike",
    "FileSpan",
    "IndexEntry",
    "LineRef",
    "RecordResult",
    "canonical",
    "chain_hashes",
    "chain_step",
    "format_spans",
    "is_chain",
    "message_digest",
    "read",
    "read_lines",
]

log = logging.getLogger("proxy.store")

ARCHIVE_VERSION: Final = 1
_DIALOG_NAME: Final = re.compile(r"\d{4}-\d{2}-\d{2}\.jsonl")


# --- hashing ---------------------------------------------------------------------------------


class LineRef(NamedTuple):
    file: str  # relative to the session directory, e.g. "dialog/2026-12-02.jsonl"
    line: int  # 1-based physical line


class FileSpan(NamedTuple):
    file: str
    first_line: int
    last_line: int


def format_spans(spans: Sequence[FileSpan]) -> str:
    """``dialog/2026-12-02.jsonl lines 1-240, dialog/2026-12-03.jsonl line 1`` for pointers."""
    parts = []
    for s in spans:
        if s.first_line == s.last_line:
            parts.append(f"{s.file} line {s.first_line}")
        else:
            parts.append(f"{s.file} lines {s.first_line}-{s.last_line}")
    return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class RecordResult:
    written: int
    first: LineRef | None  # first line written by this call
    last: LineRef | None  # last line written by this call
    chains: tuple[str, ...]  # chains of the messages (not including the answer)
    answer_chain: str | None
    branched: bool  # the new messages do not continue the session's newest archived one
    bytes_written: int = 0  # appended to the archive file by this call
    # Whether the session's thinking blocks need drop_block (proxy.upstream.thinking), read
    # with the session row this call reads anyway; None when it did not read it.
    thinking_dropped: bool | None = None

    @property
    def last_chain(self) -> str | None:
        """Chain of the newest message of this call (the answer when there was one)."""
        if self.answer_chain is not None:
            return self.answer_chain
        return self.chains[-1] if self.chains else None


@dataclass(frozen=True, slots=True)
class IndexEntry:
    tenant: str
    session: str
    chain: str
    position: int
    parent: str | None
    role: str | None
    file: str
    line: int
    ts: datetime


class _Pending(NamedTuple):
    pos: int
    chain: str
    parent: str | None
    message: Any
    incomplete: bool = False  # an answer whose stream broke: what the client saw of it


class Pending(NamedTuple):
    """What one ``record`` call may write: the items (messages, then the answer's), the chains
    of the messages, and the answer's chain. The same for every backend."""

    items: list[_Pending]
    chains: tuple[str, ...]
    answer_chain: str | None


def pending(
    messages: Sequence[Any], chains: Sequence[str] | None,
    answer: dict[str, Any] | Sequence[dict[str, Any]] | None,
    digest_cache: DigestCacheLike | None, *, incomplete: bool = False,
) -> Pending:
    """The items a ``record`` call archives, each with its chain and parent (pure)."""
    if chains is None:
        chain_list = chain_hashes(messages, digest_cache)
    else:
        if len(chains) != len(messages):
            raise ValueError(f"{len(chains)} chains for {len(messages)} messages")
        chain_list = list(chains)
    items = [_Pending(i, chain_list[i], chain_list[i - 1] if i else None, m)
             for i, m in enumerate(messages)]
    answer_chain: str | None = None
    answers = [] if answer is None else [answer] if isinstance(answer, dict) else list(answer)
    parent = chain_list[-1] if chain_list else None
    for k, one in enumerate(answers):
        answer_chain = chain_step(parent, one, digest_cache)
        items.append(_Pending(len(messages) + k, answer_chain, parent, one, incomplete))
        parent = answer_chain
    return Pending(items, tuple(chain_list), answer_chain)


def line_of(item: _Pending, session: str, ts: str) -> bytes:
    """An item's archive line (without the newline); an answer whose stream broke says so
    (``"incomplete": true``)."""
    line = {"v": ARCHIVE_VERSION, "ts": ts, "session": session, "pos": item.pos,
            "chain": item.chain, "parent": item.parent, "role": role_of(item.message),
            "message": item.message}
    if item.incomplete:
        line["incomplete"] = True
    return line_json(line)


def role_of(message: Any) -> str | None:
    """The role an archived message records (None for an item without one)."""
    if isinstance(message, dict):
        role = message.get("role")
        if isinstance(role, str):
            return role
    return None


_SELECT_KNOWN: Final = """SELECT chain FROM messages
    WHERE tenant = ? AND session = ? AND chain IN (SELECT value FROM json_each(?))"""


class DialogArchive:
    """Append-only dialog archive with its index in the shared database."""

    def __init__(
        self,
        data_dir: Path,
        db: Database,
        *,
        fsync: bool = False,
        digest_cache: DigestCacheLike | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.db = db
        self.fsync = fsync
        self.digest_cache = digest_cache

    # --- writing ------------------------------------------------------------------------

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
        """Archive the messages of a request (and the model's answer) not archived yet.

        ``chains`` may be passed when the caller already computed them for this exact list.
        ``answer`` is recorded at position ``len(messages)`` after the last message (a list of
        answer items, as the Responses API returns, one after the other); ``incomplete``: its
        stream broke, and its lines say so. Blocking
        (disk + database lock): call it from a worker thread when on the event loop.
        """
        moment = utc(now)
        parts = dialog_parts(tenant, session, moment.date())
        items, frozen_chains, answer_chain = pending(messages, chains, answer, self.digest_cache,
                                                     incomplete=incomplete)
        if not items:
            return RecordResult(0, None, None, frozen_chains, answer_chain, False)

        rel = f"{DIALOG_DIR}/{parts[-1]}"
        ts = format_ts(moment)
        probe = orjson.dumps([it.chain for it in items]).decode()
        # Check-then-append must be atomic, or two requests resending the same history would
        # both write its new tail: the write transaction (thread lock + SQLite write lock, so
        # across processes too) spans the index check, the file append and the index insert.
        with self.db.transaction() as conn:
            known = {row[0] for row in conn.execute(_SELECT_KNOWN, (tenant, session, probe))}
            new = [it for it in items if it.chain not in known]
            if not new:
                return RecordResult(0, None, None, frozen_chains, answer_chain, False)
            row = conn.execute(
                "SELECT last_chain, thinking_dropped_at FROM sessions "
                "WHERE tenant = ? AND session = ?",
                (tenant, session),
            ).fetchone()
            last = row[0] if row is not None else None
            dropped = row is not None and row[1] is not None
            branched = last is not None and new[0].parent != last
            lines = [line_of(it, session, ts) for it in new]
            first_line, appended = self._append(conn, tenant, session, rel, parts, lines)
            conn.executemany(
                """INSERT OR REPLACE INTO messages
                   (tenant, session, chain, position, parent, role, file, line, ts)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)""",
                [
                    (
                        tenant,
                        session,
                        it.chain,
                        it.pos,
                        it.parent,
                        role_of(it.message),
                        rel,
                        first_line + k,
                        ts,
                    )
                    for k, it in enumerate(new)
                ],
            )
            self.db.touch_session(
                tenant, session, now=moment, messages=len(new), last_chain=new[-1].chain
            )
        if branched:
            log.info("session %s/%s: history branched at position %d", tenant, session, new[0].pos)
        return RecordResult(
            written=len(new),
            first=LineRef(rel, first_line),
            last=LineRef(rel, first_line + len(new) - 1),
            chains=frozen_chains,
            answer_chain=answer_chain,
            branched=branched,
            bytes_written=appended,
            thinking_dropped=dropped,
        )

    def _append(
        self,
        conn: Any,
        tenant: str,
        session: str,
        rel: str,
        parts: tuple[str, ...],
        lines: list[bytes],
    ) -> tuple[int, int]:
        """Append ``lines`` (JSON bodies, no terminator) as whole lines; returns the line number
        of the first and the bytes written. Caller holds the write transaction, so nobody else
        appends to this file meanwhile."""
        fd = fs.append_fd(self.data_dir, parts)
        try:
            size = os.fstat(fd).st_size
            row = conn.execute(
                "SELECT lines, size FROM dialog_files WHERE tenant = ? AND session = ? AND file = ?",
                (tenant, session, rel),
            ).fetchone()
            if row is not None and row[1] == size:
                count = int(row[0])
            else:
                # First append since this database knew the file, or it changed behind our back
                # (torn write, restore): count once, then the counter carries on.
                if row is not None:
                    log.info("%s/%s/%s: size changed outside the index, recounting lines",
                             tenant, session, rel)
                count = count_newlines(fd, size)
            prefix = b""
            if size and os.pread(fd, 1, size - 1) != b"\n":
                log.warning("%s/%s/%s: last line is torn; starting a new line after it",
                            tenant, session, rel)
                prefix = b"\n"
            chunks = [prefix] if prefix else []
            for body in lines:
                chunks += (body, b"\n")
            written = write_all(fd, chunks)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        count += len(prefix)
        conn.execute(
            """INSERT INTO dialog_files (tenant, session, file, lines, size)
               VALUES (?, ?, ?, ?, ?)
               ON CONFLICT (tenant, session, file) DO UPDATE SET
                   lines = excluded.lines, size = excluded.size""",
            (tenant, session, rel, count + len(lines), size + written),
        )
        return count + 1, written

    # --- index queries ------------------------------------------------------------------

    def lookup(self, tenant: str, session: str, chain: str) -> IndexEntry | None:
        with self.db.connect() as conn:
            row = conn.execute(
                "SELECT * FROM messages WHERE tenant = ? AND session = ? AND chain = ?",
                (tenant, session, chain),
            ).fetchone()
        if row is None:
            return None
        return IndexEntry(
            tenant=row["tenant"],
            session=row["session"],
            chain=row["chain"],
            position=row["position"],
            parent=row["parent"],
            role=row["role"],
            file=row["file"],
            line=row["line"],
            ts=parse_ts(row["ts"]),
        )

    def known(self, tenant: str, session: str, chains: Sequence[str]) -> set[str]:
        """Which of ``chains`` are archived for this session (one query)."""
        if not chains:
            return set()
        with self.db.connect() as conn:
            rows = conn.execute(
                _SELECT_KNOWN, (tenant, session, orjson.dumps(list(chains)).decode())
            ).fetchall()
        return {r[0] for r in rows}

    def span(
        self, tenant: str, session: str, chains: Sequence[str], *, exact: bool = False
    ) -> list[FileSpan]:
        """File ranges covering the archived lines of ``chains`` (unknown chains are ignored),
        in file (= date) order.

        By default one ``(file, first, last)`` per file, the range a summary's pointer names;
        lines of other branches may lie inside it. ``exact=True`` gives maximal runs of
        consecutive lines that all belong to ``chains``.
        """
        if not chains:
            return []
        with self.db.connect() as conn:
            rows = conn.execute(
                """SELECT file, line FROM messages
                   WHERE tenant = ? AND session = ?
                     AND chain IN (SELECT value FROM json_each(?))
                   ORDER BY file, line""",
                (tenant, session, orjson.dumps(list(chains)).decode()),
            ).fetchall()
        spans: list[FileSpan] = []
        for file, line in rows:
            if spans and spans[-1].file == file and (not exact or line == spans[-1].last_line + 1):
                spans[-1] = spans[-1]._replace(last_line=line)
            else:
                spans.append(FileSpan(file, line, line))
        return spans

    # --- reading ------------------------------------------------------------------------

    def dialog_files(self, tenant: str, session: str) -> list[str]:
        """Archive file names (``YYYY-MM-DD.jsonl``) of a session, oldest first. Symlinks and
        anything not named like an archive file are ignored."""
        found = fs.list_files(self.data_dir, (tenant, session, DIALOG_DIR), ".jsonl")
        return sorted(e.name for e in found if _DIALOG_NAME.fullmatch(e.name))

    def dialog_path(self, tenant: str, session: str, day: date | str) -> Path:
        """Path of one day's file; ``day`` is a date or a name like ``2026-12-02.jsonl``."""
        return dialog_file(self.data_dir, tenant, session, day)

    def read_dialog_lines(self, tenant: str, session: str, day: date | str) -> Iterator[DialogLine]:
        """Numbered records of one day's file; a chain already seen in the file (re-written
        after a crash between append and commit) is yielded only the first time."""
        parts = dialog_parts(tenant, session, day)
        fd, _ = fs.open_file(self.data_dir, parts)
        return unique(read_handle(open(fd, "rb"), "/".join(parts)))  # noqa: SIM115

    def read_dialog(self, tenant: str, session: str, day: date | str) -> Iterator[dict[str, Any]]:
        return (entry.record for entry in self.read_dialog_lines(tenant, session, day))

    def today_file(self, now: datetime | None = None) -> str:
        return f"{DIALOG_DIR}/{dialog_filename(utc(now).date())}"

    # --- sessions -----------------------------------------------------------------------

    def sessions(self, tenant: str | None = None) -> list[SessionRow]:
        if tenant is not None:
            check_name(tenant, "tenant")
        return self.db.sessions(tenant)

    def session_stats(self, tenant: str, session: str) -> SessionRow | None:
        return self.db.session_stats(tenant, session)
