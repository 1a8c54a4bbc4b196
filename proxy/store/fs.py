"""The one way files under ``data_dir`` are opened, read, written and listed.

Every path below ``data_dir`` is walked one component at a time from a descriptor of
``data_dir`` (``openat`` with ``O_NOFOLLOW``, ``mkdirat``, ``renameat``, ``unlinkat``), so a symlink
planted anywhere below it -- as a file, a session directory or a sub-directory -- is refused by the
kernel, never by an ``is_symlink()`` check that a rename could race. Each component is also a
validated name (:func:`proxy.store.paths.check_name`), so ``..``, separators and NUL never reach
the filesystem. ``data_dir`` itself is the operator's choice and may be a symlink.

Callers name a file as ``(root, parts)``: ``root`` is ``data_dir``, ``parts`` the components below
it, e.g. ``(tenant, session, "tool_result", "<id>.txt")``. Functions that write are blocking (and
may fsync): call them from a worker thread when on the event loop.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from proxy.errors import Hidden as Hidden
from proxy.store.paths import InvalidName, check_name

__all__ = [
    "Entry",
    "Hidden",
    "append_fd",
    "list_files",
    "iter_chunks",
    "lstat",
    "move",
    "open_dir",
    "remove_tree",
    "open_file",
    "read_bytes",
    "subdirs",
    "unlink",
    "valid_name",
    "walk_files",
    "write_atomic",
]

_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted in the tree must not hang the worker thread in open().
_FILE_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_APPEND_FLAGS: Final = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK: Final = 1 << 16
_TMP_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def valid_name(name: str) -> bool:
    try:
        check_name(name)
    except InvalidName:
        return False
    return True


def _open_at(parent: int, name: str, flags: int, mode: int = 0o644) -> int:
    try:
        check_name(name)
        return os.open(name, flags, mode, dir_fd=parent)
    except InvalidName:
        raise Hidden(name) from None
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise Hidden(name, absent=True) from None
        # ELOOP: a symlink (O_NOFOLLOW); ENOTDIR: a file where a directory should be.
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EACCES, errno.ENXIO):
            raise Hidden(name) from None
        raise


def _fsync_fd(fd: int) -> None:
    # Best effort: some filesystems refuse to fsync a directory.
    with contextlib.suppress(OSError):
        os.fsync(fd)


def open_dir(
    root: Path, parts: Sequence[str], *, create: bool = False, durable: bool = False
) -> int:
    """A descriptor of the directory ``root/parts...``; the caller closes it.

    ``create`` makes missing directories (``mkdirat``); with ``durable`` each new entry is
    fsynced into its parent, so a power cut cannot lose a fresh session's directory together
    with the files renamed into it.
    """
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        if not create:
            raise Hidden(str(root), absent=True) from None
        Path(root).mkdir(parents=True, exist_ok=True)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        raise Hidden(str(root)) from None
    try:
        for part in parts:
            try:
                child = _open_at(fd, part, _DIR_FLAGS)
            except Hidden as exc:
                if not (create and exc.absent):
                    raise
                with contextlib.suppress(FileExistsError):  # a concurrent request made it
                    os.mkdir(part, 0o755, dir_fd=fd)
                    if durable:
                        _fsync_fd(fd)
                child = _open_at(fd, part, _DIR_FLAGS)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(root: Path, parts: Sequence[str]) -> tuple[int, os.stat_result]:
    """A descriptor of the regular file ``root/parts...`` and its stat; the caller closes it.

    Raises :class:`Hidden` for anything else.
    """
    if not parts:
        raise Hidden("")
    parent = open_dir(root, parts[:-1])
    try:
        fd = _open_at(parent, parts[-1], _FILE_FLAGS)
    finally:
        os.close(parent)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise Hidden(parts[-1])
    return fd, info


def read_bytes(root: Path, parts: Sequence[str]) -> bytes:
    """The regular file ``root/parts...`` as it was when opened (an archive may grow
    meanwhile); :class:`Hidden` for anything else."""
    fd, info = open_file(root, parts)
    return b"".join(iter_chunks(fd, info.st_size))


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



def lstat(root: Path, parts: Sequence[str]) -> os.stat_result | None:
    """The entry's own stat (a symlink is reported as one, never followed); None if absent."""
    try:
        parent = open_dir(root, parts[:-1])
    except Hidden:
        return None
    try:
        check_name(parts[-1])
        return os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
    except (FileNotFoundError, InvalidName, NotADirectoryError):
        return None
    finally:
        os.close(parent)


def write_atomic(root: Path, parts: Sequence[str], data: bytes, *, fsync: bool = True) -> int:
    """Write ``data`` as ``root/parts...`` so readers see either no file, the old file or the
    whole new one; returns the bytes written.

    The temp file lives in the same directory (``renameat`` is only atomic within one
    filesystem) under a ``.`` name no listing or URL can reach; the rename replaces whatever
    entry has the name, a symlink included, without following it. With ``fsync`` the data is on
    disk before the rename and the directory entry after it.
    """
    parent = open_dir(root, parts[:-1], create=True, durable=fsync)
    name = check_name(parts[-1])
    tmp = f".{name}.{secrets.token_hex(6)}.tmp"
    try:
        fd = os.open(tmp, _TMP_FLAGS, 0o644, dir_fd=parent)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=parent)
            raise
        if fsync:
            _fsync_fd(parent)
    finally:
        os.close(parent)
    return len(data)


def move(
    src_root: Path, src: Sequence[str], dst_root: Path, dst: Sequence[str], *, fsync: bool = True
) -> None:
    """Rename ``src_root/src...`` to ``dst_root/dst...`` (replacing what has that name), both
    walked without following symlinks; the two roots must be on one filesystem. With ``fsync``
    the new entry is made durable."""
    sparent = open_dir(src_root, src[:-1])
    try:
        dparent = open_dir(dst_root, dst[:-1], create=True, durable=fsync)
        try:
            os.replace(check_name(src[-1]), check_name(dst[-1]),
                       src_dir_fd=sparent, dst_dir_fd=dparent)
            if fsync:
                _fsync_fd(dparent)
        finally:
            os.close(dparent)
    finally:
        os.close(sparent)


def remove_tree(root: Path, parts: Sequence[str]) -> None:
    """Delete a directory and the regular files in it (one level; symlinks removed, never
    followed); missing is fine."""
    try:
        fd = open_dir(root, parts)
    except Hidden:
        return
    try:
        for name in os.listdir(fd):
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)
    parent = open_dir(root, parts[:-1]) if parts else None
    if parent is None:
        return
    try:
        with contextlib.suppress(OSError):
            os.rmdir(parts[-1], dir_fd=parent)
    finally:
        os.close(parent)


def append_fd(root: Path, parts: Sequence[str]) -> int:
    """A descriptor of ``root/parts...`` opened for appending (created if missing, never through
    a symlink); the caller closes it."""
    parent = open_dir(root, parts[:-1], create=True)
    try:
        return _open_at(parent, parts[-1], _APPEND_FLAGS)
    finally:
        os.close(parent)


def unlink(root: Path, parts: Sequence[str]) -> bool:
    """Remove the entry (a symlink itself, never its target); False when it was not there."""
    try:
        parent = open_dir(root, parts[:-1])
    except Hidden:
        return False
    try:
        os.unlink(check_name(parts[-1]), dir_fd=parent)
        return True
    except (FileNotFoundError, InvalidName):
        return False
    finally:
        os.close(parent)


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    size: int
    mtime: float


def list_files(root: Path, parts: Sequence[str], suffix: str = "") -> list[Entry]:
    """Regular files named ``<valid name><suffix>`` in a directory (symlinks skipped), newest
    first; a missing directory is simply empty."""
    try:
        fd = open_dir(root, parts)
    except Hidden:
        return []
    found = []
    try:
        with os.scandir(fd) as entries:
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


def subdirs(root: Path, parts: Sequence[str] = ()) -> list[str]:
    """Names of the real sub-directories (no symlinks, no ``.``/``_`` names) of a directory."""
    try:
        fd = open_dir(root, parts)
    except Hidden:
        return []
    try:
        with os.scandir(fd) as entries:
            return sorted(
                e.name for e in entries
                if e.is_dir(follow_symlinks=False) and valid_name(e.name)
            )
    finally:
        os.close(fd)


def walk_files(root: Path, parts: Sequence[str] = ()) -> Iterator[tuple[tuple[str, ...], Entry]]:
    """Every regular file below ``root/parts`` (symlinks skipped, never followed), with the
    components of its directory relative to ``root``. Temp files (``.`` names) are included:
    they take disk space too."""
    try:
        fd = open_dir(root, parts)
    except Hidden:
        return
    here = tuple(parts)
    files: list[Entry] = []
    dirs: list[str] = []
    try:
        # DirEntry.stat() resolves names against `fd`: everything is read before it closes.
        with os.scandir(fd) as it:
            for e in it:
                try:
                    if e.is_dir(follow_symlinks=False):
                        if valid_name(e.name):
                            dirs.append(e.name)
                    elif e.is_file(follow_symlinks=False):
                        info = e.stat(follow_symlinks=False)
                        files.append(Entry(e.name, info.st_size, info.st_mtime))
                except OSError:
                    continue  # removed while walking
    finally:
        os.close(fd)
    for entry in files:
        yield here, entry
    for name in dirs:
        yield from walk_files(root, (*here, name))
