"""Offloaded tool outputs: `data_dir/<tenant>/<session>/tool_result/<id>.txt`, written once."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

from .paths import TOOL_RESULT_DIR, atomic_write, check_name, tool_result_file

log = logging.getLogger("proxy.store")


class OffloadedFileMissing(LookupError):
    """The file is gone: expired (TTL) or never written. The message says what to do instead."""


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

    def __init__(self, data_dir: Path, ttl_days: float) -> None:
        self.data_dir = Path(data_dir)
        self.ttl_s = ttl_days * 86400

    def path(self, tenant: str, session: str, rid: str) -> Path:
        return tool_result_file(self.data_dir, tenant, session, rid)

    def save(self, tenant: str, session: str, rid: str, content: str) -> bool:
        """Persist `content` unless that id exists already; True when written now."""
        path = self.path(tenant, session, rid)
        if path.exists():
            return False
        atomic_write(path, content.encode("utf-8", "surrogatepass"), fsync=False)
        return True

    def read(self, tenant: str, session: str, rid: str) -> str:
        path = self.path(tenant, session, rid)
        try:
            if path.is_symlink():
                raise FileNotFoundError(path)
            return path.read_bytes().decode("utf-8", "surrogatepass")
        except FileNotFoundError:
            days = self.ttl_s / 86400
            raise OffloadedFileMissing(
                f"{relative_path(rid)} is no longer available: offloaded files are kept "
                f"{days:g} days. The full original is still in this session's dialog archive "
                f"(dialog/*.jsonl)."
            ) from None

    def gc(self, now: float | None = None) -> int:
        """Delete tool_result files older than the TTL; returns how many were deleted."""
        cutoff = (time.time() if now is None else now) - self.ttl_s
        deleted = 0
        if not self.data_dir.is_dir():
            return 0
        for tenant in _subdirs(self.data_dir):
            for session in _subdirs(tenant):
                folder = session / TOOL_RESULT_DIR
                if not folder.is_dir() or folder.is_symlink():
                    continue
                with os.scandir(folder) as entries:
                    for entry in entries:
                        try:
                            if entry.is_file(follow_symlinks=False) and (
                                entry.stat(follow_symlinks=False).st_mtime < cutoff
                            ):
                                os.unlink(entry.path)
                                deleted += 1
                        except OSError as exc:
                            log.warning("gc could not delete %s: %s", entry.path, exc)
        if deleted:
            log.info("gc deleted %d expired tool_result files", deleted)
        return deleted


def _subdirs(path: Path) -> list[Path]:
    try:
        with os.scandir(path) as entries:
            return [
                Path(e.path)
                for e in entries
                if e.is_dir(follow_symlinks=False) and not e.name.startswith((".", "_"))
            ]
    except OSError:
        return []
