"""The rows one telemetry flush adds to the index, without a database in sight.

Two writers store a flush: the SQLAlchemy one (cachectl.index.telemetry_queries, every database)
and the service's stdlib one for SQLite (cachectl.index.stdlib, which spares a service the
SQLAlchemy import). Both take their rows and rules from here, so they cannot drift apart.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from cachectl.telemetry.batch import TelemetryBatch, check_batch

MAX_SIGNATURES_PER_FUNCTION = 256  # rows per (environment, function); the rest add up in digest '*'
OVERFLOW_DIGEST = "*"
SIGNATURE_COUNTERS = ("requests", "hits", "misses", "uncacheable", "repeats")


def signature_digest(
    module: str, leaves: list, key: str | None, statics: list | None = None
) -> str:
    canon = json.dumps([module, leaves, key, statics], separators=(",", ":"), default=str)
    return hashlib.sha256(canon.encode()).hexdigest()


def flush_rows(
    env_id: int, batch: TelemetryBatch, now: datetime
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The ``telemetry`` and ``serving_telemetry`` rows of one flush (BadInput for impossible counts).

    When the flush ended is the process's claim: a row dated in the future would outlive every
    retention, so it is never later than ``now``."""
    check_batch(batch)
    at = min(batch.ended_at, now)
    rows = [
        {
            "environment_id": env_id,
            "at": at,
            "process": batch.process,
            "function": fn,
            "requests": c.requests,
            "hits": c.hits,
            "misses": c.misses,
            "writes": c.writes,
            "saved_seconds": float(c.saved_seconds),
            "dropped": 0,
            "uncacheable": c.uncacheable,
            "loads": c.loads,
            "miss_seconds": float(c.miss_seconds),
            "hit_seconds": float(c.hit_seconds),
        }
        for fn, c in batch.functions.items()
        if c.requests or c.hits or c.writes or c.loads
    ]
    if batch.dropped:
        if rows:
            rows[0]["dropped"] = batch.dropped
        else:
            rows.append(
                {
                    "environment_id": env_id,
                    "at": at,
                    "process": batch.process,
                    "function": None,
                    "requests": 0,
                    "hits": 0,
                    "misses": 0,
                    "writes": 0,
                    "saved_seconds": 0.0,
                    "dropped": batch.dropped,
                    "uncacheable": 0,
                    "loads": 0,
                    "miss_seconds": 0.0,
                    "hit_seconds": 0.0,
                }
            )
    serving = [
        {"environment_id": env_id, "at": at, "process": batch.process, **c.row(fn)}
        for fn, c in batch.serving.items()
    ]
    return rows, serving


def hit_times(batch: TelemetryBatch, now: datetime) -> dict[str, tuple[int, datetime]]:
    """Hits per key and when, each time clamped to ``now`` (a reported time is only a claim)."""
    out = {}
    for key, (count, at) in batch.hit_keys.items():
        if at.tzinfo is None:
            at = at.replace(tzinfo=UTC)
        out[key] = (count, min(at, now))
    return out


def merged_signatures(batch: TelemetryBatch) -> dict[tuple[str, str], dict[str, Any]]:
    """One flush's signatures keyed by (function, digest), the dropped ones in digest '*'."""

    def utc(ts: float) -> datetime:
        return datetime.fromtimestamp(ts, tz=UTC)

    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for (module, *_rest), c in batch.signatures.items():
        leaves = [[list(shape), dtype, weak, sharding] for shape, dtype, weak, sharding in c.leaves]
        statics = None if c.statics is None else [[k, v] for k, v in c.statics]
        digest = signature_digest(module, leaves, c.key, statics)
        merged[(module, digest)] = {
            "key": c.key,
            "leaves": leaves,
            "source": c.source,
            "statics": statics,
            "requests": c.requests,
            "hits": c.hits,
            "misses": c.misses,
            "uncacheable": c.uncacheable,
            "repeats": c.repeats,
            "first_seen": utc(c.first_seen or batch.ended_at.timestamp()),
            "last_seen": utc(c.last_seen or batch.ended_at.timestamp()),
        }
    if batch.signatures_dropped:
        merged[("", OVERFLOW_DIGEST)] = {
            "key": None,
            "leaves": [],
            "source": None,
            "statics": None,
            "requests": batch.signatures_dropped,
            "hits": 0,
            "misses": batch.signatures_dropped,
            "uncacheable": 0,
            "repeats": 0,
            "first_seen": batch.started_at,
            "last_seen": batch.ended_at,
        }
    return merged


def by_function(
    merged: dict[tuple[str, str], dict[str, Any]],
) -> Iterable[tuple[str, dict[str, dict[str, Any]]]]:
    """The merged signatures of each function, functions in order (writers lock rows in one order)."""
    for module in sorted({m for m, _ in merged}):
        yield module, {d: v for (m, d), v in merged.items() if m == module}


def placed_signatures(
    mine: dict[str, dict[str, Any]], existing: Iterable[str], total: int
) -> list[tuple[str, dict[str, Any], bool]]:
    """(digest, values, insert?) for each signature of one function, in order.

    ``existing``: the digests of this function's rows among ``mine`` and '*'; ``total``: how many
    rows the function has. A new signature past MAX_SIGNATURES_PER_FUNCTION adds up in '*'
    (without leaves), so the table stays bounded whatever a process reports."""
    have = set(existing)
    out = []
    for digest, v in mine.items():
        if digest not in have and total >= MAX_SIGNATURES_PER_FUNCTION:
            digest = OVERFLOW_DIGEST
            v = {**v, "leaves": [], "key": None, "source": None, "statics": None}
        new = digest not in have
        if new:
            have.add(digest)
            total += 1
        out.append((digest, v, new))
    return out
