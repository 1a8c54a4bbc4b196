"""A throwaway PostgreSQL server for tests and benchmarks: ``initdb`` into a temp dir, ``pg_ctl``
start/stop (so a test can take the database away and bring it back), one database per use.

The binaries are Debian's (``/usr/lib/postgresql/<v>/bin``) or whatever ``PATH`` has;
:func:`find_binaries` returns None when there are none (tests then skip, saying why). PostgreSQL
refuses to run as root, so as root the server runs as the ``postgres`` user (Debian's package
creates it; else ``nobody``) through ``runuser``. Durability against power loss is off (``fsync``,
``full_page_writes``); commits still reach the WAL, so ``stop("immediate")`` loses nothing.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

import psycopg

from harness.process import free_port

__all__ = ["PostgresServer", "find_binaries"]


def find_binaries() -> Path | None:
    """The directory holding ``initdb``, ``pg_ctl`` and ``postgres``, or None."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(str(Path(os.path.realpath(on_path)).parent))
    for c in candidates:
        d = Path(c)
        if all((d / b).exists() for b in ("initdb", "pg_ctl", "postgres")):
            return d
    return None


def _run_as() -> str | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    raise RuntimeError("running as root and no postgres/nobody user to run PostgreSQL as")


class PostgresServer:
    """``start()`` initialises (once) and starts; ``stop()`` stops (data kept); ``close()``
    stops and deletes everything. ``url(db)`` for a database made by ``create_database``."""

    def __init__(self, bindir: Path | None = None) -> None:
        found = bindir or find_binaries()
        if found is None:
            raise RuntimeError("no PostgreSQL server binaries (initdb, pg_ctl, postgres)")
        self.bindir = found
        self.user = _run_as()
        self.root = Path(tempfile.mkdtemp(prefix="ctxproxy-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self._initialised = False
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)

    def _cmd(self, *argv: str) -> list[str]:
        prefix = ["runuser", "-u", self.user, "--"] if self.user is not None else []
        return [*prefix, *argv]

    def _run(self, *argv: str) -> None:
        done = subprocess.run(self._cmd(*argv), capture_output=True, text=True, cwd=self.root)
        if done.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed ({done.returncode}): {done.stderr[-2000:]}")

    def start(self) -> None:
        if not self._initialised:
            self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", "ctxproxy",
                      "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync")
            self._initialised = True
        opts = (f"-p {self.port} -h 127.0.0.1 -k {self.root} -c fsync=off "
                "-c full_page_writes=off -c max_connections=300")
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l",
                  str(self.root / "log"), "-o", opts, "-w", "-t", "60", "start")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``immediate``: as a crash would); the data stays for ``start``."""
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://ctxproxy@127.0.0.1:{self.port}/{dbname}"

    def create_database(self, name: str) -> str:
        """A new empty database (dropped first if it exists); returns its URL."""
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.url(), connect_timeout=1):
                    return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
