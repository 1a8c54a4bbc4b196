"""The C heap under the interpreter: freed memory handed back to the system.

A large request's pipeline (parsing, cutting, tokenizing megabytes) allocates and frees far
more than the caches keep, much of it in worker threads. glibc's malloc keeps what a thread
freed in that thread's arena for reuse, one arena per thread up to 8 per core, so the resident
set climbs to the high-water mark of every arena and stays there: the fuzz run's RSS was
2-3x the configured caches after 10,000 requests. Two calls keep it near what is live:

* :func:`limit_arenas` at start-up, before any worker thread exists: ``mallopt(M_ARENA_MAX,
  2)`` (what ``MALLOC_ARENA_MAX=2`` in the environment does), so the worker threads share
  two arenas instead of growing one each;
* :class:`Trimmer`, after a large request: ``malloc_trim(0)`` in a worker thread, at most
  once per ``interval`` seconds, which returns the free pages at the top of each arena and
  the free whole pages inside it (``man 3 malloc_trim``).

Neither exists outside glibc (musl, macOS): then both do nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time

__all__ = ["Trimmer", "limit_arenas"]

log = logging.getLogger("proxy")

_M_ARENA_MAX = -8  # glibc's malloc.h


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not hasattr(libc, "malloc_trim") or not hasattr(libc, "mallopt"):
        return None  # not glibc
    return libc


def limit_arenas(arenas: int = 2) -> bool:
    """Cap glibc's malloc arenas (before worker threads start); False where there is none."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, arenas))


class Trimmer:
    """``malloc_trim(0)`` off the event loop, at most once per ``interval`` seconds."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self._libc = _libc()
        self._last = 0.0
        self._running = False
        self.trims = 0

    @property
    def enabled(self) -> bool:
        return self._libc is not None

    def trim_now(self) -> None:
        """Trim in this thread (a worker's)."""
        if self._libc is not None:
            self._libc.malloc_trim(0)
            self.trims += 1

    def after_large(self) -> None:
        """A large request is done: trim soon, unless a trim ran or runs within the interval."""
        now = time.monotonic()
        if self._libc is None or self._running or now - self._last < self.interval:
            return
        self._last = now
        self._running = True

        async def run() -> None:
            try:
                await asyncio.to_thread(self.trim_now)
            except Exception:
                log.exception("malloc_trim failed")
            finally:
                self._running = False

        asyncio.ensure_future(run())
