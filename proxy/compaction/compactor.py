"""The compaction orchestrator (SPEC section 5): everything of compaction that is not pure.

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
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Coroutine
from datetime import UTC, datetime
from typing import Any

from ..config import CompactionConfig
from ..lru import LRU
from ..pipeline.model import RequestView
from ..store.interfaces import DialogStore, Summaries
from ..store.summaries import SummaryRecord, markdown_size
from ..writes import Mode, Writes
from .client import Complete, SummarizerClient
from .index import SummaryIndex
from .planner import Plan
from .prepared import PreparedCompactions
from .summarizer import summarize
from .windows import ContextWindows

__all__ = ["Compactor", "NullCompactor"]

log = logging.getLogger("proxy.pipeline")

FlightKey = tuple[str, str, str]  # tenant, session, chain of the last replaced message


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
    ) -> None:
        self.config = config
        self.summaries = summaries
        self.archive = archive
        self.client = client
        self.windows = windows
        self.index = SummaryIndex(summaries)
        self._records: LRU[FlightKey, SummaryRecord] = LRU(4096)
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

    def prepare(self, plan: Plan, request: RequestView, tokens: int) -> None:
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
            self.client.completer(request.model, request.headers, api=request.api),
            self.config.model or request.model,
            tokens_before,
            # The verbatim user requests take at most ~5% of the window (~4 chars a token).
            max(1000, min(8000, 4 * self.windows.window(request.model) // 20)),
        )

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
    ) -> SummaryRecord:
        previous = plan.previous.text if plan.previous is not None else None
        outcome = await summarize(
            complete, previous, evicted,
            per_message_chars=min(2000, user_chars), total_chars=user_chars,
        )
        if outcome.source == "fallback":
            log.warning("summarizer failed (%s); using a deterministic summary", outcome.error)
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
            stored = await asyncio.to_thread(self.summaries.put, record)
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
