"""Putting the proxy's own read rounds back where the model saw them (README "Retrieval").

The client never sees the proxy's ``read_offloaded`` rounds, so its next history holds the
answer without them. Forwarded that way, the history is not the model's: a signed thinking
block of the answer is bound to a prefix that held the rounds (the provider rejects it), the
prompt cache misses from there, and the model reads again what it had read. This step puts
them back, right before the answer they led to; an answer whose copy lost the proxy's calls
(it called the client's tools too) is replaced by the model's own, the proxy's results right
after it (a format writer puts them first in the following user message where the wire wants
that). The forwarded history is then the model's view plus what the client appended.

Pure over the pipeline's model: :func:`candidates` names the chains worth looking up (the
assistant messages still forwarded: an answer a compaction evicted has its rounds replaced by
the summary too), the caller looks them up (:class:`Source`, an effect), :func:`insert` puts
the records found in place. An answer is recognised by its chain (the client's copy exactly,
after exactly the prefix it followed) and the chain before it, so an edited history gets
nothing. Runs after compaction and memory, before validate: the pairs put in are whole.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from .model import Message, RequestView, StageOutcome

__all__ = ["Replayed", "Source", "candidates", "insert", "run"]

log = logging.getLogger("proxy.pipeline")


@dataclass(frozen=True, slots=True)
class Replayed:
    """One answer's rounds in the pipeline's model (see :mod:`proxy.store.rounds`)."""

    parent: str  # the chain before the answer ("" at the root)
    before: tuple[Message, ...]
    answer: tuple[Message, ...] | None  # the model's answer in place of the client's copy
    after: tuple[Message, ...] = ()


class Source(Protocol):
    """Where the records come from (proxy.rounds: a cache in front of the store)."""

    enabled: bool

    async def find(self, request: RequestView, chains: Sequence[str]) -> Mapping[str, Replayed]:
        ...


def candidates(messages: Sequence[Message], history: Sequence[Message],
               chains: Sequence[str]) -> list[str]:
    """The chains of the history's assistant messages that are still forwarded."""
    if len(chains) != len(history):
        return []
    kept = {id(m) for m in messages}
    return [chains[k] for k, m in enumerate(history)
            if m.get("role") == "assistant" and id(m) in kept]


def insert(messages: list[Message], history: Sequence[Message], chains: Sequence[str],
           found: Mapping[str, Replayed]) -> StageOutcome:
    """``messages`` with each found answer's rounds before it (and its own answer and results,
    when the client's copy lost the proxy's calls)."""
    at: dict[int, Replayed] = {}
    for k, m in enumerate(history):
        rec = found.get(chains[k]) if k < len(chains) else None
        if rec is None or m.get("role") != "assistant":
            continue
        if rec.parent != (chains[k - 1] if k else ""):
            continue  # the same answer after another prefix: not the model's view
        at[id(m)] = rec
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
              request: RequestView) -> StageOutcome:
    """Look up (the caller's effect, through ``source``) and insert."""
    wanted = candidates(messages, history, request.chains)
    found = await source.find(request, wanted) if wanted else {}
    return insert(messages, history, request.chains, found)
