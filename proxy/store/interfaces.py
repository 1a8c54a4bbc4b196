"""The store interface: one Protocol per kind of state the proxy keeps.

    Originals     offloaded tool outputs (tool_result/<id>.txt)     store.tool_results
    DialogStore   the dialog archive and its index                   store.dialog
    Summaries     summary records (and their .md copies)             store.summaries
    SessionIndex  per-session counters (/files), thinking flags       store.db
    MemoryStore   long-term memory: notes, versions, pins, fold lock  store.memory
    SessionFiles  a session's files as /files and the read tool see them   store.session_files
    RoundStore    the proxy's read rounds of an answer, replayed later  store.rounds
    LedgerStore   the cost ledger: one row per billed call, totals per session  store.ledger
    SharedSummaries  Summaries many replicas write, with claims      store.postgres.summaries

A :class:`StoreBackend` bundles one of each: :class:`proxy.store.backend.FilesBackend` (files
plus one SQLite database under ``data_dir``, the default) or
:class:`proxy.store.postgres.PostgresBackend` (everything in one PostgreSQL database shared by
many replicas; ``storage.url``). The services and the pipeline's runner depend on these
Protocols, never on a backend; the stages depend on no store at all.

Adding a kind of state (long-term memory, say): a Protocol here, an attribute on both backends,
a module in each (for PostgreSQL one more entry in ``postgres.schema.MIGRATIONS``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import date, datetime
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from proxy.store.chains import DigestCacheLike
    from proxy.store.dialog import FileSpan, RecordResult
    from proxy.store.fs import Entry
    from proxy.store.gc import GcReport
    from proxy.store.ledger_entry import LedgerEntry, LedgerTotals
    from proxy.store.memory import FoldClaim, MemoryVersion, ScopeRow
    from proxy.store.rounds import RoundsRecord
    from proxy.store.sessions import SessionRow
    from proxy.store.summaries import SummaryRecord
    from proxy.store.usage import DiskUsage

__all__ = [
    "DialogStore",
    "FileKind",
    "LedgerStore",
    "MemoryStore",
    "Originals",
    "RoundStore",
    "SessionFiles",
    "SessionIndex",
    "SharedSummaries",
    "StoreBackend",
    "Summaries",
]

FileKind = Literal["dialog", "tool_result", "summaries"]


class Originals(Protocol):
    """Offloaded originals: written once, read back by the read tool, expired by the gc."""

    def needs_write(self, tenant: str, session: str, rid: str, content: str) -> bool: ...

    def write(self, tenant: str, session: str, rid: str, content: str) -> int: ...

    def stage(self, rid: str, content: str) -> tuple[str, int]: ...

    def promote(self, tenant: str, session: str, rid: str, token: str) -> None: ...

    def discard(self, token: str) -> None: ...

    def read(self, tenant: str, session: str, rid: str) -> str: ...

    def gc(self, now: float | None = None) -> int: ...


class DialogStore(Protocol):
    """The archive: each message once, in order, with its chain; spans for summary pointers."""

    digest_cache: DigestCacheLike | None

    def record(
        self, tenant: str, session: str, messages: Sequence[Any], *,
        chains: Sequence[str] | None = None,
        answer: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
        now: datetime | None = None, incomplete: bool = False,
    ) -> RecordResult: ...

    def span(self, tenant: str, session: str, chains: Sequence[str], *,
             exact: bool = False) -> list[FileSpan]: ...


class Summaries(Protocol):
    """Summary records, first writer wins (see store.summaries)."""

    def get(self, tenant: str, session: str, chain: str) -> SummaryRecord | None: ...

    def chains(self, tenant: str, session: str) -> set[str]: ...

    def put(self, record: SummaryRecord, *, replace: bool = False) -> SummaryRecord: ...

    def history(self, tenant: str, session: str) -> list[SummaryRecord]: ...


class SessionIndex(Protocol):
    """Per-session counters, and the sessions whose thinking blocks need ``drop_block``
    (:mod:`proxy.upstream.thinking`: set once, never cleared)."""

    def update_session_stats(
        self, tenant: str, session: str, *, now: datetime | None = None, **increments: int
    ) -> SessionRow: ...

    def sessions(self, tenant: str | None = None) -> list[SessionRow]: ...

    def session_stats(self, tenant: str, session: str) -> SessionRow | None: ...

    def thinking_dropped(self, tenant: str, session: str) -> bool: ...

    def mark_thinking_dropped(self, tenant: str, session: str) -> None: ...


class MemoryStore(Protocol):
    """Long-term memory per (tenant, scope) (see store.memory for the semantics a backend must
    keep): daily notes appended, immutable numbered versions, first-writer-wins pins, and a
    fold lock that is one lease per scope across every process sharing the store."""

    def append(self, tenant: str, scope: str, day: date, text: str, *,
               now: datetime | None = None) -> int: ...

    def days(self, tenant: str, scope: str) -> list[str]: ...

    def read_day(self, tenant: str, scope: str, day: str) -> str | None: ...

    def version(self, tenant: str, scope: str, number: int) -> MemoryVersion | None: ...

    def versions(self, tenant: str, scope: str) -> list[MemoryVersion]: ...

    def scopes(self, tenant: str | None = None) -> list[ScopeRow]: ...

    def pin(self, tenant: str, scope: str, session: str, epoch: str, *,
            now: datetime | None = None) -> int: ...

    def claim_fold(self, tenant: str, scope: str, *, now: datetime | None = None,
                   min_interval_s: float, lease_s: float) -> FoldClaim | None: ...

    def finish_fold(self, claim: FoldClaim, text: str, *,
                    now: datetime | None = None) -> MemoryVersion | None: ...


class RoundStore(Protocol):
    """The proxy's read rounds per answer, keyed by the answer (see store.rounds): one record
    per key, the first one written."""

    def put(self, record: RoundsRecord, *, now: datetime | None = None) -> None: ...

    def find(self, tenant: str, session: str, keys: Sequence[str]) -> list[RoundsRecord]: ...


class LedgerStore(Protocol):
    """The cost ledger (:mod:`proxy.store.ledger_entry`): one row per billed call, and per-session
    totals kept in step with the rows (so a tenant's page is one query, not a scan)."""

    def add(self, entries: Sequence[LedgerEntry]) -> None:
        """Keep entries (an id already kept is ignored: a retried write adds nothing)."""
        ...

    def entries(self, tenant: str, session: str, *, kind: str | None = None,
                limit: int | None = None) -> list[LedgerEntry]:
        """A session's entries, oldest first (``limit``: the newest that many)."""
        ...

    def entry(self, tenant: str, session: str, entry_id: str) -> LedgerEntry | None: ...

    def last(self, tenant: str, session: str) -> LedgerEntry | None:
        """The session's newest ``request`` or ``read_round`` entry (by ``ts``): what its next
        request's cache is compared with."""
        ...

    def totals(self, tenant: str | None = None, *, search: str | None = None,
               limit: int | None = None) -> list[LedgerTotals]:
        """Per-session totals of ``tenant`` (None: every tenant), most recently active first;
        ``search``: only sessions whose name contains it (case-insensitive)."""
        ...

    def expire(self, before: float) -> int:
        """Delete entries older than ``before`` (unix seconds), totals adjusted; how many."""
        ...


class SharedSummaries(Summaries, Protocol):
    """Summaries other replicas write too: no in-memory index can be trusted, and a summarizer
    call is claimed first so one replica makes it (see store.postgres.summaries)."""

    def find_latest(self, tenant: str, session: str,
                    chains: Sequence[str]) -> SummaryRecord | None: ...

    def claim(self, tenant: str, session: str, chain: str, ttl_s: float) -> bool: ...

    def claimed(self, tenant: str, session: str, chain: str) -> bool: ...

    def release(self, tenant: str, session: str, chain: str) -> None: ...


class SessionFiles(Protocol):
    """A session's files by kind and name (``dialog/2026-12-02.jsonl``, ``tool_result/<id>.txt``,
    ``summaries/<name>.md``), wherever the backend keeps them: for /files and the read tool."""

    def exists(self, tenant: str, session: str) -> bool: ...

    def listing(self, tenant: str, session: str, kind: FileKind) -> list[Entry]: ...

    def open(self, tenant: str, session: str, kind: FileKind,
             name: str) -> tuple[int, os.stat_result]:
        """A readable descriptor (the caller closes it) and its stat; ``Hidden`` when absent."""
        ...

    def tenant_known(self, tenant: str) -> bool: ...


class StoreBackend(Protocol):
    """Every kind of state of one backend. ``dialog``, ``summaries`` and ``sessions`` are None
    when the backend's index could not be opened (the proxy then forwards without them)."""

    name: str

    @property
    def originals(self) -> Originals: ...

    @property
    def files(self) -> SessionFiles: ...

    @property
    def dialog(self) -> DialogStore | None: ...

    @property
    def summaries(self) -> Summaries | None: ...

    @property
    def sessions(self) -> SessionIndex | None: ...

    @property
    def memory(self) -> MemoryStore | None:
        """Long-term memory's notes, versions, pins and fold lock (None: not on this backend)."""
        ...

    @property
    def rounds(self) -> RoundStore | None:
        """The proxy's read rounds, replayed on later turns (None: the index is unavailable)."""
        ...

    @property
    def ledger(self) -> LedgerStore | None:
        """The cost ledger (None: the index is unavailable)."""
        ...

    @property
    def shared(self) -> SharedSummaries | None:
        """Set when other replicas share the store."""
        ...

    @property
    def failures(self) -> int:
        """Store calls that failed because the store was unavailable (a metric)."""
        ...

    def tenant_sizes(self) -> dict[str, int]:
        """Bytes stored per tenant, for the quota (blocking)."""
        ...

    def collect(self, usage: DiskUsage, *, dialog_ttl_days: float | None,
                now: float | None = None) -> GcReport:
        """Expire what is due and measure every tenant (blocking)."""
        ...

    def ready(self) -> bool:
        """Whether the store answers now (for /readyz; blocking, short)."""
        ...

    def close(self) -> None: ...
