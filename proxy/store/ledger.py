"""The cost ledger's rows (the ``LedgerStore`` Protocol; values in :mod:`proxy.store.ledger_entry`),
in the files backend's SQLite database; :mod:`proxy.store.postgres.ledger` is the same store
over PostgreSQL, with the same SQL.

Three tables:

* ``ledger``: one row per billed call, keyed by ``(tenant, session, id)``. Columns for what is
  summed, searched or ordered (the kind, the model, the billed and counterfactual usage parts,
  the costs, the cache reason), and ``body``, the whole entry (:func:`encode_entry`), from which
  an entry is read back. A retried write of an id adds nothing (``ON CONFLICT DO NOTHING``).
* ``ledger_sessions``: the totals per session, added to in the transaction that inserts the
  rows, by what was actually inserted, so a tenant's page is one indexed query, never a scan.
* ``ledger_breaks``: the cache breaks per session and reason (a reason is any string, so a row
  each, summed by an upsert as the totals are).

The totals are :meth:`LedgerTotals.of` the session's rows: an insert adds ``LedgerTotals.of``
the new rows, :meth:`SqlLedger.expire` recomputes the sessions it deleted from in SQL, with the
same rules (sums over request entries only for what only requests carry, ``cost`` the sum of
the priced ones). Floats are summed as REAL / double precision: equal up to rounding.

Retention: entries older than ``storage.dialog_ttl_days`` are expired by the gc with the
archive (:mod:`proxy.store.gc`, and the PostgreSQL backend's ``collect``). They do not count
toward a tenant's disk quota: a few hundred bytes per call, and a quota must never stop the
accounting of what the proxy still forwards (the ledger service skips its writes for a tenant
over quota, as the archive does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from itertools import groupby
from typing import Any, Final, Protocol

from proxy.store.db import Database
from proxy.store.ledger_entry import LedgerEntry, LedgerTotals, decode_entry, encode_entry
from proxy.store.paths import check_name
from proxy.usage import Usage

__all__ = ["PG_SQL", "SQLITE_SQL", "Cursor", "Execute", "LedgerSql", "SqlLedger", "SqliteLedger", "like_pattern"]

# Usage's parts as columns (the billed ones bare, the counterfactual's prefixed ``direct_``).
_PARTS: Final = ("input", "cache_read", "cache_write_5m", "cache_write_1h", "output",
                 "reasoning", "iterations")
_DIRECT: Final = tuple(f"direct_{p}" for p in _PARTS)
_ENTRY_COLUMNS: Final = ("tenant", "session", "id", "request", "ts", "kind", "api", "model",
                         "status", "tokens_sent", "tokens_forwarded", *_PARTS, "estimated",
                         "cost", *_DIRECT, "direct_cost", "cache_reason", "body")
_COUNTS: Final = ("requests", "calls", "estimated", "tokens_sent", "tokens_forwarded", *_PARTS,
                  *_DIRECT, "cost", "direct_cost", "unpriced")
_TOTALS_COLUMNS: Final = ("tenant", "session", *_COUNTS, "first_ts", "last_ts")
# What one session's rows sum to, in the order of _TOTALS_COLUMNS (LedgerTotals.of in SQL).
_REQUEST: Final = "kind = 'request'"
_AGGREGATES: Final = (
    "tenant", "session",
    f"sum(CASE WHEN {_REQUEST} THEN 1 ELSE 0 END)", "count(*)",
    "sum(CASE WHEN estimated THEN 1 ELSE 0 END)",
    f"sum(CASE WHEN {_REQUEST} THEN tokens_sent ELSE 0 END)",
    f"sum(CASE WHEN {_REQUEST} THEN tokens_forwarded ELSE 0 END)",
    *(f"sum({p})" for p in _PARTS),
    *(f"sum(CASE WHEN {_REQUEST} THEN {d} ELSE 0 END)" for d in _DIRECT),
    "coalesce(sum(cost), 0.0)",
    f"coalesce(sum(CASE WHEN {_REQUEST} THEN direct_cost END), 0.0)",
    "sum(CASE WHEN cost IS NULL THEN 1 ELSE 0 END)",
    "min(ts)", "max(ts)",
)
_SESSION: Final = "tenant = {m} AND session = {m}"


class Cursor(Protocol):
    @property
    def rowcount(self) -> int: ...

    def fetchall(self) -> list[Any]: ...

    def fetchone(self) -> Any: ...


Execute = Callable[[str, Sequence[Any]], Cursor]


@dataclass(frozen=True, slots=True)
class LedgerSql:
    """The statements, in one dialect: ``mark`` the parameter placeholder, ``least`` and
    ``greatest`` the two-argument min and max, ``order`` the insertion order's column."""

    insert: str
    add_totals: str
    add_break: str
    recompute_totals: str
    recompute_breaks: str
    forget_totals: str
    forget_breaks: str
    expire: str
    entry: str
    entries: str
    entries_of_kind: str
    newest: str
    newest_of_kind: str
    last: str
    totals: str
    mark: str

    @classmethod
    def build(cls, mark: str, least: str, greatest: str, order: str) -> LedgerSql:
        session = _SESSION.format(m=mark)
        counts = ", ".join(f"{c} = ledger_sessions.{c} + excluded.{c}" for c in _COUNTS)
        # Oldest first; "newest" takes the last n and puts them back in that order.
        oldest = f"ORDER BY ts, {order}"
        body = f"SELECT body FROM ledger WHERE {session}"
        newest = (f"SELECT body FROM (SELECT body, ts, {order} AS o FROM ledger "
                  f"WHERE {session}{{kind}} ORDER BY ts DESC, {order} DESC LIMIT {mark}) AS n "
                  "ORDER BY ts, o")
        return cls(
            insert=(f"INSERT INTO ledger ({', '.join(_ENTRY_COLUMNS)}) "
                    f"VALUES ({', '.join([mark] * len(_ENTRY_COLUMNS))}) "
                    "ON CONFLICT (tenant, session, id) DO NOTHING"),
            add_totals=(
                f"INSERT INTO ledger_sessions ({', '.join(_TOTALS_COLUMNS)}) "
                f"VALUES ({', '.join([mark] * len(_TOTALS_COLUMNS))}) "
                f"ON CONFLICT (tenant, session) DO UPDATE SET {counts}, "
                f"first_ts = {least}(ledger_sessions.first_ts, excluded.first_ts), "
                f"last_ts = {greatest}(ledger_sessions.last_ts, excluded.last_ts)"),
            add_break=(f"INSERT INTO ledger_breaks (tenant, session, reason, n) "
                       f"VALUES ({mark}, {mark}, {mark}, {mark}) "
                       "ON CONFLICT (tenant, session, reason) DO UPDATE SET "
                       "n = ledger_breaks.n + excluded.n"),
            recompute_totals=(
                f"INSERT INTO ledger_sessions ({', '.join(_TOTALS_COLUMNS)}) "
                f"SELECT {', '.join(_AGGREGATES)} FROM ledger WHERE {session} "
                "GROUP BY tenant, session"),
            recompute_breaks=(
                "INSERT INTO ledger_breaks (tenant, session, reason, n) "
                f"SELECT tenant, session, cache_reason, count(*) FROM ledger WHERE {session} "
                f"AND {_REQUEST} AND cache_reason IS NOT NULL AND cache_reason <> '' "
                "GROUP BY tenant, session, cache_reason"),
            forget_totals=f"DELETE FROM ledger_sessions WHERE {session}",
            forget_breaks=f"DELETE FROM ledger_breaks WHERE {session}",
            expire=f"DELETE FROM ledger WHERE ts < {mark} RETURNING tenant, session",
            entry=f"{body} AND id = {mark}",
            entries=f"{body} {oldest}",
            entries_of_kind=f"{body} AND kind = {mark} {oldest}",
            newest=newest.format(kind=""),
            newest_of_kind=newest.format(kind=f" AND kind = {mark}"),
            last=(f"{body} AND kind IN ('request', 'read_round') "
                  f"ORDER BY ts DESC, {order} DESC LIMIT 1"),
            # The page's sessions first (their LIMIT), then their breaks: one row per break.
            totals=(f"SELECT t.*, b.reason, b.n FROM (SELECT {', '.join(_TOTALS_COLUMNS)} "
                    "FROM ledger_sessions{where} ORDER BY last_ts DESC, tenant, session{limit}) "
                    "AS t LEFT JOIN ledger_breaks AS b ON b.tenant = t.tenant "
                    "AND b.session = t.session ORDER BY t.last_ts DESC, t.tenant, t.session, "
                    "b.reason"),
            mark=mark,
        )


SQLITE_SQL: Final = LedgerSql.build("?", "min", "max", "rowid")
PG_SQL: Final = LedgerSql.build("%s", "least", "greatest", "seq")


def like_pattern(search: str) -> str:
    """A LIKE pattern (``ESCAPE '\\'``) matching names that contain ``search`` literally,
    lower-cased: ``%`` and ``_`` in what a user typed are characters, not wildcards."""
    escaped = search.lower().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def _text(value: str | None) -> str | None:
    # PostgreSQL's text refuses NUL; the body keeps the exact string, the column is for search.
    return None if value is None else value.replace("\x00", "\ufffd")


def _entry_row(e: LedgerEntry) -> tuple[Any, ...]:
    billed = e.billed
    direct = e.direct or Usage()
    return (e.tenant, e.session, e.id, _text(e.request), e.ts, _text(e.kind), _text(e.api),
            _text(e.model), e.status, e.tokens_sent, e.tokens_forwarded,
            *(getattr(billed, p) for p in _PARTS), e.estimated, e.cost,
            *(getattr(direct, p) for p in _PARTS), e.direct_cost, _text(e.cache_reason),
            encode_entry(e))


def _totals_row(t: LedgerTotals) -> tuple[Any, ...]:
    return (t.tenant, t.session, t.requests, t.calls, t.estimated, t.tokens_sent,
            t.tokens_forwarded, *(getattr(t.billed, p) for p in _PARTS),
            *(getattr(t.direct, p) for p in _PARTS), t.cost, t.direct_cost, t.unpriced,
            t.first_ts, t.last_ts)


def _totals(row: Sequence[Any], breaks: dict[str, int]) -> LedgerTotals:
    n = len(_PARTS)
    billed = Usage(*(int(v) for v in row[7:7 + n]))
    direct = Usage(*(int(v) for v in row[7 + n:7 + 2 * n]))
    at = 7 + 2 * n
    return LedgerTotals(
        str(row[0]), str(row[1]), requests=int(row[2]), calls=int(row[3]),
        estimated=int(row[4]), tokens_sent=int(row[5]), tokens_forwarded=int(row[6]),
        billed=billed, direct=direct, cost=float(row[at]), direct_cost=float(row[at + 1]),
        unpriced=int(row[at + 2]), breaks=breaks, first_ts=float(row[at + 3]),
        last_ts=float(row[at + 4]))


def _session_of(e: LedgerEntry) -> tuple[str, str]:
    return e.tenant, e.session


def _limit(limit: int | None) -> int | None:
    return None if limit is None else max(0, int(limit))


class SqlLedger:
    """The ledger over SQL (either dialect); a subclass says how to get a connection. Every
    query is scoped by tenant and session (``totals`` by tenant unless it is the master's)."""

    sql: LedgerSql = SQLITE_SQL

    def _reading(self) -> AbstractContextManager[Execute]:
        raise NotImplementedError

    def _writing(self) -> AbstractContextManager[Execute]:
        """One transaction: everything it executes commits together or not at all."""
        raise NotImplementedError

    def add(self, entries: Sequence[LedgerEntry]) -> None:
        self.insert(entries)

    def insert(self, entries: Sequence[LedgerEntry]) -> int:
        """:meth:`add`, returning how many entries were new."""
        for e in entries:
            check_name(e.tenant, "tenant")
            check_name(e.session, "session")
            check_name(e.id, "ledger entry id")
        if not entries:
            return 0
        with self._writing() as execute:
            # The rows in the caller's order (it breaks ties of ts), the totals in the sessions'
            # order, so two writers adding to the same sessions never wait on each other in a
            # cycle.
            new = [e for e in entries if execute(self.sql.insert, _entry_row(e)).rowcount == 1]
            for (tenant, name), rows in groupby(sorted(new, key=_session_of), key=_session_of):
                totals = LedgerTotals.of(tenant, name, list(rows))
                execute(self.sql.add_totals, _totals_row(totals))
                for reason, n in sorted(totals.breaks.items()):
                    execute(self.sql.add_break, (tenant, name, _text(reason), n))
        return len(new)

    def entries(self, tenant: str, session: str, *, kind: str | None = None,
                limit: int | None = None) -> list[LedgerEntry]:
        n = _limit(limit)
        params: tuple[Any, ...] = (tenant, session) if kind is None else (tenant, session, kind)
        if n is None:
            query = self.sql.entries if kind is None else self.sql.entries_of_kind
        else:
            query = self.sql.newest if kind is None else self.sql.newest_of_kind
            params = (*params, n)
        with self._reading() as execute:
            rows = execute(query, params).fetchall()
        return [decode_entry(bytes(r[0])) for r in rows]

    def entry(self, tenant: str, session: str, entry_id: str) -> LedgerEntry | None:
        with self._reading() as execute:
            row = execute(self.sql.entry, (tenant, session, entry_id)).fetchone()
        return None if row is None else decode_entry(bytes(row[0]))

    def last(self, tenant: str, session: str) -> LedgerEntry | None:
        with self._reading() as execute:
            row = execute(self.sql.last, (tenant, session)).fetchone()
        return None if row is None else decode_entry(bytes(row[0]))

    def totals(self, tenant: str | None = None, *, search: str | None = None,
               limit: int | None = None) -> list[LedgerTotals]:
        m = self.sql.mark
        where: list[str] = []
        params: list[Any] = []
        if tenant is not None:
            where.append(f"tenant = {m}")
            params.append(tenant)
        if search:
            where.append(f"lower(session) LIKE {m} ESCAPE '\\'")
            params.append(like_pattern(search))
        n = _limit(limit)
        if n is not None:
            params.append(n)
        query = self.sql.totals.format(
            where=" WHERE " + " AND ".join(where) if where else "",
            limit="" if n is None else f" LIMIT {m}")
        with self._reading() as execute:
            rows = execute(query, params).fetchall()
        width = len(_TOTALS_COLUMNS)
        out: list[LedgerTotals] = []
        for _, group in groupby(rows, key=lambda r: (r[0], r[1])):
            got = list(group)
            breaks = {str(r[width]): int(r[width + 1]) for r in got if r[width] is not None}
            out.append(_totals(got[0], breaks))
        return out

    def expire(self, before: float) -> int:
        with self._writing() as execute:
            gone = execute(self.sql.expire, (before,)).fetchall()
            for tenant, session in sorted({(str(r[0]), str(r[1])) for r in gone}):
                for query in (self.sql.forget_totals, self.sql.forget_breaks,
                              self.sql.recompute_totals, self.sql.recompute_breaks):
                    execute(query, (tenant, session))
        return len(gone)


class SqliteLedger(SqlLedger):
    """The ledger in the files backend's SQLite database (tables ``ledger``,
    ``ledger_sessions``, ``ledger_breaks``); insertion order is the rowid's."""

    sql = SQLITE_SQL

    def __init__(self, db: Database) -> None:
        self.db = db

    @contextmanager
    def _reading(self) -> Iterator[Execute]:
        with self.db.connect() as conn:
            yield conn.execute

    @contextmanager
    def _writing(self) -> Iterator[Execute]:
        with self.db.transaction() as conn:
            yield conn.execute
