"""The ledger's records: one :class:`LedgerEntry` per call the provider bills, and the totals a
store keeps per session (pure values, schema-versioned like the dialog archive's lines).

Kinds of entry:

* ``request``: a client's request as forwarded (its first upstream call);
* ``read_round``: a further call the proxy's read-tool loop made for that request;
* ``summarizer``: a compaction's summarizer call;
* ``memory_fold``: long-term memory's fold call.

Every entry carries the provider's usage when it reported one (``usage``), else the proxy's
own estimate (``estimate``; ``usage`` None), and its cost at the prices in force when it was
recorded (``cost``; None for a model without a price). A ``request`` entry also carries what
the client sent (``tokens_sent``, our count), what was forwarded (``tokens_forwarded``), the
counterfactual (``direct``: the same request sent by the client directly, priced under the same
caching rules, :mod:`proxy.ledger.cache`) and, when its cached share fell, why
(``cache_reason``). ``changes`` lists what ctxproxy changed in it (:mod:`proxy.ledger.changes`);
``prefix`` is what the session's next request compares itself with.

On disk an entry is one row: indexed columns for what is summed or searched, and ``body``, the
whole entry as JSON with ``"v": SCHEMA``. A reader accepts every version up to its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import orjson

from proxy.usage import Usage

__all__ = [
    "CACHE_REASONS",
    "KINDS",
    "SCHEMA",
    "Change",
    "LedgerEntry",
    "LedgerTotals",
    "Prefix",
    "decode_entry",
    "encode_entry",
]

SCHEMA: Final = 1
Kind = Literal["request", "read_round", "summarizer", "memory_fold"]
KINDS: Final[tuple[str, ...]] = ("request", "read_round", "summarizer", "memory_fold")
# Why a request's cached share fell (docs/ledger.md#why-a-cache-broke): the proxy's compaction
# started an epoch, the client changed its own history, the cache's TTL lapsed, or none of
# these.
CACHE_REASONS: Final[tuple[str, ...]] = ("compaction", "client", "ttl", "unknown")


@dataclass(frozen=True, slots=True)
class Change:
    """One thing ctxproxy did to a forwarded request (see :mod:`proxy.ledger.changes`)."""

    what: str  # "cut", "aged", "harder", "evicted", "summary", "memory", "replayed", ...
    reason: str  # one sentence for people
    at: int | None = None  # index in the client's history (the first, for a range)
    upto: int | None = None  # evicted range end (exclusive)
    role: str | None = None
    call_id: str | None = None
    tool: str | None = None  # the tool whose call produced a cut result
    bytes_before: int = 0
    bytes_after: int = 0
    kept_bytes: int | None = None  # a cut: the excerpt is the original's first kept_bytes bytes
    notice: str | None = None  # a cut: the notice appended to the excerpt, as forwarded
    file: str | None = None  # the original's file in the session (tool_result/<id>.txt)

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _CHANGE_FIELDS if getattr(self, k) is not None}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Change:
        return cls(**{k: data[k] for k in _CHANGE_FIELDS if k in data})


_CHANGE_FIELDS: Final = ("what", "reason", "at", "upto", "role", "call_id", "tool",
                         "bytes_before", "bytes_after", "kept_bytes", "notice", "file")


@dataclass(frozen=True, slots=True)
class Prefix:
    """What a client request was, for comparing the session's next request with it (the
    counterfactual's cached prefix): how many items it held, the marker-free chain of its last
    one, and a digest of what precedes the conversation in the provider's cache (model, tools)."""

    items: int = 0
    last: str = ""
    head: str = ""
    ttl_s: float = 300.0  # the client's cache TTL (1 h when it marks ttl "1h")
    cacheable: bool = True  # whether the client's request would be cached at all

    def to_json(self) -> dict[str, Any]:
        return {"items": self.items, "last": self.last, "head": self.head, "ttl_s": self.ttl_s,
                "cacheable": self.cacheable}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Prefix:
        return cls(items=int(data.get("items", 0)), last=str(data.get("last", "")),
                   head=str(data.get("head", "")), ttl_s=float(data.get("ttl_s", 300.0)),
                   cacheable=bool(data.get("cacheable", True)))


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    tenant: str
    session: str
    id: str  # unique per call (hex)
    request: str  # the client request this call belongs to (== id for kind "request")
    ts: float  # unix seconds: when the call was sent (a request: when it arrived)
    kind: Kind
    api: str  # "chat", "responses", "messages"
    model: str
    usage: Usage | None = None  # the provider's own count (None: it reported none)
    estimate: Usage | None = None  # the proxy's estimate, used when ``usage`` is None
    cost: float | None = None  # USD at the prices in force when recorded (None: no price)
    status: int = 200  # the upstream's status
    # Request entries only ------------------------------------------------------------------
    tokens_sent: int = 0  # the client's request, our count
    tokens_forwarded: int = 0  # the forwarded request, our count
    direct: Usage | None = None  # the counterfactual: the client's request sent directly
    direct_cost: float | None = None
    cache_reason: str | None = None  # why the cached share fell (CACHE_REASONS); None: it held
    gap_s: float | None = None  # seconds since the session's previous call (None: the first)
    scale: float | None = None  # provider tokens per proxy token (the counterfactual's calibration)
    epoch: str = ""  # the epoch the request was forwarded in (proxy.history.epoch)
    compacted: bool = False  # the forwarded request carries a summary
    compaction: bool = False  # this request made a new one
    offloaded: int = 0  # tool results forwarded cut
    rounds: int = 0  # read-tool rounds after the first call
    changes: tuple[Change, ...] = ()
    # The first history message ``changes`` covers: 0, every change (an epoch's first request,
    # an edited history); else only the messages this request added, the rest being forwarded
    # as the previous request forwarded them (the epoch rule).
    changes_from: int = 0
    prefix: Prefix | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # fields of a newer schema, kept

    @property
    def billed(self) -> Usage:
        """The tokens this call is counted with: the provider's, else the estimate."""
        return self.usage or self.estimate or Usage()

    @property
    def estimated(self) -> bool:
        return self.usage is None


_SCALARS: Final = ("tenant", "session", "id", "request", "ts", "kind", "api", "model", "cost",
                   "status", "tokens_sent", "tokens_forwarded", "direct_cost", "cache_reason",
                   "gap_s", "scale", "epoch", "compacted", "compaction", "offloaded", "rounds",
                   "changes_from")
_USAGES: Final = ("usage", "estimate", "direct")


def encode_entry(entry: LedgerEntry) -> bytes:
    """The entry as its JSON body (``"v": SCHEMA``)."""
    data: dict[str, Any] = dict(entry.extra)
    data["v"] = SCHEMA
    for name in _SCALARS:
        data[name] = getattr(entry, name)
    for name in _USAGES:
        value = getattr(entry, name)
        data[name] = None if value is None else value.to_json()
    data["changes"] = [c.to_json() for c in entry.changes]
    data["prefix"] = None if entry.prefix is None else entry.prefix.to_json()
    return orjson.dumps(data)


def decode_entry(body: bytes | str) -> LedgerEntry:
    """An entry from its JSON body; fields a newer schema added are kept in ``extra``."""
    data = orjson.loads(body)
    if not isinstance(data, dict) or not isinstance(data.get("v"), int):
        raise ValueError("not a ledger entry")
    known = set(_SCALARS) | set(_USAGES) | {"v", "changes", "prefix"}
    def usage(name: str) -> Usage | None:
        value = data.get(name)
        return Usage.from_json(value) if isinstance(value, dict) else None

    changes = tuple(Change.from_json(c) for c in data.get("changes") or () if isinstance(c, dict))
    prefix = Prefix.from_json(data["prefix"]) if isinstance(data.get("prefix"), dict) else None
    return LedgerEntry(
        **{name: data[name] for name in _SCALARS if name in data},
        usage=usage("usage"), estimate=usage("estimate"), direct=usage("direct"),
        changes=changes, prefix=prefix,
        extra={k: v for k, v in data.items() if k not in known},
    )


@dataclass(frozen=True, slots=True)
class LedgerTotals:
    """A session's sums over its entries (what the tenant's page lists)."""

    tenant: str
    session: str
    requests: int = 0  # request entries
    calls: int = 0  # every entry
    estimated: int = 0  # entries without the provider's usage
    tokens_sent: int = 0
    tokens_forwarded: int = 0
    billed: Usage = Usage()  # summed over every entry (read rounds, summaries, folds included)
    direct: Usage = Usage()  # summed over request entries
    cost: float = 0.0  # USD, entries with a price
    direct_cost: float = 0.0
    unpriced: int = 0  # entries whose model has no price (their cost is not in ``cost``)
    breaks: Mapping[str, int] = field(default_factory=dict)  # cache_reason -> requests
    first_ts: float = 0.0
    last_ts: float = 0.0

    @property
    def saved(self) -> float:
        """USD the client saved through ctxproxy (negative: it paid more), net of every cost."""
        return self.direct_cost - self.cost

    @staticmethod
    def of(tenant: str, session: str, entries: Sequence[LedgerEntry]) -> LedgerTotals:
        """The totals of ``entries`` (a store may sum in SQL instead: the same numbers)."""
        billed = direct = Usage()
        cost = direct_cost = 0.0
        breaks: dict[str, int] = {}
        requests = estimated = unpriced = sent = forwarded = 0
        for e in entries:
            billed = billed + e.billed
            estimated += e.estimated
            if e.cost is None:
                unpriced += 1
            else:
                cost += e.cost
            if e.kind == "request":
                requests += 1
                sent += e.tokens_sent
                forwarded += e.tokens_forwarded
                if e.direct is not None:
                    direct = direct + e.direct
                direct_cost += e.direct_cost or 0.0
                if e.cache_reason:
                    breaks[e.cache_reason] = breaks.get(e.cache_reason, 0) + 1
        return LedgerTotals(
            tenant, session, requests=requests, calls=len(entries), estimated=estimated,
            tokens_sent=sent, tokens_forwarded=forwarded, billed=billed, direct=direct,
            cost=cost, direct_cost=direct_cost, unpriced=unpriced, breaks=breaks,
            first_ts=min((e.ts for e in entries), default=0.0),
            last_ts=max((e.ts for e in entries), default=0.0),
        )
