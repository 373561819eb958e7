"""The JAX log records warm reads: which key JAX looked up, hit or missed, wrote or skipped.

In core, below warm and service: warm captures per bucket, and the exec hook in a `warm-run`
command's processes reports each key written.

JAX names a program's persistent-cache key in exactly one place, its DEBUG log
(its compiler logs the hit or miss with the key before loading or compiling; its
compilation cache logs the write: the loggers and messages are in cachectl.core.jax_seam). A logging filter
captures these records into the compiling thread's own list (XLA compiles run in
the calling thread and release the GIL, so buckets compile concurrently in
threads), then drops them below the level the user asked for. ``writes()`` collects the key
of every write this process makes, from any thread: what a warm itself wrote, told apart from
files other processes write into the same namespace meanwhile (warm-run's command reports its
keys the same way, from the exec hook: cachectl.service.exec_hook).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from cachectl.core import jax_seam

_JAX_LOGGERS = jax_seam.CACHE_LOGGERS

# --------------------------------------------------------------------------- capturing keys


@dataclass
class Event:
    kind: str  # hit | miss | write | skip
    key: str | None
    text: str


class _KeyCapture(logging.Filter):
    """Routes JAX's cache log records to the compiling thread's sink; hides the DEBUG ones.

    Installed as a logger filter, so it sees every record the (temporarily DEBUG)
    logger emits, and returns False for those below the level the logger had
    before: the user's logging output is unchanged.
    """

    def __init__(self) -> None:
        super().__init__()
        self._local = threading.local()
        self._floors: dict[str, int] = {}
        self._saved: dict[str, int] = {}
        self._installs = 0
        self._lock = threading.Lock()
        # One (set, callback) per open writes(), filled from any thread.
        self._writes: list[tuple[set[str], Callable[[str], None] | None]] = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[_KeyCapture]:
        with self._lock:
            if self._installs == 0:
                for name in _JAX_LOGGERS:
                    logger = logging.getLogger(name)
                    self._saved[name] = logger.level
                    self._floors[name] = logger.getEffectiveLevel()
                    logger.setLevel(logging.DEBUG)
                    logger.addFilter(self)
            self._installs += 1
        try:
            yield self
        finally:
            with self._lock:
                self._installs -= 1
                if self._installs == 0:
                    for name in _JAX_LOGGERS:
                        logger = logging.getLogger(name)
                        logger.removeFilter(self)
                        logger.setLevel(self._saved.get(name, logging.NOTSET))

    @contextlib.contextmanager
    def writes(
        self, keys: set[str] | None = None, on_write: Callable[[str], None] | None = None
    ) -> Iterator[set[str]]:
        """The key of every entry JAX writes in this process while open, from any thread, added to
        ``keys`` (a new set by default; the capture is installed meanwhile) and handed to
        ``on_write`` as it is written (a process that dies later has said it already): a shared
        namespace's listing cannot say who wrote a file."""
        keys = set() if keys is None else keys
        with self.installed():
            with self._lock:
                self._writes.append((keys, on_write))
            try:
                yield keys
            finally:
                with self._lock:
                    self._writes[:] = [w for w in self._writes if w[0] is not keys]

    @contextlib.contextmanager
    def sink(self) -> Iterator[list[Event]]:
        events: list[Event] = []
        self._local.sink = events
        try:
            yield events
        finally:
            self._local.sink = None

    def filter(self, record: logging.LogRecord) -> bool:
        sink = getattr(self._local, "sink", None)
        if sink is not None or self._writes:
            event = _classify(record)
            if event is not None and sink is not None:
                sink.append(event)
            if event is not None and event.kind == "write" and event.key is not None:
                with self._lock:
                    for keys, _ in self._writes:
                        keys.add(event.key)
                    callbacks = [f for _, f in self._writes if f is not None]
                for on_write in callbacks:  # outside the lock: it may do I/O
                    on_write(event.key)
        return record.levelno >= self._floors.get(record.name, logging.WARNING)


def _classify(record: logging.LogRecord) -> Event | None:
    found = jax_seam.classify_record(record)
    return None if found is None else Event(*found)


CAPTURE = _KeyCapture()
