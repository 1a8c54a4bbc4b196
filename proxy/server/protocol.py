"""How uvicorn serves the app: its HTTP protocol with a deadline for a request's headers.

uvicorn closes a kept-alive connection after ``timeout_keep_alive`` of silence, but sets no
deadline on a connection that never finishes sending its headers: one byte every few seconds
keeps it open for good (500 such connections stayed open over 60 s in a black-box run). The
protocol here closes a connection whose headers have not all come within
``server.header_timeout_s`` of it opening, or of a kept-alive request's first byte. The body's
own deadline is the app's (:func:`proxy.asgi.read_body`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["header_deadline_protocol"]


class _HeaderDeadline(HttpToolsProtocol):
    header_timeout_s: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()


def header_deadline_protocol(header_timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol, closing connections whose headers take longer than
    ``header_timeout_s``."""
    return type("HeaderDeadlineProtocol", (_HeaderDeadline,),
                {"header_timeout_s": header_timeout_s})
