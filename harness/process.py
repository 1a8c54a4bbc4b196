"""The real server, ``python -m proxy serve``, as a child process (signals, ``kill -9``,
start-up time); and :func:`free_port` for whatever needs a port to bind later."""

from __future__ import annotations

import http.client
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from proxy.demo.servers import format_url

__all__ = ["ProxyProcess", "free_port", "healthy"]

def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the caller binds it later; fine for tests)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def healthy(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether ``GET /healthz`` on ``host:port`` answers 200 now."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/healthz")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


class ProxyProcess:
    """``python -m proxy serve --config FILE --port PORT`` as a child process.

    :meth:`start` spawns it and returns once ``GET /healthz`` answers 200, with the seconds
    that took (``startup_s``); :meth:`kill` is ``kill -9``; :meth:`signal` sends anything else.
    The same instance can be started again after the process ended (same port, same config).
    stdout and stderr are appended to ``log_path`` when given (else discarded).
    ``command`` replaces ``python -m proxy serve`` (e.g. a benchmark's own launcher); it gets
    the same arguments (``--config FILE --host HOST --port PORT`` and ``extra_args``).
    """

    def __init__(
        self,
        config_path: Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: Path | None = None,
        python: str = sys.executable,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        command: Sequence[str] | None = None,
    ) -> None:
        self.config_path = Path(config_path)
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.log_path = log_path
        self.python = python
        self.extra_args = tuple(extra_args)
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.command = tuple(command) if command is not None else None
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s: list[float] = []  # one entry per successful start

    @property
    def url(self) -> str:
        return format_url(self.host, self.port)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 30.0) -> float:
        if self.running:
            raise RuntimeError("the proxy process is already running")
        command = self.command or (self.python, "-m", "proxy", "serve")
        argv = [*command, "--config", str(self.config_path),
                "--host", self.host, "--port", str(self.port), *self.extra_args]
        log = open(self.log_path, "ab") if self.log_path is not None else None  # noqa: SIM115
        try:
            out = log if log is not None else subprocess.DEVNULL
            began = time.perf_counter()
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=self.env, cwd=self.cwd
            )
        finally:
            if log is not None:
                log.close()  # the child has its own descriptor now
        deadline = began + timeout
        while True:
            if healthy(self.host, self.port, timeout=1.0):
                took = time.perf_counter() - began
                self.startup_s.append(took)
                return took
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"proxy exited with {code} during start-up{self.log_tail()}")
            if time.perf_counter() > deadline:
                self.kill()
                raise TimeoutError(f"proxy not healthy after {timeout}s{self.log_tail()}")
            time.sleep(0.005)

    def log_tail(self) -> str:
        """The end of the log file (for failure messages), prefixed "; log tail:"; "" without."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        tail = self.log_path.read_bytes()[-2000:].decode("utf-8", "replace")
        return f"; log tail:\n{tail}"

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> bool:
        """SIGKILL and reap; True when a live process was killed."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        return True

    def wait(self, timeout: float | None = None) -> int:
        """The exit status (negative: killed by that signal); raises TimeoutExpired."""
        if self.proc is None:
            raise RuntimeError("the proxy process was never started")
        return self.proc.wait(timeout)

    def stop(self) -> None:
        self.kill()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
