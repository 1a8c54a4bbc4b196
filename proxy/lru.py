"""The one bounded cache: least recently used entries go first, bounded by a count or by the
size of what the entries pin (``sizeof``), safe to share between the event loop and worker
threads. A thin lock around :class:`cachetools.LRUCache`.

Every in-process cache of the proxy is one of these (token counts, cuts, message digests,
archived chains, summaries, ...): they are only ever caches, the stores hold the truth.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, TypeVar

from cachetools import LRUCache

__all__ = ["LRU"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Evicting(LRUCache):  # type: ignore[type-arg]
    """cachetools calls popitem() to make room: the hook sees what is pushed out."""

    def __init__(self, maxsize: int, getsizeof: Any, on_evict: Callable[[Any], None]) -> None:
        super().__init__(maxsize, getsizeof)
        self._on_evict = on_evict

    def popitem(self) -> Any:
        key, item = super().popitem()
        self._on_evict(item)
        return key, item


class LRU(Generic[K, V]):
    """``maxsize`` entries, or with ``sizeof`` a total of ``maxsize`` by that measure (an entry
    larger than the whole budget is simply not kept). ``on_evict`` is told of each entry pushed
    out to make room (not of ``pop``/``clear``), under the cache's lock: keep it short."""

    def __init__(
        self,
        maxsize: int,
        sizeof: Callable[[K, V], int] | None = None,
        *,
        on_evict: Callable[[K, V], None] | None = None,
    ) -> None:
        # cachetools sizes values only; the key is passed through so that entries can be
        # measured by the text they are keyed by (what they pin).
        getsizeof = (lambda item: max(1, sizeof(item[0], item[1]))) if sizeof else None
        size = max(int(maxsize), 1)
        if on_evict is None:
            self._cache: LRUCache[K, tuple[K, V]] = LRUCache(size, getsizeof)
        else:
            self._cache = _Evicting(size, getsizeof, lambda item: on_evict(item[0], item[1]))
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            item = self._cache.get(key)
        return None if item is None else item[1]

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._cache

    def put(self, key: K, value: V) -> None:
        with self._lock:
            try:
                self._cache[key] = (key, value)
            except ValueError:
                pass  # larger than the whole budget: not kept

    def pop(self, key: K) -> V | None:
        with self._lock:
            item = self._cache.pop(key, None)
        return None if item is None else item[1]

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._cache)

    def items(self) -> Iterator[tuple[K, V]]:
        """A snapshot of the entries (in no particular order)."""
        with self._lock:
            snapshot = list(self._cache.values())
        return iter(snapshot)

    @property
    def size(self) -> int:
        """What the entries weigh together (their count without ``sizeof``)."""
        with self._lock:
            return int(self._cache.currsize)
