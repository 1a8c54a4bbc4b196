"""Compactions prepared in the background (pre-compaction, SPEC section 5).

Past `precompact_ratio` the engine starts the summary the threshold request will need; the
summarizer call runs as a task held here, in memory, until a request uses it (or it is pushed
out). A prepared summary is persisted only when a request actually uses it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from ..store.summaries import SummaryRecord

log = logging.getLogger("proxy.pipeline")

# Prepared summaries hold their evicted messages until used; bound the memory they pin.
_PREPARED_LIMIT = 64

FlightKey = tuple[str, str, str]  # tenant, session, chain of the last replaced message


@dataclass(frozen=True, slots=True)
class Plan:
    """One compaction: replace messages[head:cut] (merging `previous`) by a summary."""

    head: int
    start: int
    cut: int
    cut_chain: str
    previous: SummaryRecord | None


@dataclass(frozen=True, slots=True)
class _Prepared:
    plan: Plan
    task: asyncio.Task[SummaryRecord]


def _previous_chain(plan: Plan) -> str | None:
    return plan.previous.chain if plan.previous is not None else None


class PreparedCompactions:
    """At most one prepared compaction per (session, state), `_PREPARED_LIMIT` in all."""

    def __init__(self) -> None:
        self._items: OrderedDict[FlightKey, _Prepared] = OrderedDict()
        self.started = 0

    def __contains__(self, key: FlightKey) -> bool:
        return key in self._items

    def start(
        self, key: FlightKey, plan: Plan, work: Callable[[], Coroutine[Any, Any, SummaryRecord]]
    ) -> None:
        """Run `work()` for `plan` unless this session already prepares from the same state."""
        tenant, session, _ = key
        prev = _previous_chain(plan)
        for (t, s, _), prepared in self._items.items():
            if (t, s) == (tenant, session) and _previous_chain(prepared.plan) == prev:
                return  # one prepared compaction per state: the threshold request reuses it
        task = asyncio.ensure_future(work())
        task.add_done_callback(_quiet)
        self._items[key] = _Prepared(plan, task)
        self.started += 1
        while len(self._items) > _PREPARED_LIMIT:
            _, old = self._items.popitem(last=False)
            old.task.cancel()

    def take(self, key: FlightKey) -> asyncio.Task[SummaryRecord] | None:
        prepared = self._items.pop(key, None)
        return prepared.task if prepared is not None else None

    def plan_for(
        self, tenant: str, session: str, chains: Sequence[str], previous: SummaryRecord | None
    ) -> Plan | None:
        """A compaction prepared from this history's current state, if any."""
        prev = previous.chain if previous is not None else None
        for (t, s, chain), prepared in reversed(self._items.items()):
            plan = prepared.plan
            if (t, s) != (tenant, session) or plan.cut > len(chains):
                continue
            if chains[plan.cut - 1] == chain and _previous_chain(plan) == prev:
                return plan
        return None

    async def close(self) -> None:
        tasks = [p.task for p in self._items.values()]
        self._items.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except BaseException:
                pass


def _quiet(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("background pre-compaction failed: %r", task.exception())
