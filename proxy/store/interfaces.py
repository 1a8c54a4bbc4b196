"""The store interface: one Protocol per kind of state the proxy keeps.

    Originals     offloaded tool outputs (tool_result/<id>.txt)     store.tool_results
    DialogStore   the dialog archive and its index                   store.dialog
    Summaries     summary records (and their .md copies)             store.summaries
    SessionIndex  per-session counters, for /files                   store.db
    MemoryStore   long-term memory: notes, versions, pins, fold lock  store.memory

The services and the pipeline's runner depend on these, never on a backend; the stages depend
on no store at all. The backend today is files plus one SQLite database under ``data_dir``; a
second one (a shared database for many replicas) implements the same Protocols.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import date, datetime
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .chains import DigestCacheLike
    from .db import SessionRow
    from .dialog import FileSpan, RecordResult
    from .memory import FoldClaim, MemoryVersion, ScopeRow
    from .summaries import SummaryRecord

__all__ = ["DialogStore", "MemoryStore", "Originals", "SessionIndex", "Summaries"]


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
        now: datetime | None = None,
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
    """Per-session counters."""

    def update_session_stats(
        self, tenant: str, session: str, *, now: datetime | None = None, **increments: int
    ) -> SessionRow: ...

    def sessions(self, tenant: str | None = None) -> list[SessionRow]: ...

    def session_stats(self, tenant: str, session: str) -> SessionRow | None: ...


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
