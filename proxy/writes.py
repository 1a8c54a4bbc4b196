"""What a request may write for its tenant, and when.

See docs/security.md#open-proxies-the-provider-judges-the-key and docs/security.md#bounded-disk.

Every write a request causes -- archive lines, offloaded originals, a summary, the answer -- goes
through the request's :class:`Writes`, in one of three modes:

* ``now``: written as it happens (in a worker thread), as always.
* ``held``: the client's own key goes upstream and the provider has never accepted it, so the
  provider is the judge. Writes queue in memory until the upstream's status arrives: a
  rejection (401/403) drops them, so it leaves nothing on disk; any other answer starts them, in
  the background while the answer is relayed and done before its last byte (every write is
  idempotent, so a next request racing them is harmless). A success (or a summarizer answer
  obtained with the client's own key) makes the tenant known: from then on its writes happen at
  once, also after a restart (its directory exists). A request nobody judged keeps its writes
  when the upstream failed, and drops them when the client left first.
* ``off``: the tenant is over its disk quota. Nothing new is written; the request is still
  forwarded (results whose original is not saved yet go uncut) and the answer says so.

A write is a blocking function returning the bytes it wrote (counted into the tenant's usage)
plus an optional follow-up run on the event loop once it is done (in-memory bookkeeping that
must not run for a write that never happened).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from enum import Enum
from typing import Any

from proxy.background import Background
from proxy.metrics import Metrics
from proxy.store.usage import DiskUsage

__all__ = ["REJECTED", "Mode", "WritePolicy", "Writes"]

log = logging.getLogger("proxy.store")

Job = Callable[[], int]
After = Callable[[], None]

_QUOTA_LOG_EVERY_S = 60.0


class Mode(Enum):
    NOW = "now"
    HELD = "held"
    OFF = "off"


# Statuses by which the provider rejects the client's key.
REJECTED = frozenset({401, 403, 407})


class Writes:
    """One request's writes for one tenant."""

    def __init__(
        self,
        tenant: str,
        mode: Mode,
        usage: DiskUsage,
        on_accept: Callable[[str], None],
        spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]],
    ) -> None:
        self.tenant = tenant
        self.mode = mode
        self._usage = usage
        self._on_accept = on_accept
        self._spawn = spawn
        self._held: list[tuple[Job, After | None]] = []
        self._undo: list[Callable[[], None]] = []
        self._commit: asyncio.Task[Any] | None = None
        self.dropped = False

    @property
    def allowed(self) -> bool:
        """Whether anything may be written (now or once the key is accepted)."""
        return self.mode is not Mode.OFF and not self.dropped

    def _run(self, job: Job) -> int:
        written = job()
        self.count(written)
        return written

    def count(self, nbytes: int) -> None:
        """Bytes written for this tenant outside :meth:`write` (counted into its usage)."""
        self._usage.add(self.tenant, nbytes)

    async def write(
        self, job: Job, after: After | None = None, *, undo: Callable[[], None] | None = None
    ) -> bool:
        """Run ``job`` in a worker thread now, or hold it; False when it is not done (now or
        ever). ``undo`` (blocking) runs if a held job is dropped instead: it cleans up what was
        prepared for it. Raises what ``job`` raises in mode ``now``."""
        if self.mode is Mode.NOW:
            await asyncio.to_thread(self._run, job)
            if after is not None:
                after()
            return True
        if self.mode is Mode.HELD and not self.dropped:
            self._held.append((job, after))
            if undo is not None:
                self._undo.append(undo)
        elif undo is not None:
            await asyncio.to_thread(undo)
        return False

    def write_sync(self, job: Job) -> bool:
        """:meth:`write` for code already in a worker thread (no follow-up)."""
        if self.mode is Mode.NOW:
            self._run(job)
            return True
        if self.mode is Mode.HELD and not self.dropped:
            self._held.append((job, None))
        return False

    async def settle(self, status: int) -> None:
        """The upstream answered. A rejection (401/403/407) drops the held writes; any other
        status starts them, in the background while the answer is relayed (see
        :meth:`drain`), and a success makes the tenant known."""
        if self.mode is not Mode.HELD or self.dropped:
            return
        if status in REJECTED:
            self._drop()
        else:
            self._release(known=status < 500)

    def finish(self, *, disconnected: bool) -> None:
        """The request is over. Writes still held were never judged: a client that left
        takes its request with it (it still has it), while one the upstream failed to answer
        (unreachable, timed out) is kept, as every request the proxy received is."""
        if self.mode is Mode.HELD and not self.dropped:
            if disconnected:
                self._drop()
            else:
                self._release(known=False)

    def _drop(self) -> None:
        self._held.clear()
        self.dropped = True
        undo, self._undo = self._undo, []
        if undo:
            self._spawn(asyncio.to_thread(_run_all, undo))

    def _release(self, *, known: bool) -> None:
        held, self._held = self._held, []
        self._undo.clear()
        self.mode = Mode.NOW
        if known:
            self._on_accept(self.tenant)
        if held:
            self._commit = self._spawn(self._run_held(held))

    async def _run_held(self, held: list[tuple[Job, After | None]]) -> None:
        def run_all() -> list[bool]:
            done = []
            for job, _ in held:
                try:
                    self._run(job)
                    done.append(True)
                except Exception as exc:  # the request was forwarded already: log, go on
                    log.warning("a held write failed once the key was accepted: %s", exc)
                    done.append(False)
            return done

        for ok, (_, after) in zip(await asyncio.to_thread(run_all), held, strict=True):
            if ok and after is not None:
                after()

    async def drain(self) -> None:
        """Wait until the writes released by :meth:`settle` are done (before the read tool
        reads an offloaded file, or a summary points into the archive)."""
        if self._commit is not None:
            await asyncio.shield(self._commit)


def _run_all(jobs: list[Callable[[], None]]) -> None:
    for job in jobs:
        try:
            job()
        except Exception as exc:
            log.warning("cleaning up after a rejected key failed: %s", exc)


class WritePolicy:
    """Decides each request's :class:`Writes`: known keys, the disk quota."""

    def __init__(
        self,
        tenant_known: Callable[[str], bool],
        usage: DiskUsage,
        limit_mb: float | None,
        metrics: Metrics,
        background: Background,
    ) -> None:
        self._tenant_known = tenant_known  # has the store anything of this tenant?
        self.usage = usage
        self.limit_mb = limit_mb
        self.metrics = metrics
        self.background = background
        self._known: set[str] = set()
        self._lock = threading.Lock()
        self._logged: dict[str, float] = {}

    def _accept(self, tenant: str) -> None:
        with self._lock:
            self._known.add(tenant)

    def known(self, tenant: str) -> bool:
        """Whether the provider accepted this tenant's key before. A tenant with anything
        stored was accepted by an earlier process (nothing is written for one that never was):
        one stat (or query) per unknown tenant, then it is remembered."""
        with self._lock:
            if tenant in self._known:
                return True
        try:
            if not self._tenant_known(tenant):
                return False
        except OSError:  # the store is away: treat the key as new (its writes are held)
            return False
        self._accept(tenant)
        return True

    def for_request(
        self, tenant: str, *, provider_judges: bool, limit_mb: float | None = None
    ) -> Writes:
        """``provider_judges``: the client's own key goes upstream unverified by the proxy.
        ``limit_mb``: the caller's own quota (else ``storage.max_tenant_mb``)."""
        limit = limit_mb if limit_mb is not None else self.limit_mb
        if self.usage.over(tenant, limit):
            self._over_quota(tenant, limit)
            mode = Mode.OFF
        elif provider_judges and not self.known(tenant):
            mode = Mode.HELD
        else:
            mode = Mode.NOW
        return Writes(tenant, mode, self.usage, self._accept, self.background.spawn)

    def _over_quota(self, tenant: str, limit: float | None) -> None:
        self.metrics.quota_exceeded.inc()
        now = time.monotonic()
        if now - self._logged.get(tenant, -_QUOTA_LOG_EVERY_S) >= _QUOTA_LOG_EVERY_S:
            self._logged[tenant] = now
            log.warning(
                "tenant %s is over its disk quota (%.1f of %s MiB): forwarding without writing",
                tenant, self.usage.used(tenant) / (1024 * 1024), f"{limit:g}",
            )
