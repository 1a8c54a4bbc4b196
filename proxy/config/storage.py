"""``storage``: where data lives (files and SQLite under ``data_dir``, or PostgreSQL), quotas
and retention.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from proxy.config.section import _Section

__all__ = [
    "StorageConfig",
]


class StorageConfig(_Section):
    data_dir: Path = Field(
        Path("./ctxproxy-data"), description="Directory holding offloaded files and archives."
    )
    url: str | None = Field(
        None,
        description="Shared database for many replicas: a postgresql://user:pass@host/db URL "
        "(or os.environ/NAME). Then summaries, session counters, the dialog archive and "
        "offloaded originals all live in PostgreSQL and data_dir is not used for them; null: "
        "files and SQLite under data_dir (one process).",
    )
    pool_size: int = Field(
        10, ge=1, le=200, description="With url: most database connections of one replica."
    )
    statement_timeout_s: float = Field(
        5, gt=0, description="With url: longest wait for one database call (connection or "
        "query); past it the request goes on without the store (forwarded uncut, not archived).",
    )
    tool_result_ttl_days: float = Field(
        5, gt=0, description="Offloaded tool results older than this many days are deleted."
    )
    max_tenant_mb: float | None = Field(
        10240,
        gt=0,
        description="Disk quota per tenant in MiB (its files under data_dir: offloaded "
        "results, dialog archive, summaries); null: none. Over it, requests are still "
        "forwarded but nothing new is written for the tenant, and the answer carries "
        "x-ctxproxy-quota: exceeded. Measured by the periodic gc and counted as writes happen.",
    )
    dialog_ttl_days: float | None = Field(
        None,
        gt=0,
        description="Dialog archive files and summaries older than this many days are deleted "
        "(with their index rows) by the periodic gc and `ctxproxy gc`, and so are cost ledger "
        "entries (their sessions' totals recomputed); null: kept forever.",
    )

    @field_validator("url")
    @classmethod
    def _postgres_only(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("postgresql://", "postgres://")):
            raise ValueError("must be a postgresql:// URL (or null for files and SQLite)")
        return value
