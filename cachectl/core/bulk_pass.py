"""Fewer garbage collections while a pass over every file of a cache runs (sync, verify).

Such a pass keeps about one small object per file alive until it ends (a planned check, a row to
write), so with the collector's default thresholds it runs a full collection now and then, each
scanning everything the process holds, its own growing lists included: in one run of the lifecycle
bench, 6% of verify's time and 9% of sync's (BENCHMARKS.md, "Lifecycle"). Inside ``bulk_pass()`` a
young collection waits for ``YOUNG_THRESHOLD`` new objects instead of 700, which makes full
collections rare: nothing is left uncollected, what the pass makes is collected later.

Thresholds are the whole process's: passes on several threads at once (a server running two jobs)
share one raise, and the last to finish puts back what was there before the first.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

YOUNG_THRESHOLD = 100_000

_lock = threading.Lock()
_active = 0
_saved: tuple[int, ...] = ()


@contextmanager
def bulk_pass() -> Iterator[None]:
    global _active, _saved
    with _lock:
        if _active == 0:
            _saved = gc.get_threshold()
            gc.set_threshold(max(_saved[0], YOUNG_THRESHOLD), *_saved[1:])
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                gc.set_threshold(*_saved)
