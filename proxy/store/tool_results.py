"""Offloaded tool outputs: `data_dir/<tenant>/<session>/tool_result/<id>.txt`, written once.

Durability: each original is written to a temp file in the same directory (a ``.``-name no
listing or URL can reach), fsynced, renamed over the final name, and the directory is fsynced
after the rename (POSIX), so neither a kill nor a power cut can leave a partial file under a
final name: readers see no file or the whole one. A directory created for the first file of a
session is fsynced into its parent too. A file found under its final name with the wrong size
(e.g. restored from a backup or damaged outside the proxy) is rewritten from the resent original
instead of being trusted: the id is a digest of the content, so the size alone tells.
A crash can leave a stray ``.<id>.txt.<hex>.tmp``; it is never served and gc removes it with
the expired files.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import stat
import time
from pathlib import Path

from proxy.errors import OffloadedFileMissing as OffloadedFileMissing
from proxy.store import fs
from proxy.store.paths import (
    MEMORY_DIR,
    STAGING_DIR,
    TOOL_RESULT_DIR,
    check_name,
    tool_result_dir,
    tool_result_file,
    tool_result_parts,
)

log = logging.getLogger("proxy.store")

_SIZE_CACHE = 65536  # ids whose (non-ASCII) UTF-8 size is remembered
_RID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def result_id(tenant: str, session: str, content: str) -> str:
    """A uuid-shaped digest of tenant, session and content: same output, same file, same text."""
    h = hashlib.sha256()
    h.update(tenant.encode())
    h.update(b"\0")
    h.update(session.encode())
    h.update(b"\0")
    h.update(content.encode("utf-8", "surrogatepass"))
    d = h.hexdigest()
    return f"{d[:8]}-{d[8:12]}-{d[12:16]}-{d[16:20]}-{d[20:32]}"


def relative_path(rid: str) -> str:
    """How notices name the file: relative to the session, stable across machines."""
    return f"{TOOL_RESULT_DIR}/{check_name(rid, 'id')}.txt"


class ToolResultStore:
    """Writes each original once (temp file + rename) and deletes them after their TTL."""

    def __init__(self, data_dir: Path, ttl_days: float, *, fsync: bool = True) -> None:
        self.data_dir = Path(data_dir)
        self.ttl_s = ttl_days * 86400
        self.fsync = fsync
        self._sizes: dict[str, int] = {}
        self._dirs: dict[tuple[str, str], str] = {}

    def _utf8_size(self, rid: str, content: str) -> int:
        if content.isascii():
            return len(content)
        size = self._sizes.get(rid)
        if size is None:
            size = len(content.encode("utf-8", "surrogatepass"))
            if len(self._sizes) >= _SIZE_CACHE:
                self._sizes.clear()
            self._sizes[rid] = size
        return size

    def path(self, tenant: str, session: str, rid: str) -> Path:
        return tool_result_file(self.data_dir, tenant, session, rid)

    def _fast_path(self, tenant: str, session: str, rid: str) -> str:
        """:meth:`path` as a string, for the stat every resent cut costs: names validated once
        per session directory (building and checking a Path took ~35 us of a ~40 us check)."""
        directory = self._dirs.get((tenant, session))
        if directory is None:
            directory = os.fspath(tool_result_dir(self.data_dir, tenant, session))
            if len(self._dirs) >= _SIZE_CACHE:
                self._dirs.clear()
            self._dirs[(tenant, session)] = directory
        if not _RID.fullmatch(rid):
            check_name(rid, "id")
        return f"{directory}/{rid}.txt"

    def save(self, tenant: str, session: str, rid: str, content: str) -> bool:
        """Persist `content` unless that id exists already whole; True when written now."""
        if not self.needs_write(tenant, session, rid, content):
            return False
        self.write(tenant, session, rid, content)
        return True

    def needs_write(self, tenant: str, session: str, rid: str, content: str) -> bool:
        """False when the file exists whole: one stat, cheap enough for the event loop.

        A plain ``lstat`` of the path (3 us) rather than :func:`fs.lstat` (20 us, an ``openat``
        per component): it opens nothing, and a symlinked directory that fooled it only means
        the file is not rewritten; every read goes through :mod:`proxy.store.fs` and refuses it.
        """
        try:
            info = os.lstat(self._fast_path(tenant, session, rid))
        except (FileNotFoundError, NotADirectoryError):
            return True
        # Called for every offloaded message of every resent history: a stat, and the
        # UTF-8 size without encoding when the text is ASCII (or was measured before).
        size = self._utf8_size(rid, content)
        if stat.S_ISREG(info.st_mode) and info.st_size == size:
            return False
        # Damaged (short, empty) or replaced by something else: the rename in `write` replaces
        # the entry itself, a symlink is never followed.
        log.warning("%s is not the %d-byte original; rewriting it", relative_path(rid), size)
        return True

    def write(self, tenant: str, session: str, rid: str, content: str) -> int:
        """Write (or rewrite) the original atomically; fsynced, so it may block for ms.
        Returns the bytes written."""
        data = content.encode("utf-8", "surrogatepass")
        return fs.write_atomic(
            self.data_dir, tool_result_parts(tenant, session, rid), data, fsync=self.fsync
        )

    # -- staging: originals of a key the provider has not judged yet (proxy.writes) ----------

    @property
    def staging(self) -> Path:
        """Where staged originals wait: outside every tenant (no tenant name starts with _)."""
        return self.data_dir / STAGING_DIR

    def stage(self, rid: str, content: str) -> tuple[str, int]:
        """Write an original that no tenant owns yet, durably as :meth:`write` does; returns
        the staging token and the bytes written. :meth:`promote` moves it into place once the
        provider accepts the key, :meth:`discard` deletes it when it rejects it."""
        token = secrets.token_hex(8)
        data = content.encode("utf-8", "surrogatepass")
        written = fs.write_atomic(self.staging, (token, f"{rid}.txt"), data, fsync=self.fsync)
        return token, written

    def promote(self, tenant: str, session: str, rid: str, token: str) -> None:
        fs.move(self.staging, (token, f"{rid}.txt"), self.data_dir,
                tool_result_parts(tenant, session, rid), fsync=self.fsync)
        fs.remove_tree(self.staging, (token,))

    def discard(self, token: str) -> None:
        fs.remove_tree(self.staging, (token,))

    def read(self, tenant: str, session: str, rid: str) -> str:
        try:
            data = fs.read_bytes(self.data_dir, tool_result_parts(tenant, session, rid))
            return data.decode("utf-8", "surrogatepass")
        except fs.Hidden:
            days = self.ttl_s / 86400
            raise OffloadedFileMissing(
                f"{relative_path(rid)} is no longer available: offloaded files are kept "
                f"{days:g} days. The full original is still in this session's dialog archive "
                f"(dialog/*.jsonl)."
            ) from None

    def gc(self, now: float | None = None) -> int:
        """Delete tool_result files (and stray temp files) older than the TTL; returns how many
        were deleted."""
        cutoff = (time.time() if now is None else now) - self.ttl_s
        deleted = 0
        for tenant in fs.subdirs(self.data_dir):
            for session in fs.subdirs(self.data_dir, (tenant,)):
                if session == MEMORY_DIR:  # memory scopes, not a session (store.memory)
                    continue
                deleted += _delete_older(self.data_dir, (tenant, session, TOOL_RESULT_DIR), cutoff)
        # Staged originals whose request never settled (a crash): an hour is far beyond any
        # request's lifetime.
        for token in fs.subdirs(self.staging):
            if (info := fs.lstat(self.staging, (token,))) is not None and (
                info.st_mtime < (time.time() if now is None else now) - 3600
            ):
                fs.remove_tree(self.staging, (token,))
        if deleted:
            log.info("gc deleted %d expired tool_result files", deleted)
        return deleted


def _delete_older(root: Path, parts: tuple[str, ...], cutoff: float) -> int:
    """Delete the regular files of one directory last modified before ``cutoff``."""
    try:
        fd = fs.open_dir(root, parts)
    except fs.Hidden:
        return 0
    deleted = 0
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                try:
                    if entry.is_file(follow_symlinks=False) and (
                        entry.stat(follow_symlinks=False).st_mtime < cutoff
                    ):
                        os.unlink(entry.name, dir_fd=fd)
                        deleted += 1
                except OSError as exc:
                    log.warning("gc could not delete %s: %s", entry.name, exc)
    finally:
        os.close(fd)
    return deleted
