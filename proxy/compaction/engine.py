"""The compaction stage: keep the request under the context threshold (SPEC section 5).

Per request, statelessly from the history plus the summary cache:

1. The newest cached summary whose replaced messages (by chain hash) open this history is
   applied: leading system messages, the summary message, the messages after it. A cached
   summary is only ever created when a request crossed the threshold, so applying it is what
   that request did too: the same history forwards the same bytes.
2. If that is still over `threshold = threshold_ratio x window - reserved output`, the oldest
   un-summarized turns are evicted (the kept suffix fits `keep_recent_ratio x window`, split on
   turn boundaries) and merged with the previous summary in one summarizer call, shared by
   every concurrent request that needs the same compaction (single flight).
3. Past `precompact_ratio` (or once two turns as large as the newest would cross the
   threshold), the compaction the threshold will need is computed in the background and kept
   in memory (:mod:`.prepared`), so the request that crosses the threshold pays no summarizer
   latency; it is persisted only when a request actually uses it.
4. If even the kept suffix is over the threshold, its tool outputs are re-cut harder.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ..config import CompactionConfig
from ..hotcache import SummaryIndex
from ..models import ContextWindows
from ..pipeline import Message, RequestView, StageOutcome
from ..pipeline.ageing import tool_turns
from ..pipeline.count import RequestCounter
from ..pipeline.offload import OffloadStage
from ..pipeline.turns import leading_system_count, split, units
from ..store.dialog import DialogArchive
from ..store.summaries import SummaryRecord, SummaryStore, markdown_size
from ..writes import Mode, Writes
from .client import Complete, SummarizerClient
from .prepared import FlightKey, Plan, PreparedCompactions
from .summarizer import summarize, summary_message

log = logging.getLogger("proxy.pipeline")

# Early preparation: start once this many turns as large as the largest of the newest
# _STEP_UNITS would cross the threshold (and the context is past half of it).
_LOOKAHEAD_TURNS = 2
_STEP_UNITS = 4


@dataclass(frozen=True, slots=True)
class Budget:
    window: int
    threshold: int
    keep: int
    pre: int


class CompactStage:
    name = "compact"

    def __init__(
        self,
        config: CompactionConfig,
        *,
        counter: RequestCounter,
        windows: ContextWindows,
        summaries: SummaryStore,
        archive: DialogArchive,
        client: SummarizerClient,
        offload: OffloadStage | None,
        old_max_bytes: int,
        read_tool: str | None,
    ) -> None:
        self.config = config
        self.counter = counter
        self.windows = windows
        self.summaries = summaries
        self.archive = archive
        self.client = client
        self.offload = offload
        self.old_max_bytes = old_max_bytes
        self.read_tool = read_tool
        self.index = SummaryIndex(summaries)
        self._records: OrderedDict[FlightKey, SummaryRecord] = OrderedDict()
        self._flights: dict[FlightKey, asyncio.Future[SummaryRecord]] = {}
        self._prepared = PreparedCompactions()
        self.compactions = 0

    @property
    def precompactions(self) -> int:
        """Compactions prepared in the background so far."""
        return self._prepared.started

    # -- budget ------------------------------------------------------------------------------

    def budget(self, request: RequestView) -> Budget:
        window = self.windows.window(request.model)
        reserved = 0
        for field in ("max_completion_tokens", "max_tokens"):
            value = request.body.get(field)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                reserved = value
                break
        reserved = min(reserved, window // 4)
        c = self.config
        return Budget(
            window=window,
            threshold=int(c.threshold_ratio * window) - reserved,
            keep=int(c.keep_recent_ratio * window),
            pre=int(c.precompact_ratio * window) - reserved,
        )

    # -- helpers -----------------------------------------------------------------------------

    def _apply(self, messages: list[Message], rec: SummaryRecord | None, head: int) -> list[Message]:
        if rec is None:
            return messages
        summary = summary_message(rec.text, pointer=rec.pointer, tool_name=self.read_tool)
        return [*messages[:head], summary, *messages[rec.upto :]]

    def _aged(
        self, messages: list[Message], request: RequestView, rec: SummaryRecord | None
    ) -> list[Message]:
        """Stage-2 ageing as of the compaction in use: results that had aged when it was made
        are re-cut, at the same moment the summary changed the prefix anyway."""
        if self.offload is None or not self.offload.defer_ageing or rec is None or not rec.seen:
            return messages
        _, turns_then = tool_turns(request.body["messages"][: rec.seen])
        aged = max(turns_then - self.offload.config.recent_n, 0)
        if aged == 0:
            return messages
        return self.offload.run(request.body["messages"], request, aged_turns=aged).messages

    def _step(self, applied: Sequence[Message], request: RequestView) -> int:
        """Tokens of the largest of the newest few turns: what the next request may add."""
        spans = units(applied, leading_system_count(applied))[-_STEP_UNITS:]
        return max(
            (sum(self.counter.message(m, request.model) for m in applied[a:b]) for a, b in spans),
            default=0,
        )

    def _count(self, messages: Sequence[Message], request: RequestView) -> int:
        tools = request.body.get("tools")
        return self.counter.request(messages, request.model, tools if isinstance(tools, list) else None)

    def _plan(
        self, messages: list[Message], request: RequestView, rec: SummaryRecord | None,
        head: int, keep: int,
    ) -> Plan | None:
        start = rec.upto if rec is not None else head
        view = [*messages[:head], *messages[start:]]
        # prefer_user=False: keep every whole turn that fits, not only from the newest user
        # message on (which can keep almost nothing in an agent loop). over_budget_keep="unit":
        # when the newest turn alone fills the budget keep just that turn; going back to the last
        # user message would keep a whole agent loop (or, with one request, evict nothing). The
        # evicted user messages reach the summary verbatim.
        found = split(
            view, lambda m: self.counter.message(m, request.model), keep,
            prefer_user=False, over_budget_keep="unit",
        )
        if found is None:
            return None
        cut = start + (found.cut - head)
        if cut <= start:
            return None
        return Plan(head, start, cut, request.chains[cut - 1], rec)

    def _summarize(
        self, plan: Plan, request: RequestView, tokens_before: int
    ) -> Coroutine[Any, Any, SummaryRecord]:
        """The summarizer coroutine for `plan`, holding only what it needs of the request
        (a prepared one may wait in memory for a while)."""
        return self._summarize_parts(
            plan,
            request.identity.tenant,
            request.identity.session,
            list(request.body["messages"][plan.start : plan.cut]),
            list(request.chains[plan.head : plan.cut]),
            self.client.completer(request.model, request.headers),
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
            previous_chain=plan.previous.chain if plan.previous is not None else None,
            span=tuple(spans),
        )

    async def _persisted(self, plan: Plan, request: RequestView, tokens: int) -> SummaryRecord:
        """The stored summary for `plan`: from a prepared one, a running call, or a new call."""
        ident = request.identity
        key = (ident.tenant, ident.session, plan.cut_chain)
        flight = self._flights.get(key)
        if flight is not None:
            return await asyncio.shield(flight)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[SummaryRecord] = loop.create_future()
        self._flights[key] = future
        try:
            prepared = self._prepared.take(key)
            if prepared is not None:
                record = await prepared
            else:
                record = await self._summarize(plan, request, tokens)
            # The request that makes the compaction fixes when ageing happens (`_aged`).
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

    async def _proven(self, record: SummaryRecord, plan: Plan, request: RequestView) -> SummaryRecord:
        """A summary the model wrote with the client's own key proves the provider accepts
        that key: a new key's held writes (the archive first) are released now, and the
        summary points into the archive as for any other key."""
        writes = request.writes
        if (writes is None or writes.mode is not Mode.HELD or record.source != "model"
                or not self.client.judges_key(request.model)):
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
            self._records[(rec.tenant, rec.session, rec.chain)] = rec

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

    def _prepare(self, plan: Plan, request: RequestView, tokens: int) -> None:
        ident = request.identity
        key = (ident.tenant, ident.session, plan.cut_chain)
        if key not in self._prepared and key not in self._flights:
            self._prepared.start(key, plan, lambda: self._summarize(plan, request, tokens))

    async def _latest(self, tenant: str, session: str, chains: Sequence[str]) -> SummaryRecord | None:
        """The newest summary this history starts with; no query when the session has none."""
        known = self.index.cached(tenant, session)
        if known is None:
            known = await asyncio.to_thread(self.index.load, tenant, session)
        chain = self.index.latest(known, chains)
        if chain is None:
            return None
        cached = self._records.get((tenant, session, chain))
        if cached is not None:
            return cached
        rec = await asyncio.to_thread(self.summaries.get, tenant, session, chain)
        if rec is not None:
            self._records[(tenant, session, chain)] = rec
            while len(self._records) > 4096:
                self._records.popitem(last=False)
        return rec

    # -- the stage ---------------------------------------------------------------------------

    async def __call__(self, messages: list[Message], request: RequestView) -> StageOutcome:
        if not self.config.enabled or len(request.chains) != len(messages) or not messages:
            return StageOutcome(messages, False)
        ident = request.identity
        await self.counter.ready(request.model)
        head = leading_system_count(messages)
        budget = self.budget(request)
        rec = await self._latest(ident.tenant, ident.session, request.chains)
        if rec is not None and not (
            rec.upto <= len(messages) and rec.head == head and request.chains[rec.upto - 1] == rec.chain
        ):
            rec = None
        base = messages
        applied = self._apply(self._aged(base, request, rec), rec, head)
        tokens = self._count(applied, request)
        compacted_now = 0
        for _ in range(2):  # a prepared compaction may be one step short: then go again
            if tokens <= budget.threshold:
                break
            plan = self._prepared.plan_for(ident.tenant, ident.session, request.chains, rec) or self._plan(
                messages, request, rec, head, budget.keep
            )
            if plan is None:
                break
            rec = await self._persisted(plan, request, tokens)
            compacted_now = 1
            applied = self._apply(self._aged(base, request, rec), rec, head)
            tokens = self._count(applied, request)
        if tokens > budget.threshold and self.offload is not None:
            applied, tokens = self._last_resort(applied, request, budget, rec, head)
        elif compacted_now == 0 and (
            tokens > budget.pre
            or (2 * tokens > budget.threshold
                and tokens + _LOOKAHEAD_TURNS * self._step(applied, request) > budget.threshold)
        ):
            # Plan the split the threshold request will make: by then the history has grown by
            # at least (threshold - tokens), which that split would not keep either. Agent turns
            # that add tens of thousands of tokens can jump from below precompact_ratio to over
            # the threshold in one request, leaving no time for the summary; so preparation also
            # starts once a few turns as large as the newest ones would cross the threshold.
            keep = max(budget.keep - (budget.threshold - tokens), budget.keep // 4)
            plan = self._plan(messages, request, rec, head, keep)
            if plan is not None:
                self._prepare(plan, request, tokens)
        stats = {
            "compacted": int(rec is not None),
            "compactions": compacted_now,
            "tokens_budget": budget.threshold,
        }
        return StageOutcome(applied, rec is not None or applied is not messages, stats)

    def _last_resort(
        self, applied: list[Message], request: RequestView, budget: Budget,
        rec: SummaryRecord | None, head: int,
    ) -> tuple[list[Message], int]:
        """Even the newest turns are over budget: re-cut tool outputs harder, oldest first and
        only as many as needed (the newest stay as they were if they can), never refuse."""
        assert self.offload is not None
        tokens = self._count(applied, request)
        model = request.model
        tool_idx = [i for i, m in enumerate(applied) if m.get("role") in ("tool", "function")]
        for size in (self.old_max_bytes, 1024):
            for i in tool_idx:
                if tokens <= budget.threshold:
                    return applied, tokens
                before = applied[i]
                after = self.offload.harder([before], request.identity, size)[0]
                if after is not before:
                    tokens += self.counter.message(after, model) - self.counter.message(before, model)
                    applied = [*applied[:i], after, *applied[i + 1 :]]
        if tokens > budget.threshold:
            log.warning(
                "request still over the threshold after compaction (%d > %d tokens); forwarding",
                tokens, budget.threshold,
            )
        return applied, tokens

    def forget(self) -> None:
        """Drop the in-memory summary shortcuts (summaries may have expired on disk)."""
        self.index.clear()
        self._records.clear()

    async def close(self) -> None:
        await self._prepared.close()
