"""Hit/miss telemetry for a managed service, collected in-process.

JAX reports cache use through ``jax.monitoring`` events (docs/jax-facts.md, fact 5):
``compile_requests_use_cache`` and ``cache_hits`` on every compile that could
use the cache, ``cache_misses`` only when an entry is *written* (so misses are
requests minus hits), and two durations. None of them names the program; the
only place that names the key of a hit is a DEBUG record of JAX's compiler
logger (cachectl.core.jax_seam owns every such JAX detail). So the collector listens to both:

- a tap on that logger's ``log``/``debug`` methods reads module and key from the
  hit/miss calls' arguments and passes every call on unchanged: the logger's
  level and handlers are untouched, so the service's logs stay as they were and
  no DEBUG record is ever built for us (telemetry/taps.py);
- event listeners count requests, hits, writes and the saved time, attributed
  to the module named by the log record just before them on the same thread.

Everything lands in a bounded in-memory buffer (full = drop and count); a
daemon thread hands the buffer to a pluggable sink every few seconds and at
exit. The hooks never raise into JAX and never wait on I/O: the only work on
the compile path is a dict update under an uncontended lock.

Modules: batch.py (the batch, its bounds, the memory sink), rows.py (the rows a flush
writes), taps.py (the log taps), collector.py (the events, the buffer, the flusher, exit
and fork); the index and server sinks are service/telemetry_sinks.py. This package keeps
every name importable from here.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from cachectl.core.jax_seam import (  # noqa: F401 - re-exported
    COMPILER_LOGGER,
    EVENT_HITS,
    EVENT_REQUESTS,
    EVENT_RETRIEVAL,
    EVENT_SAVED,
    EVENT_WRITES,
)
from cachectl.core.jax_seam import HIT_PREFIX as _HIT_PREFIX  # noqa: F401 - re-exported
from cachectl.core.jax_seam import MISS_PREFIX as _MISS_PREFIX  # noqa: F401 - re-exported
from cachectl.core.jax_seam import compiler_logger as _compiler_logger  # noqa: F401 - re-exported
from cachectl.telemetry.batch import (  # noqa: F401 - re-exported
    MAX_FLUSH_COUNT,
    MAX_FLUSH_SECONDS,
    MAX_SERVING_AXES,
    MAX_SERVING_SIZES,
    CollectorStats,
    FunctionCounts,
    MemorySink,
    ServingCounts,
    SignatureCounts,
    TelemetryBatch,
    TelemetrySink,
    check_batch,
    process_id,
)
from cachectl.telemetry.collector import (  # noqa: F401 - re-exported
    DEFAULT_INTERVAL_S,
    DEFAULT_MAX_FUNCTIONS,
    DEFAULT_MAX_KEYS,
    DEFAULT_MAX_SIGNATURES,
    EXIT_FLUSH_TIMEOUT_S,
    SEEN_SIGNATURES,
    Collector,
    log,
)
from cachectl.telemetry.taps import LogTap, SignatureTap  # noqa: F401 - re-exported

_current: Collector | None = None
_current_lock = threading.Lock()


def current() -> Collector | None:
    """The collector activate() installed in this process, if any."""
    return _current


def start(
    *, cache: str, environment: Any, sink: TelemetrySink | None, interval_s: float | None = None
) -> Collector:
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
        collector = Collector(
            cache=cache, environment_digest=environment.digest, sink=sink, interval_s=interval_s
        )
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
