"""Run any ASGI app on a real loopback socket: in a background thread, or in the current loop.

    with serve_in_thread(app) as srv:          # sync tests, benchmarks, `ctxproxy demo`
        httpx.get(srv.url + "/v1/models")
        srv.drain()                            # the proxy's work left behind by requests

    async with serve_async(app) as srv:        # async tests; app runs on *this* event loop
        ...

The socket is bound here (not by uvicorn) so that ``port=0`` works and the real port is
known before the context manager returns.

:mod:`harness.process` runs the real command line (``python -m proxy serve``) as a child
process instead, for what needs a process of its own: signals, ``kill -9``, start-up time.
:mod:`harness.inprocess` calls an app with no socket at all (handler logic).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, Protocol, Self

import uvicorn

__all__ = [
    "ASGIApp",
    "ServerHandle",
    "ServerThread",
    "bind_socket",
    "format_url",
    "serve_async",
    "serve_in_thread",
]

#: Deliberately loose: any ``async (scope, receive, send) -> None`` callable (Starlette, raw ASGI).
ASGIApp = Callable[..., Awaitable[None]]
Lifespan = Literal["auto", "on", "off"]


class _Drains(Protocol):
    async def drain(self) -> None: ...


def bind_socket(host: str = "127.0.0.1", port: int = 0, backlog: int = 2048) -> socket.socket:
    """Bind and listen on ``host:port`` (0 = any free port); the caller owns the socket."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        # Listening now means clients that connect before uvicorn's loop is up just queue.
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def format_url(host: str, port: int) -> str:
    """``http://host:port`` with IPv6 hosts bracketed."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _NotifyingServer(uvicorn.Server):
    """uvicorn.Server that calls ``on_started`` once its listeners are up (no polling)."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self._on_started()

    async def main_loop(self) -> None:
        # uvicorn polls should_exit every 100 ms; tests start and stop hundreds of servers, so
        # poll every 10 ms (on_tick's once-a-second work keeps its cadence).
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            for _ in range(10):
                await asyncio.sleep(0.01)
                if self.should_exit:
                    break
            counter = (counter + 1) % 864000
            should_exit = await self.on_tick(counter)


async def _serve(server: uvicorn.Server, sock: socket.socket) -> None:
    try:
        await server.serve(sockets=[sock])
    except SystemExit as exc:
        # uvicorn sys.exit()s when lifespan startup fails; a SystemExit escaping a task
        # would tear down the whole event loop (and pytest with it).
        raise RuntimeError(f"ASGI server exited during startup (code {exc.code})") from exc


def _make_config(
    app: ASGIApp, lifespan: Lifespan, graceful_timeout: int, config_kwargs: dict[str, Any]
) -> uvicorn.Config:
    kwargs: dict[str, Any] = {
        "log_level": "warning",
        "access_log": False,
        "lifespan": lifespan,
        # Bounds shutdown when a test leaves a request hanging (e.g. a 30 s fake delay).
        "timeout_graceful_shutdown": graceful_timeout,
    }
    kwargs.update(config_kwargs)
    return uvicorn.Config(app, **kwargs)


class ServerThread:
    """An ASGI app served by uvicorn on its own event loop in a daemon thread.

    Context manager: ``__enter__`` binds, starts and waits until the server accepts
    connections, returning ``self``; ``__exit__`` asks the server to exit and joins the
    thread (bounded: graceful_timeout + 2 * stop_timeout at most, then warns).
    Extra keyword arguments go to ``uvicorn.Config`` (e.g. ``http="h11"``, ``loop="asyncio"``).
    ``loop_setup``, when given, is called in the server's thread with its new event loop before
    the server starts (e.g. :meth:`proxy.testing.slow_callbacks.SlowCallbacks.install`).
    """

    def __init__(
        self,
        app: ASGIApp,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        lifespan: Lifespan = "auto",
        startup_timeout: float = 10.0,
        graceful_timeout: int = 1,
        stop_timeout: float = 5.0,
        loop_setup: Callable[[asyncio.AbstractEventLoop], None] | None = None,
        **config_kwargs: Any,
    ) -> None:
        self.app = app
        self.host = host
        self.port = port  # replaced by the bound port in start()
        self.lifespan: Lifespan = lifespan
        self.startup_timeout = startup_timeout
        self.graceful_timeout = graceful_timeout
        self.stop_timeout = stop_timeout
        self.loop_setup = loop_setup
        self.config_kwargs = config_kwargs
        self.server: uvicorn.Server | None = None
        #: The server's event loop (for ``asyncio.run_coroutine_threadsafe``), set once running.
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (no trailing slash)."""
        return format_url(self.host, self.port)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> Self:
        if self._thread is not None:
            raise RuntimeError("ServerThread already started")
        sock = bind_socket(self.host, self.port)
        self.port = int(sock.getsockname()[1])
        config = _make_config(self.app, self.lifespan, self.graceful_timeout, self.config_kwargs)
        server = _NotifyingServer(config, self._started.set)
        self.server = server
        self._thread = threading.Thread(
            target=self._run, args=(server, config, sock), name=f"asgi-{self.port}", daemon=True
        )
        self._thread.start()
        if not self._started.wait(self.startup_timeout):
            self.stop()
            raise TimeoutError(f"server on {self.url} did not start in {self.startup_timeout}s")
        if self._error is not None or not server.started:
            self._thread.join(self.stop_timeout)
            raise RuntimeError(f"server on {self.url} failed to start") from self._error
        return self

    def _run(self, server: uvicorn.Server, config: uvicorn.Config, sock: socket.socket) -> None:
        try:
            with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
                self.loop = runner.get_loop()
                if self.loop_setup is not None:
                    self.loop_setup(self.loop)
                runner.run(_serve(server, sock))
        except BaseException as exc:  # noqa: BLE001 -- surfaced to start(); a thread can't raise to its owner
            self._error = exc
        finally:
            sock.close()
            self._started.set()  # unblock start() if we died before listening

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until the work requests left behind is done: ``app.services.drain()`` (see
        :meth:`proxy.services.Services.drain`), run on the server's loop. Blocks this thread."""
        services: _Drains | None = getattr(self.app, "services", None)
        if services is None or self.loop is None or not self.running:
            raise RuntimeError(f"the app on {self.url} is not running or has no services")

        async def drain() -> None:
            await services.drain()

        asyncio.run_coroutine_threadsafe(drain(), self.loop).result(timeout)

    def stop(self) -> None:
        """Ask uvicorn to exit, join the thread; force exit if graceful shutdown stalls."""
        thread, server = self._thread, self.server
        if thread is None or server is None:
            return
        server.should_exit = True
        thread.join(self.graceful_timeout + self.stop_timeout)
        if thread.is_alive():
            server.force_exit = True
            thread.join(self.stop_timeout)
        if thread.is_alive():
            warnings.warn(f"ASGI server thread for {self.url} did not stop", RuntimeWarning, 2)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def serve_in_thread(
    app: ASGIApp, host: str = "127.0.0.1", port: int = 0, **kwargs: Any
) -> ServerThread:
    """``with serve_in_thread(app) as srv: srv.url`` -- see :class:`ServerThread` for kwargs."""
    return ServerThread(app, host, port, **kwargs)


@dataclass(frozen=True)
class ServerHandle:
    """What :func:`serve_async` yields."""

    host: str
    port: int
    server: uvicorn.Server

    @property
    def url(self) -> str:
        return format_url(self.host, self.port)


@contextlib.asynccontextmanager
async def serve_async(
    app: ASGIApp,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    lifespan: Lifespan = "auto",
    startup_timeout: float = 10.0,
    graceful_timeout: int = 1,
    stop_timeout: float = 5.0,
    **config_kwargs: Any,
) -> AsyncIterator[ServerHandle]:
    """Serve ``app`` as a task in the running loop; yields a :class:`ServerHandle`.

    Note: code in the same loop must not block (use ``FakeUpstream.wait_for_async``).
    """
    sock = bind_socket(host, port)
    started = asyncio.Event()
    config = _make_config(app, lifespan, graceful_timeout, config_kwargs)
    server = _NotifyingServer(config, started.set)
    handle = ServerHandle(host, int(sock.getsockname()[1]), server)
    task = asyncio.create_task(_serve(server, sock), name=f"asgi-{handle.port}")
    waiter = asyncio.create_task(started.wait())
    try:
        await asyncio.wait({task, waiter}, timeout=startup_timeout, return_when="FIRST_COMPLETED")
    finally:
        waiter.cancel()
    if not started.is_set():
        try:
            if task.done():
                task.result()  # re-raises the startup error
                raise RuntimeError(f"server on {handle.url} exited during startup")
            raise TimeoutError(f"server on {handle.url} did not start in {startup_timeout}s")
        finally:
            task.cancel()
            sock.close()
    try:
        yield handle
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), graceful_timeout + stop_timeout)
        except TimeoutError:
            server.force_exit = True
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(task, stop_timeout)
        finally:
            sock.close()
