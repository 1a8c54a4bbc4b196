"""On-disk layout under ``data_dir`` (docs/sessions.md#on-disk) and the helpers that keep it safe.

Layout::

    data_dir/
        _index.sqlite3                      the one database (+ -wal / -shm); see proxy.store.db
        _staging/<token>/<id>.txt           originals waiting for the provider to accept a key
        <tenant>/<session>/
            tool_result/<id>.txt            offloaded tool output
            dialog/YYYY-MM-DD.jsonl         dialog archive (proxy.store.dialog)
            summaries/<created>-<chain12>.md  human-readable copies of the summary cache
        <tenant>/memory/<scope>/            long-term memory of one scope (proxy.store.memory)
            MEMORY.md                       the current folded memory
            memory/YYYY-MM-DD.md            durable facts recorded that day
            versions/MEMORY-vNNNN.md        earlier MEMORY.md versions

``memory`` is a reserved session name (:mod:`proxy.session` hashes a client's session called
so), so the memory directory never collides with a session's.

Tenant and session names reach this module already sanitised by :mod:`proxy.session`, but every
path is built here, so this is the one place that re-checks them: a name that slipped through
unsanitised would otherwise become a path traversal. The check raises :class:`InvalidName`
(a ``ValueError``) rather than using ``assert``, which ``python -O`` would strip.

The database file name starts with ``_``, which a valid tenant name cannot, so a tenant
directory can never collide with it.
"""

from __future__ import annotations

import re
from datetime import date
from pathlib import Path
from typing import Final

from proxy.errors import InvalidName as InvalidName

__all__ = [
    "DB_FILENAME",
    "DIALOG_DIR",
    "STAGING_DIR",
    "SUMMARIES_DIR",
    "MEMORY_DAYS_DIR",
    "MEMORY_DIR",
    "MEMORY_FILE",
    "MEMORY_VERSIONS_DIR",
    "TOOL_RESULT_DIR",
    "InvalidName",
    "check_name",
    "db_path",
    "dialog_dir",
    "dialog_file",
    "dialog_filename",
    "dialog_parts",
    "memory_day_parts",
    "memory_parts",
    "memory_version_name",
    "session_dir",
    "summaries_dir",
    "tenant_dir",
    "tool_result_dir",
    "tool_result_file",
    "tool_result_parts",
]

DB_FILENAME: Final = "_index.sqlite3"
STAGING_DIR: Final = "_staging"  # originals of keys the provider has not accepted yet
DIALOG_DIR: Final = "dialog"
SUMMARIES_DIR: Final = "summaries"
TOOL_RESULT_DIR: Final = "tool_result"
MEMORY_DIR: Final = "memory"  # below a tenant: one directory per memory scope
MEMORY_FILE: Final = "MEMORY.md"
MEMORY_DAYS_DIR: Final = "memory"  # below a scope: the daily notes
MEMORY_VERSIONS_DIR: Final = "versions"

# Same alphabet and bound as proxy.session.safe_name: a leading alphanumeric excludes "." and
# "..", hidden files and option-looking names; ".." anywhere is refused too, as safe_name does.
_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_DIALOG_FILE: Final = re.compile(r"\d{4}-\d{2}-\d{2}\.jsonl")
_DAY: Final = re.compile(r"\d{4}-\d{2}-\d{2}")


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
    return Path(data_dir).joinpath(*tool_result_parts(tenant, session, result_id))


def tool_result_parts(tenant: str, session: str, result_id: str) -> tuple[str, str, str, str]:
    """The components of an offloaded file below ``data_dir`` (see :mod:`proxy.store.fs`)."""
    return (check_name(tenant, "tenant"), check_name(session, "session"), TOOL_RESULT_DIR,
            check_name(result_id, "id") + ".txt")


def dialog_parts(tenant: str, session: str, day: date | str) -> tuple[str, str, str, str]:
    """The components of one day's archive file below ``data_dir``."""
    return (check_name(tenant, "tenant"), check_name(session, "session"), DIALOG_DIR,
            dialog_file(Path(), tenant, session, day).name)


def memory_parts(tenant: str, scope: str, *rest: str) -> tuple[str, ...]:
    """The components of a memory scope's directory (and ``rest`` below it) under
    ``data_dir``."""
    return (check_name(tenant, "tenant"), MEMORY_DIR, check_name(scope, "memory scope"),
            *(check_name(p) for p in rest))


def memory_day_parts(tenant: str, scope: str, day: date | str) -> tuple[str, ...]:
    """One day's notes of a scope; ``day`` a date or ``YYYY-MM-DD`` (``.md`` optional)."""
    name = day.isoformat() if isinstance(day, date) else day.removesuffix(".md")
    if not _DAY.fullmatch(name):
        raise InvalidName(f"invalid memory day: {day!r}")
    return memory_parts(tenant, scope, MEMORY_DAYS_DIR, f"{name}.md")


def memory_version_name(version: int) -> str:
    return f"MEMORY-v{version:04d}.md"
