"""In-memory shortcuts that keep the database off the path of a repeated request.

Agents resend their whole history every turn, so almost every message a request carries was
archived before, and almost every session has no summary or the same one as last turn. These
caches answer those questions without a thread hop or a SQLite query; the database stays the
source of truth (one process owns a data_dir).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from .store.db import Database
from .store.summaries import SummaryStore

log = logging.getLogger("proxy.store")


class KnownChains:
    """Chains already archived, per session: a bounded LRU set."""

    def __init__(self, limit: int = 200_000) -> None:
        self._seen: OrderedDict[tuple[str, str, str], None] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    def all_known(self, tenant: str, session: str, chains: Iterable[str]) -> bool:
        with self._lock:
            for c in chains:
                key = (tenant, session, c)
                if key not in self._seen:
                    return False
                self._seen.move_to_end(key)
        return True

    def add(self, tenant: str, session: str, chains: Iterable[str]) -> None:
        with self._lock:
            for c in chains:
                self._seen[(tenant, session, c)] = None
            while len(self._seen) > self._limit:
                self._seen.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._seen.clear()


class StatsBuffer:
    """Per-session counters summed in memory and written in one transaction per interval."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._pending: dict[tuple[str, str], dict[str, int]] = {}
        self._lock = threading.Lock()

    def add(self, tenant: str, session: str, **increments: int) -> None:
        with self._lock:
            row = self._pending.setdefault((tenant, session), {})
            for k, v in increments.items():
                row[k] = row.get(k, 0) + v

    def flush(self) -> int:
        with self._lock:
            pending, self._pending = self._pending, {}
        for (tenant, session), inc in pending.items():
            try:
                self.db.update_session_stats(tenant, session, **inc)  # type: ignore[arg-type]
            except Exception as exc:  # counters are best effort; never fail a request for them
                log.warning("session counters for %s/%s not saved: %s", tenant, session, exc)
        return len(pending)

    async def run(self, interval: float = 1.0) -> None:
        try:
            while True:
                await asyncio.sleep(interval)
                if self._pending:
                    await asyncio.to_thread(self.flush)
        finally:
            await asyncio.to_thread(self.flush)


class SummaryIndex:
    """Which chains of a session have a summary, loaded once per session."""

    def __init__(self, store: SummaryStore) -> None:
        self.store = store
        self._chains: OrderedDict[tuple[str, str], set[str]] = OrderedDict()
        self._lock = threading.Lock()
        self._limit = 10_000

    def cached(self, tenant: str, session: str) -> set[str] | None:
        with self._lock:
            found = self._chains.get((tenant, session))
            if found is not None:
                self._chains.move_to_end((tenant, session))
            return found

    def load(self, tenant: str, session: str) -> set[str]:
        chains = self.store.chains(tenant, session)
        with self._lock:
            self._chains[(tenant, session)] = chains
            while len(self._chains) > self._limit:
                self._chains.popitem(last=False)
        return chains

    def add(self, tenant: str, session: str, chain: str) -> None:
        with self._lock:
            known = self._chains.get((tenant, session))
            if known is not None:
                known.add(chain)

    def clear(self) -> None:
        with self._lock:
            self._chains.clear()

    @staticmethod
    def latest(known: set[str], chains: Sequence[str]) -> str | None:
        for c in reversed(chains):
            if c in known:
                return c
        return None
