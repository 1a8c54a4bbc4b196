"""Putting the proxy's own read rounds back where the model saw them
(docs/retrieval.md#internal-rounds-are-replayed).

The client never sees the proxy's ``read_offloaded`` rounds, so its next history holds the
answer without them. Forwarded that way, the history is not the model's: a signed thinking
block of the answer is bound to a prefix that held the rounds (the provider rejects it), the
prompt cache misses from there, and the model reads again what it had read. This step puts
them back, right before the answer they led to; an answer whose copy lost the proxy's calls
(it called the client's tools too) is replaced by the model's own, the proxy's results right
after it (a format writer puts them first in the following user message where the wire wants
that). The forwarded history is then the model's view plus what the client appended.

Pure over the pipeline's model: :func:`candidates` names the assistant messages worth looking
up (the ones still forwarded: an answer a compaction evicted has its rounds replaced by the
summary too), the caller looks them up (:class:`Source`, an effect), :func:`insert` puts the
records found in place. An answer is recognised by :func:`key` of its message and of the
message before it (:func:`answer_key`), both as the client's originals in the model: what a client may change
without changing the conversation does not count (``cache_control`` markers, which Claude Code
moves to its newest message every turn, and null fields), everything else does, so an edited
answer, or one after an edited message, gets nothing. Runs after compaction and memory, before
validate: the pairs put in are whole.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.model import Message, RequestView, StageOutcome
from proxy.store.chains import CHAIN_HEX, canonical

__all__ = ["Replayed", "Source", "answer_key", "candidates", "insert", "key", "keys_at", "run"]

log = logging.getLogger("proxy.pipeline")


@dataclass(frozen=True, slots=True)
class Replayed:
    """One answer's rounds in the pipeline's model (see :mod:`proxy.store.rounds`)."""

    parent: str  # key() of the message before the answer ("" at the start)
    before: tuple[Message, ...]
    answer: tuple[Message, ...] | None  # the model's answer in place of the client's copy
    after: tuple[Message, ...] = ()


class Source(Protocol):
    """Where the records come from (proxy.retrieval.rounds: caches in front of the store)."""

    enabled: bool

    def keys(self, request: RequestView, history: Sequence[Message],
             indices: Sequence[int]) -> Mapping[int, tuple[str, str]]:
        """:func:`keys_at` of those history messages (cached by the caller)."""
        ...

    async def find(self, request: RequestView, keys: Sequence[str]) -> Mapping[str, Replayed]:
        """The records of those :func:`answer_key` values that have one."""
        ...


def _plain(value: Any) -> Any:
    """``value`` without ``cache_control`` members and null fields, at any depth (the very
    object when it has none)."""
    if isinstance(value, dict):
        if any(k == "cache_control" or v is None or isinstance(v, dict | list)
               for k, v in value.items()):
            return {k: _plain(v) for k, v in value.items()
                    if k != "cache_control" and v is not None}
        return value
    if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        return [_plain(v) for v in value]
    return value


def key(message: Message) -> str:
    """A message's identity for recognising an answer: its digest as the model reads it."""
    return hashlib.sha256(canonical(_plain(message))).hexdigest()[:CHAIN_HEX]


def answer_key(parent: str, answer: str) -> str:
    """The key an answer is kept under: its own :func:`key` after its parent's (the same
    answer after another message is another answer)."""
    return hashlib.sha256(f"{parent}:{answer}".encode()).hexdigest()[:CHAIN_HEX]


def keys_at(history: Sequence[Message], k: int) -> tuple[str, str]:
    """The :func:`answer_key` of history message ``k`` and the key of the one before it."""
    parent = key(history[k - 1]) if k else ""
    return answer_key(parent, key(history[k])), parent


def candidates(messages: Sequence[Message], history: Sequence[Message], since: int = 0
               ) -> list[int]:
    """The history's assistant messages that are still forwarded, from index ``since`` on:
    an answer produced before the current epoch began (pipeline.epoch) gets no rounds back,
    since their signed thinking is bound to a prefix the epoch's rewrite changed."""
    kept = {id(m) for m in messages}
    return [k for k, m in enumerate(history) if k >= since and m.get("role") == "assistant"
            and id(m) in kept]


def insert(messages: list[Message], history: Sequence[Message],
           found: Mapping[int, Replayed]) -> StageOutcome:
    """``messages`` with the rounds of each found answer (history index) before it, and its
    own answer and results when the client's copy lost the proxy's calls."""
    at = {id(history[k]): rec for k, rec in found.items()}
    if not at:
        return StageOutcome(messages, False)
    out: list[Message] = []
    for m in messages:
        rec = at.get(id(m))
        if rec is None:
            out.append(m)
            continue
        out += rec.before
        out += rec.answer if rec.answer is not None else (m,)
        out += rec.after
    return StageOutcome(out, True, {"replayed": len(out) - len(messages)})


async def run(source: Source, messages: list[Message], history: list[Message],
              request: RequestView, since: int = 0) -> StageOutcome:
    """Look up (the caller's effect, through ``source``) and insert the answers found after
    the message they followed (produced from history index ``since`` on)."""
    wanted = candidates(messages, history, since)
    if not wanted:
        return StageOutcome(messages, False)
    keys = source.keys(request, history, wanted)
    found = await source.find(request, [keys[k][0] for k in wanted])
    matched = {}
    for k in wanted:
        rec = found.get(keys[k][0])
        if rec is not None and rec.parent == keys[k][1]:
            matched[k] = rec
    return insert(messages, history, matched)
