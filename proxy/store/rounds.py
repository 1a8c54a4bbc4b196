"""The proxy's own read rounds of an answer, kept to be put back on later turns
(docs/retrieval.md#internal-rounds-are-replayed).

When the model calls the proxy's read tool, the proxy runs it and asks again; the client only
sees the final answer. Its next request holds that answer but not the rounds before it, so what
would be forwarded is not what the model saw. A :class:`RoundsRecord` keeps, per answer that had
any, what the history must hold around it for the model's view to be whole again:

* ``before``: the internal rounds (the assistant messages with the proxy's calls and their
  results), as wire items exactly as they were forwarded inside the loop;
* ``answer``: the answer as the model produced it, when the client's copy lost the proxy's
  calls (an answer that called the client's tools too, or one past the round limit); None
  when the client's copy is the model's;
* ``after``: the results of those calls (for Messages, ``tool_result`` blocks).

Keyed by ``answer_key`` (:func:`proxy.pipeline.replay.answer_key`): the answer as the client got
it (in the pipeline's model) after the message it followed, whose key is ``parent``; a later
history holding that answer after that message gets the record.

The items are kept as JSON bytes, never re-encoded: a signed thinking block goes back as the
loop sent it. On disk one row per answer, ``body`` the JSON object ``{"api", "parent",
"before", "answer", "after"}`` spliced from those bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final

import msgspec
import orjson

from proxy.store.db import Database
from proxy.store.paths import check_name
from proxy.store.times import format_ts, parse_ts, utc

__all__ = ["RoundsRecord", "SqliteRounds", "decode_body", "encode_body"]

_COLUMNS: Final = "tenant, session, answer_key, body, created_at"
_MEMBERS: Final = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ITEMS: Final = msgspec.json.Decoder(list[msgspec.Raw])
_BATCH: Final = 500  # keys per query (SQLite's limit on parameters is far above)


@dataclass(frozen=True, slots=True)
class RoundsRecord:
    tenant: str
    session: str
    answer_key: str  # pipeline.replay.answer_key() of the answer as the client got it
    parent: str  # key() of the message before it ("" when there is none)
    api: str  # the wire format: "chat", "responses", "messages"
    before: tuple[bytes, ...]  # wire items inserted right before the answer
    answer: tuple[bytes, ...] | None  # the model's answer, in place of the client's copy
    after: tuple[bytes, ...] = ()  # results of the proxy's calls in that answer
    created_at: datetime | None = None


def encode_body(record: RoundsRecord) -> bytes:
    def array(items: Sequence[bytes]) -> bytes:
        return b"[" + b",".join(items) + b"]"

    answer = b"null" if record.answer is None else array(record.answer)
    return (b'{"api":' + orjson.dumps(record.api) + b',"parent":' + orjson.dumps(record.parent)
            + b',"before":' + array(record.before)
            + b',"answer":' + answer + b',"after":' + array(record.after) + b"}")


def decode_body(tenant: str, session: str, answer_key: str, body: bytes,
                created_at: datetime | None = None) -> RoundsRecord:
    """The record of a stored body; each item as the bytes it was stored as."""
    parts = _MEMBERS.decode(body)

    def items(name: str) -> tuple[bytes, ...]:
        return tuple(bytes(i) for i in _ITEMS.decode(parts[name]))

    answer_raw = bytes(parts["answer"])
    return RoundsRecord(
        tenant=tenant, session=session, answer_key=answer_key,
        parent=str(orjson.loads(bytes(parts["parent"]))), api=str(orjson.loads(bytes(parts["api"]))),
        before=items("before"), answer=None if answer_raw == b"null" else items("answer"),
        after=items("after"), created_at=created_at,
    )


class SqliteRounds:
    """Rounds records in the files backend's SQLite database (table ``rounds``)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def put(self, record: RoundsRecord, *, now: datetime | None = None) -> None:
        """Keep a record; one answer has one (a second put for its key changes nothing)."""
        check_name(record.tenant, "tenant")
        check_name(record.session, "session")
        with self.db.transaction() as conn:
            conn.execute(
                f"INSERT INTO rounds ({_COLUMNS}) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (tenant, session, answer_key) DO NOTHING",
                (record.tenant, record.session, record.answer_key, encode_body(record),
                 format_ts(utc(now))))

    def find(self, tenant: str, session: str, keys: Sequence[str]) -> list[RoundsRecord]:
        """The records of those of ``keys`` that have one."""
        rows = []
        with self.db.connect() as conn:
            for at in range(0, len(keys), _BATCH):
                batch = list(keys[at:at + _BATCH])
                marks = ", ".join("?" * len(batch))
                rows += conn.execute(
                    f"SELECT {_COLUMNS} FROM rounds WHERE tenant = ? AND session = ? "
                    f"AND answer_key IN ({marks})", (tenant, session, *batch)).fetchall()
        return [decode_body(r[0], r[1], r[2], bytes(r[3]), parse_ts(r[4])) for r in rows]
