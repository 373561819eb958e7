"""The collector: JAX's monitoring events and log taps -> a bounded buffer -> a sink.

Event listeners count requests, hits, writes and the saved time, attributed to the
module named by the compiler's log call just before them on the same thread
(telemetry/taps.py reads those calls). The categories are JAX's own: a hit; a miss (looked
up and not found, whether JAX then writes it or not: too fast to compile, a read-only
service); not cacheable (a JAX-internal staging program, the eager dispatch of one
primitive, which no manifest can name, or a program with host callbacks, which JAX never
writes: in the per-function counts and in the signatures alike, so `stats` and `misses` agree). Executables cachectl.serving
loads are counted apart as loads: JAX never looked them up. Everything lands in a bounded in-memory buffer
(full = drop and count); a daemon thread hands the buffer to the sink every few
seconds and at exit (bounded in time), and a forked child starts clean. The hooks
never raise into JAX and never wait on I/O: the only work on the compile path is a
dict update under an uncontended lock.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from threading import get_ident
from typing import Any

from cachectl.core import jax_seam
from cachectl.core.jax_seam import (
    EVENT_BACKEND_COMPILE,
    EVENT_HITS,
    EVENT_REQUESTS,
    EVENT_RETRIEVAL,
    EVENT_SAVED,
    EVENT_WRITES,
)
from cachectl.telemetry.batch import (
    CollectorStats,
    FunctionCounts,
    ServingCounts,
    SignatureCounts,
    TelemetryBatch,
    TelemetrySink,
    process_id,
)
from cachectl.telemetry.taps import LogTap, SignatureTap

log = logging.getLogger("cachectl.telemetry")

DEFAULT_INTERVAL_S = 5.0
DEFAULT_MAX_FUNCTIONS = 4096
DEFAULT_MAX_KEYS = 16384
DEFAULT_MAX_SIGNATURES = 1024  # distinct signatures per flush; more are dropped and counted
SEEN_SIGNATURES = 16384  # per process: what tells a re-jitted function from a new program
EXIT_FLUSH_TIMEOUT_S = 5.0


class Collector:
    """Counts cache use in this process and flushes it to a sink in the background."""

    def __init__(
        self,
        *,
        cache: str,
        environment_digest: str,
        sink: TelemetrySink | None,
        interval_s: float = DEFAULT_INTERVAL_S,
        max_functions: int = DEFAULT_MAX_FUNCTIONS,
        max_keys: int = DEFAULT_MAX_KEYS,
        clock: Callable[[], float] | None = None,
        max_signatures: int = DEFAULT_MAX_SIGNATURES,
    ) -> None:
        self.cache = cache
        self.environment_digest = environment_digest
        self.sink = sink
        self.interval_s = interval_s
        self.max_functions = max_functions
        self.max_keys = max_keys
        self.max_signatures = max_signatures
        self._seen: dict[tuple[Any, ...], None] = {}
        self._clock = clock or time.time
        self._lock = threading.Lock()
        self._threads: dict[int, list[Any]] = {}
        self._process = process_id()
        self._reset_buffer()
        # lifetime totals
        self._requests = self._hits = self._writes = self._loads = 0
        self._saved = 0.0
        self._dropped_total = 0
        self._flushes = self._failed = 0
        self._last_error: str | None = None
        self._warned = False
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._installed = False
        self._tap: LogTap | None = None
        self._final = False  # the flusher's last round, at exit
        self._sig_tap: SignatureTap | None = None
        self._sources: list[Callable[[], dict[str, ServingCounts]]] = []

    def add_serving_source(self, take: Callable[[], dict[str, ServingCounts]]) -> None:
        """A serving runtime whose counters each flush takes (and resets) with ``take``."""
        with self._lock:
            self._sources.append(take)

    # -- buffer -------------------------------------------------------------

    def _reset_buffer(self) -> None:
        self._functions: dict[str | None, FunctionCounts] = {}
        self._keys: dict[str, list[float]] = {}  # key -> [count, last hit (epoch seconds)]
        self._dropped = 0
        self._signatures: dict[tuple[Any, ...], SignatureCounts] = {}
        self._sig_dropped = 0
        self._started = self._clock()

    def _counts(self, module: str | None) -> FunctionCounts | None:
        counts = self._functions.get(module)
        if counts is None:
            if len(self._functions) >= self.max_functions:
                self._dropped += 1
                self._dropped_total += 1
                return None
            counts = self._functions[module] = FunctionCounts()
        return counts

    # -- hooks (run on the compiling thread; must be cheap and never raise) --
    #
    # Per thread: [requests not yet attributed, module of the current compile].
    # JAX's order on one thread is: request event, then the hit or miss log
    # (names the module), then the hit event and durations, or the write event.

    def _thread_state(self) -> list[Any]:
        tid = get_ident()
        state = self._threads.get(tid)
        if state is None:
            if len(self._threads) > 4096:  # threads come and go: forget finished ones
                self._threads.clear()
            # [requests not attributed, module, pending (module, leaves), last signature counts,
            #  whether the current lookup is of a not-cacheable staging program,
            #  the current lookup's outcome until its compile stage is timed: True hit, False miss]
            state = self._threads[tid] = [0, None, None, None, False, None]
        return state

    def _on_lowering(self, module: Any, in_avals: Any, in_shardings: Any) -> None:
        # Only references here (avals and shardings are immutable); take() turns them into text.
        with contextlib.suppress(Exception):  # telemetry never breaks a compile
            source, statics = jax_seam.call_context(3)
            self._thread_state()[2] = (
                str(module),
                tuple(in_avals),
                tuple(in_shardings),
                source,
                statics,
            )

    def _record_signature(
        self, state: list[Any], pending: Any, hit: bool, staging: bool, module: str, key: str
    ) -> None:
        """Under self._lock: count this request against the signature its lowering logged."""
        state[3] = None
        # pxla names the lowering jit(f), the compiler's module is jit_f: same thread, same order.
        if pending is None:
            return
        ident = (module, pending[1], pending[2], key, pending[4])
        try:
            counts = self._signatures.get(ident)
        except TypeError:  # an unhashable sharding: text now
            ident = (module, jax_seam.leaves_of(pending[1], pending[2]), (), key, pending[4])
            counts = self._signatures.get(ident)
        now = self._clock()
        if counts is None:
            if len(self._signatures) >= self.max_signatures:
                self._sig_dropped += 1
                return
            counts = self._signatures[ident] = SignatureCounts(
                (), key, first_seen=now, source=pending[3], statics=pending[4], raw=ident[1:3]
            )
        counts.requests += 1
        counts.last_seen = now
        if staging:
            counts.uncacheable += 1
        elif hit:
            counts.hits += 1
        else:
            counts.misses += 1
        if ident in self._seen:
            counts.repeats += 1
        elif len(self._seen) < SEEN_SIGNATURES:
            self._seen[ident] = None
        state[3] = counts

    def _on_not_written(self, module: str) -> None:
        """JAX decided not to write the program just missed: it stays a miss (it was looked up
        and not found), so there is nothing to move; host callbacks are _on_host_callbacks'."""

    def _on_host_callbacks(self, module: str) -> None:
        """JAX will not write the program just missed because it uses host callbacks: no warm
        can ever serve it, so its request is counted as not cacheable, as staging programs are,
        in the function's counts and in its signature's (`stats` tells the two kinds apart by
        the signature's source, jax_seam.is_staging). Its compile stage is not a miss's cost
        either."""
        state = self._thread_state()
        if state[1] != module or state[5] is not False:  # not the miss this thread just logged
            return
        state[5] = None
        with self._lock:
            counts = self._counts(module)
            if counts is not None:
                counts.uncacheable += 1
            signature = state[3]
            if signature is not None and signature.misses > 0:
                signature.misses -= 1
                signature.uncacheable += 1

    def _on_log(self, hit: bool, module: str, key: str) -> None:
        state = self._thread_state()
        unattributed, state[0], state[1] = state[0], 0, module
        lowering, state[2] = state[2], None
        staging = lowering is not None and jax_seam.is_staging(lowering[3])
        state[4] = staging
        state[5] = None if staging else hit
        with self._lock:
            counts = self._counts(module)
            if counts is not None:
                counts.requests += unattributed
                if staging:
                    counts.uncacheable += 1
            self._record_signature(state, lowering, hit, staging, module, key)
            if hit:
                self._note_key_hit(key)

    def record_load(self, module: str, key: str) -> None:
        """A stored executable was loaded for ``key`` (cachectl.serving). JAX never looked it up,
        so it is neither a request nor a hit: it is counted apart as a load. It is still a use
        of the entry, and lifecycle's LRU must see it."""
        with self._lock:
            self._loads += 1
            counts = self._counts(module)
            if counts is not None:
                counts.loads += 1
            self._note_key_hit(key)

    def _note_key_hit(self, key: str) -> None:
        """One more hit of ``key`` (for the entry's last access); bounded. Call under the lock."""
        seen = self._keys.get(key)
        if seen is not None:
            seen[0] += 1
            seen[1] = self._clock()
        elif len(self._keys) < self.max_keys:
            self._keys[key] = [1, self._clock()]
        else:
            self._dropped += 1
            self._dropped_total += 1

    def _on_event(self, event: str, **_kwargs: Any) -> None:
        try:
            if event == EVENT_REQUESTS:
                state = self._thread_state()
                stale, state[0], state[1], state[4], state[5] = state[0], 1, None, False, None
                with self._lock:
                    self._requests += 1
                    if stale:  # the previous request never logged: count it unattributed
                        counts = self._counts(None)
                        if counts is not None:
                            counts.requests += stale
            elif event == EVENT_HITS:
                state = self._thread_state()
                pending, state[0] = state[0], 0
                with self._lock:
                    self._hits += 1  # lifetime totals are JAX's own events (stats())
                    counts = self._counts(state[1])
                    if state[4]:  # a staging program found in the cache: still not cacheable
                        return
                    if counts is not None:
                        counts.hits += 1
                        counts.requests += pending  # only when the hit log was not seen
            elif event == EVENT_WRITES:
                module = self._thread_state()[1]
                with self._lock:
                    self._writes += 1
                    counts = self._counts(module)
                    if counts is not None:
                        counts.writes += 1
        except Exception:  # noqa: BLE001 - telemetry never breaks a compile
            pass

    def _on_duration(self, event: str, duration_secs: float, **_kwargs: Any) -> None:
        try:
            if event == EVENT_SAVED:
                module = self._thread_state()[1]
                with self._lock:
                    self._saved += duration_secs
                    counts = self._counts(module)
                    if counts is not None:
                        counts.saved_seconds += duration_secs
            elif event == EVENT_RETRIEVAL:
                module = self._thread_state()[1]
                with self._lock:
                    counts = self._counts(module)
                    if counts is not None:
                        counts.retrieval_seconds += duration_secs
            elif event == EVENT_BACKEND_COMPILE:
                # The compile stage of the lookup just logged: what a miss cost this service and
                # what a hit still cost it ("saved" is estimated from the two).
                state = self._thread_state()
                outcome, state[5] = state[5], None
                if outcome is None:
                    return
                with self._lock:
                    counts = self._counts(state[1])
                    if counts is not None:
                        if outcome:
                            counts.hit_seconds += duration_secs
                        else:
                            counts.miss_seconds += duration_secs
        except Exception:  # noqa: BLE001
            pass

    # -- lifecycle ----------------------------------------------------------

    def install(self) -> None:
        """Register the JAX listeners and the log tap; start the flusher thread."""
        if self._installed:
            return
        from jax import monitoring

        monitoring.register_event_listener(self._on_event)
        monitoring.register_event_duration_secs_listener(self._on_duration)
        self._tap = LogTap(self, jax_seam.compiler_logger())
        self._tap.install()
        self._sig_tap = SignatureTap(self, jax_seam.pxla_logger())
        self._sig_tap.install()
        self._installed = True
        if self.sink is not None:
            self._stop.clear()
            self._final = False
            self._start_flusher()
            atexit.register(self._at_exit)
            if hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=self._after_fork_in_child)

    def _start_flusher(self) -> None:
        self._thread = threading.Thread(target=self._run, name="cachectl-telemetry", daemon=True)
        self._thread.start()

    def _after_fork_in_child(self) -> None:
        """A forked child has this object but not its thread, and its locks may be held by a
        thread that no longer exists: start clean, under the child's own process id."""
        if not self._installed or self.sink is None:
            return
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._threads = {}
        self._process = process_id()
        self._reset_buffer()
        self._stop = threading.Event()
        self._final = False
        self._start_flusher()

    def uninstall(self, *, flush: bool = True) -> None:
        """Undo install(): listeners, log tap, logger level; final flush if asked."""
        if not self._installed:
            return
        from jax import monitoring as _monitoring

        listeners: tuple[tuple[Callable[[Any], None], object], ...] = (
            (_monitoring.unregister_event_listener, self._on_event),
            (_monitoring.unregister_event_duration_listener, self._on_duration),
        )
        for remove, fn in listeners:
            with contextlib.suppress(AssertionError, ValueError):
                remove(fn)
        if self._tap is not None:
            self._tap.uninstall()
            self._tap = None
        if self._sig_tap is not None:
            self._sig_tap.uninstall()
            self._sig_tap = None
        self._installed = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=EXIT_FLUSH_TIMEOUT_S)
            self._thread = None
        atexit.unregister(self._at_exit)
        if flush:
            self.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.flush()
        if self._final:
            self.flush()

    def _at_exit(self) -> None:
        """Final flush, bounded in time: an unreachable index must not hold up exit.

        The flusher thread that already runs does it: at interpreter shutdown a
        new thread cannot be started (Python 3.12 raises), and flushing inline
        could wait on a dead index for as long as its client's timeout.
        """
        thread = self._thread
        self._final = True
        self._stop.set()
        if thread is not None and thread.is_alive():
            thread.join(EXIT_FLUSH_TIMEOUT_S)
        else:
            with contextlib.suppress(Exception):
                self.flush()

    def take(self) -> TelemetryBatch:
        """Swap the buffer out (the compile path only ever waits for this swap)."""
        with self._lock:
            started, functions, keys, dropped = (
                self._started,
                self._functions,
                self._keys,
                self._dropped,
            )
            signatures, sig_dropped = self._signatures, self._sig_dropped
            # A miss still compiling keeps its signature for the next batch: JAX says only after
            # the compile whether it will never write it (host callbacks), which moves the
            # signature's miss to not cacheable (_on_host_callbacks), as the function's counts.
            compiling = {  # none at the process's last flush: nothing comes after it
                id(state[3])
                for state in self._threads.values()
                if state[3] is not None and state[5] is False and not self._final
            }
            kept = {i: c for i, c in signatures.items() if id(c) in compiling}
            for ident in kept:
                del signatures[ident]
            for state in self._threads.values():  # the others now belong to the batch taken
                if id(state[3]) not in compiling:
                    state[3] = None
            ended = self._clock()
            self._reset_buffer()
            self._signatures.update(kept)
            sources = list(self._sources)
        serving: dict[str, ServingCounts] = {}
        for source in sources:
            with contextlib.suppress(Exception):  # telemetry never breaks the service
                serving.update({k: v for k, v in source().items() if not v.empty})

        def utc(ts: float) -> datetime:
            return datetime.fromtimestamp(ts, tz=UTC)

        named: dict[tuple[Any, ...], SignatureCounts] = {}
        for ident, c in signatures.items():
            with contextlib.suppress(Exception):
                if c.raw is not None:
                    c.leaves = (
                        ident[1] if not ident[2] and c.raw[1] == () else jax_seam.leaves_of(*c.raw)
                    )
                    c.raw = None
                key = (ident[0], c.leaves, ident[3], ident[4])
                if key in named:  # the same text from two sharding objects
                    for f in ("requests", "hits", "misses", "uncacheable", "repeats"):
                        setattr(named[key], f, getattr(named[key], f) + getattr(c, f))
                else:
                    named[key] = c
        signatures = named

        return TelemetryBatch(
            process=self._process,
            cache=self.cache,
            environment_digest=self.environment_digest,
            started_at=utc(started),
            ended_at=utc(ended),
            functions=functions,
            hit_keys={k: (int(v[0]), utc(v[1])) for k, v in keys.items()},
            dropped=dropped,
            serving=serving,
            signatures=signatures,
            signatures_dropped=sig_dropped,
        )

    def _give_back_dropped(self, batch: TelemetryBatch) -> None:
        """A failed flush loses its counts; what survives is how many were lost."""
        lost = sum(c.requests + c.writes + c.loads for c in batch.functions.values()) + len(
            batch.hit_keys
        )
        with self._lock:
            self._dropped += batch.dropped + lost
            self._dropped_total += lost

    def flush(self) -> bool:
        """Hand the buffer to the sink; failures are counted, logged once, never raised."""
        if self.sink is None:
            return False
        with self._flush_lock:
            batch = self.take()
            if batch.empty:
                return True
            try:
                self.sink.write(batch)
            except Exception as exc:  # noqa: BLE001 - telemetry never breaks the service
                self._failed += 1
                self._last_error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                self._give_back_dropped(batch)
                level = logging.DEBUG if self._warned else logging.INFO
                self._warned = True
                log.log(
                    level,
                    "cachectl telemetry: flush to %s failed (%s); counts dropped",
                    type(self.sink).__name__,
                    self._last_error,
                )
                return False
            self._flushes += 1
            return True

    def stats(self) -> CollectorStats:
        with self._lock:
            return CollectorStats(
                requests=self._requests,
                hits=self._hits,
                loads=self._loads,
                writes=self._writes,
                saved_seconds=self._saved,
                dropped=self._dropped_total,
                flushes=self._flushes,
                failed_flushes=self._failed,
                sink=self.sink.describe() if self.sink else None,
                last_error=self._last_error,
            )
