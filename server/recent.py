"""What this replica saw in the last few seconds: the bound within which a change made elsewhere reaches it.

Tokens and the (cache, environment) pairs the read routes resolve are asked for on every
request; remembering them for ``ttl_s`` seconds saves an index round trip each time. A change
made on another replica or with the CLI (a revoked token, a changed policy, a pruned
environment) is seen at the latest ``ttl_s`` later; one made through this replica clears it at
once. ``ttl_s=0`` turns remembering off. Only successes are remembered: something created
elsewhere is found at once.
"""

from __future__ import annotations

import threading
import time
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Recent(Generic[K, V]):
    MAX = 10_000  # a flood of distinct keys costs one clear, never unbounded memory

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._items: dict[K, tuple[V, float]] = {}
        self._lock = threading.Lock()

    def _live(self, key: K) -> tuple[V, float] | None:
        """``key``'s value and its deadline, while it is remembered."""
        if self.ttl_s <= 0:
            return None
        with self._lock:
            item = self._items.get(key)
        if item is None or item[1] < time.monotonic():
            return None
        return item

    def get(self, key: K) -> V | None:
        item = self._live(key)
        return None if item is None else item[0]

    def expires(self, key: K) -> float | None:
        """When ``key``'s remembered value will be asked for again (``time.monotonic``), if it is
        remembered now: how long an answer made from it may be kept elsewhere (server/accel.py)."""
        item = self._live(key)
        return None if item is None else item[1]

    def put(self, key: K, value: V) -> None:
        if self.ttl_s <= 0:
            return
        with self._lock:
            if len(self._items) >= self.MAX:
                self._items.clear()
            self._items[key] = (value, time.monotonic() + self.ttl_s)

    def forget(self, key: K) -> None:
        """Ask for ``key`` again on its next use."""
        with self._lock:
            self._items.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
