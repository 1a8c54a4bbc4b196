"""Compactions prepared in the background (docs/compaction.md#pre-compaction).

Past `precompact_ratio` the planner asks for the summary the threshold request will need; its
summarizer call runs as a task held here, in memory, until a request uses it (or it is pushed
out, and cancelled). A prepared summary is persisted only when a request actually uses it.
There is at most one per session state (the summary it would merge), so the threshold request
finds it by a lookup.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.compaction.planner import Plan
from proxy.lru import LRU
from proxy.store.summaries import SummaryRecord

log = logging.getLogger("proxy.pipeline")

# Prepared summaries hold their evicted messages until used; bound the memory they pin.
_PREPARED_LIMIT = 64

State = tuple[str, str, str | None]  # tenant, session, chain of the summary it merges


@dataclass(frozen=True, slots=True)
class _Prepared:
    plan: Plan
    task: asyncio.Task[SummaryRecord]


class PreparedCompactions:
    def __init__(self) -> None:
        self._items: LRU[State, _Prepared] = LRU(_PREPARED_LIMIT, on_evict=_cancel)
        self.started = 0

    def start(
        self, tenant: str, session: str, plan: Plan,
        work: Callable[[], Coroutine[Any, Any, SummaryRecord]],
    ) -> None:
        """Run ``work()`` for ``plan`` unless this session already prepares from that state."""
        state = (tenant, session, plan.previous_chain)
        if state in self._items:
            return  # one per state: the threshold request reuses it
        task = asyncio.ensure_future(work())
        task.add_done_callback(_quiet)
        self._items.put(state, _Prepared(plan, task))
        self.started += 1

    def plan_for(
        self, tenant: str, session: str, chains: Sequence[str], previous: SummaryRecord | None
    ) -> Plan | None:
        """The compaction prepared from this history's current state, if it still applies."""
        found = self._items.get((tenant, session, previous.chain if previous else None))
        if found is None:
            return None
        plan = found.plan
        if plan.cut <= len(chains) and chains[plan.cut - 1] == plan.cut_chain:
            return plan
        return None

    def take(self, tenant: str, session: str, plan: Plan) -> asyncio.Task[SummaryRecord] | None:
        """The running summary task for ``plan``, removed from here (its caller owns it)."""
        state = (tenant, session, plan.previous_chain)
        found = self._items.get(state)
        if found is None or found.plan.cut_chain != plan.cut_chain:
            return None
        self._items.pop(state)
        return found.task

    def busy(self, tenant: str, session: str, plan: Plan) -> bool:
        return (tenant, session, plan.previous_chain) in self._items

    async def close(self) -> None:
        tasks = [p.task for _, p in self._items.items()]
        self._items.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except BaseException:
                pass


def _cancel(_: State, old: _Prepared) -> None:
    old.task.cancel()  # pushed out: nobody will use it


def _quiet(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("background pre-compaction failed: %r", task.exception())
