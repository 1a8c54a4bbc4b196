"""Per-session counters (turns, tokens in and out, compactions, offloads) for ``/files``: the
row both stores give back (:class:`SessionRow`), the counters a caller may add to (checked by
:func:`check_counters`, since they become column names), and :class:`SessionCounters`, which
sums them in memory and writes them in one transaction per interval, never on a request's
path."""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from proxy.store.interfaces import SessionIndex
from proxy.store.paths import check_name

__all__ = ["SESSION_COUNTERS", "SessionCounters", "SessionRow", "check_counters"]

log = logging.getLogger("proxy.store")


# Counters update_session_stats may touch. "messages" is maintained by the dialog archive.
SESSION_COUNTERS: Final = frozenset({"turns", "tokens_in", "tokens_out", "compactions", "offloads"})


def check_counters(tenant: str, session: str, increments: dict[str, int]) -> list[str]:
    """The names of ``increments``, sorted, once each is a known counter with an int (they
    become column names in SQL: only the whitelist gets there)."""
    check_name(tenant, "tenant")
    check_name(session, "session")
    for key, value in increments.items():
        if key not in SESSION_COUNTERS:
            raise ValueError(f"unknown session counter: {key!r}")
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"session counter {key!r} must be an int, got {value!r}")
    return sorted(increments)


@dataclass(frozen=True, slots=True)
class SessionRow:
    """Per-session counters for the /files pages."""

    tenant: str
    session: str
    turns: int
    tokens_in: int
    tokens_out: int
    compactions: int
    offloads: int
    messages: int  # distinct messages archived
    first_seen: datetime
    last_seen: datetime
    last_chain: str | None  # chain of the newest archived message (branch detection)

    @property
    def saved_ratio(self) -> float:
        """Share of client tokens the proxy did not forward (0 when nothing was counted)."""
        if self.tokens_in <= 0:
            return 0.0
        return max(0.0, 1.0 - self.tokens_out / self.tokens_in)


class SessionCounters:
    def __init__(self, store: SessionIndex, interval: float = 1.0) -> None:
        self.store = store
        self.interval = interval
        self._pending: dict[tuple[str, str], dict[str, int]] = {}
        self._lock = threading.Lock()
        self._task: asyncio.Task[None] | None = None

    def add(self, tenant: str, session: str, **increments: int) -> None:
        with self._lock:
            row = self._pending.setdefault((tenant, session), {})
            for k, v in increments.items():
                row[k] = row.get(k, 0) + v

    def flush(self) -> int:
        """Write what is pending (blocking: a worker thread); returns how many sessions."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for (tenant, session), inc in pending.items():
            try:
                self.store.update_session_stats(tenant, session, **inc)  # type: ignore[arg-type]
            except Exception as exc:  # counters are best effort; never fail a request for them
                log.warning("session counters for %s/%s not saved: %s", tenant, session, exc)
        return len(pending)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            if self._pending:
                await asyncio.to_thread(self.flush)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def drain(self) -> None:
        """Write what is pending now (tests, shutdown)."""
        if self._pending:
            await asyncio.to_thread(self.flush)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.drain()
