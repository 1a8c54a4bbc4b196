"""Which chains of a session have a summary: loaded once per session, then kept in memory, so
the common request (no summary yet, or the same one as last turn) needs no database query."""

from __future__ import annotations

from collections.abc import Sequence

from proxy.lru import LRU
from proxy.store.interfaces import Summaries

__all__ = ["SummaryIndex"]


class SummaryIndex:
    def __init__(self, store: Summaries, limit: int = 10_000) -> None:
        self.store = store
        self._chains: LRU[tuple[str, str], frozenset[str]] = LRU(limit)

    def cached(self, tenant: str, session: str) -> frozenset[str] | None:
        return self._chains.get((tenant, session))

    def load(self, tenant: str, session: str) -> frozenset[str]:
        """Blocking (a query): call it from a worker thread."""
        chains = frozenset(self.store.chains(tenant, session))
        self._chains.put((tenant, session), chains)
        return chains

    def add(self, tenant: str, session: str, chain: str) -> None:
        known = self._chains.get((tenant, session))
        if known is not None:
            self._chains.put((tenant, session), known | {chain})

    def include(self, tenant: str, session: str, chain: str) -> None:
        """Add ``chain`` even when the session was never loaded: for a shared store, where
        this index is only the fallback while the database is away (a partial hint)."""
        known = self._chains.get((tenant, session)) or frozenset()
        self._chains.put((tenant, session), known | {chain})

    def clear(self) -> None:
        self._chains.clear()

    @staticmethod
    def latest(known: frozenset[str], chains: Sequence[str]) -> str | None:
        for c in reversed(chains):
            if c in known:
                return c
        return None
