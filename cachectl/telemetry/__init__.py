"""Hit/miss telemetry for a managed service, collected in-process.

JAX reports cache use through ``jax.monitoring`` events (DESIGN.md fact 5):
``compile_requests_use_cache`` and ``cache_hits`` on every compile that could
use the cache, ``cache_misses`` only when an entry is *written* (so misses are
requests minus hits), and two durations. None of them names the program; the
only place that names the key of a hit is a DEBUG record of the logger
``jax._src.compiler``. So the collector listens to both:

- a tap on that logger's ``log``/``debug`` methods reads module and key from the
  hit/miss calls' arguments and passes every call on unchanged: the logger's
  level and handlers are untouched, so the service's logs stay as they were and
  no DEBUG record is ever built for us (see _LogTap);
- event listeners count requests, hits, writes and the saved time, attributed
  to the module named by the log record just before them on the same thread.

Everything lands in a bounded in-memory buffer (full = drop and count); a
daemon thread hands the buffer to a pluggable sink every few seconds and at
exit. The hooks never raise into JAX and never wait on I/O: the only work on
the compile path is a dict update under an uncontended lock.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from threading import get_ident
from typing import Any

from cachectl import jax_signatures, service_sqlite
from cachectl.records import utcnow
from cachectl.telemetry.records import (  # noqa: F401 - re-exported
    MAX_FLUSH_COUNT,
    MAX_FLUSH_SECONDS,
    MAX_SERVING_AXES,
    MAX_SERVING_SIZES,
    CollectorStats,
    FunctionCounts,
    ServingCounts,
    SignatureCounts,
    TelemetryBatch,
    TelemetrySink,
    check_batch,
    process_id,
)

log = logging.getLogger(__name__)

EVENT_REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"
EVENT_HITS = "/jax/compilation_cache/cache_hits"
EVENT_WRITES = "/jax/compilation_cache/cache_misses"  # fires only when an entry is written
EVENT_SAVED = "/jax/compilation_cache/compile_time_saved_sec"
EVENT_RETRIEVAL = "/jax/compilation_cache/cache_retrieval_time_sec"
COMPILER_LOGGER = "jax._src.compiler"
_HIT_PREFIX = "Persistent compilation cache hit for"
_MISS_PREFIX = "PERSISTENT COMPILATION CACHE MISS for"

DEFAULT_INTERVAL_S = 5.0
DEFAULT_MAX_FUNCTIONS = 4096
DEFAULT_MAX_KEYS = 16384
DEFAULT_MAX_SIGNATURES = 1024  # distinct signatures per flush; more are dropped and counted
SEEN_SIGNATURES = 16384  # per process: what tells a re-jitted function from a new program
EXIT_FLUSH_TIMEOUT_S = 5.0


def _index_side() -> Any:
    """cachectl.service_index, imported in the flusher thread: a service never pays for SQLAlchemy at start."""
    from cachectl import service_index

    return service_index


class IndexSink:
    """Writes batches to the index: telemetry rows plus entry hit counts.

    The index is opened lazily, in the flusher thread, and re-opened after a
    failure, so an index that comes back later gets the counts again.
    """

    def __init__(self, db_url: str, cache: str, environment: Any, *, create_cache_at: str | None = None) -> None:
        self.db_url = db_url
        self.cache = cache
        self.environment = environment
        self.create_cache_at = create_cache_at  # the embedded default is created on first use
        self._index: Any = None
        self._env_id: int | None = None

    def describe(self) -> str:
        # Without SQLAlchemy: the service must not pay for its import at start.
        return "index " + re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", self.db_url)

    def _open(self) -> tuple[Any, int]:
        if self._index is None or self._env_id is None:
            def record(index: Any) -> int:
                if self.create_cache_at:
                    index.ensure_cache(self.cache, self.create_cache_at)
                return int(index.ensure_environment(self.cache, self.environment).id)

            self._index, self._env_id = _index_side().index_with(self.db_url, record)
        return self._index, self._env_id

    def _write_fast(self, batch: TelemetryBatch) -> bool:
        """Write through the stdlib driver when the index allows it (no SQLAlchemy import)."""
        if self._index is not None:
            return False  # the SQLAlchemy index is open already: keep using it
        fast = service_sqlite.open_fast(self.db_url)
        if fast is None:
            return False
        try:
            now = utcnow()
            env_id = fast.touch_environment(self.cache, self.environment.digest, now)
            if env_id is None:
                return False
            fast.record_telemetry(env_id, batch, now)
            return True
        except sqlite3.Error:
            return False
        finally:
            fast.close()

    def write(self, batch: TelemetryBatch) -> None:
        if self._write_fast(batch):
            return
        try:
            index, env_id = self._open()
            _index_side().record_telemetry(index, env_id, batch)
        except Exception:
            if self._index is not None:
                self._index.close()
            self._index = self._env_id = None
            raise

    def close(self) -> None:
        if self._index is not None:
            self._index.close()
            self._index = None


class MemorySink:
    """Keeps batches in a list: for benchmarks and for embedding without an index."""

    def __init__(self) -> None:
        self.batches: list[TelemetryBatch] = []

    def describe(self) -> str:
        return "memory"

    def write(self, batch: TelemetryBatch) -> None:
        self.batches.append(batch)


class _LogTap:
    """Reads the hit/miss records of ``jax._src.compiler`` as JAX emits them, for free.

    JAX names the key of a hit only in a DEBUG record. Lowering the logger to
    DEBUG would make every debug call in that module build a LogRecord (stack
    walk, timestamps: ~5-20 µs each, several per compile) and hand it to the
    service's handlers. Instead the tap wraps this one logger's ``log`` and
    ``debug`` methods: it reads module and key from the call's arguments and
    passes every call on unchanged, so the logger's level, its handlers and
    what the service sees stay exactly as they were, and a suppressed DEBUG
    record is never built at all.
    """

    def __init__(self, collector: Collector, logger: logging.Logger) -> None:
        self.collector = collector
        self.logger = logger
        self._saved: dict[str, Any] = {}

    def _peek(self, msg: Any, args: tuple[Any, ...]) -> None:
        try:
            if len(args) == 2 and isinstance(msg, str):
                if msg.startswith(_HIT_PREFIX):
                    self.collector._on_log(True, str(args[0]), str(args[1]))
                elif msg.startswith(_MISS_PREFIX):
                    self.collector._on_log(False, str(args[0]), str(args[1]))
            elif args and isinstance(msg, str) and msg.startswith(jax_signatures.NOT_WRITING_PREFIX):
                never = jax_signatures.uncacheable(args, msg)
                if never:
                    self.collector._on_uncacheable(str(args[0]))
        except Exception:  # noqa: BLE001 - never raise into JAX's logging
            pass

    def install(self) -> None:
        logger = self.logger
        cls_log, cls_debug = type(logger).log, type(logger).debug
        for name in ("log", "debug"):
            if name in logger.__dict__:
                self._saved[name] = logger.__dict__[name]
        prev_log = self._saved.get("log")
        prev_debug = self._saved.get("debug")
        peek = self._peek

        # stacklevel + 1: records keep naming JAX's line, not this wrapper.
        def log(level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
            peek(msg, args)
            if prev_log is not None:
                prev_log(level, msg, *args, **kwargs)
            elif logger.isEnabledFor(level):
                kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
                cls_log(logger, level, msg, *args, **kwargs)

        def debug(msg: Any, *args: Any, **kwargs: Any) -> None:
            peek(msg, args)
            if prev_debug is not None:
                prev_debug(msg, *args, **kwargs)
            elif logger.isEnabledFor(logging.DEBUG):
                kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
                cls_debug(logger, msg, *args, **kwargs)

        logger.log = log  # type: ignore[method-assign]
        logger.debug = debug  # type: ignore[method-assign]

    def uninstall(self) -> None:
        for name in ("log", "debug"):
            if name in self._saved:
                setattr(self.logger, name, self._saved[name])
            else:
                self.logger.__dict__.pop(name, None)


class _SignatureTap:
    """Reads each lowering's module name, input avals and shardings from the one guarded
    debug call of ``jax._src.interpreters.pxla`` (see cachectl.jax_signatures)."""

    def __init__(self, collector: Collector, logger: logging.Logger) -> None:
        self.collector = collector
        self.logger = logger
        self._saved: dict[str, Any] = {}

    def install(self) -> None:
        logger = self.logger
        cls = type(logger)
        for name in ("log", "isEnabledFor"):
            if name in logger.__dict__:
                self._saved[name] = logger.__dict__[name]
        prev_log = self._saved.get("log")
        prev_enabled = self._saved.get("isEnabledFor")
        collector = self.collector
        prefix = jax_signatures.LOWERING_PREFIX

        def really_enabled(level: int) -> bool:
            return prev_enabled(level) if prev_enabled is not None else cls.isEnabledFor(logger, level)

        def is_enabled(level: int) -> bool:
            return level == logging.DEBUG or really_enabled(level)

        def log(level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
            if len(args) == 3 and isinstance(msg, str) and msg.startswith(prefix):
                collector._on_lowering(args[0], args[1], args[2])
            if prev_log is not None:
                prev_log(level, msg, *args, **kwargs)
            elif really_enabled(level):
                kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
                cls.log(logger, level, msg, *args, **kwargs)

        logger.isEnabledFor = is_enabled  # type: ignore[method-assign]
        logger.log = log  # type: ignore[method-assign]

    def uninstall(self) -> None:
        for name in ("log", "isEnabledFor"):
            if name in self._saved:
                setattr(self.logger, name, self._saved[name])
            else:
                self.logger.__dict__.pop(name, None)


def _compiler_logger() -> logging.Logger:
    """The logger object jax._src.compiler logs through (the one it imported)."""
    try:
        from jax._src import compiler

        candidate = getattr(compiler, "logger", None)
        if isinstance(candidate, logging.Logger):
            return candidate
    except ImportError:
        pass
    return logging.getLogger(COMPILER_LOGGER)


class Collector:
    """Counts cache use in this process and flushes it to a sink in the background."""

    def __init__(self, *, cache: str, environment_digest: str, sink: TelemetrySink | None,
                 interval_s: float = DEFAULT_INTERVAL_S, max_functions: int = DEFAULT_MAX_FUNCTIONS,
                 max_keys: int = DEFAULT_MAX_KEYS, clock: Callable[[], float] | None = None,
                 max_signatures: int = DEFAULT_MAX_SIGNATURES) -> None:
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
        self._requests = self._hits = self._writes = 0
        self._saved = 0.0
        self._dropped_total = 0
        self._flushes = self._failed = 0
        self._last_error: str | None = None
        self._warned = False
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._installed = False
        self._tap: _LogTap | None = None
        self._final = False  # the flusher's last round, at exit
        self._sig_tap: _SignatureTap | None = None
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
            # [requests not attributed, module, pending (module, leaves), last signature counts]
            state = self._threads[tid] = [0, None, None, None]
        return state

    def _on_lowering(self, module: Any, in_avals: Any, in_shardings: Any) -> None:
        # Only references here (avals and shardings are immutable); take() turns them into text.
        with contextlib.suppress(Exception):  # telemetry never breaks a compile
            source, statics = jax_signatures.call_context(3)
            self._thread_state()[2] = (str(module), tuple(in_avals), tuple(in_shardings), source, statics)

    def _record_signature(self, state: list[Any], hit: bool, module: str, key: str) -> None:
        """Under self._lock: count this request against the signature its lowering logged."""
        pending, state[2], state[3] = state[2], None, None
        # pxla names the lowering jit(f), the compiler's module is jit_f: same thread, same order.
        if pending is None:
            return
        ident = (module, pending[1], pending[2], key, pending[4])
        try:
            counts = self._signatures.get(ident)
        except TypeError:  # an unhashable sharding: text now
            ident = (module, jax_signatures.leaves_of(pending[1], pending[2]), (), key, pending[4])
            counts = self._signatures.get(ident)
        now = self._clock()
        if counts is None:
            if len(self._signatures) >= self.max_signatures:
                self._sig_dropped += 1
                return
            counts = self._signatures[ident] = SignatureCounts((), key, first_seen=now, source=pending[3],
                                                               statics=pending[4], raw=ident[1:3])
        counts.requests += 1
        counts.last_seen = now
        if hit:
            counts.hits += 1
        else:
            counts.misses += 1
        if ident in self._seen:
            counts.repeats += 1
        elif len(self._seen) < SEEN_SIGNATURES:
            self._seen[ident] = None
        state[3] = counts

    def _on_uncacheable(self, module: str) -> None:
        """JAX decided never to write the program just missed: move it to uncacheable."""
        state = self._thread_state()
        counts = state[3]
        with self._lock:
            if counts is not None and counts.misses:
                counts.misses -= 1
                counts.uncacheable += 1
            fn = self._functions.get(module)
            if fn is not None:
                fn.uncacheable += 1
        state[3] = None

    def _on_log(self, hit: bool, module: str, key: str) -> None:
        state = self._thread_state()
        pending, state[0], state[1] = state[0], 0, module
        with self._lock:
            counts = self._counts(module)
            if counts is not None:
                counts.requests += pending
            self._record_signature(state, hit, module, key)
            if hit:
                self._note_key_hit(key)

    def record_load(self, module: str, key: str) -> None:
        """A stored executable was loaded for ``key`` (cachectl.serving): JAX fires no event for
        it, yet it is a use of the entry, and lifecycle's LRU must see it."""
        with self._lock:
            self._requests += 1
            self._hits += 1
            counts = self._counts(module)
            if counts is not None:
                counts.requests += 1
                counts.hits += 1
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
                stale, state[0], state[1] = state[0], 1, None
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
                    self._hits += 1
                    counts = self._counts(state[1])
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

    def _on_duration(self, event: str, duration: float, **_kwargs: Any) -> None:
        try:
            if event == EVENT_SAVED:
                module = self._thread_state()[1]
                with self._lock:
                    self._saved += duration
                    counts = self._counts(module)
                    if counts is not None:
                        counts.saved_seconds += duration
            elif event == EVENT_RETRIEVAL:
                module = self._thread_state()[1]
                with self._lock:
                    counts = self._counts(module)
                    if counts is not None:
                        counts.retrieval_seconds += duration
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
        self._tap = _LogTap(self, _compiler_logger())
        self._tap.install()
        self._sig_tap = _SignatureTap(self, jax_signatures.pxla_logger())
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

        for remove, fn in ((_monitoring.unregister_event_listener, self._on_event),
                           (_monitoring.unregister_event_duration_listener, self._on_duration)):
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
            started, functions, keys, dropped = self._started, self._functions, self._keys, self._dropped
            signatures, sig_dropped = self._signatures, self._sig_dropped
            for state in self._threads.values():  # counts now belong to the batch taken
                state[3] = None
            ended = self._clock()
            self._reset_buffer()
            sources = list(self._sources)
        serving: dict[str, ServingCounts] = {}
        for source in sources:
            with contextlib.suppress(Exception):  # telemetry never breaks the service
                serving.update({k: v for k, v in source().items() if not v.empty})

        def utc(ts: float) -> datetime:
            return datetime.fromtimestamp(ts, tz=timezone.utc)

        named: dict[tuple[Any, ...], SignatureCounts] = {}
        for ident, c in signatures.items():
            with contextlib.suppress(Exception):
                if c.raw is not None:
                    c.leaves = ident[1] if not ident[2] and c.raw[1] == () else jax_signatures.leaves_of(*c.raw)
                    c.raw = None
                key = (ident[0], c.leaves, ident[3], ident[4])
                if key in named:  # the same text from two sharding objects
                    for f in ("requests", "hits", "misses", "uncacheable", "repeats"):
                        setattr(named[key], f, getattr(named[key], f) + getattr(c, f))
                else:
                    named[key] = c
        signatures = named

        return TelemetryBatch(
            process=self._process, cache=self.cache, environment_digest=self.environment_digest,
            started_at=utc(started), ended_at=utc(ended), functions=functions,
            hit_keys={k: (int(v[0]), utc(v[1])) for k, v in keys.items()}, dropped=dropped,
            serving=serving, signatures=signatures, signatures_dropped=sig_dropped,
        )

    def _give_back_dropped(self, batch: TelemetryBatch) -> None:
        """A failed flush loses its counts; what survives is how many were lost."""
        lost = sum(c.requests + c.writes for c in batch.functions.values()) + len(batch.hit_keys)
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
                log.log(level, "cachectl telemetry: flush to %s failed (%s); counts dropped",
                        type(self.sink).__name__, self._last_error)
                return False
            self._flushes += 1
            return True

    def stats(self) -> CollectorStats:
        with self._lock:
            return CollectorStats(
                requests=self._requests, hits=self._hits, writes=self._writes,
                saved_seconds=self._saved, dropped=self._dropped_total, flushes=self._flushes,
                failed_flushes=self._failed, sink=self.sink.describe() if self.sink else None,
                last_error=self._last_error,
            )


_current: Collector | None = None
_current_lock = threading.Lock()


def current() -> Collector | None:
    """The collector activate() installed in this process, if any."""
    return _current


def start(*, cache: str, environment: Any, sink: TelemetrySink | None,
          interval_s: float | None = None) -> Collector:
    """Install the process-wide collector (once); a later call retargets it."""
    global _current
    if interval_s is None:
        try:
            interval_s = float(os.environ.get("CACHECTL_TELEMETRY_INTERVAL", DEFAULT_INTERVAL_S))
        except ValueError:
            interval_s = DEFAULT_INTERVAL_S
    with _current_lock:
        if _current is not None:
            _current.flush()
            _current.uninstall(flush=False)
        collector = Collector(cache=cache, environment_digest=environment.digest, sink=sink,
                              interval_s=interval_s)
        collector.install()
        _current = collector
        return collector


def stop(*, flush: bool = True) -> CollectorStats | None:
    """Remove the process-wide collector (tests, or a service that wants it off)."""
    global _current
    with _current_lock:
        if _current is None:
            return None
        collector, _current = _current, None
    collector.uninstall(flush=flush)
    return collector.stats()
