"""Summary records in PostgreSQL (the ``Summaries`` Protocol) and the cross-replica single
flight of summarizer calls (the ``Claims`` Protocol).

First writer wins, across replicas: :meth:`PgSummaries.put` inserts with ``ON CONFLICT DO
NOTHING`` and returns whatever the table then holds, so concurrent compactions of the same
prefix on different replicas converge on one text (a ``fallback`` record is still replaced by a
``model`` one, as in the files backend). The ``.md`` copy for people is rendered from the row
when ``/files`` asks for it; nothing is written to disk.

Claims: before a summarizer call, a replica claims (tenant, session, chain) with an expiry;
another replica needing the same compaction finds the claim taken and polls for the summary
(a primary-key probe every ``POLL_S``) instead of calling the summarizer too. A replica that
dies holding a claim only delays the others until ``expires_at``; then the next one claims it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Final

import orjson

from proxy.store.dialog import FileSpan
from proxy.store.postgres.pool import PgPool
from proxy.store.summaries import SummaryRecord, _markdown, _replaces

__all__ = ["PgSummaries"]

log = logging.getLogger("proxy.store")

_COLUMNS: Final = ("tenant, session, chain, v, head, upto, previous_chain, text, source, model, "
                   "created_at, tokens_before, tokens_after, span, seen, error")
_MARKS: Final = ", ".join(["%s"] * len(_COLUMNS.split(",")))


def _row(rec: SummaryRecord) -> tuple[object, ...]:
    return (rec.tenant, rec.session, rec.chain, rec.v, rec.head, rec.upto, rec.previous_chain,
            rec.text, rec.source, rec.model, rec.created_at, rec.tokens_before,
            rec.tokens_after, orjson.dumps([list(s) for s in rec.span]).decode(), rec.seen,
            rec.error)


def _record(row: Sequence[Any]) -> SummaryRecord:
    (tenant, session, chain, v, head, upto, previous, text, source, model, created,
     before, after, span, seen, error) = row
    return SummaryRecord(
        tenant=tenant, session=session, chain=chain, head=head, upto=upto, text=text,
        source="model" if source == "model" else "fallback", model=model, created_at=created,
        tokens_before=before, tokens_after=after, previous_chain=previous,
        span=tuple(FileSpan(str(f), int(a), int(b)) for f, a, b in orjson.loads(span)),
        v=v, seen=seen, error=error,
    )


class PgSummaries:
    shared = True  # other replicas write here too: in-memory indexes are only hints

    def __init__(self, pool: PgPool, *, owner: str) -> None:
        self.pool = pool
        self.owner = owner  # this replica, in claims

    def get(self, tenant: str, session: str, chain: str) -> SummaryRecord | None:
        with self.pool.connection() as conn:
            row = conn.execute(
                f"SELECT {_COLUMNS} FROM summaries WHERE tenant = %s AND session = %s "
                "AND chain = %s", (tenant, session, chain)).fetchone()
        return None if row is None else _record(row)

    def chains(self, tenant: str, session: str) -> set[str]:
        with self.pool.connection() as conn:
            rows = conn.execute("SELECT chain FROM summaries WHERE tenant = %s AND session = %s",
                                (tenant, session)).fetchall()
        return {r[0] for r in rows}

    def find_latest(self, tenant: str, session: str,
                    chains: Sequence[str]) -> SummaryRecord | None:
        """The summary of the largest ``i`` with one for ``chains[i]``, in one query."""
        if not chains:
            return None
        cols = ", ".join("s." + c.strip() for c in _COLUMNS.split(","))
        with self.pool.connection() as conn:
            row = conn.execute(
                f"""SELECT {cols} FROM unnest(%s::text[]) WITH ORDINALITY AS j(chain, i)
                    JOIN summaries AS s
                      ON s.tenant = %s AND s.session = %s AND s.chain = j.chain
                    ORDER BY j.i DESC LIMIT 1""",
                (list(chains), tenant, session)).fetchone()
        return None if row is None else _record(row)

    def put(self, record: SummaryRecord, *, replace: bool = False) -> SummaryRecord:
        key = (record.tenant, record.session, record.chain)
        with self.pool.connection() as conn, conn.transaction():
            conn.execute(f"INSERT INTO summaries ({_COLUMNS}) VALUES ({_MARKS}) "
                         "ON CONFLICT DO NOTHING", _row(record))
            row = conn.execute(
                f"SELECT {_COLUMNS} FROM summaries WHERE tenant = %s AND session = %s "
                "AND chain = %s FOR UPDATE", key).fetchone()
            stored = record if row is None else _record(row)
            if stored != record and _replaces(stored, record, replace):
                conn.execute("DELETE FROM summaries WHERE tenant = %s AND session = %s "
                             "AND chain = %s", key)
                conn.execute(f"INSERT INTO summaries ({_COLUMNS}) VALUES ({_MARKS})",
                             _row(record))
                stored = record
        return stored

    def history(self, tenant: str, session: str) -> list[SummaryRecord]:
        with self.pool.connection() as conn:
            rows = conn.execute(
                f"SELECT {_COLUMNS} FROM summaries WHERE tenant = %s AND session = %s "
                "ORDER BY created_at, upto", (tenant, session)).fetchall()
        return [_record(r) for r in rows]

    def markdown(self, tenant: str, session: str, name: str) -> bytes | None:
        """The ``.md`` copy named ``name``, rendered from its row (for /files)."""
        for rec in self.history(tenant, session):
            if rec.md_name == name:
                return _markdown(rec)
        return None

    # --- claims: one summarizer call per compaction, across replicas ---------------------

    def claim(self, tenant: str, session: str, chain: str, ttl_s: float) -> bool:
        """Take the claim on this compaction (or renew this replica's own); False while
        another replica holds an unexpired one."""
        with self.pool.connection() as conn:
            row = conn.execute(
                """INSERT INTO claims (tenant, session, chain, owner, expires_at)
                   VALUES (%s, %s, %s, %s, now() + %s)
                   ON CONFLICT (tenant, session, chain) DO UPDATE SET
                       owner = excluded.owner, expires_at = excluded.expires_at
                   WHERE claims.expires_at < now() OR claims.owner = excluded.owner
                   RETURNING owner""",
                (tenant, session, chain, self.owner, timedelta(seconds=ttl_s))).fetchone()
        return row is not None

    def claimed(self, tenant: str, session: str, chain: str) -> bool:
        """Whether another replica holds an unexpired claim."""
        with self.pool.connection() as conn:
            row = conn.execute(
                "SELECT 1 FROM claims WHERE tenant = %s AND session = %s AND chain = %s "
                "AND expires_at >= now() AND owner <> %s",
                (tenant, session, chain, self.owner)).fetchone()
        return row is not None

    def release(self, tenant: str, session: str, chain: str) -> None:
        with self.pool.connection() as conn:
            conn.execute("DELETE FROM claims WHERE tenant = %s AND session = %s AND chain = %s "
                         "AND owner = %s", (tenant, session, chain, self.owner))
