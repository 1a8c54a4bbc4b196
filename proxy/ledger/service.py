"""The ledger service: records every billed call of the requests this process serves.

    begin(identity, api, model)            at the request's arrival: its time and id
    finish(ticket, ...)                    after the response: the calls made for it, recorded
                                           in the background (never on the request's path)
    record_call(identity, call)            a summarizer or memory-fold call (a CallSink)

Recording a request compares it with the session's previous call (the entries themselves:
:mod:`proxy.ledger.record`). The previous call is kept in memory per session (with the
previous request's chains, which locate a client's edit); with a store other replicas share,
it is read from the store each time (one indexed query, in the background), since another
replica may have served the turn in between.

What is recorded: the provider's usage of every upstream call (the request's first call, each
read-tool round, each summarizer and fold call), its cost at the configured prices, and for a
request the counterfactual, the cache reason and what ctxproxy changed in it. A request whose
upstream answered with an error, or whose writes were dropped (a key the provider rejected, or
never judged), records nothing. A tenant over its disk quota is still recorded: the quota
limits files, and the ledger is the account of what its requests cost (a few hundred bytes a
call, not counted in the quota).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from proxy.background import Background
from proxy.catalog.prices import Prices
from proxy.config.ledger import LedgerConfig
from proxy.config.offload import OffloadConfig
from proxy.formats import Parsed
from proxy.ledger.record import Previous, Recorder, RequestCalls, Ticket
from proxy.lru import LRU
from proxy.metrics import Metrics
from proxy.model import PipelineResult
from proxy.session import Identity
from proxy.store.chains import DigestCacheLike
from proxy.store.interfaces import LedgerStore
from proxy.store.ledger_entry import LedgerEntry
from proxy.tokens.request import RequestCounter
from proxy.upstream.calls import Call
from proxy.writes import Writes

__all__ = ["Ledger", "NullLedger", "RequestCalls", "Ticket"]

log = logging.getLogger("proxy.store")

# How long the writer gathers entries before a commit.
_FLUSH_S: Final = 0.02

# What recording a request takes: ticket, parsed, chains, raw, result, calls.
_Args = tuple[Ticket, Parsed, Sequence[str], bytes, PipelineResult, RequestCalls]


class NullLedger:
    """The ledger is off (or has no store): nothing is recorded."""

    enabled = False

    def begin(self, identity: Identity, api: str, model: str) -> Ticket | None:
        return None

    def finish(self, ticket: Ticket | None, *,
               done: Callable[[Sequence[LedgerEntry]], None] | None = None, **_: Any) -> None:
        if done is not None:
            done(())

    def record_call(self, identity: Identity, call: Call) -> None:
        return None


class Ledger:
    enabled = True

    def __init__(
        self,
        config: LedgerConfig,
        offload: OffloadConfig,
        store: LedgerStore,
        prices: Prices,
        counter: RequestCounter,
        metrics: Metrics,
        background: Background,
        *,
        digest_cache: DigestCacheLike | None = None,
        read_tool: Mapping[str, Any] | None = None,
        shared: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.store = store
        self.prices = prices
        self.recorder = Recorder(config, offload, prices, counter, digest_cache=digest_cache,
                                 read_tool=read_tool)
        self.metrics = metrics
        self.background = background
        self.shared = shared
        self.clock = clock
        self._state: LRU[tuple[str, str], Previous] = LRU(16384)
        self._locks: LRU[tuple[str, str], asyncio.Lock] = LRU(16384)
        self._pending: list[tuple[list[LedgerEntry],
                                  Callable[[Sequence[LedgerEntry]], None] | None]] = []
        self._writer: asyncio.Task[None] | None = None
        self.recorded = 0  # entries kept (tests, metrics)

    # -- the route's side -------------------------------------------------------------------

    def begin(self, identity: Identity, api: str, model: str) -> Ticket | None:
        return Ticket(identity, api, model, self.clock(), uuid.uuid4().hex)

    def finish(
        self,
        ticket: Ticket | None,
        *,
        parsed: Parsed,
        chains: Sequence[str],
        raw: bytes,
        result: PipelineResult,
        calls: RequestCalls,
        writes: Writes,
        large: bool = False,
        done: Callable[[Sequence[LedgerEntry]], None] | None = None,
    ) -> None:
        """Record the request; ``done`` is told of its entries (the request's first, then its
        read rounds; none when nothing is recorded). ``large``: a body whose records (its
        chains, the change list) are worth a worker thread."""
        if ticket is None or writes.dropped or calls.status is None or not (
                200 <= calls.status < 300):
            if done is not None:
                done(())
            return
        args = (ticket, parsed, chains, raw, result, calls)
        state = self._state.get((ticket.identity.tenant, ticket.identity.session))
        if state is None or self.shared or large:
            self.background.spawn(self._record(args, large, done))
            return
        # The common case, done now (tens of microseconds): the session's previous call is in
        # memory and the request is small; only the write is queued.
        self._recorded(args, state, done)

    def record_call(self, identity: Identity, call: Call) -> None:
        """A summarizer or fold call (CallSink): recorded when the provider answered."""
        if not 200 <= call.status < 300:
            return
        self._queue([self.recorder.call(identity, call)], None)

    # -- recording --------------------------------------------------------------------------

    def _lock(self, key: tuple[str, str]) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = asyncio.Lock()
            self._locks.put(key, lock)
        return lock

    async def _record(self, args: _Args, large: bool,
                      done: Callable[[Sequence[LedgerEntry]], None] | None) -> None:
        """The previous call is to be read from the store (none in memory, or another replica
        may have served the session since), or the request is large: in a task, one per
        session at a time."""
        ident = args[0].identity
        try:
            async with self._lock((ident.tenant, ident.session)):
                state = await self._previous((ident.tenant, ident.session))
                if large:
                    entries, mf_chains = await asyncio.to_thread(
                        self.recorder.entries, *args, state
                    )
                else:
                    entries, mf_chains = self.recorder.entries(*args, state)
        except Exception:
            log.exception("recording the ledger failed; the request was served")
            if done is not None:
                done(())
            return
        self._keep_and_queue(ident, entries, mf_chains, done)

    def _recorded(self, args: _Args, state: Previous,
                  done: Callable[[Sequence[LedgerEntry]], None] | None) -> None:
        try:
            entries, mf_chains = self.recorder.entries(*args, state)
        except Exception:
            log.exception("recording the ledger failed; the request was served")
            if done is not None:
                done(())
            return
        self._keep_and_queue(args[0].identity, entries, mf_chains, done)

    def _keep_and_queue(self, ident: Identity, entries: list[LedgerEntry],
                        mf_chains: Sequence[str] | None,
                        done: Callable[[Sequence[LedgerEntry]], None] | None) -> None:
        """The session's new previous call (in memory, at once), and the entries' write."""
        self._state.put((ident.tenant, ident.session), Previous(entries[-1], entries[0], mf_chains))
        self._queue(entries, done)

    async def _previous(self, key: tuple[str, str]) -> Previous | None:
        """The session's previous call: this process's, or, with a store other replicas share
        (or none in memory), the store's when it is newer."""
        state = self._state.get(key)
        if state is not None and not self.shared:
            return state
        loaded = await asyncio.to_thread(self._load, *key)
        if loaded is None:
            return state
        if state is not None:
            if state.last.ts > loaded.last.ts:
                return state  # ours, still queued for the store
            if state.request is not None and loaded.request is not None and (
                    state.request.id == loaded.request.id):
                loaded.chains = state.chains  # still this replica's last request
        return loaded

    def _queue(self, entries: list[LedgerEntry],
               done: Callable[[Sequence[LedgerEntry]], None] | None) -> None:
        """Entries are written by one task at a time, everything queued in one transaction:
        under load a write per request would queue behind itself (a thread hop and a commit
        each, ~0.2 ms), a batch costs a fraction of that per entry."""
        self._pending.append((entries, done))
        if self._writer is None or self._writer.done():
            self._writer = self.background.spawn(self._write())

    async def _write(self) -> None:
        while self._pending:
            # A short window gathers what the requests in flight are about to queue: one
            # commit for them all (entries are the account, not the request's outcome).
            await asyncio.sleep(_FLUSH_S)
            batch, self._pending = self._pending, []
            ok = await self._keep([e for entries, _ in batch for e in entries])
            for entries, done in batch:
                if done is not None:
                    try:
                        done(entries if ok else ())
                    except Exception:
                        log.exception("a ledger listener failed")

    def _load(self, tenant: str, session: str) -> Previous | None:
        last = self.store.last(tenant, session)
        if last is None:
            return None
        request = last if last.kind == "request" else (
            self.store.entry(tenant, session, last.request) if last.request else None)
        return Previous(last, request)

    async def _keep(self, entries: list[LedgerEntry]) -> bool:
        try:
            await asyncio.to_thread(self.store.add, entries)
        except Exception as exc:
            log.warning("ledger write failed (%s); the request was served", exc)
            return False
        self.recorded += len(entries)
        billed: dict[tuple[str, str], int] = {}
        costs: dict[str, float] = {}
        direct = 0.0
        breaks: dict[str, int] = {}
        for e in entries:  # summed first: a labelled child costs a lookup and a lock each
            b = e.billed
            for part, n in (("input", b.input), ("cache_read", b.cache_read),
                            ("cache_write", b.cache_write), ("output", b.output)):
                if n:
                    billed[part, e.kind] = billed.get((part, e.kind), 0) + n
            if e.cost is not None:
                costs[e.kind] = costs.get(e.kind, 0.0) + e.cost
            direct += e.direct_cost or 0.0
            if e.cache_reason is not None:
                breaks[e.cache_reason] = breaks.get(e.cache_reason, 0) + 1
        m = self.metrics
        for (part, kind), n in billed.items():
            m.billed_tokens.labels(part, kind).inc(n)
        for kind, usd in costs.items():
            m.cost_usd.labels(kind).inc(usd)
        if direct:
            m.direct_cost_usd.inc(direct)
        for reason, n in breaks.items():
            m.cache_breaks.labels(reason).inc(n)
        return True
