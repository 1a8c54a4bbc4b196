"""On-disk layout under ``data_dir`` (SPEC section 3) and the helpers that keep it safe.

Layout::

    data_dir/
        _index.sqlite3                      the one database (+ -wal / -shm); see proxy.store.db
        <tenant>/<session>/
            tool_result/<id>.txt            offloaded tool output
            dialog/YYYY-MM-DD.jsonl         dialog archive (proxy.store.dialog)
            summaries/<created>-<chain12>.md  human-readable copies of the summary cache

Tenant and session names reach this module already sanitised by :mod:`proxy.session`, but every
path is built here, so this is the one place that re-checks them: a name that slipped through
unsanitised would otherwise become a path traversal. The check raises :class:`InvalidName`
(a ``ValueError``) rather than using ``assert``, which ``python -O`` would strip.

The database file name starts with ``_``, which a valid tenant name cannot, so a tenant
directory can never collide with it.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from datetime import date
from pathlib import Path
from typing import Final

__all__ = [
    "DB_FILENAME",
    "DIALOG_DIR",
    "SUMMARIES_DIR",
    "TOOL_RESULT_DIR",
    "InvalidName",
    "atomic_write",
    "check_name",
    "db_path",
    "dialog_dir",
    "dialog_file",
    "dialog_filename",
    "safe_relative",
    "session_dir",
    "summaries_dir",
    "tenant_dir",
    "tool_result_dir",
    "tool_result_file",
]

DB_FILENAME: Final = "_index.sqlite3"
DIALOG_DIR: Final = "dialog"
SUMMARIES_DIR: Final = "summaries"
TOOL_RESULT_DIR: Final = "tool_result"

# Same alphabet and bound as proxy.session.safe_name: a leading alphanumeric excludes "." and
# "..", hidden files and option-looking names; ".." anywhere is refused too, as safe_name does.
_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_DIALOG_FILE: Final = re.compile(r"\d{4}-\d{2}-\d{2}\.jsonl")


class InvalidName(ValueError):
    """A tenant, session, id or path component that is not a safe single path component."""


def check_name(name: str, kind: str = "name") -> str:
    """Return ``name`` if it is one safe path component, else raise :class:`InvalidName`."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise InvalidName(f"invalid {kind}: {name!r}")
    return name


def db_path(data_dir: Path) -> Path:
    return Path(data_dir) / DB_FILENAME


def tenant_dir(data_dir: Path, tenant: str) -> Path:
    return Path(data_dir) / check_name(tenant, "tenant")


def session_dir(data_dir: Path, tenant: str, session: str) -> Path:
    return tenant_dir(data_dir, tenant) / check_name(session, "session")


def dialog_dir(data_dir: Path, tenant: str, session: str) -> Path:
    return session_dir(data_dir, tenant, session) / DIALOG_DIR


def dialog_filename(day: date) -> str:
    """``YYYY-MM-DD.jsonl`` for a (UTC) calendar day."""
    return f"{day.isoformat()}.jsonl"


def dialog_file(data_dir: Path, tenant: str, session: str, day: date | str) -> Path:
    """The archive file of one day; ``day`` may also be a file name such as ``2026-12-02.jsonl``
    (optionally prefixed ``dialog/``), which must look exactly like one."""
    if isinstance(day, date):
        name = dialog_filename(day)
    else:
        name = day.removeprefix(DIALOG_DIR + "/")
        if not _DIALOG_FILE.fullmatch(name):
            raise InvalidName(f"invalid dialog file: {day!r}")
    return dialog_dir(data_dir, tenant, session) / name


def summaries_dir(data_dir: Path, tenant: str, session: str) -> Path:
    return session_dir(data_dir, tenant, session) / SUMMARIES_DIR


def tool_result_dir(data_dir: Path, tenant: str, session: str) -> Path:
    return session_dir(data_dir, tenant, session) / TOOL_RESULT_DIR


def tool_result_file(data_dir: Path, tenant: str, session: str, result_id: str) -> Path:
    return tool_result_dir(data_dir, tenant, session) / (check_name(result_id, "id") + ".txt")


def safe_relative(base: Path, relative: str) -> Path:
    """Join a ``/``-separated relative path (from the index or a URL) onto ``base``.

    Every component must be a safe name, and the resolved result must stay inside the resolved
    ``base``: the component check stops ``..`` and absolute paths, the resolve check stops a
    symlink planted inside the tree from pointing outside it.
    """
    if not relative or relative.startswith("/") or "\\" in relative or "\x00" in relative:
        raise InvalidName(f"invalid relative path: {relative!r}")
    parts = relative.split("/")
    for part in parts:
        check_name(part, "path component")
    candidate = Path(base).joinpath(*parts)
    root = Path(base).resolve()
    resolved = candidate.resolve()
    if resolved != root and root not in resolved.parents:
        raise InvalidName(f"path escapes its directory: {relative!r}")
    return candidate


def atomic_write(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` so readers see either the old file or the whole new one.

    The temp file lives in the same directory (``os.replace`` is only atomic within one
    filesystem) and starts with ``.`` so no listing of valid names ever shows it. With ``fsync``
    the data is on disk before the rename and the directory entry after it, so a crash cannot
    leave an empty file under the final name.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    # Best effort: some filesystems (and all of Windows) refuse to open a directory for fsync.
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
