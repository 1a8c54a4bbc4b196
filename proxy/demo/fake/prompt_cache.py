"""A provider's prompt cache, as the fake upstream keeps it (``FakeUpstream(prompt_cache=True)``):
what of each model request would be read from the cache, written to it, or billed as plain
input, the way the real providers bill it.

The request as a provider caches it is a sequence of whole *units*, in the order the provider
renders them (:func:`prompt_units`): the tools, the system prompt (``system``, one unit per
block; Responses ``instructions``), then each message or input item; each is canonical JSON
(sorted keys) without its ``cache_control`` markers (a marker moving to the newest message, as
Claude Code's does every turn, changes nothing cached). A unit counts ``len(bytes) // 4``
tokens, at least 1 (:func:`unit_tokens`, the fake's usual estimate).

:class:`PromptCache` keeps, per (API key or ``Authorization`` header, model), the unit-digest
chains of earlier prompts with when each was last used (the fake's injectable clock). What a
request reads is the longest whole-unit prefix it shares with an entry used within the TTL
(300 s; 3600 s when a ``cache_control`` of the request says ``"ttl": "1h"``); the entry is
refreshed by the read. Then, by provider:

* Anthropic Messages caches only what a request marks: without a ``cache_control`` anywhere
  (tools, system blocks, content blocks, or the top-level one, which marks the last unit)
  nothing is read or written. The prefix through the last marker is written: what of it was not
  read is ``cache_creation_input_tokens``, split 5m / 1h by the ttl of the first marker at or
  after each unit; a read reaches no further than the last marker; the tokens after it are
  plain ``input_tokens``. (The real API reads only at marker-free boundaries of earlier written
  prefixes, and has a minimum cacheable length per model: neither is modelled.)
* OpenAI (chat completions, Responses) caches automatically: after the call a prompt of at
  least 1024 tokens is cached whole; a read counts in 128-token steps (``floor(P / 128) * 128``
  of a shared prefix of P >= 1024 tokens, else nothing); writes are not billed, so none are
  reported.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from proxy.formats.messages.request import strip_cache_control

__all__ = [
    "MIN_OPENAI_PREFIX",
    "OPENAI_STEP",
    "Prompt",
    "PromptCache",
    "cache_key",
    "prompt_units",
    "unit_tokens",
]

TTL_5M: Final = 300.0
TTL_1H: Final = 3600.0
MIN_OPENAI_PREFIX: Final = 1024  # OpenAI caches prompts of at least this many tokens
OPENAI_STEP: Final = 128  # ... and reads them in steps of this many
MAX_ENTRIES: Final = 64  # per key: the least recently used go first


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request's prompt as the cache billed it: ``tokens`` in all, of which ``read`` from
    the cache and ``write_5m`` / ``write_1h`` written to it; the rest is plain input."""

    tokens: int
    read: int = 0
    write_5m: int = 0
    write_1h: int = 0

    @property
    def write(self) -> int:
        return self.write_5m + self.write_1h

    @property
    def uncached(self) -> int:
        return self.tokens - self.read - self.write




def _markers(value: Any) -> Iterator[Any]:
    """The ``cache_control`` values inside ``value``, in document order."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k == "cache_control":
                if v is not None:
                    yield v
            else:
                yield from _markers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _markers(v)


def _parts(api: str, body: Mapping[str, Any]) -> list[Any]:
    """The request's values that become units, in the provider's order."""
    parts: list[Any] = []
    if body.get("tools") is not None:
        parts.append(body["tools"])
    if api == "messages":
        system = body.get("system")
        if isinstance(system, list):
            parts += system
        elif system is not None:
            parts.append(system)
        conversation = body.get("messages")
    elif api == "responses":
        if body.get("instructions") is not None:
            parts.append(body["instructions"])
        conversation = body.get("input")
        if isinstance(conversation, str):  # the shorthand for one user message
            conversation = [{"role": "user", "content": conversation}]
    else:
        conversation = body.get("messages")
    if isinstance(conversation, list):
        parts += conversation
    return parts


def _canonical(value: Any) -> bytes:
    return orjson.dumps(strip_cache_control(value), option=orjson.OPT_SORT_KEYS)


def prompt_units(api: str, body: Mapping[str, Any]) -> list[bytes]:
    """The request (wire format ``api``: "chat", "responses" or "messages") as the provider
    caches it: whole units in order, canonical JSON without ``cache_control``."""
    return [_canonical(p) for p in _parts(api, body)]


def unit_tokens(unit: bytes) -> int:
    return max(1, len(unit) // 4)


def cache_key(headers: Mapping[str, str], model: Any) -> tuple[str, str]:
    """Whose cache a request reads: its credential (``x-api-key``, else ``Authorization``;
    lower-cased header names) and its model."""
    credential = headers.get("x-api-key") or headers.get("authorization") or ""
    return credential, str(model)


def _ttl_of(marker: Any) -> float:
    return TTL_1H if isinstance(marker, Mapping) and marker.get("ttl") == "1h" else TTL_5M


@dataclass(slots=True)
class _Entry:
    chain: list[bytes]  # the digest of each unit prefix: chain[i] covers units[: i + 1]
    used: float
    ttl: float


@dataclass(slots=True)
class PromptCache:
    """The cached prompts of every (credential, model); see the module docstring."""

    _entries: dict[tuple[str, str], list[_Entry]] = field(default_factory=dict)

    def clear(self) -> None:
        self._entries.clear()

    def account(self, api: str, key: tuple[str, str], body: Mapping[str, Any],
                now: float) -> Prompt:
        """What request ``body`` (wire format ``api``) reads from and writes to the cache of
        ``key`` at ``now`` (the cache is updated)."""
        parts = _parts(api, body)
        units = [_canonical(p) for p in parts]
        tokens = [unit_tokens(u) for u in units]
        chain = _chain(units)
        total = sum(tokens)
        if api == "messages":
            return self._anthropic(key, body, parts, tokens, chain, total, now)
        ttl = max((_ttl_of(m) for m in _markers(body)), default=TTL_5M)
        entry, shared = self._longest(key, chain, now)
        read = sum(tokens[:shared])
        read = read // OPENAI_STEP * OPENAI_STEP if read >= MIN_OPENAI_PREFIX else 0
        if entry is not None and read:
            entry.used, entry.ttl = now, max(entry.ttl, ttl)
        if total >= MIN_OPENAI_PREFIX and shared < len(chain):
            self._store(key, chain, now, ttl)
        return Prompt(tokens=total, read=read)

    def _anthropic(self, key: tuple[str, str], body: Mapping[str, Any], parts: list[Any],
                   tokens: list[int], chain: list[bytes], total: int, now: float) -> Prompt:
        # The ttl each unit is written with: that of the first marker at or after it.
        marks: list[Any | None] = [None] * len(parts)
        for i, part in enumerate(parts):
            found = list(_markers(part))
            if found:
                marks[i] = found[-1]
        top = body.get("cache_control")
        if top is not None and parts:
            marks[-1] = top  # automatic caching: the last cacheable unit is marked
        marked = [i for i, m in enumerate(marks) if m is not None]
        if not marked:
            return Prompt(tokens=total)
        last = marked[-1]
        ttl = max(_ttl_of(m) for m in _markers(body))  # the top-level marker among them
        entry, shared = self._longest(key, chain, now)
        shared = min(shared, last + 1)
        if entry is not None and shared:
            entry.used, entry.ttl = now, max(entry.ttl, ttl)
        unit_ttl: list[float] = [TTL_5M] * len(parts)
        following = TTL_5M
        for i in range(last, -1, -1):
            if marks[i] is not None:
                following = _ttl_of(marks[i])
            unit_ttl[i] = following
        write_5m = sum(tokens[i] for i in range(shared, last + 1) if unit_ttl[i] == TTL_5M)
        write_1h = sum(tokens[i] for i in range(shared, last + 1) if unit_ttl[i] == TTL_1H)
        if shared < last + 1:
            self._store(key, chain[: last + 1], now, ttl)
        return Prompt(tokens=total, read=sum(tokens[:shared]), write_5m=write_5m,
                      write_1h=write_1h)

    def _longest(self, key: tuple[str, str], chain: list[bytes],
                 now: float) -> tuple[_Entry | None, int]:
        """The live entry sharing the longest unit prefix with ``chain``, and its length (the
        expired entries of ``key`` are dropped)."""
        live = [e for e in self._entries.get(key, ()) if now - e.used <= e.ttl]
        self._entries[key] = live
        best: _Entry | None = None
        shared = 0
        for entry in live:
            n = _shared(entry.chain, chain)
            if n > shared:
                best, shared = entry, n
        return best, shared

    def _store(self, key: tuple[str, str], chain: list[bytes], now: float, ttl: float) -> None:
        # An entry the new one extends says nothing the new one does not.
        kept = [e for e in self._entries.get(key, ())
                if not (len(e.chain) <= len(chain) and chain[len(e.chain) - 1] == e.chain[-1])]
        kept.append(_Entry(chain, now, ttl))
        if len(kept) > MAX_ENTRIES:
            kept.sort(key=lambda e: e.used)
            kept = kept[-MAX_ENTRIES:]
        self._entries[key] = kept


def _chain(units: list[bytes]) -> list[bytes]:
    h = hashlib.sha256()
    out = []
    for unit in units:
        h.update(hashlib.sha256(unit).digest())
        out.append(h.copy().digest())
    return out


def _shared(a: list[bytes], b: list[bytes]) -> int:
    """How many leading units two chains share (a chain digest covers its whole prefix, so
    the first differing digest ends it)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # the digests agree up to some index and differ from there on
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo
