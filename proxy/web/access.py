"""Who is asking ``/files``, in which format, what they may see, and how files are reached
inside ``data_dir``.

Identity: the API key comes from ``Authorization: Bearer KEY``, ``Authorization: Basic
base64(user:KEY)`` (what a browser sends after its native login prompt), ``x-api-key`` or
``api-key``. The caller's tenant is :func:`proxy.session.tenant_of` of that key, so a key sees
exactly the sessions its chat requests created. The master key (``auth.master_key``) sees every
tenant. The key itself is only hashed or compared here, never stored, echoed or logged.

Format: ``?format=json|html|text`` or ``?raw=1`` win, then the ``Accept`` header (highest q of
``text/html``, ``application/json``, ``text/plain``; ties prefer HTML), else HTML -- except that
a windowed read of a file (``?start_line=``/``?lines=``) from a client that stated no preference
(``curl``, a model's fetch tool) gets raw text, as the offload notices promise.

File access goes through :mod:`proxy.store.fs` (``openat`` one component at a time with
``O_NOFOLLOW``), the one way anything under ``data_dir`` is opened.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Final, Literal

from proxy.errors import Unauthorized
from proxy.session import ANON, client_key, tenant_of

__all__ = [
    "REALM",
    "Ask",
    "AuthRequired",
    "Caller",
    "Fmt",
    "Window",
    "ask_of",
    "identify",
    "iter_chunks",
    "presented_key",
    "read_window",
]

REALM: Final = "ctxproxy"
_CHUNK: Final = 1 << 16


class AuthRequired(Unauthorized):
    """401 that asks a browser for credentials (``WWW-Authenticate: Basic``)."""

    headers: Final = {"WWW-Authenticate": f'Basic realm="{REALM}", charset="UTF-8"'}


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str  # the caller's own tenant (``anon`` without a key)
    master: bool

    def may_see(self, tenant: str) -> bool:
        return self.master or tenant == self.tenant

    @property
    def scope(self) -> str | None:
        """The tenant filter for listings; ``None`` means every tenant (master key)."""
        return None if self.master else self.tenant


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The API key the request carries, or ``None``."""
    auth = headers.get("authorization", "").strip()
    scheme, _, rest = auth.partition(" ")
    if scheme.lower() != "basic":
        return client_key(headers)
    try:
        decoded = base64.b64decode(rest.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        # Deliberately no detail: the credentials must not be echoed back.
        raise AuthRequired("malformed Basic credentials") from None
    user, _, password = decoded.partition(":")
    # The key normally goes in the password field; a key typed as user name works too.
    return password or user or None


def identify(headers: Mapping[str, str], master_key: str | None, *, login: bool = False) -> Caller:
    """The caller of a ``/files`` request; raises :class:`AuthRequired` when a key is needed.

    ``login`` asks for credentials even without a master key, so a browser (which only sends
    Basic credentials after a 401) can switch from ``anon`` to its own tenant.
    """
    key = presented_key(headers)
    if key is None:
        if master_key is not None or login:
            raise AuthRequired("an API key is required: send it as a Bearer token or log in")
        return Caller(ANON, False)
    if master_key is not None and hmac.compare_digest(
        key.encode("utf-8", "surrogatepass"), master_key.encode("utf-8", "surrogatepass")
    ):
        return Caller(tenant_of(key), True)
    return Caller(tenant_of(key), False)


Fmt = Literal["html", "json", "text"]
_MEDIA: Final[Mapping[str, Fmt]] = {
    "text/html": "html",
    "application/xhtml+xml": "html",
    "application/json": "json",
    "text/plain": "text",
}
_PREFERENCE: Final[Mapping[Fmt, int]] = {"html": 3, "json": 2, "text": 1}
_NAMED: Final[Mapping[str, Fmt]] = {"html": "html", "json": "json", "text": "text"}


@dataclass(frozen=True, slots=True)
class Ask:
    """What a request asks for, beyond its path."""

    fmt: Fmt
    explicit: bool  # the client named a format rather than accepting anything
    query: Mapping[str, str]
    base: str  # URL of /files itself (behind a root_path too)

    def file_fmt(self) -> Fmt:
        windowed = "start_line" in self.query or "lines" in self.query
        return "text" if windowed and not self.explicit else self.fmt


def _from_accept(header: str) -> Fmt | None:
    best: tuple[float, int, Fmt] | None = None
    for item in header.split(","):
        media, *params = item.strip().split(";")
        fmt = _MEDIA.get(media.strip().lower())
        if fmt is None:
            continue
        q = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if q > 0 and (best is None or (q, _PREFERENCE[fmt]) > best[:2]):
            best = (q, _PREFERENCE[fmt], fmt)
    return None if best is None else best[2]


def ask_of(headers: Mapping[str, str], query: Mapping[str, str], root_path: str = "") -> Ask:
    params = dict(query)
    base = root_path + "/files"
    named = _NAMED.get(params.get("format", ""))
    if named is not None:
        return Ask(named, True, params, base)
    if params.get("raw") in ("1", "true", "yes"):
        return Ask("text", True, params, base)
    accepted = _from_accept(headers.get("accept", ""))
    return Ask(accepted or "html", accepted is not None, params, base)


# --- file windows ------------------------------------------------------------------------------


def iter_chunks(fd: int, size: int) -> Iterator[bytes]:
    """Exactly ``size`` bytes from the start of ``fd`` (an archive may grow meanwhile; the
    declared Content-Length must hold), then closes it."""
    try:
        offset = 0
        while offset < size:
            chunk = os.pread(fd, min(_CHUNK, size - offset), offset)
            if not chunk:
                break
            offset += len(chunk)
            yield chunk
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class Window:
    total_lines: int
    start_line: int  # 1-based
    lines: list[bytes]  # each with its own terminator, as in the file
    truncated: bool  # the byte budget ended the window before ``count`` lines

    @property
    def next_start(self) -> int | None:
        after = self.start_line + len(self.lines)
        return after if after <= self.total_lines else None


def read_window(fd: int, start: int, count: int | None, max_bytes: int) -> Window:
    """Lines ``start .. start+count-1`` (1-based; ``None``: to the end) of ``fd``, at most
    ``max_bytes`` of them (but always one line), and the total line count. Lines end at ``\\n``
    only, as the offload notices count them."""
    lines: list[bytes] = []
    taken = 0
    number = 0
    end = None if count is None else start + count
    os.lseek(fd, 0, os.SEEK_SET)
    with open(fd, "rb", buffering=_CHUNK, closefd=False) as handle:
        for line in handle:
            number += 1
            if number < start:
                continue
            if (end is not None and number >= end) or (lines and taken + len(line) > max_bytes):
                truncated = end is None or number < end
                break
            lines.append(line)
            taken += len(line)
        else:
            return Window(number, start, lines, False)
        # The window is full: count the rest without splitting it into line objects.
        last = b"\n"
        while chunk := handle.read(_CHUNK * 16):
            number += chunk.count(b"\n")
            last = chunk
        if not last.endswith(b"\n"):
            number += 1
    return Window(number, start, lines, truncated)
