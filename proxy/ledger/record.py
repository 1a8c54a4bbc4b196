"""One request's ledger entries (:class:`LedgerEntry`), from what the client sent, what was
forwarded and what the provider billed, against the session's previous call (pure, but for the
tokenizer's caches): the counterfactual (:mod:`.cache`), the cache-break reason, what ctxproxy
changed (:mod:`.changes`), and a summarizer or fold call's entry. :mod:`.service` decides when
and where this runs, and keeps and writes the results."""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from proxy.catalog.prices import Prices
from proxy.config.ledger import LedgerConfig
from proxy.config.offload import OffloadConfig
from proxy.formats import Parsed
from proxy.formats.messages.request import strip_cache_control
from proxy.history.turns import LEADING_ROLES
from proxy.ledger.cache import (
    ClientChange,
    attribute,
    cache_fell,
    compare,
    direct_prompt,
    direct_usage,
    local_scale,
)
from proxy.ledger.changes import OWN_FORMS, describe
from proxy.model import PipelineResult
from proxy.session import Identity
from proxy.store.chains import DigestCacheLike, canonical, chain_hashes
from proxy.store.ledger_entry import Change, LedgerEntry, Prefix
from proxy.tokens.request import RequestCounter
from proxy.upstream.calls import Call
from proxy.usage import Usage, parse_usage

__all__ = ["Previous", "Recorder", "RequestCalls", "Ticket", "marker_free_chains"]

_TTL_1H: Final = re.compile(rb'"ttl"\s*:\s*"1h"')


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


@dataclass(slots=True)
class Previous:
    """A session's previous call and previous request, with that request's chains."""

    last: LedgerEntry
    request: LedgerEntry | None
    chains: Sequence[str] | None = None


class Recorder:
    """Computes a request's entries; holds what that needs (the config, prices, the pipeline's
    token counter with its caches, the archive's digest cache, the read tool's schema)."""

    def __init__(
        self, config: LedgerConfig, offload: OffloadConfig, prices: Prices,
        counter: RequestCounter, *, digest_cache: DigestCacheLike | None = None,
        read_tool: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.offload = offload
        self.prices = prices
        self.counter = counter  # the pipeline's, with its cached per-message counts
        self.digest_cache = digest_cache
        self.read_tool = read_tool  # the read tool's schema (chat shape), counted when offered

    def call(self, identity: Identity, call: Call) -> LedgerEntry:
        """A summarizer or fold call's entry."""
        usage = parse_usage(call.api, call.usage)
        return LedgerEntry(
            tenant=identity.tenant, session=identity.session, id=uuid.uuid4().hex,
            request="", ts=call.ts, kind=call.kind, api=call.api, model=call.model,
            usage=usage, estimate=None if usage is not None else Usage(),
            cost=self.prices.cost(call.model, usage or Usage()), status=call.status)

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

    def entries(
        self, ticket: Ticket, parsed: Parsed, chains: Sequence[str], raw: bytes,
        result: PipelineResult, calls: RequestCalls, state: Previous | None,
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
