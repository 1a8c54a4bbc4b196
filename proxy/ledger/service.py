"""The ledger service: records every billed call of the requests this process serves.

    begin(identity, api, model)            at the request's arrival: its time and id
    finish(ticket, ...)                    after the response: the calls made for it, recorded
                                           in the background (never on the request's path)
    record_call(identity, call)            a summarizer or memory-fold call (a CallSink)

Recording a request compares it with the session's previous call (:mod:`proxy.ledger.cache`):
the client's own prefix for the counterfactual, the provider's cached share for cache breaks.
The previous call is kept in memory per session (with the previous request's chains, which
locate a client's edit); with a store other replicas share, it is read from the store each
time (one indexed query, in the background), since another replica may have served the turn
in between.

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
import hashlib
import logging
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from ..background import Background
from ..config import LedgerConfig, OffloadConfig
from ..formats import Parsed
from ..formats.messages import strip_cache_control
from ..lru import LRU
from ..metrics import Metrics
from ..pipeline.count import RequestCounter
from ..pipeline.model import PipelineResult
from ..pipeline.turns import LEADING_ROLES
from ..session import Identity
from ..store.chains import DigestCacheLike, canonical, chain_hashes
from ..store.interfaces import LedgerStore
from ..writes import Writes
from .cache import (
    ClientChange,
    attribute,
    cache_fell,
    compare,
    direct_prompt,
    direct_usage,
    local_scale,
)
from .calls import Call
from .changes import OWN_FORMS, describe
from .entry import Change, LedgerEntry, Prefix
from .prices import Prices
from .usage import Usage, parse_usage

__all__ = ["Ledger", "NullLedger", "RequestCalls", "Ticket"]

log = logging.getLogger("proxy.store")

_TTL_1H: Final = re.compile(rb'"ttl"\s*:\s*"1h"')
# How long the writer gathers entries before a commit.
_FLUSH_S: Final = 0.02




def _has_marker(item: Any) -> bool:
    if not isinstance(item, dict):
        return False
    if "cache_control" in item:
        return True
    content = item.get("content")
    if isinstance(content, list):
        return any(_has_marker(block) for block in content)
    return False


def marker_free_chains(items: Sequence[Any], chains: Sequence[str],
                       cache: DigestCacheLike | None) -> list[str]:
    """The items' chains with ``cache_control`` markers left out (the provider's cache ignores
    them; Claude Code moves its marker every turn). ``chains`` when no item has one."""
    first = next((i for i, item in enumerate(items) if _has_marker(item)), None)
    if first is None:
        return list(chains)
    stripped = [strip_cache_control(item) if _has_marker(item) else item for item in items]
    return chain_hashes(stripped, cache)


@dataclass(frozen=True, slots=True)
class Ticket:
    """A client request as the ledger sees it at its arrival."""

    identity: Identity
    api: str
    model: str
    ts: float
    id: str


@dataclass(frozen=True, slots=True)
class RequestCalls:
    """What a request's upstream calls reported, gathered by the route after the response."""

    status: int | None  # the first call's status (None: no answer)
    usages: Sequence[Any]  # each call's raw usage object, in order (the first call first)
    sent_at: Sequence[float]  # unix seconds each call was sent (may be empty)
    answer: Any  # the answer as archived (for an estimate of its output)
    read_tool: bool = False  # the proxy's read tool went out with the request


# What recording a request takes: ticket, parsed, chains, raw, result, calls.
_Args = tuple[Ticket, Parsed, Sequence[str], bytes, PipelineResult, RequestCalls]


@dataclass(slots=True)
class _State:
    """A session's previous call and previous request, with that request's chains."""

    last: LedgerEntry
    request: LedgerEntry | None
    chains: Sequence[str] | None = None


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
        self.offload = offload
        self.store = store
        self.prices = prices
        self.counter = counter  # the pipeline's, with its cached per-message counts
        self.metrics = metrics
        self.background = background
        self.digest_cache = digest_cache
        self.read_tool = read_tool  # the read tool's schema (chat shape), counted when offered
        self.shared = shared
        self.clock = clock
        self._state: LRU[tuple[str, str], _State] = LRU(16384)
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
        usage = parse_usage(call.api, call.usage)
        entry = LedgerEntry(
            tenant=identity.tenant, session=identity.session, id=uuid.uuid4().hex,
            request="", ts=call.ts, kind=call.kind, api=call.api, model=call.model,
            usage=usage, estimate=None if usage is not None else Usage(),
            cost=self.prices.cost(call.model, usage or Usage()), status=call.status)
        self._queue([entry], None)

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
                    entries, mf_chains = await asyncio.to_thread(self._entries, *args, state)
                else:
                    entries, mf_chains = self._entries(*args, state)
        except Exception:
            log.exception("recording the ledger failed; the request was served")
            if done is not None:
                done(())
            return
        self._keep_and_queue(ident, entries, mf_chains, done)

    def _recorded(self, args: _Args, state: _State,
                  done: Callable[[Sequence[LedgerEntry]], None] | None) -> None:
        try:
            entries, mf_chains = self._entries(*args, state)
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
        self._state.put((ident.tenant, ident.session), _State(entries[-1], entries[0], mf_chains))
        self._queue(entries, done)

    async def _previous(self, key: tuple[str, str]) -> _State | None:
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

    def _load(self, tenant: str, session: str) -> _State | None:
        last = self.store.last(tenant, session)
        if last is None:
            return None
        request = last if last.kind == "request" else (
            self.store.entry(tenant, session, last.request) if last.request else None)
        return _State(last, request)

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

    # -- the entries (pure but for the clock-free inputs) -------------------------------------

    def _rule(self, api: str, raw: bytes) -> tuple[float, bool]:
        """The client's cache TTL and whether its requests are cached at all."""
        if api == "messages":
            # Anthropic caches only what the client marks (blocks, system, tools, or the
            # top-level automatic cache_control).
            if b"cache_control" not in raw:
                return self.config.cache_ttl_s, False
        ttl = 3600.0 if b'"1h"' in raw and _TTL_1H.search(raw) else self.config.cache_ttl_s
        return ttl, True

    @staticmethod
    def _head(model: str, body: Mapping[str, Any]) -> str:
        """A digest of what precedes the conversation in the provider's cache: the model (each
        has its own cache) and the tools, as the client declared them (from the parsed body: no
        second decode of a body that may be megabytes)."""
        h = hashlib.sha256(model.encode())
        tools = body.get("tools")
        if tools is not None:
            h.update(b"\0")
            h.update(canonical(tools))
        return h.hexdigest()[:32]

    def _entries(
        self, ticket: Ticket, parsed: Parsed, chains: Sequence[str], raw: bytes,
        result: PipelineResult, calls: RequestCalls, state: _State | None,
    ) -> tuple[list[LedgerEntry], Sequence[str] | None]:
        ident, api, model = ticket.identity, ticket.api, ticket.model
        stats = result.stats
        sent = int(stats.get("tokens_in", len(raw) // 4))
        forwarded = int(stats.get("tokens_out", sent))
        if calls.read_tool and self.read_tool is not None:
            # Offered after the pipeline counted: it is forwarded (and billed) all the same.
            forwarded += self.counter.counter.count_tools([self.read_tool], model)
        ttl, cacheable = self._rule(api, raw)
        items = parsed.items
        mf: Sequence[str] | None = None
        change: ClientChange | None = None
        prefix: Prefix | None = None
        if not parsed.continued and len(chains) == len(items):
            mf = marker_free_chains(items, chains, self.digest_cache) if api == "messages" \
                else chains
            prefix = Prefix(items=len(items), last=mf[-1] if mf else "",
                            head=self._head(model, parsed.body), ttl_s=ttl, cacheable=cacheable)
            before = state.request.prefix if state and state.request else None
            change = compare(before, prefix, mf, state.chains if state else None)
        usages = [parse_usage(api, u) for u in calls.usages] or [None]
        first = usages[0]
        last = state.last if state else None
        prev_request = state.request if state else None
        gap = ticket.ts - last.ts if last is not None else None
        direct_gap = ticket.ts - prev_request.ts if prev_request is not None else None
        epoch_start = prev_request is not None and result.epoch != prev_request.epoch
        summary_chain = result.epoch.split(":", 1)[0]
        compaction = bool(summary_chain) and (
            prev_request is None and bool(stats.get("compactions"))
            or prev_request is not None and prev_request.epoch.split(":", 1)[0] != summary_chain)
        extends = change is None or change.extends

        output = first.output if first is not None else self._output_estimate(calls.answer)

        # The forwarded request, estimated when the provider reported nothing.
        estimate = None
        if first is None:
            holds = (last is not None and extends and not epoch_start and gap is not None
                     and gap <= ttl and cacheable)
            shared = min(last.billed.prompt, forwarded) if holds and last is not None else 0
            estimate = self._estimated(forwarded, shared, cacheable, ttl, output, api)
        billed = first or estimate or Usage()

        since = 0
        if not (epoch_start or change is None or not change.extends or prev_request is None):
            since = self._since(parsed, change.items)
        changes: tuple[Change, ...] = ()
        if result.changed:
            changes = tuple(describe(
                parsed.history, result.messages, tenant=ident.tenant, session=ident.session,
                evicted=result.evicted, since=since, old_max_bytes=self.offload.old_max_bytes,
                recent_max_bytes=self.offload.recent_max_bytes))

        # The provider's count calibrates the proxy's (proxy.ledger.cache): the content this
        # request added, when it extends the previous one in the same epoch and none of it was
        # forwarded in a form the proxy wrote (a marker, a delta or a reference is not the
        # content it stands for, and tokenizes unlike it).
        rewritten = any(c.what in OWN_FORMS for c in changes)
        scale: float | None = None
        if (first is not None and prev_request is not None and prev_request.usage is not None
                and extends and not epoch_start and not rewritten):
            scale = local_scale(prev_request.usage.prompt, first.prompt,
                                prev_request.tokens_forwarded, forwarded)
        if scale is None and prev_request is not None:
            scale = prev_request.scale
        if scale is None:
            scale = first.prompt / forwarded if first is not None and forwarded > 0 else 1.0

        # The counterfactual.
        writes = api == "messages" or billed.cache_write > 0
        if parsed.continued:
            # The history lives upstream either way: the client would have paid what was
            # billed plus the tokens the proxy cut from its new items, at the input price.
            direct = Usage(billed.input + round(max(0, sent - forwarded) * scale),
                           billed.cache_read, billed.cache_write_5m, billed.cache_write_1h,
                           output)
        else:
            earlier = prev_request.direct if prev_request is not None else None
            appended = (change is not None and change.extends and prev_request is not None
                        and earlier is not None)
            total = direct_prompt(
                sent=sent, scale=scale,
                previous=(prev_request.tokens_sent, earlier.prompt)
                if appended and prev_request is not None and earlier is not None else None)
            shared_tokens = 0
            if appended and earlier is not None:
                shared_tokens = earlier.prompt
            elif change is not None and prev_request is not None:
                shared_tokens = round(self._prefix_tokens(parsed, change) * scale)
            direct = direct_usage(total=total, shared=shared_tokens,
                                  rule=prefix or Prefix(ttl_s=ttl, cacheable=cacheable),
                                  gap_s=direct_gap, min_tokens=self.config.min_cacheable_tokens,
                                  output=output, writes_billed=writes)

        reason = self._reason(api, last, billed, first is not None and last is not None
                              and last.usage is not None, gap=gap, ttl=ttl,
                              epoch_start=epoch_start, change=change, cacheable=cacheable,
                              head=self._leading(items))
        sent_at = list(calls.sent_at)
        entries = [LedgerEntry(
            tenant=ident.tenant, session=ident.session, id=ticket.id, request=ticket.id,
            ts=ticket.ts, kind="request", api=api, model=model, usage=first, estimate=estimate,
            cost=self.prices.cost(model, billed), status=calls.status or 200,
            tokens_sent=sent, tokens_forwarded=forwarded, direct=direct,
            direct_cost=self.prices.cost(model, direct), cache_reason=reason, gap_s=gap,
            scale=scale,
            epoch=result.epoch, compacted=bool(stats.get("compacted")), compaction=compaction,
            offloaded=int(stats.get("offloaded", 0)), rounds=max(0, len(calls.usages) - 1),
            changes=changes, changes_from=since, prefix=prefix,
        )]
        previous = entries[0]
        for k, usage in enumerate(usages[1:], start=1):
            # Anchored at the request's time (the ledger's clock), spaced as the loop sent them.
            ts = ticket.ts + (sent_at[k] - sent_at[0] if k < len(sent_at) else 0.0)
            round_estimate = None
            if usage is None:
                # A round repeats the request with the rounds so far appended: all of it read.
                round_estimate = Usage(cache_read=previous.billed.prompt if cacheable else 0,
                                       input=0 if cacheable else previous.billed.prompt)
            rbilled = usage or round_estimate or Usage()
            rreason = self._reason(api, previous, rbilled,
                                   usage is not None and previous.usage is not None,
                                   gap=ts - previous.ts, ttl=ttl, epoch_start=False, change=None,
                                   cacheable=cacheable, head=0)
            entry = LedgerEntry(
                tenant=ident.tenant, session=ident.session, id=uuid.uuid4().hex,
                request=ticket.id, ts=ts, kind="read_round", api=api, model=model, usage=usage,
                estimate=round_estimate, cost=self.prices.cost(model, rbilled),
                cache_reason=rreason, gap_s=ts - previous.ts, epoch=result.epoch,
                prefix=prefix)
            entries.append(entry)
            previous = entry
        return entries, mf

    def _reason(self, api: str, previous: LedgerEntry | None, current: Usage, measured: bool,
                *, gap: float | None, ttl: float, epoch_start: bool,
                change: ClientChange | None, cacheable: bool, head: int) -> str | None:
        """Why ``current``'s cached share fell (None: it held, or there was no previous call)."""
        if previous is None or not cacheable:
            return None
        if measured:
            writes = api == "messages" or previous.billed.cache_write > 0
            fell = cache_fell(previous.billed, current, writes_billed=writes)
        else:
            fell = (gap is not None and gap > ttl) or epoch_start or (
                change is not None and not change.extends)
        if not fell:
            return None
        return attribute(gap_s=gap, ttl_s=ttl, epoch_start=epoch_start, client=change, head=head)

    @staticmethod
    def _estimated(forwarded: int, shared: int, cacheable: bool, ttl: float,
                   output: int, api: str) -> Usage:
        if not cacheable:
            return Usage(input=forwarded, output=output)
        written = forwarded - shared
        if api != "messages":  # OpenAI bills no writes: the uncached part is input
            return Usage(input=written, cache_read=shared, output=output)
        if ttl >= 3600:
            return Usage(cache_read=shared, cache_write_1h=written, output=output)
        return Usage(cache_read=shared, cache_write_5m=written, output=output)

    @staticmethod
    def _output_estimate(answer: Any) -> int:
        # Without the provider's count, the answer's JSON at 4 bytes a token (as the fake and
        # the proxy's other fallbacks estimate).
        if answer is None:
            return 0
        try:
            return len(orjson.dumps(answer)) // 4
        except TypeError:
            return 0

    @staticmethod
    def _leading(items: Sequence[Any]) -> int:
        n = 0
        for item in items:
            if not isinstance(item, dict) or item.get("role") not in LEADING_ROLES:
                break
            n += 1
        return n

    @staticmethod
    def _since(parsed: Parsed, items: int) -> int:
        """The first history message holding an item beyond the first ``items``."""
        if not parsed.spans:
            return items
        for j, span in enumerate(parsed.spans):
            if span.stop > items:
                return j
        return len(parsed.spans)

    def _prefix_tokens(self, parsed: Parsed, change: ClientChange) -> int:
        """The client's tokens in the items it shares with its previous request (the tools and
        the first ``change.items`` items); 0 when not even the head is shared."""
        if change.at == -1 or not change.known:
            return 0
        # Counted through the pipeline's cached per-message counts: the history messages
        # wholly within the shared items.
        return self._count_prefix(parsed, self._since(parsed, change.items))

    def _count_prefix(self, parsed: Parsed, messages: int) -> int:
        return self.counter.request(parsed.history[:messages], parsed.model, parsed.tools)
