"""Many ``ctxproxy serve`` replicas behind a real load balancer (haproxy), for the scale-out
tests and benchmarks.

:class:`Haproxy` runs Debian's haproxy in the foreground with :func:`haproxy_config`: round
robin, no stickiness, a ``/healthz`` check every 200 ms (a killed replica leaves the rotation
within a few hundred ms), and a connection that fails is retried on another replica
(``retry-on conn-failure`` + ``option redispatch``; a request already sent is never retried: it
may have been billed). :class:`Cluster` starts N replicas of one config file and the balancer.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Self

from harness.process import ProxyProcess, free_port, healthy

__all__ = ["Cluster", "Haproxy", "find_haproxy", "haproxy_config"]


def find_haproxy() -> str | None:
    return shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if Path(p).exists()), None)


def haproxy_config(port: int, backends: Sequence[tuple[str, int]]) -> str:
    """The balancer the tests use (docs/scaling.md#the-balancer-the-tests-use)."""
    servers = "\n".join(
        f"    server r{i} {host}:{p} check inter 200ms fall 1 rise 1"
        for i, (host, p) in enumerate(backends)
    )
    return f"""global
    maxconn 4096

defaults
    mode http
    timeout connect 2s
    timeout client 300s
    timeout server 300s
    retries 3
    option redispatch
    retry-on conn-failure empty-response

frontend ctxproxy
    bind 127.0.0.1:{port}
    default_backend replicas

backend replicas
    balance roundrobin
    option httpchk GET /healthz
{servers}
"""


class Haproxy:
    def __init__(self, workdir: Path, backends: Sequence[tuple[str, int]]) -> None:
        binary = find_haproxy()
        if binary is None:
            raise RuntimeError("haproxy is not installed")
        self.binary = binary
        self.port = free_port()
        self.config_path = Path(workdir) / "haproxy.cfg"
        self.config_path.write_text(haproxy_config(self.port, backends))
        self.log_path = Path(workdir) / "haproxy.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 15.0) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([self.binary, "-db", "-f", str(self.config_path)],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout
        while not healthy("127.0.0.1", self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("haproxy did not start: "
                                   + self.log_path.read_text(errors="replace")[-2000:])
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Cluster:
    """``replicas`` processes of ``config_path`` (each may get its own ``extra_args``) behind
    one haproxy; ``url`` is the balancer's."""

    def __init__(self, workdir: Path, config_paths: Sequence[Path]) -> None:
        self.workdir = Path(workdir)
        self.replicas = [ProxyProcess(cfg, log_path=self.workdir / f"replica-{i}.log")
                         for i, cfg in enumerate(config_paths)]
        self.balancer = Haproxy(self.workdir, [(r.host, r.port) for r in self.replicas])

    @property
    def url(self) -> str:
        return self.balancer.url

    def start(self) -> Self:
        try:
            with ThreadPoolExecutor(len(self.replicas)) as pool:  # start-ups overlap
                for started in [pool.submit(r.start, 60) for r in self.replicas]:
                    started.result()
            self.balancer.start()  # replicas answer already: haproxy starts them UP
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self.balancer.stop()
        for r in self.replicas:
            with contextlib.suppress(Exception):
                r.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
