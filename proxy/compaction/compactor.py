"""The compaction orchestrator (docs/compaction.md): everything of compaction that is not pure.

The planner (:mod:`.planner`) decides; this service finds the summary in use, obtains a new
one when the planner needs it, and keeps it:

* :meth:`Compactor.state`: the newest cached summary this history starts with (an in-memory
  index per session, the store once per session);
* :meth:`Compactor.obtain`: the summary for a plan, from a compaction prepared in the background,
  from a summarizer call already running for the same plan (single flight), or from a new call;
  then persisted as the request may write (:mod:`proxy.writes`);
* :meth:`Compactor.prepare`: start the summary the threshold request will need, in the
  background (:mod:`.prepared`).

A summarizer that fails or times out yields the deterministic fallback summary (the request is
still served); an abandoned request does not wait for it.

With long-term memory on (a :class:`FactsSink`), the same summarizer call also returns durable
facts, handed to the sink (:mod:`proxy.memory`); a failure there is logged, never raised.

Each summarizer call (a retry too) is reported to ``calls`` (a
:class:`~proxy.ledger.calls.CallSink`, the ledger) once, for the request whose compaction made
it: not for the requests that wait on its flight.

With a store shared by many replicas (``shared``, PostgreSQL) the same history must forward the
same bytes on every replica, so nothing a replica holds in memory decides: :meth:`state` asks
the store on every request (one query), :meth:`obtain` claims the compaction in the store
before calling the summarizer (a replica that finds it claimed polls for the summary instead),
and compactions are not prepared in the background (a prepared plan lives in one replica's
memory, and would change what that replica alone forwards). While the database is away, the
summaries this replica used last serve from memory and a new compaction is made here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Coroutine
from datetime import UTC, datetime
from typing import Any, Protocol

from proxy.catalog.windows import ContextWindows
from proxy.compaction.client import Complete, OnCall, SummarizerClient
from proxy.compaction.guard import user_turns
from proxy.compaction.index import SummaryIndex
from proxy.compaction.planner import Plan
from proxy.compaction.prepared import PreparedCompactions
from proxy.compaction.summarizer import summarize
from proxy.config.compaction import CompactionConfig
from proxy.errors import StoreUnavailable
from proxy.lru import LRU
from proxy.model import RequestView
from proxy.session import Identity
from proxy.store.interfaces import DialogStore, SharedSummaries, Summaries
from proxy.store.summaries import SummaryRecord, markdown_size
from proxy.upstream.calls import CallSink
from proxy.writes import Mode, Writes

__all__ = ["Compactor", "FactsSink", "NullCompactor"]

log = logging.getLogger("proxy.pipeline")

# The summaries kept in memory (the store has them all).
_RECORDS_BYTES = 16 * 1024 * 1024

FlightKey = tuple[str, str, str]  # tenant, session, chain of the last replaced message

CLAIM_POLL_S = 0.05  # how often a replica waiting on another's claim looks for the summary
CLAIM_MARGIN_S = 2.0  # a claim outlives the summarizer timeout by this much


class FactsSink(Protocol):
    """Where the durable facts of a compaction go (long-term memory)."""

    async def record(self, tenant: str, scope: str, session: str, facts: str,
                     writes: Writes | None) -> None: ...


class Compactor:
    enabled = True

    def __init__(
        self,
        config: CompactionConfig,
        *,
        summaries: Summaries,
        archive: DialogStore,
        client: SummarizerClient,
        windows: ContextWindows,
        facts: FactsSink | None = None,
        shared: SharedSummaries | None = None,
        calls: CallSink | None = None,
    ) -> None:
        self.config = config
        self.facts = facts
        self.calls = calls  # told of each summarizer call (the ledger)
        self.summaries = summaries
        self.shared = shared
        self.archive = archive
        self.client = client
        self.windows = windows
        self.index = SummaryIndex(summaries)
        # Sized by the summary text each pins (and its dialog spans).
        self._records: LRU[FlightKey, SummaryRecord] = LRU(
            _RECORDS_BYTES, lambda _, rec: 600 + len(rec.text) + 100 * len(rec.span))
        self._flights: dict[FlightKey, asyncio.Future[SummaryRecord]] = {}
        self._prepared = PreparedCompactions()
        self.compactions = 0

    @property
    def precompactions(self) -> int:
        """Compactions prepared in the background so far."""
        return self._prepared.started

    # -- the summary in use ------------------------------------------------------------------

    async def state(self, request: RequestView) -> SummaryRecord | None:
        """The newest summary this history starts with; no query when the session has none."""
        tenant, session = request.identity.tenant, request.identity.session
        if self.shared is not None:
            try:
                found = await asyncio.to_thread(self.shared.find_latest, tenant, session,
                                                request.chains)
            except StoreUnavailable:
                return self._remembered(tenant, session, request)
            if found is not None:
                self._remember(found)
            return found
        known = self.index.cached(tenant, session)
        if known is None:
            known = await asyncio.to_thread(self.index.load, tenant, session)
        chain = self.index.latest(known, request.chains)
        if chain is None:
            return None
        cached = self._records.get((tenant, session, chain))
        if cached is not None:
            return cached
        rec = await asyncio.to_thread(self.summaries.get, tenant, session, chain)
        if rec is not None:
            self._records.put((tenant, session, chain), rec)
        return rec

    def _remembered(self, tenant: str, session: str, request: RequestView) -> SummaryRecord | None:
        """The newest summary this replica used for this history (the database is away)."""
        known = self.index.cached(tenant, session)
        chain = None if known is None else self.index.latest(known, request.chains)
        return None if chain is None else self._records.get((tenant, session, chain))

    def _remember(self, rec: SummaryRecord) -> None:
        self.index.include(rec.tenant, rec.session, rec.chain)
        self._records.put((rec.tenant, rec.session, rec.chain), rec)

    def prepared_plan(self, request: RequestView, summary: SummaryRecord | None) -> Plan | None:
        ident = request.identity
        return self._prepared.plan_for(ident.tenant, ident.session, request.chains, summary)

    # -- a new summary -------------------------------------------------------------------------

    async def obtain(self, plan: Plan, request: RequestView, tokens: int) -> SummaryRecord:
        """The stored summary for ``plan``: from a prepared one, a running call, or a new call."""
        ident = request.identity
        key = (ident.tenant, ident.session, plan.cut_chain)
        flight = self._flights.get(key)
        if flight is not None:
            return await asyncio.shield(flight)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[SummaryRecord] = loop.create_future()
        self._flights[key] = future
        try:
            if self.shared is not None:
                stored = await self._obtain_shared(self.shared, plan, request, tokens)
                future.set_result(stored)
                return stored
            prepared = self._prepared.take(ident.tenant, ident.session, plan)
            if prepared is not None:
                record = await prepared
            else:
                record = await self._summarize(plan, request, tokens)
            # The request that makes the compaction fixes when ageing happens.
            record = dataclasses.replace(record, seen=len(request.chains))
            record = await self._proven(record, plan, request)
            stored = await self._store(record, request.writes)
            self.compactions += 1
            future.set_result(stored)
            return stored
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # mark retrieved: waiters get it, nobody else must
            raise
        finally:
            self._flights.pop(key, None)

    async def _obtain_shared(
        self, shared: SharedSummaries, plan: Plan, request: RequestView, tokens: int
    ) -> SummaryRecord:
        """:meth:`obtain` across replicas: the stored summary if another replica made it,
        else claim it and make it; while another replica holds the claim, wait for its
        summary. A dead replica's claim expires (``summarizer_timeout_s`` + a margin); with
        the database away the call is made here."""
        tenant, session, chain = request.identity.tenant, request.identity.session, plan.cut_chain
        ttl = self.config.summarizer_timeout_s + CLAIM_MARGIN_S
        deadline = time.monotonic() + ttl
        claimed = False
        while True:
            try:
                found = await asyncio.to_thread(shared.get, tenant, session, chain)
                if found is not None:
                    self._remember(found)
                    return found
                claimed = await asyncio.to_thread(shared.claim, tenant, session, chain, ttl)
            except StoreUnavailable:
                break
            if claimed or time.monotonic() > deadline:
                break
            await asyncio.sleep(CLAIM_POLL_S)
        try:
            record = await self._summarize(plan, request, tokens)
            record = dataclasses.replace(record, seen=len(request.chains))
            record = await self._proven(record, plan, request)
            stored = await self._store(record, request.writes)
            self.compactions += 1
            return stored
        finally:
            if claimed:
                with contextlib.suppress(StoreUnavailable):
                    await asyncio.to_thread(shared.release, tenant, session, chain)

    def prepare(self, plan: Plan, request: RequestView, tokens: int) -> None:
        if self.shared is not None:
            return  # see the module docstring: no replica-local plans with a shared store
        ident = request.identity
        if (ident.tenant, ident.session, plan.cut_chain) in self._flights:
            return
        self._prepared.start(
            ident.tenant, ident.session, plan, lambda: self._summarize(plan, request, tokens)
        )

    def _summarize(
        self, plan: Plan, request: RequestView, tokens_before: int
    ) -> Coroutine[Any, Any, SummaryRecord]:
        """The summarizer coroutine for ``plan``, holding only what it needs of the request
        (a prepared one may wait in memory for a while)."""
        return self._summarize_parts(
            plan,
            request.identity.tenant,
            request.identity.session,
            list(request.messages[plan.start : plan.cut]),
            list(request.chains[plan.head : plan.cut]),
            self.client.completer(request.model, request.headers, api=request.api,
                                  on_call=self._on_call(request.identity)),
            self.client.route(request.model, request.api).model,
            tokens_before,
            # The verbatim user requests take at most ~5% of the window (~4 chars a token).
            max(1000, min(8000, 4 * self.windows.window(request.model) // 20)),
            (request.identity.memory_scope, request.writes),
            # The guard numbers turns over the whole history: count those already summarized.
            user_turns(request.messages[: plan.start]) if self.config.guard.enabled else 0,
        )

    def _on_call(self, identity: Identity) -> OnCall | None:
        """Summarizer calls reported for the request that makes them: requests waiting on the
        same flight (or taking a prepared summary) made none."""
        calls = self.calls
        if calls is None:
            return None
        return lambda call: calls.record_call(identity, call)

    async def _summarize_parts(
        self,
        plan: Plan,
        tenant: str,
        session: str,
        evicted: list[Any],
        replaced_chains: list[str],
        complete: Complete,
        model: str,
        tokens_before: int,
        user_chars: int,
        memory: tuple[str, Writes | None],
        turn_base: int,
    ) -> SummaryRecord:
        previous = plan.previous.text if plan.previous is not None else None
        outcome = await summarize(
            complete, previous, evicted,
            per_message_chars=min(2000, user_chars), total_chars=user_chars,
            facts=self.facts is not None,
            guard=self.config.guard if self.config.guard.enabled else None,
            turn_base=turn_base,
        )
        if outcome.source == "fallback":
            log.warning("summarizer failed (%s); using a deterministic summary", outcome.error)
        if outcome.facts is not None and self.facts is not None:
            try:
                await self.facts.record(tenant, memory[0], session, outcome.facts, memory[1])
            except Exception:
                log.exception("recording durable facts failed; the compaction goes on")
        spans = await asyncio.to_thread(self.archive.span, tenant, session, replaced_chains)
        return SummaryRecord(
            tenant=tenant,
            session=session,
            chain=plan.cut_chain,
            head=plan.head,
            upto=plan.cut,
            text=outcome.text,
            source=outcome.source,
            model=model if outcome.source == "model" else None,
            error=outcome.error if outcome.source == "fallback" else None,
            created_at=datetime.now(UTC),
            tokens_before=tokens_before,
            tokens_after=0,
            previous_chain=plan.previous_chain,
            span=tuple(spans),
        )

    async def _proven(self, record: SummaryRecord, plan: Plan, request: RequestView) -> SummaryRecord:
        """A summary the model wrote with the client's own key proves the provider accepts
        that key: a new key's held writes (the archive first) are released now, and the
        summary points into the archive as for any other key."""
        writes = request.writes
        if (writes is None or writes.mode is not Mode.HELD or record.source != "model"
                or not self.client.judges_key(request.model, api=request.api)):
            return record
        await writes.settle(200)
        await writes.drain()
        ident = request.identity
        spans = await asyncio.to_thread(
            self.archive.span, ident.tenant, ident.session, list(request.chains[plan.head : plan.cut])
        )
        return dataclasses.replace(record, span=tuple(spans))

    async def _store(self, record: SummaryRecord, writes: Writes | None) -> SummaryRecord:
        """Persist ``record`` as the request may (:mod:`proxy.writes`) and remember it. Over
        quota it is only remembered (in memory, so later requests reuse it without another
        summarizer call); for a key not accepted yet it is remembered once the write is done."""
        def remember(rec: SummaryRecord) -> None:
            self.index.add(rec.tenant, rec.session, rec.chain)
            self._records.put((rec.tenant, rec.session, rec.chain), rec)

        if writes is None or writes.mode is Mode.NOW:
            try:
                stored = await asyncio.to_thread(self.summaries.put, record)
            except StoreUnavailable as exc:  # the database is away: serve it from memory
                log.warning("summary not stored (%s); kept in memory", exc)
                remember(record)
                return record
            if writes is not None:
                writes.count(markdown_size(stored))
            remember(stored)
            return stored
        if writes.allowed:
            await writes.write(lambda: (self.summaries.put(record), markdown_size(record))[1],
                               lambda: remember(record))
        else:
            remember(record)
        return record

    def forget(self) -> None:
        """Drop the in-memory summary shortcuts (summaries may have expired on disk)."""
        self.index.clear()
        self._records.clear()

    async def close(self) -> None:
        await self._prepared.close()


class NullCompactor:
    """Compaction off (or no store to keep summaries in): nothing is ever compacted."""

    enabled = False
    compactions = 0
    precompactions = 0

    async def state(self, request: RequestView) -> SummaryRecord | None:
        return None

    def prepared_plan(self, request: RequestView, summary: SummaryRecord | None) -> Plan | None:
        return None

    async def obtain(self, plan: Plan, request: RequestView, tokens: int) -> SummaryRecord:
        raise RuntimeError("compaction is off")

    def prepare(self, plan: Plan, request: RequestView, tokens: int) -> None:
        return None

    def forget(self) -> None:
        return None

    async def close(self) -> None:
        return None
