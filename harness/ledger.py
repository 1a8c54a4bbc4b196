"""An in-memory :class:`proxy.store.interfaces.LedgerStore`, for tests of what reads or writes
the ledger without a database (the real ones: proxy.store.ledger)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from proxy.store.ledger_entry import LedgerEntry, LedgerTotals

__all__ = ["MemoryLedger"]


class MemoryLedger:
    """Entries in a list; totals summed on demand (:meth:`LedgerTotals.of`). Thread-safe: /files
    reads from worker threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[LedgerEntry] = []
        self._ids: set[tuple[str, str, str]] = set()

    def add(self, entries: Sequence[LedgerEntry]) -> None:
        with self._lock:
            for e in entries:
                key = (e.tenant, e.session, e.id)
                if key not in self._ids:
                    self._ids.add(key)
                    self._entries.append(e)

    def _session(self, tenant: str, session: str) -> list[LedgerEntry]:
        with self._lock:
            found = [e for e in self._entries if e.tenant == tenant and e.session == session]
        return sorted(found, key=lambda e: e.ts)

    def entries(self, tenant: str, session: str, *, kind: str | None = None,
                limit: int | None = None) -> list[LedgerEntry]:
        found = [e for e in self._session(tenant, session) if kind is None or e.kind == kind]
        return found[-limit:] if limit is not None else found

    def entry(self, tenant: str, session: str, entry_id: str) -> LedgerEntry | None:
        return next((e for e in self._session(tenant, session) if e.id == entry_id), None)

    def last(self, tenant: str, session: str) -> LedgerEntry | None:
        calls = [e for e in self._session(tenant, session) if e.kind in ("request", "read_round")]
        return calls[-1] if calls else None

    def totals(self, tenant: str | None = None, *, search: str | None = None,
               limit: int | None = None) -> list[LedgerTotals]:
        with self._lock:
            keys = dict.fromkeys((e.tenant, e.session) for e in self._entries
                                 if tenant is None or e.tenant == tenant)
        if search:
            keys = {k: None for k in keys if search.lower() in k[1].lower()}
        rows = [LedgerTotals.of(t, s, self._session(t, s)) for t, s in keys]
        rows.sort(key=lambda r: r.last_ts, reverse=True)
        return rows[:limit] if limit is not None else rows

    def expire(self, before: float) -> int:
        with self._lock:
            kept = [e for e in self._entries if e.ts >= before]
            gone = len(self._entries) - len(kept)
            self._entries = kept
            self._ids = {(e.tenant, e.session, e.id) for e in kept}
        return gone
