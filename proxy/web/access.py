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

File access: every path is opened one component at a time from a descriptor of ``data_dir``
(``openat`` with ``O_NOFOLLOW``), so a symlink anywhere below ``data_dir`` -- planted as the
file, the session directory or a sub-directory -- is refused by the kernel rather than by a
check that could race with a rename. Each component is also a validated name, so ``..``,
separators and NUL never reach the filesystem at all.
"""

from __future__ import annotations

import base64
import binascii
import errno
import hmac
import os
import stat
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from proxy.errors import Unauthorized
from proxy.session import ANON, client_key, tenant_of
from proxy.store.paths import InvalidName, check_name

__all__ = [
    "REALM",
    "Ask",
    "AuthRequired",
    "Caller",
    "Entry",
    "Fmt",
    "Hidden",
    "Window",
    "ask_of",
    "identify",
    "iter_chunks",
    "list_files",
    "open_dir",
    "open_file",
    "presented_key",
    "read_window",
]

REALM: Final = "ctxproxy"
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted in the tree must not hang the worker thread in open().
_FILE_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_CHUNK: Final = 1 << 16


class AuthRequired(Unauthorized):
    """401 that asks a browser for credentials (``WWW-Authenticate: Basic``)."""

    headers: Final = {"WWW-Authenticate": f'Basic realm="{REALM}", charset="UTF-8"'}


class Hidden(FileNotFoundError):
    """Missing, not a regular file/directory, a symlink, or an invalid name: all look alike
    to the caller, so a refused path reveals nothing about what is there. ``absent`` says a
    component simply does not exist (no symlink, no type mismatch): the honest case for an
    offloaded file that expired."""

    def __init__(self, name: str, *, absent: bool = False) -> None:
        super().__init__(name)
        self.absent = absent


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


# --- file access -----------------------------------------------------------------------------


def _open_at(parent: int, name: str, flags: int) -> int:
    try:
        check_name(name)
        return os.open(name, flags, dir_fd=parent)
    except InvalidName:
        raise Hidden(name) from None
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise Hidden(name, absent=True) from None
        # ELOOP: a symlink (O_NOFOLLOW); ENOTDIR: a file where a directory should be.
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EACCES, errno.ENXIO):
            raise Hidden(name) from None
        raise


def open_dir(data_dir: Path, parts: Sequence[str]) -> int:
    """A descriptor of ``data_dir/parts...``; the caller closes it. ``data_dir`` itself is the
    operator's choice and may be a symlink; nothing below it may."""
    try:
        fd = os.open(data_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        raise Hidden(str(data_dir)) from None
    try:
        for part in parts:
            child = _open_at(fd, part, _DIR_FLAGS)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(data_dir: Path, parts: Sequence[str]) -> tuple[int, os.stat_result]:
    """A descriptor of the regular file ``data_dir/parts...`` and its stat; caller closes it.

    Raises :class:`Hidden` for anything else.
    """
    if not parts:
        raise Hidden("")
    parent = open_dir(data_dir, parts[:-1])
    try:
        fd = _open_at(parent, parts[-1], _FILE_FLAGS)
    finally:
        os.close(parent)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise Hidden(parts[-1])
    return fd, info


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    size: int
    mtime: float


def list_files(data_dir: Path, parts: Sequence[str], suffix: str) -> list[Entry]:
    """Regular files named ``<valid name><suffix>`` in a directory (symlinks skipped), newest
    first; a missing directory is simply empty."""
    try:
        fd = open_dir(data_dir, parts)
    except Hidden:
        return []
    try:
        with os.scandir(fd) as entries:
            found = []
            for entry in entries:
                if not entry.name.endswith(suffix) or not valid_name(entry.name):
                    continue
                if not entry.is_file(follow_symlinks=False):
                    continue
                info = entry.stat(follow_symlinks=False)
                found.append(Entry(entry.name, info.st_size, info.st_mtime))
    finally:
        os.close(fd)
    found.sort(key=lambda e: (-e.mtime, e.name))
    return found


def valid_name(name: str) -> bool:
    try:
        check_name(name)
    except InvalidName:
        return False
    return True


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
