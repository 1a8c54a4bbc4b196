"""The compaction planner (docs/compaction.md#budget, docs/compaction.md#split): pure, no I/O.

Given the history as offloaded for the compaction in use (``summary``, the newest cached summary
whose replaced messages open this history; looked up by the caller), the budget and the token
counts, :meth:`Planner.plan` says what the request needs:

* ``use``: forward ``applied`` (leading system messages, the summary, the messages after it);
* ``need``: over ``threshold = threshold_ratio x window - reserved output``, a new summary of
  the oldest un-summarized turns (:class:`Plan`) must replace them first; the caller obtains it
  (:mod:`.compactor`) and plans again with it;
* ``prepare``: past ``precompact_ratio`` (or once two turns as large as the largest of the newest
  four would cross the threshold), the summary the threshold request will need should be
  computed in the background.

A cached summary is only ever created when a request crossed the threshold, so applying it is
what that request did too: the same history forwards the same bytes.

Provider-native compaction (:mod:`proxy.history.native`): the head that is never compacted runs
through the newest provider compaction item, the threshold counts from that item on, and a
request in which the provider compacts gets no new summary and no last-resort cuts (a summary
already in use is still applied: the provider compacts what the model has been seeing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from proxy.catalog.windows import ContextWindows
from proxy.compaction.message import summary_message
from proxy.config.compaction import CompactionConfig
from proxy.history.native import head as native_head
from proxy.history.native import in_context, native
from proxy.history.turns import split, units
from proxy.model import Message, RequestView
from proxy.store.summaries import SummaryRecord
from proxy.tokens.request import RequestCounter

__all__ = ["Budget", "Decision", "Plan", "Planner"]

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


@dataclass(frozen=True, slots=True)
class Plan:
    """One compaction: replace messages[head:cut] (merging `previous`) by a summary."""

    head: int
    start: int
    cut: int
    cut_chain: str
    previous: SummaryRecord | None

    @property
    def previous_chain(self) -> str | None:
        return self.previous.chain if self.previous is not None else None


@dataclass(frozen=True, slots=True)
class Decision:
    applied: list[Message]  # what to forward with the summary in use
    tokens: int  # of ``applied``, tools and reply priming included
    summary: SummaryRecord | None  # the summary in use
    budget: Budget
    need: Plan | None = None  # a new summary is needed first
    prepare: Plan | None = None  # to compute in the background
    provider_compacts: bool = False  # the provider compacts this request: ctxproxy stands down

    @property
    def over(self) -> bool:
        """Over the threshold (with or without a plan that could help), and ctxproxy's to act
        on: not when the provider compacts (no summary, no last-resort cuts either)."""
        return not self.provider_compacts and self.tokens > self.budget.threshold


class Planner:
    def __init__(
        self,
        config: CompactionConfig,
        counter: RequestCounter,
        windows: ContextWindows,
        read_tool: str | None,
    ) -> None:
        self.config = config
        self.counter = counter
        self.windows = windows
        self.read_tool = read_tool

    def budget(self, request: RequestView) -> Budget:
        window = self.windows.window(request.model)
        reserved = min(request.reserved_output, window // 4)
        c = self.config
        return Budget(
            window=window,
            threshold=int(c.threshold_ratio * window) - reserved,
            keep=int(c.keep_recent_ratio * window),
            pre=int(c.precompact_ratio * window) - reserved,
        )

    def usable(
        self, summary: SummaryRecord | None, messages: Sequence[Message], request: RequestView
    ) -> SummaryRecord | None:
        """``summary`` if it replaces a prefix of this very history, else None."""
        if summary is None:
            return None
        head = native_head(messages)
        chains = request.chains
        if summary.upto <= len(messages) and summary.head == head and (
            chains[summary.upto - 1] == summary.chain
        ):
            return summary
        return None

    def apply(self, messages: list[Message], summary: SummaryRecord | None) -> list[Message]:
        if summary is None:
            return messages
        head = native_head(messages)
        inserted = summary_message(summary.text, pointer=summary.pointer, tool_name=self.read_tool)
        return [*messages[:head], inserted, *messages[summary.upto :]]

    def count(self, messages: Sequence[Message], request: RequestView) -> int:
        """What the provider reads: from its newest compaction item on (and the system block)."""
        return self.counter.request(in_context(messages), request.model, request.tool_schemas)

    def plan(
        self,
        messages: list[Message],
        request: RequestView,
        summary: SummaryRecord | None,
        *,
        split_from: Callable[[], list[Message]] | None = None,
        prepared: Plan | None = None,
        may_prepare: bool = True,
    ) -> Decision:
        """What ``messages`` (offloaded for ``summary``'s ageing) need. A split is measured on
        what ``split_from()`` gives (the history with only stage-1 cuts; default ``messages``),
        asked only when a split is needed;
        ``prepared``: a plan prepared earlier from this very state, preferred to a new split."""
        budget = self.budget(request)
        head = native_head(messages)
        if prepared is not None and prepared.head != head:
            prepared = None  # prepared before a provider compaction item moved the head
        applied = self.apply(messages, summary)
        tokens = self.count(applied, request)
        def base() -> list[Message]:
            return split_from() if split_from is not None else messages

        if native(request).compacts:
            # The provider compacts this request (or at its own threshold): no second summary,
            # and no harder cuts of what it is about to summarize.
            return Decision(applied, tokens, summary, budget, provider_compacts=True)
        if tokens > budget.threshold:
            need = prepared or self.split(base(), request, summary, head, budget.keep)
            return Decision(applied, tokens, summary, budget, need=need)
        if may_prepare and (
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
            plan = self.split(base(), request, summary, head, keep)
            return Decision(applied, tokens, summary, budget, prepare=plan)
        return Decision(applied, tokens, summary, budget)

    def split(
        self,
        messages: list[Message],
        request: RequestView,
        summary: SummaryRecord | None,
        head: int,
        keep: int,
    ) -> Plan | None:
        start = summary.upto if summary is not None else head
        view = [*messages[:head], *messages[start:]]
        # prefer_user=False: keep every whole turn that fits, not only from the newest user
        # message on (which can keep almost nothing in an agent loop). over_budget_keep="unit":
        # when the newest turn alone fills the budget keep just that turn; going back to the last
        # user message would keep a whole agent loop (or, with one request, evict nothing). The
        # evicted user messages reach the summary verbatim.
        found = split(
            view, lambda m: self.counter.message(m, request.model), keep,
            prefer_user=False, over_budget_keep="unit", head=head,
        )
        if found is None:
            return None
        cut = start + (found.cut - head)
        if cut <= start:
            return None
        return Plan(head, start, cut, request.chains[cut - 1], summary)

    def _step(self, applied: Sequence[Message], request: RequestView) -> int:
        """Tokens of the largest of the newest few turns: what the next request may add."""
        spans = units(applied, native_head(applied))[-_STEP_UNITS:]
        return max(
            (sum(self.counter.message(m, request.model) for m in applied[a:b]) for a, b in spans),
            default=0,
        )
