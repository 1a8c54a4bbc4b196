"""Connections to the shared PostgreSQL database, and what happens when it is down or slow.

Driver: psycopg 3 with psycopg-pool, *synchronous*. Every store method is already called from a
worker thread (``asyncio.to_thread``, :mod:`proxy.writes`), because the files backend blocks on
disk; a synchronous pool slots into exactly those calls, so the pipeline, the archive service
and the compactor need no second (async) code path. asyncpg would have meant async twins of
every store method, for no gain here: bench/pg_driver.py measured the two calls a request makes
most at 16 callers, psycopg from threads 5.4k ops/s (p50 2.0 ms) vs asyncpg on the loop 3.7k
ops/s (p50 3.6 ms), asyncpg ~20% less client CPU per call (bench/README.md).

Faults: a call that cannot get a connection within ``timeout_s``, loses its connection, or runs
past the statement timeout raises :class:`proxy.errors.StoreUnavailable` (an ``OSError``, so the
callers' "disk failed" paths apply: forward uncut, skip the archive write). After a failure the
pool is marked down and calls fail at once instead of each waiting ``timeout_s`` (requests keep
their latency while the database is away); a background thread probes every ``retry_s`` with a
fresh connection and marks the pool up again when one answers. The pool itself reconnects in
the background (psycopg-pool), and the connections it holds are all tested before it is marked
up again, so the dead ones of a restarted server are replaced, not handed out. (A connection is not
checked each time it is taken: that would cost a round trip per call; the first call on a dead
connection fails at once instead, and marks the pool down.)
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from proxy.errors import StoreUnavailable

__all__ = ["PgPool"]

log = logging.getLogger("proxy.store")

RETRY_S = 0.5  # while down, the prober tries a fresh connection this often


class PgPool:
    def __init__(
        self, url: str, *, max_size: int = 10, timeout_s: float = 5.0, retry_s: float = RETRY_S,
        name: str = "ctxproxy",
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.failures = 0  # store calls that failed for want of the database (a metric)
        self._down = False
        self._up = threading.Event()  # set while the pool is up (wait_up)
        self._up.set()
        self._closed = False
        self._prober: threading.Thread | None = None
        self._lock = threading.Lock()
        ms = int(timeout_s * 1000)
        self._pool = ConnectionPool(
            url,
            min_size=1,
            max_size=max_size,
            open=False,
            name=name,
            timeout=timeout_s,
            reconnect_timeout=3600,  # keep trying: the database comes back eventually
            kwargs={
                "autocommit": True,
                "connect_timeout": max(1, int(timeout_s)),
                # A slow database costs a request at most this long per call.
                "options": f"-c statement_timeout={ms} -c lock_timeout={ms}",
                "application_name": name,
            },
        )

    def open(self, wait: bool = True) -> None:
        self._pool.open(wait=wait, timeout=self.timeout_s)

    def close(self) -> None:
        self._closed = True
        self._pool.close()

    @property
    def up(self) -> bool:
        return not self._down

    def wait_up(self, timeout: float) -> bool:
        """Block until the pool is up again (the prober found the database), at most
        ``timeout`` seconds; whether it is."""
        return self._up.wait(timeout)

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A connection in autocommit mode (use ``conn.transaction()`` for more than one
        statement); :class:`StoreUnavailable` when the database is away."""
        if self._down:
            self._fail(None)
        try:
            with self._pool.connection() as conn:
                yield conn
        except (psycopg.OperationalError, PoolTimeout) as exc:
            # OperationalError: connection lost, server shutting down, statement timeout.
            self._fail(exc)
        except psycopg.InterfaceError as exc:  # a connection closed under us
            self._fail(exc)

    def _fail(self, exc: BaseException | None) -> None:
        with self._lock:
            self.failures += 1
            if exc is not None and not self._down:
                first = str(exc).strip().splitlines()[:1] or [type(exc).__name__]
                log.error("the database is unavailable (%s): serving without the store", first[0])
                self._down = True
                self._up.clear()
                if self._prober is None or not self._prober.is_alive():
                    self._prober = threading.Thread(target=self._probe, name="pg-probe",
                                                    daemon=True)
                    self._prober.start()
        raise StoreUnavailable("the shared database is unavailable") from exc

    def _probe(self) -> None:
        """While down: a fresh connection every ``retry_s``; the first that answers marks the
        pool up (requests never wait on a probe)."""
        while not self._closed:
            time.sleep(self.retry_s)
            try:
                with psycopg.connect(self.url, connect_timeout=max(1, int(self.timeout_s)),
                                     autocommit=True) as conn:
                    conn.execute("SELECT 1")
            except psycopg.Error:
                continue
            # Connections of the old server still sit in the pool: test them all now (dead ones
            # are replaced) rather than fail a request each.
            with contextlib.suppress(Exception):
                self._pool.check()
            with self._lock:
                self._down = False
                self._up.set()
            log.warning("the database is reachable again")
            return

    def ping(self) -> bool:
        """One round trip (for /readyz); False when the database is away."""
        try:
            with self.connection() as conn:
                conn.execute("SELECT 1")
            return True
        except StoreUnavailable:
            return False
