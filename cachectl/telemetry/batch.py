"""Telemetry's record types and their bounds: what a flush holds, checked before it is stored.

Light on purpose: the index (cachectl.index.telemetry_queries) and the server read these
without the collector.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from cachectl.core.errors import BadInput

# The most one process can plausibly report in one flush for any counter (requests, hits,
# writes, a key's hits, drops): ten million compile requests in a flush interval is already
# far beyond what JAX can serve. Bounding every field keeps every SUM in the index far from
# 64-bit overflow (9.2e18 / 1e7 = 9.2e11 rows), on SQLite and PostgreSQL alike.
MAX_FLUSH_COUNT = 10_000_000
# Compile time saved or spent retrieving, in seconds, per function per flush.
MAX_FLUSH_SECONDS = 1e9


def process_id() -> str:
    """host:pid, as telemetry rows name the process they came from."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class FunctionCounts:
    """One program's counters between two flushes."""

    requests: int = 0
    hits: int = 0
    writes: int = 0
    saved_seconds: float = 0.0
    retrieval_seconds: float = 0.0
    # requests for JAX-internal staging programs (jit_stage, jit_convert_element_type, ...): not
    # cacheable, counted apart from hits and misses
    uncacheable: int = 0
    loads: int = 0  # stored executables cachectl.serving loaded: never requests nor hits
    # this service's compile stage (lookup, then compile and write, or load) for its misses and
    # its hits: what "saved" is estimated from
    miss_seconds: float = 0.0
    hit_seconds: float = 0.0

    @property
    def misses(self) -> int:
        """Requests looked up and not found (written or not), not-cacheable ones apart."""
        return max(self.requests - self.hits - self.uncacheable, 0)


@dataclass
class SignatureCounts:
    """One program signature's compile requests between two flushes.

    ``leaves``: (shape, dtype, weak_type, sharding) per flat input; ``key``: the cache key
    JAX computed; ``repeats``: requests for a signature this process had already compiled
    (a function object that changes per call: the in-memory caches never catch it).
    """

    leaves: tuple[Any, ...]
    key: str | None
    requests: int = 0
    hits: int = 0
    misses: int = 0
    uncacheable: int = 0
    repeats: int = 0
    first_seen: float = 0.0
    last_seen: float = 0.0
    source: str | None = None  # "f at model.py:12", where JAX knows it
    statics: tuple[tuple[Any, str], ...] | None = (
        None  # ((argnum or argname, repr), ...) of a jit call
    )
    raw: Any = field(default=None, repr=False)  # (avals, shardings) as JAX gave them, until take()


@dataclass
class ServingCounts:
    """How cachectl.serving answered one function's calls between two flushes.

    ``sizes`` holds the raw (pre-padding) size of every bucketed axis per call,
    {axis: {size: calls}}, bounded per flush: what bucket advice is computed from.
    """

    calls: int = 0
    aot: int = 0
    fallback: int = 0
    out_of_bucket: int = 0
    padded: int = 0
    sizes: dict[str, dict[int, int]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.calls or self.aot or self.fallback or self.out_of_bucket)

    def row(self, function: str) -> dict[str, Any]:
        """This function's counts as a JSON object: what the wire sends and the index stores."""
        return {
            "function": function,
            "calls": self.calls,
            "aot": self.aot,
            "fallback": self.fallback,
            "out_of_bucket": self.out_of_bucket,
            "padded": self.padded,
            "sizes": {
                axis: {str(size): n for size, n in sizes.items()}
                for axis, sizes in self.sizes.items()
            },
        }


@dataclass(frozen=True)
class TelemetryBatch:
    """What one flush hands to a sink: counters per function and hits per key."""

    process: str
    cache: str
    environment_digest: str
    started_at: datetime
    ended_at: datetime
    functions: dict[str | None, FunctionCounts]
    hit_keys: dict[str, tuple[int, datetime]]
    dropped: int
    serving: dict[str, ServingCounts] = field(default_factory=dict)
    # (module, leaves, key, statics) -> counts
    signatures: dict[tuple[Any, ...], SignatureCounts] = field(default_factory=dict)
    signatures_dropped: int = 0

    @property
    def empty(self) -> bool:
        return (
            not self.functions
            and not self.hit_keys
            and not self.dropped
            and not self.serving
            and not self.signatures
            and not self.signatures_dropped
        )

    def totals(self) -> FunctionCounts:
        out = FunctionCounts()
        for c in self.functions.values():
            out.requests += c.requests
            out.hits += c.hits
            out.writes += c.writes
            out.saved_seconds += c.saved_seconds
            out.retrieval_seconds += c.retrieval_seconds
            out.uncacheable += c.uncacheable
            out.loads += c.loads
            out.miss_seconds += c.miss_seconds
            out.hit_seconds += c.hit_seconds
        return out


# cachectl.serving's per-flush bounds (dispatch.MAX_SIZES_PER_FLUSH keeps within them).
MAX_SERVING_AXES = 32
MAX_SERVING_SIZES = 1024


def check_batch(batch: TelemetryBatch) -> None:
    """BadInput unless every counter of ``batch`` is one a process can report in one flush."""

    def count(name: str, value: int) -> None:
        if not isinstance(value, int) or not 0 <= value <= MAX_FLUSH_COUNT:
            raise BadInput(
                f"telemetry {name} {value!r} is outside 0..{MAX_FLUSH_COUNT} for one flush"
            )

    for fn, c in batch.functions.items():
        for name in ("requests", "hits", "writes", "uncacheable", "loads"):
            count(f"{name} of {fn!r}", getattr(c, name))
        for name in ("saved_seconds", "retrieval_seconds", "miss_seconds", "hit_seconds"):
            value = float(getattr(c, name))
            if not -MAX_FLUSH_SECONDS <= value <= MAX_FLUSH_SECONDS:
                raise BadInput(
                    f"telemetry {name} of {fn!r} {value!r} is outside +-{MAX_FLUSH_SECONDS:g}"
                )
    for key, (n, _at) in batch.hit_keys.items():
        count(f"hits of key {key[:80]!r}", n)
    count("dropped", batch.dropped)
    count("signatures dropped", batch.signatures_dropped)
    for ident, sig in batch.signatures.items():
        for name in ("requests", "hits", "misses", "uncacheable", "repeats"):
            count(f"signature {name} of {ident[0]!r}", getattr(sig, name))
    for fn, sc in batch.serving.items():
        for name in ("calls", "aot", "fallback", "out_of_bucket", "padded"):
            count(f"served {name} of {fn!r}", getattr(sc, name))
        if len(sc.sizes) > MAX_SERVING_AXES or any(
            len(v) > MAX_SERVING_SIZES for v in sc.sizes.values()
        ):
            raise BadInput(
                f"telemetry sizes of {fn!r}: at most {MAX_SERVING_AXES} axes of "
                f"{MAX_SERVING_SIZES} sizes per flush"
            )
        for axis, sizes in sc.sizes.items():
            for size, n in sizes.items():
                count(f"size {axis}={size!r} of {fn!r}", n)
                count(f"size value of {axis!r} in {fn!r}", size)


class TelemetrySink(Protocol):
    """Where flushed batches go: the index now, the HTTP server later."""

    def write(self, batch: TelemetryBatch) -> None: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class CollectorStats:
    """Lifetime totals of this process's collector (for tests, benchmarks, doctor): JAX's own
    request and hit events, staging programs included; ``loads`` are cachectl.serving's."""

    requests: int
    hits: int
    writes: int
    saved_seconds: float
    dropped: int
    flushes: int
    failed_flushes: int
    sink: str | None
    last_error: str | None
    loads: int = 0

    @property
    def misses(self) -> int:
        return max(self.requests - self.hits, 0)


class MemorySink:
    """Keeps batches in a list: for benchmarks and for embedding without an index."""

    def __init__(self) -> None:
        self.batches: list[TelemetryBatch] = []

    def describe(self) -> str:
        return "memory"

    def write(self, batch: TelemetryBatch) -> None:
        self.batches.append(batch)
