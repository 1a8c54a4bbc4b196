"""Chain hashes: a message's identity including everything before it.

Chain hashes
------------
``chain_i = sha256(raw(chain_{i-1}) || sha256(canonical(msg_i)))``, shown as the first 32 hex
digits (``raw`` is those 16 bytes); ``chain_{-1}`` is the empty string, a fixed root.
``canonical`` is ``orjson.dumps(msg, option=OPT_SORT_KEYS)``.

* A chain names a message *and its whole prefix*, so "is this history one we have seen?" is an
  index lookup, and a summary of messages ``0..i`` can be found by ``chains[i]`` alone.
* The root is fixed rather than seeded with tenant/session so :func:`chain_hashes` stays a pure
  function of the messages; every lookup is scoped by (tenant, session), so equal histories in
  different sessions never meet.
* The message enters through its own digest (not its bytes) so that digest can be cached per
  message: a resent history then costs one dictionary probe per message instead of re-hashing
  megabytes of tool output (see :class:`DigestCache`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Hashable, Sequence
from typing import Any, Final, Protocol

import orjson

from proxy.lru import LRU

CHAIN_HEX: Final = 32
_CHAIN_RE: Final = re.compile(r"[0-9a-f]{32}")


class DigestCacheLike(Protocol):
    """What :func:`chain_hashes` needs from a cache; a plain ``dict`` qualifies (unbounded)."""

    def get(self, key: Hashable, /) -> bytes | None: ...

    def __setitem__(self, key: Hashable, value: bytes, /) -> None: ...


def canonical(value: Any) -> bytes:
    """Deterministic bytes of a JSON value: orjson with sorted keys.

    Values orjson refuses (ints beyond 64 bits, lone surrogates, odd types) fall back to the
    stdlib encoder in ASCII mode, which is just as deterministic; such messages simply never
    match an orjson-encoded twin, which cannot exist anyway.
    """
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError):
        return json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str
        ).encode("ascii")


def message_digest(message: Any) -> bytes:
    """sha256 of the canonical form (32 raw bytes)."""
    return hashlib.sha256(canonical(message)).digest()


# Type tags for _freeze: ints, so they can never equal a str value.
_DICT, _LIST, _INT, _BOOL, _FLOAT = 0, 1, 2, 3, 4


def _freeze(value: Any) -> Hashable:
    """A hashable key equal for two values exactly when their canonical JSON is equal.

    Building it touches no bytes of the strings (their hashes are computed once per object by
    the dict probe), which is what makes a cache hit cheaper than serialising. Ints, bools and
    floats are tagged because ``True == 1 == 1.0`` in Python but not in JSON; floats go by
    ``repr`` because ``0.0 == -0.0``. Unsupported types raise ``TypeError`` (no caching then).
    """
    kind = type(value)
    if kind is str or value is None:
        return value  # type: ignore[no-any-return]
    if kind is dict:
        items = []
        for k, v in value.items():
            if type(k) is not str:
                raise TypeError("non-str key")
            items.append((k, _freeze(v)))
        items.sort(key=_first)
        return (_DICT, tuple(items))
    if kind is list:
        return (_LIST, tuple(_freeze(v) for v in value))
    if kind is bool:
        return (_BOOL, value)
    if kind is int:
        return (_INT, value)
    if kind is float:
        return (_FLOAT, repr(value))
    raise TypeError(f"unsupported type {kind.__name__}")


def _first(item: tuple[str, Hashable]) -> str:
    return item[0]


class DigestCache:
    """Bounded, thread-safe LRU of message digests, keyed by content (see :func:`_freeze`).

    The keys hold references to the messages' strings, so memory is bounded by the canonical
    size of what is cached (``max_bytes``); small messages are not worth an entry (hashing a
    few hundred bytes costs about what the probe does) and are skipped below ``min_bytes``.
    """

    def __init__(self, max_bytes: int = 64 << 20, min_bytes: int = 1024) -> None:
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        self._data: LRU[Hashable, tuple[bytes, int]] = LRU(max_bytes, lambda _, v: v[1])
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: Hashable, /) -> bytes | None:
        entry = self._data.get(key)
        # Approximate under threads (unlocked +=): statistics only.
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        return entry[0]

    def __setitem__(self, key: Hashable, value: bytes, /) -> None:
        self.put(key, value, self.min_bytes)

    def put(self, key: Hashable, digest: bytes, size: int) -> None:
        if self.min_bytes <= size <= self.max_bytes:
            self._data.put(key, (digest, size))


def _digest(message: Any, cache: DigestCacheLike | None) -> bytes:
    if cache is None:
        return message_digest(message)
    try:
        key: Hashable | None = _freeze(message)
    except (TypeError, RecursionError):
        key = None
    if key is not None:
        hit = cache.get(key)
        if hit is not None:
            return hit
    blob = canonical(message)
    digest = hashlib.sha256(blob).digest()
    if key is not None:
        if isinstance(cache, DigestCache):
            cache.put(key, digest, len(blob))
        else:
            cache[key] = digest
    return digest


def chain_step(parent: str | None, message: Any, cache: DigestCacheLike | None = None) -> str:
    """The chain of ``message`` following the chain ``parent`` (``None`` at the root)."""
    prev = bytes.fromhex(parent) if parent else b""
    return hashlib.sha256(prev + _digest(message, cache)).hexdigest()[:CHAIN_HEX]


def chain_hashes(messages: Sequence[Any], cache: DigestCacheLike | None = None) -> list[str]:
    """Chain hashes of a history; ``chain_hashes(m[:k]) == chain_hashes(m)[:k]``."""
    out: list[str] = []
    prev = b""
    sha256 = hashlib.sha256
    for message in messages:
        raw = sha256(prev + _digest(message, cache)).digest()[: CHAIN_HEX // 2]
        out.append(raw.hex())
        prev = raw
    return out


def is_chain(value: object) -> bool:
    return isinstance(value, str) and _CHAIN_RE.fullmatch(value) is not None


# --- records ---------------------------------------------------------------------------------
