"""Run an ASGI app inside the current event loop, without a socket: its lifespan, and an httpx
client whose requests call the app directly.

    async with InProcess(create_app(config)) as app:       # lifespan startup ... shutdown
        r = await app.client.post("/v1/chat/completions", json=body)
        await app.drain()                                  # work the requests left behind

    async with asgi_client(create_app(config)) as client:  # the same, yielding only the client
        r = await client.get("/healthz")

For tests of handler logic: no port, no server thread, no uvicorn; the app shares the test's
loop, so the test must not block it (``FakeUpstream.wait_for_async``, not ``wait_for``). What
needs real sockets (real client libraries' transports, faults and disconnects on the wire, raw
request targets, signals) belongs to :mod:`proxy.demo.servers` or :mod:`.process`.

Like uvicorn, each request runs in a task of its own with a copy of the lifespan state in
``scope["state"]``. httpx's ``ASGITransport`` collects the whole response before returning it (a
stream arrives at once), and after the request body its ``receive()`` answers
``http.disconnect`` only once the response is complete -- as uvicorn does for a client that
stays -- so the proxy's disconnect watch never fires early.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from types import TracebackType
from typing import Any, Protocol, Self

import httpx

__all__ = ["InProcess", "LifespanError", "asgi_client", "lifespan"]

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]


class LifespanError(RuntimeError):
    """The app's lifespan startup or shutdown failed (or did not answer in time)."""


class _Drains(Protocol):
    async def drain(self) -> None: ...


@contextlib.asynccontextmanager
async def lifespan(app: ASGIApp, *, timeout: float = 30.0) -> AsyncIterator[dict[str, Any]]:
    """Run ``app``'s lifespan protocol: startup on entry, shutdown on exit.

    Yields the lifespan state (what a Starlette lifespan yielded), which a server copies into
    every request's ``scope["state"]``. Raises :class:`LifespanError` when startup or shutdown
    fails, the app returns without answering, or ``timeout`` seconds pass.
    """
    state: dict[str, Any] = {}
    inbox: asyncio.Queue[Message] = asyncio.Queue()
    outbox: asyncio.Queue[Message] = asyncio.Queue()
    scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"},
             "state": state}

    async def send(message: Message) -> None:
        await outbox.put(message)

    task = asyncio.ensure_future(app(scope, inbox.get, send))

    async def exchange(kind: str) -> None:
        await inbox.put({"type": f"lifespan.{kind}"})
        reply = asyncio.ensure_future(outbox.get())
        try:
            await asyncio.wait({reply, task}, timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not reply.done():
                reply.cancel()
        if not reply.done() or reply.cancelled():
            if task.done():
                error = task.exception() if not task.cancelled() else None
                raise LifespanError(f"the app's lifespan ended during {kind}") from error
            raise LifespanError(f"the app's lifespan {kind} took over {timeout} s")
        message = reply.result()
        if message["type"] != f"lifespan.{kind}.complete":
            raise LifespanError(f"lifespan {kind} failed: {message.get('message', '')}")

    try:
        await exchange("startup")
    except BaseException:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise
    try:
        yield state
    finally:
        try:
            await exchange("shutdown")
        finally:
            if not task.done():
                task.cancel()
            with contextlib.suppress(BaseException):
                await task


class _OwnTask:
    """The app, called the way a server calls it: in a task of its own, with the state."""

    def __init__(self, app: ASGIApp, state: dict[str, Any]) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive,
                       send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope["state"] = dict(self.state)
        await asyncio.ensure_future(self.app(scope, receive, send))


class InProcess:
    """An ASGI app with its lifespan running in this loop, and :attr:`client` to call it.

    ``base_url`` is what requests appear to be addressed to (their ``host`` header);
    ``raise_app_exceptions``: an exception escaping the app fails the request in the test (the
    default) instead of becoming a 500 as a server would send. ``lifespan=False`` for apps
    without one. :meth:`stop` ends it early (idempotent), as ``ServerThread.stop`` does.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        base_url: str = "http://testserver",
        lifespan: bool = True,
        raise_app_exceptions: bool = True,
        startup_timeout: float = 30.0,
        **client_kwargs: Any,
    ) -> None:
        self.app = app
        self.url = base_url.rstrip("/")
        self.use_lifespan = lifespan
        self.raise_app_exceptions = raise_app_exceptions
        self.startup_timeout = startup_timeout
        self.client_kwargs = client_kwargs
        #: the lifespan state, copied into every request's scope
        self.state: dict[str, Any] = {}
        self._stack: contextlib.AsyncExitStack | None = None
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("InProcess is not started")
        return self._client

    @property
    def running(self) -> bool:
        return self._stack is not None

    async def start(self) -> Self:
        if self._stack is not None:
            raise RuntimeError("InProcess already started")
        stack = contextlib.AsyncExitStack()
        try:
            if self.use_lifespan:
                self.state = await stack.enter_async_context(
                    lifespan(self.app, timeout=self.startup_timeout))
            transport = httpx.ASGITransport(
                app=_OwnTask(self.app, self.state),
                raise_app_exceptions=self.raise_app_exceptions,
            )
            self._client = await stack.enter_async_context(
                httpx.AsyncClient(transport=transport, base_url=self.url, **self.client_kwargs))
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        return self

    async def stop(self) -> None:
        """Close the client and run the lifespan's shutdown (which lets pending work finish)."""
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    async def drain(self) -> None:
        """Wait until the work the requests left behind is done: the app's services' ``drain()``
        (:meth:`proxy.services.Services.drain`: archive writes, held writes, counters)."""
        services: _Drains | None = self.state.get("services") or getattr(self.app, "services", None)
        if services is None:
            raise RuntimeError("this app has no services to drain")
        await services.drain()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


@contextlib.asynccontextmanager
async def asgi_client(app: ASGIApp, **kwargs: Any) -> AsyncIterator[httpx.AsyncClient]:
    """``async with asgi_client(app) as client``: :class:`InProcess` yielding only its client."""
    async with InProcess(app, **kwargs) as running:
        yield running.client
