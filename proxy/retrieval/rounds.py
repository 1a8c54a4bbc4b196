"""The proxy's read rounds, kept per answer and put back on later turns
(docs/retrieval.md#internal-rounds-are-replayed).

:meth:`Replays.record` keeps what a read loop did (:class:`proxy.retrieval.loop.Rounds`) under
the answer as the client got it (:func:`proxy.pipeline.replay.key`, :mod:`proxy.store.rounds`),
before the answer's last byte: the client's next turn may land on another replica. :meth:`Replays.find` is the
pipeline's lookup (:mod:`proxy.retrieval.replay`): the records of the assistant messages a
history still forwards, read into the pipeline's model by the request's own format reader.

Answers are resent every turn and almost none had rounds, so an in-process cache stands in
front of the store: every answer this process returned is known (its record, or that it has
none), and so is every answer it looked up; a message's key is computed once per process (by
its chain). The store is asked only for an assistant message this process has neither
answered nor seen: once per answer another replica (or a process before a restart) returned,
never on a resent history.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final

import orjson

from proxy.errors import StoreUnavailable
from proxy.formats.messages.request import MESSAGES
from proxy.formats.responses.request import RESPONSES
from proxy.lru import LRU
from proxy.model import WIRE, Message, RequestView
from proxy.retrieval.loop import Rounds
from proxy.retrieval.replay import Replayed, answer_key, key, keys_at
from proxy.session import Identity
from proxy.store.interfaces import RoundStore
from proxy.store.rounds import RoundsRecord, encode_body
from proxy.writes import Mode, Writes

__all__ = ["Replays", "replayed"]

log = logging.getLogger("proxy.store")

_CACHE_BYTES: Final = 64 << 20
_ENTRY: Final = 200  # what an entry costs besides its items (key, tuple, dicts)
_KEYS: Final = 200_000  # messages' keys remembered by chain

_Key = tuple[str, str, str]


def _size(_: _Key, value: tuple[Replayed | None, int]) -> int:
    return _ENTRY + value[1]


class Replays:
    enabled = True

    def __init__(self, store: RoundStore | None, *, cache_bytes: int = _CACHE_BYTES) -> None:
        self.store = store
        # (tenant, session, answer key) -> (the record read into the model, or None; bytes)
        self._known: LRU[_Key, tuple[Replayed | None, int]] = LRU(cache_bytes, _size)
        # An assistant message's chain -> its keys: a resent history is digested once.
        self._keys: LRU[str, tuple[str, str]] = LRU(_KEYS)

    # -- the lookup (the pipeline's effect) ------------------------------------------------

    def keys(self, request: RequestView, history: Sequence[Message],
             indices: Sequence[int]) -> dict[int, tuple[str, str]]:
        # A message's chain stands for it and everything before it: what its keys depend on.
        chains = request.chains if len(request.chains) == len(history) else None
        out: dict[int, tuple[str, str]] = {}
        for k in indices:
            found = self._keys.get(chains[k]) if chains is not None else None
            if found is None:
                found = keys_at(history, k)
                if chains is not None:
                    self._keys.put(chains[k], found)
            out[k] = found
        return out

    async def find(self, request: RequestView, keys: Sequence[str]) -> Mapping[str, Replayed]:
        tenant, session = request.identity.tenant, request.identity.session
        found: dict[str, Replayed] = {}
        missing: list[str] = []
        for wanted in dict.fromkeys(keys):
            hit = self._known.get((tenant, session, wanted))
            if hit is None:
                missing.append(wanted)
            elif hit[0] is not None:
                found[wanted] = hit[0]
        if not missing or self.store is None:
            return found
        try:
            records = await asyncio.to_thread(self.store.find, tenant, session, missing)
        except StoreUnavailable as exc:
            log.warning("read rounds unavailable (%s); forwarding without them", exc)
            return found
        got = {r.answer_key: r for r in records}
        for wanted in missing:
            rec = got.get(wanted)
            model = replayed(rec) if rec is not None else None
            self._known.put((tenant, session, wanted), (model, _bytes(rec)))
            if model is not None:
                found[wanted] = model
        return found

    # -- after an answer --------------------------------------------------------------------

    async def record(
        self, identity: Identity, api: str, history: Sequence[Message], answer: Any,
        done: Rounds, writes: Writes,
    ) -> None:
        """Keep the rounds of an answer that had any (before its last byte); never raises."""
        keys = _answer_keys(api, history, answer)
        if keys is None or writes.mode is not Mode.NOW or self.store is None:
            return  # an answer it cannot be recognised by, or nothing may be written
        kept_as, parent = keys
        record = RoundsRecord(
            tenant=identity.tenant, session=identity.session, answer_key=kept_as,
            parent=parent, api=api, before=tuple(done.wire),
            answer=None if done.full is None else tuple(done.full), after=tuple(done.results))
        store = self.store

        def job() -> int:
            store.put(record)
            return len(encode_body(record))

        try:
            await asyncio.to_thread(writes.write_sync, job)
        except Exception as exc:
            log.warning("keeping the read rounds failed (%s); later turns forward without them",
                        exc)
            return
        self._known.put((identity.tenant, identity.session, kept_as),
                        (replayed(record), _bytes(record)))

    def answered(self, identity: Identity, api: str, history: Sequence[Message],
                 answer: Any) -> None:
        """An answer this process returned without rounds: later turns need not ask."""
        keys = _answer_keys(api, history, answer)
        if keys is None:
            return
        full = (identity.tenant, identity.session, keys[0])
        if full not in self._known:
            self._known.put(full, (None, 0))

    def forget(self) -> None:
        self._known.clear()


def _answer_keys(api: str, history: Sequence[Message], answer: Any) -> tuple[str, str] | None:
    """The answer's :func:`answer_key` as the client's next history will have it, and its
    parent's key; None when it is not one assistant message there."""
    if not answer:
        return None
    items = [answer] if isinstance(answer, dict) else list(answer)
    try:
        model = _model(api, [orjson.dumps(item) for item in items])
    except Exception:  # an answer its format cannot read is never recognised either
        return None
    if len(model) != 1 or model[0][0].get("role") != "assistant":
        return None
    parent = key(history[-1]) if history else ""
    return answer_key(parent, key(model[0][0])), parent


def _bytes(record: RoundsRecord | None) -> int:
    if record is None:
        return 0
    return sum(map(len, (*record.before, *(record.answer or ()), *record.after)))


# -- wire items into the pipeline's model -----------------------------------------------------


def replayed(record: RoundsRecord) -> Replayed:
    """A record read into the pipeline's model by its format's reader; every message that
    stands for whole wire items carries their bytes (``model.WIRE``) for the writer."""
    before = _messages(record.api, record.before)
    answer = None if record.answer is None else _messages(record.api, record.answer)
    if record.api == "messages":
        # tool_result blocks: read as the user message they open (the writer puts them first
        # in the client's following one).
        after = _messages("messages", (b'{"role":"user","content":['
                                       + b",".join(record.after) + b"]}",)) if record.after else ()
    else:
        after = _messages(record.api, record.after)
    return Replayed(record.parent, before, answer, after)


def _model(api: str, items: Sequence[bytes]) -> list[tuple[Message, range]]:
    """Wire items as the format reads them: each message with the items it stands for."""
    if api == "chat":
        return [(orjson.loads(item), range(i, i + 1)) for i, item in enumerate(items)]
    array = b"[" + b",".join(items) + b"]"
    if api == "responses":
        parsed = RESPONSES.parse(b'{"model":"-","input":' + array + b"}", len(items))
    elif api == "messages":
        parsed = MESSAGES.parse(b'{"model":"-","messages":' + array + b"}", len(items))
    else:
        raise ValueError(f"unknown wire format {api!r}")
    return list(zip(parsed.history, parsed.spans, strict=True))


def _messages(api: str, items: Sequence[bytes]) -> tuple[Message, ...]:
    if not items:
        return ()
    out: list[Message] = []
    for message, span in _model(api, items):
        # Chat: the model is the wire format. Messages: only an assistant message is written
        # from its bytes (tool results are rebuilt as blocks, the same bytes). Responses:
        # every item is.
        if api == "responses" or (api == "messages" and message.get("role") == "assistant"):
            message = {**message, WIRE: [items[i].decode() for i in span]}
        out.append(message)
    return tuple(out)
