"""Per-session counters (turns, tokens in and out, compactions, offloads) for ``/files``: summed
in memory and written in one transaction per interval, never on a request's path."""

from __future__ import annotations

import asyncio
import logging
import threading

from proxy.store.interfaces import SessionIndex

__all__ = ["SessionCounters"]

log = logging.getLogger("proxy.store")


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
