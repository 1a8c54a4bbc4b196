"""Disk used per tenant under ``data_dir``, for the quota (``storage.max_tenant_mb``).

The periodic gc measures every tenant's files (:meth:`DiskUsage.measure`, a walk of the tree in
a worker thread); between two walks every write adds what it wrote, so a tenant cannot write
gigabytes in the hour between them. Until the first walk is done nobody is over quota.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from proxy.store import fs

__all__ = ["DiskUsage"]

_MB = 1024 * 1024


class DiskUsage:
    """Bytes per tenant; thread-safe (writes happen in worker threads)."""

    def __init__(self, data_dir: Path, sizes: Callable[[], dict[str, int]] | None = None) -> None:
        self.data_dir = Path(data_dir)
        # How the figures are taken: a walk of data_dir, or the backend's own (a query).
        self._sizes = sizes or self._walk
        self._bytes: dict[str, int] = {}
        self._during: dict[str, int] | None = None  # writes counted while a walk runs
        self._lock = threading.Lock()

    def measure(self) -> dict[str, int]:
        """Walk ``data_dir`` and replace the figures (blocking: call it in a worker thread).
        What was written during the walk is added on top: the walk may have missed it, and
        counting a file twice until the next walk errs on the quota's side."""
        with self._lock:
            self._during = {}
        sizes: dict[str, int] = {}
        try:
            sizes = self._sizes()
        finally:
            with self._lock:
                for tenant, nbytes in (self._during or {}).items():
                    sizes[tenant] = sizes.get(tenant, 0) + nbytes
                self._during = None
                self._bytes = sizes
        return dict(sizes)

    def _walk(self) -> dict[str, int]:
        return {tenant: sum(e.size for _, e in fs.walk_files(self.data_dir, (tenant,)))
                for tenant in fs.subdirs(self.data_dir)}

    def add(self, tenant: str, nbytes: int) -> None:
        if nbytes:
            with self._lock:
                self._bytes[tenant] = self._bytes.get(tenant, 0) + nbytes
                if self._during is not None:
                    self._during[tenant] = self._during.get(tenant, 0) + nbytes

    def used(self, tenant: str) -> int:
        with self._lock:
            return self._bytes.get(tenant, 0)

    def over(self, tenant: str, limit_mb: float | None) -> bool:
        return limit_mb is not None and self.used(tenant) >= limit_mb * _MB
