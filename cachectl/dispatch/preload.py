"""When each bucket's executable loads: in the background, so that serving answers its first call
without waiting for the other buckets.

:class:`Preloader` loads the slots it is given in their order (the manifest's), in a few daemon
threads. A call to a bucket not loaded yet loads it at once in the caller's thread
(:meth:`~cachectl.dispatch.loading.Slot.ensure_loaded`), ahead of the queue; a bucket loads
once: whoever comes second (a call, or a loader thread) waits on the slot's lock for that load.

At interpreter exit the queue is dropped and each thread finishes the load it is in (never a
thread inside XLA while the process tears the backend down). In a child of ``os.fork`` the
threads do not exist: every slot gets a fresh lock (one a parent's thread held would never be
released) and what was not loaded loads at its first call there.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence

from cachectl.dispatch.loading import Slot

# Every live preloader: stopped at exit, reset in a forked child.
_LIVE: weakref.WeakSet[Preloader] = weakref.WeakSet()
_HOOKED: list[bool] = []  # the exit and fork hooks, registered at the first preloader


class Preloader:
    """Loads ``slots`` in order, in ``workers`` background threads; ``loaded_seconds`` (from
    ``started``, a ``time.perf_counter()``) once every one has loaded or failed."""

    def __init__(self, slots: Sequence[Slot], workers: int, started: float) -> None:
        self._all = list(slots)
        self._todo = deque(self._all)
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._started = started
        self._stopped = False
        self.loaded_seconds: float | None = None
        count = max(1, min(workers, len(self._all)))
        self._running = count
        self._threads = [
            threading.Thread(target=self._run, name=f"cachectl-load-{i}", daemon=True)
            for i in range(count)
        ]
        _hook()
        _LIVE.add(self)
        for thread in self._threads:
            thread.start()

    def _next(self) -> Slot | None:
        with self._lock:
            if self._stopped or not self._todo:
                return None
            return self._todo.popleft()

    def _run(self) -> None:
        try:
            while (slot := self._next()) is not None:
                try:
                    slot.ensure_loaded()  # a slot a call is loading: waits for that load
                except Exception as exc:  # noqa: BLE001 - that bucket goes to jit; the rest load
                    with slot.lock:
                        if slot.compiled is None and slot.error is None:
                            slot.error = f"loading it raised {type(exc).__name__}: {exc}"
        finally:
            with self._lock:
                self._running -= 1
                last = self._running == 0
                if last and not self._stopped:
                    self.loaded_seconds = time.perf_counter() - self._started
            if last:
                self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every slot has loaded (or failed to); False when ``timeout`` came first."""
        return self._done.wait(timeout)

    def stop(self) -> None:
        """Load nothing more; wait for the loads in progress."""
        with self._lock:
            self._stopped = True
            self._todo.clear()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()

    def _after_fork_in_child(self) -> None:
        """The parent's threads do not exist here: nothing loads in the background, each slot
        loads at its first call, behind a lock no vanished thread holds."""
        self._lock = threading.Lock()
        self._stopped = True
        self._todo.clear()
        self._threads = []
        for slot in self._all:
            slot.lock = threading.Lock()
        self._done.set()


def _stop_all() -> None:
    for preloader in list(_LIVE):
        preloader.stop()


def _reset_in_child() -> None:
    for preloader in list(_LIVE):
        preloader._after_fork_in_child()


def _hook() -> None:
    """Registered at the first preloader, after JAX was imported: exit hooks run last first,
    so the loads stop before JAX's own hook tears its backends down."""
    if _HOOKED:
        return
    _HOOKED.append(True)
    atexit.register(_stop_all)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_reset_in_child)
