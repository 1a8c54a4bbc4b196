"""The long-term memory service (docs/memory.md): what a request carries, when a scope folds,
and where a compaction's durable facts go.

    compaction   -> record()      facts of the same summarizer call, dated, appended to the
                                  scope's notes of the day (as the request may write)
    every request -> message()    the version pinned for (session, epoch), as a system message;
                                  and, when a fold may be due, _fold() in the background with
                                  this request's route and credentials

*Epoch*: the chain of the summary in use ("" before the first compaction). A session pins the
scope's current version the first time it is seen in an epoch (:meth:`MemoryStore.pin`, first
writer wins across replicas), so its forwarded prefix does not change until its next
compaction, when the summary changes the prefix anyway.

*Fold*: at most one per ``fold_interval_hours`` per scope and only when facts came in since the
last (:meth:`MemoryStore.claim_fold` checks both and takes the scope's lease in one
transaction). A failed call or an unusable answer writes nothing and keeps the lease until it
runs out, which spaces retries. Requests never wait for a fold. Its call is reported to
``calls`` (the ledger) for the request that started the fold.

A request whose key the provider has not accepted yet (writes held) gets no memory and starts
no fold: such a tenant has none, and nothing may be written for it before the provider judges.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, date, datetime
from typing import Final

from proxy.background import Background
from proxy.compaction.client import Complete, SummarizerClient
from proxy.compaction.facts import stamp_facts
from proxy.config.memory import MemoryConfig
from proxy.lru import LRU
from proxy.memory.fold import cap, clean_fold, fold_prompt
from proxy.memory.inject import memory_message
from proxy.model import Message, RequestView
from proxy.store.interfaces import MemoryStore
from proxy.store.memory import FoldClaim, MemoryVersion, ScopeRow
from proxy.upstream.calls import CallSink
from proxy.writes import Mode, Writes

__all__ = ["Memory", "NoMemoryStore", "NullMemory"]

log = logging.getLogger("proxy.memory")

# After a scope was found not due, how long this process waits before asking the store again
# (facts recorded here make it ask at once; another replica's are seen this late).
RECHECK_S: Final = 300.0

ScopeKey = tuple[str, str]  # tenant, scope


class Memory:
    enabled = True

    def __init__(
        self,
        config: MemoryConfig,
        store: MemoryStore,
        client: SummarizerClient,
        background: Background,
        *,
        read_tool: str | None,
        calls: CallSink | None = None,
    ) -> None:
        self.config = config
        self.calls = calls  # told of each fold call (the ledger), for the request that folds
        self.store = store
        self.client = client
        self.background = background
        self.read_tool = read_tool
        self._pins: LRU[tuple[str, str, str, str], int] = LRU(65536)
        self._texts: LRU[tuple[str, str, int], str] = LRU(
            1024, lambda _, text: len(text) + 64
        )
        self._next_check: LRU[ScopeKey, float] = LRU(65536)
        self._folding: set[ScopeKey] = set()
        self.facts_recorded = 0  # blocks of facts appended to daily notes
        self.fold_calls = 0  # summarizer calls made to fold
        self.folds = 0  # new versions stored
        self.fold_failures = 0

    # -- writing: the facts of a compaction ----------------------------------------------------

    async def record(self, tenant: str, scope: str, session: str, facts: str,
                     writes: Writes | None) -> None:
        """Append ``facts`` (dated, with their session) to the scope's notes of today."""
        if writes is not None and not writes.allowed:
            return  # over quota, or a rejected key: nothing is written
        now = datetime.now(UTC)
        block = stamp_facts(facts, now, session)

        def job() -> int:
            return self.store.append(tenant, scope, now.date(), block, now=now)

        def done() -> None:
            self.facts_recorded += 1
            self._next_check.pop((tenant, scope))  # a fold may be due now

        if writes is None:
            await asyncio.to_thread(job)
            done()
        else:
            await writes.write(job, done)

    # -- use: the version a request carries ---------------------------------------------------

    async def message(self, request: RequestView, epoch: str) -> Message | None:
        """The memory message this request carries (None: no memory), and a fold started in
        the background when one may be due."""
        writes = request.writes
        if writes is not None and writes.mode is Mode.HELD:
            return None
        ident = request.identity
        key = (ident.tenant, ident.memory_scope, ident.session, epoch)
        version = self._pins.get(key)
        if version is None:
            version = await asyncio.to_thread(self.store.pin, *key)
            self._pins.put(key, version)
        # After pinning: a fold this request starts is for the sessions (and epochs) to come.
        self._maybe_fold(request)
        if version == 0:
            return None
        text = await self._text(ident.tenant, ident.memory_scope, version)
        if text is None:
            return None
        return memory_message(cap(text, self.config.max_bytes), tool_name=self.read_tool)

    async def _text(self, tenant: str, scope: str, version: int) -> str | None:
        key = (tenant, scope, version)
        text = self._texts.get(key)
        if text is None:
            found = await asyncio.to_thread(self.store.version, tenant, scope, version)
            if found is None:
                return None  # expired
            text = found.text
            self._texts.put(key, text)
        return text

    # -- folding --------------------------------------------------------------------------

    def _maybe_fold(self, request: RequestView) -> None:
        writes = request.writes
        if writes is not None and writes.mode is not Mode.NOW:
            return
        ident = request.identity
        key = (ident.tenant, ident.memory_scope)
        if key in self._folding or (self._next_check.get(key) or 0.0) > time.monotonic():
            return
        self._folding.add(key)
        calls = self.calls
        on_call = (None if calls is None
                   else lambda call: calls.record_call(ident, call))
        # The request's own format: its upstream and its credentials (never another provider's).
        complete = self.client.completer(request.model, request.headers, api=request.api,
                                         on_call=on_call)
        self.background.spawn(self._fold(key, complete, writes))

    async def _fold(self, key: ScopeKey, complete: Complete, writes: Writes | None) -> None:
        tenant, scope = key
        config = self.config
        recheck = RECHECK_S
        try:
            claim = await asyncio.to_thread(
                self.store.claim_fold, tenant, scope,
                min_interval_s=config.fold_interval_hours * 3600, lease_s=config.fold_lease_s,
            )
            if claim is None:
                return
            recheck = config.fold_lease_s  # until the lease runs out, claiming again is futile
            stored = await self._fold_claimed(claim, complete)
            if stored is not None:
                self.folds += 1
                if writes is not None:
                    writes.count(len(stored.text.encode("utf-8")))
                log.info("memory of %s/%s folded into version %d", tenant, scope,
                         stored.version)
        except Exception:
            self.fold_failures += 1
            log.exception("memory fold of %s/%s failed; nothing written", tenant, scope)
        finally:
            self._next_check.put(key, time.monotonic() + recheck)
            self._folding.discard(key)

    async def _fold_claimed(self, claim: FoldClaim, complete: Complete) -> MemoryVersion | None:
        tenant, scope = claim.tenant, claim.scope
        since = claim.since.date() if claim.since is not None else None

        def inputs() -> tuple[str | None, list[tuple[str, str]]]:
            current = self.store.version(tenant, scope, claim.version) if claim.version else None
            notes = []
            for day in self.store.days(tenant, scope):
                if since is None or date.fromisoformat(day) >= since:
                    text = self.store.read_day(tenant, scope, day)
                    if text:
                        notes.append((day, text))
            return (current.text if current is not None else None), notes

        current, notes = await asyncio.to_thread(inputs)
        if not notes:
            return None
        prompt = fold_prompt(current, notes, max_bytes=self.config.max_bytes,
                             input_chars=self.config.fold_input_chars)
        self.fold_calls += 1
        try:
            answer = await complete(prompt)
        except Exception as exc:
            self.fold_failures += 1
            log.warning("memory fold of %s/%s: summarizer failed (%s); nothing written",
                        tenant, scope, exc)
            return None
        text = clean_fold(answer, self.config.max_bytes) if isinstance(answer, str) else None
        if text is None:
            self.fold_failures += 1
            log.warning("memory fold of %s/%s: the answer holds no facts; nothing written",
                        tenant, scope)
            return None
        return await asyncio.to_thread(self.store.finish_fold, claim, text)

    def forget(self) -> None:
        """Drop the in-memory shortcuts (versions and pins may have expired)."""
        self._pins.clear()
        self._texts.clear()


class NoMemoryStore:
    """Memory off, or no database: nothing to show or read."""

    def append(self, tenant: str, scope: str, day: date, text: str, *,
               now: datetime | None = None) -> int:
        return 0

    def days(self, tenant: str, scope: str) -> list[str]:
        return []

    def read_day(self, tenant: str, scope: str, day: str) -> str | None:
        return None

    def version(self, tenant: str, scope: str, number: int) -> MemoryVersion | None:
        return None

    def versions(self, tenant: str, scope: str) -> list[MemoryVersion]:
        return []

    def scopes(self, tenant: str | None = None) -> list[ScopeRow]:
        return []

    def pin(self, tenant: str, scope: str, session: str, epoch: str, *,
            now: datetime | None = None) -> int:
        return 0

    def claim_fold(self, tenant: str, scope: str, *, now: datetime | None = None,
                   min_interval_s: float, lease_s: float) -> FoldClaim | None:
        return None

    def finish_fold(self, claim: FoldClaim, text: str, *,
                    now: datetime | None = None) -> MemoryVersion | None:
        return None


class NullMemory:
    """Memory off: no message, no facts, no folds."""

    enabled = False
    facts_recorded = fold_calls = folds = fold_failures = 0

    def __init__(self, store: MemoryStore | None = None) -> None:
        # /files still shows what an earlier run with memory on kept, when there is a store.
        self.store: MemoryStore = store if store is not None else NoMemoryStore()

    async def message(self, request: RequestView, epoch: str) -> Message | None:
        return None

    def forget(self) -> None:
        return None
