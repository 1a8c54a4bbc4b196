"""The one bounded cache: least recently used entries go first, bounded by a count or by the
size of what the entries pin (``sizeof``), safe to share between the event loop and worker
threads.

Every in-process cache of the proxy is one of these (token counts, cuts, message digests,
archived chains, summaries, ...): they are only ever caches, the stores hold the truth. A hit is
a dict probe and a ``move_to_end`` under a lock (~0.4 us): these caches are probed hundreds of
times per request, so the class is deliberately small (cachetools' LRUCache, pure Python, cost
~5 us a hit here).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

__all__ = ["LRU"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRU(Generic[K, V]):
    """``maxsize`` entries, or with ``sizeof`` a total of ``maxsize`` by that measure (an entry
    larger than the whole budget is simply not kept). ``on_evict`` is told of each entry pushed
    out to make room (not of ``pop``/``clear``), under the cache's lock: keep it short."""

    __slots__ = ("_data", "_lock", "_maxsize", "_on_evict", "_size", "_sizeof")

    def __init__(
        self,
        maxsize: int,
        sizeof: Callable[[K, V], int] | None = None,
        *,
        on_evict: Callable[[K, V], None] | None = None,
    ) -> None:
        self._data: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._maxsize = max(int(maxsize), 1)
        self._sizeof = sizeof
        self._on_evict = on_evict
        self._size = 0
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            item = self._data.get(key)
            if item is None:
                return None
            self._data.move_to_end(key)
            return item[0]

    def __contains__(self, key: object) -> bool:
        return key in self._data  # a dict probe is atomic: no lock needed

    def put(self, key: K, value: V) -> None:
        weight = max(1, self._sizeof(key, value)) if self._sizeof is not None else 1
        if weight > self._maxsize:
            return  # larger than the whole budget: not kept
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._size -= old[1]
            self._data[key] = (value, weight)
            self._size += weight
            while self._size > self._maxsize:
                evicted, (gone, w) = self._data.popitem(last=False)
                self._size -= w
                if self._on_evict is not None:
                    self._on_evict(evicted, gone)

    def pop(self, key: K) -> V | None:
        with self._lock:
            item = self._data.pop(key, None)
            if item is None:
                return None
            self._size -= item[1]
            return item[0]

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._size = 0

    def __len__(self) -> int:
        return len(self._data)

    def items(self) -> Iterator[tuple[K, V]]:
        """A snapshot of the entries, least recently used first."""
        with self._lock:
            snapshot = [(k, v) for k, (v, _) in self._data.items()]
        return iter(snapshot)

    @property
    def size(self) -> int:
        """What the entries weigh together (their count without ``sizeof``)."""
        return self._size
