"""The ledger's parts of the ``/files`` payloads (pure: ledger values in, JSON-able dicts out).

A session's page gets its totals and its newest calls (:func:`session_ledger`), the index one
row of totals per tenant (:func:`tenant_rows`) and, per session, its cost (:func:`cost_of`);
a request's page its entry (:func:`entry_row`) and what ctxproxy changed in it. Amounts are USD
floats, ``None`` where no price is known; times are ISO 8601 strings as everywhere in /files.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, Final

from proxy.store.ledger_entry import Change, LedgerEntry, LedgerTotals
from proxy.store.times import format_ts
from proxy.usage import Usage

__all__ = [
    "LEDGER_ROWS",
    "by_request",
    "change_json",
    "cost_of",
    "entry_row",
    "session_ledger",
    "sum_totals",
    "tenant_rows",
    "totals_json",
    "usage_json",
]

LEDGER_ROWS: Final = 2000  # calls a session page lists (the newest); its totals count them all


def _time(ts: float) -> str | None:
    return format_ts(datetime.fromtimestamp(ts, UTC)) if ts else None


def usage_json(u: Usage) -> dict[str, int]:
    """Every count, zeros included, with the sums a page shows (written, prompt)."""
    return {"input": u.input, "cache_read": u.cache_read, "cache_write_5m": u.cache_write_5m,
            "cache_write_1h": u.cache_write_1h, "cache_write": u.cache_write,
            "output": u.output, "reasoning": u.reasoning, "prompt": u.prompt}


def _saved(direct_cost: float | None, cost: float | None) -> float | None:
    return None if direct_cost is None or cost is None else direct_cost - cost


def entry_row(e: LedgerEntry, session_url: str, number: int | None = None) -> dict[str, Any]:
    """One call: what the session's table lists and its page shows (``number``: the request's
    place in the chart, request entries only)."""
    return {
        "id": e.id,
        "request": e.request,
        "url": f"{session_url}/requests/{e.id}",
        "number": number,
        "time": _time(e.ts),
        "ts": e.ts,
        "kind": e.kind,
        "api": e.api,
        "model": e.model,
        "status": e.status,
        "estimated": e.estimated,
        "billed": usage_json(e.billed),
        "usage": None if e.usage is None else usage_json(e.usage),
        "cost": e.cost,
        "tokens_sent": e.tokens_sent,
        "tokens_forwarded": e.tokens_forwarded,
        "direct": None if e.direct is None else usage_json(e.direct),
        "direct_cost": e.direct_cost,
        "saved": _saved(e.direct_cost, e.cost) if e.kind == "request" else None,
        "cache_reason": e.cache_reason,
        "gap_s": e.gap_s,
        "epoch": e.epoch,
        "compacted": e.compacted,
        "compaction": e.compaction,
        "offloaded": e.offloaded,
        "rounds": e.rounds,
        "changes": len(e.changes),
        "changes_from": e.changes_from,
    }


def totals_json(t: LedgerTotals) -> dict[str, Any]:
    return {
        "requests": t.requests,
        "calls": t.calls,
        "estimated": t.estimated,
        "unpriced": t.unpriced,
        "tokens_sent": t.tokens_sent,
        "tokens_forwarded": t.tokens_forwarded,
        "billed": usage_json(t.billed),
        "direct": usage_json(t.direct),
        "cost": t.cost,
        "direct_cost": t.direct_cost,
        "saved": t.saved,
        "breaks": dict(t.breaks),
        "first": _time(t.first_ts),
        "last": _time(t.last_ts),
    }


def session_ledger(entries: Sequence[LedgerEntry], totals: LedgerTotals | None,
                   session_url: str, limit: int = LEDGER_ROWS) -> dict[str, Any]:
    """A session page's ``ledger``: its totals (every call) and ``entries``, its newest
    ``limit`` calls oldest first (request entries numbered in that order, as in the chart)."""
    shown = list(entries)[-limit:] if limit else []
    rows = []
    number = 0
    for e in shown:
        if e.kind == "request":
            number += 1
        rows.append(entry_row(e, session_url, number if e.kind == "request" else None))
    calls = totals.calls if totals is not None else len(shown)
    return {
        "totals": None if totals is None else totals_json(totals),
        "entries": rows,
        "shown": len(rows),
        "limit": limit,
        "calls": calls,
        "truncated": calls > len(rows),
    }


def cost_of(t: LedgerTotals) -> dict[str, Any]:
    """A session's money on the index: what it cost, directly, and saved."""
    return {"requests": t.requests, "calls": t.calls, "cost": t.cost,
            "direct_cost": t.direct_cost, "saved": t.saved, "unpriced": t.unpriced}


def sum_totals(tenant: str, rows: Iterable[LedgerTotals]) -> LedgerTotals:
    """Sessions' totals added up (``session`` is empty: it is the tenant's)."""
    billed = direct = Usage()
    breaks: dict[str, int] = {}
    fields = {"requests": 0, "calls": 0, "estimated": 0, "unpriced": 0, "tokens_sent": 0,
              "tokens_forwarded": 0}
    cost = direct_cost = 0.0
    first, last = 0.0, 0.0
    for t in rows:
        for name in fields:
            fields[name] += getattr(t, name)
        billed, direct = billed + t.billed, direct + t.direct
        cost += t.cost
        direct_cost += t.direct_cost
        for reason, n in t.breaks.items():
            breaks[reason] = breaks.get(reason, 0) + n
        first = min(first, t.first_ts) if first else t.first_ts
        last = max(last, t.last_ts)
    return LedgerTotals(tenant, "", billed=billed, direct=direct, cost=cost,
                        direct_cost=direct_cost, breaks=breaks, first_ts=first, last_ts=last,
                        **fields)


def tenant_rows(totals: Iterable[LedgerTotals]) -> list[dict[str, Any]]:
    """One row per tenant (its sessions' totals summed), tenants in name order."""
    by_tenant: dict[str, list[LedgerTotals]] = {}
    for t in totals:
        by_tenant.setdefault(t.tenant, []).append(t)
    return [{"tenant": tenant, "sessions": len(rows), **totals_json(sum_totals(tenant, rows))}
            for tenant, rows in sorted(by_tenant.items())]


def change_json(c: Change) -> dict[str, Any]:
    """Every field of a change, absent ones as None (a template can name each)."""
    return {"what": c.what, "reason": c.reason, "at": c.at, "upto": c.upto, "role": c.role,
            "call_id": c.call_id, "tool": c.tool, "bytes_before": c.bytes_before,
            "bytes_after": c.bytes_after, "kept_bytes": c.kept_bytes, "notice": c.notice,
            "file": c.file}


def by_request(entries: Iterable[LedgerEntry], request: str, own: str) -> list[LedgerEntry]:
    """The calls made for ``request`` other than the entry ``own`` itself."""
    return [e for e in entries if e.request == request and e.id != own]
