"""Work that runs after the response (archiving the answer, counters, held writes): tracked,
so that tests can wait for it (:meth:`Background.drain`) and shutdown can let it finish."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

__all__ = ["Background"]

log = logging.getLogger("proxy")


class Background:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background task failed: %r", task.exception())

    async def drain(self) -> None:
        """Wait until nothing is pending, including work spawned while waiting."""
        while self._tasks:
            await asyncio.wait(list(self._tasks))

    async def close(self, timeout: float = 10) -> None:
        """Let pending work finish for up to ``timeout`` seconds (graceful shutdown)."""
        pending = [t for t in self._tasks if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)

    def __len__(self) -> int:
        return len(self._tasks)
