"""Telemetry in the index: what services write on each flush, and the stats over a window.

A flush writes one ``telemetry`` row per (process, environment, function) that
saw activity, and adds the hit counts and last-access times it learned to the
entries it hit (object stores keep no access times; JAX writes ``-atime``
files only with its own size limit on). Stats aggregate in the database.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import CursorResult, delete, func, select

from cachectl.index import Index, usage
from cachectl.index.models import (
    Cache,
    ServingRecord,
    SignatureRecord,
    TelemetryRecord,
    utcnow,
)
from cachectl.index.models import Environment as EnvRow
from cachectl.index.usage import TelemetryStats
from cachectl.telemetry.rows import (
    OVERFLOW_DIGEST,
    SIGNATURE_COUNTERS,
    by_function,
    flush_rows,
    hit_times,
    merged_signatures,
    placed_signatures,
)

if TYPE_CHECKING:
    from cachectl.telemetry.batch import TelemetryBatch


def counter_sum(dialect: str, column: Any) -> Any:
    """SUM of a counter column that can never fail: SQLite's SUM raises "integer overflow" past
    2**63, its TOTAL() is a float that cannot; PostgreSQL's SUM(bigint) is numeric already."""
    return func.total(column) if dialect == "sqlite" else func.coalesce(func.sum(column), 0)


# Built once: every flush runs them.
_INSERT_TELEMETRY = TelemetryRecord.__table__.insert()
_INSERT_SERVING = ServingRecord.__table__.insert()


def record_telemetry(index: Index, env_id: int, batch: TelemetryBatch) -> int:
    """Store one flush; returns how many telemetry rows were written.

    Every counter must be one a process can report in one flush (check_batch: BadInput
    otherwise), so no sum over the table can overflow."""
    now = utcnow()
    rows, serving = flush_rows(env_id, batch, now)
    if rows or serving or batch.hit_keys:
        with index.connection() as s:  # one transaction: a flush is counted whole or not at all
            if rows:
                s.execute(_INSERT_TELEMETRY, rows)
            if serving:
                s.execute(_INSERT_SERVING, serving)
            if batch.hit_keys:
                index.record_hits(env_id, hit_times(batch, now), session=s)
    if batch.signatures or batch.signatures_dropped:
        record_signatures(index, env_id, batch)
    return len(rows) + len(serving)


def record_signatures(index: Index, env_id: int, batch: TelemetryBatch) -> int:
    """Add one flush's signature counts: one row per signature, bounded per function."""
    written = 0
    with index.session() as s:
        for module, mine in by_function(merged_signatures(batch)):
            existing = {
                row.digest: row
                for row in s.scalars(
                    select(SignatureRecord).where(
                        SignatureRecord.environment_id == env_id,
                        SignatureRecord.function == module,
                        SignatureRecord.digest.in_(list(mine) + [OVERFLOW_DIGEST]),
                    )
                )
            }
            total = (
                s.scalar(
                    select(func.count())
                    .select_from(SignatureRecord)
                    .where(
                        SignatureRecord.environment_id == env_id, SignatureRecord.function == module
                    )
                )
                or 0
            )
            for digest, v, new in placed_signatures(mine, existing, total):
                if new:
                    row = SignatureRecord(
                        environment_id=env_id,
                        function=module,
                        digest=digest,
                        key=v["key"],
                        leaves=v["leaves"],
                        source=v["source"],
                        statics=v["statics"],
                        first_seen=v["first_seen"],
                        last_seen=v["last_seen"],
                        **{k: v[k] for k in SIGNATURE_COUNTERS},
                    )
                    s.add(row)
                    existing[digest] = row
                    written += 1
                else:
                    row = existing[digest]
                    for k in SIGNATURE_COUNTERS:
                        setattr(row, k, int(getattr(row, k) or 0) + v[k])
                    row.last_seen = max(row.last_seen, v["last_seen"])
        s.flush()
    return written


@dataclass(frozen=True)
class SignatureRow:
    """One signature's counts over a window (summed across environments' duplicate rows)."""

    environment: str
    function: str
    digest: str
    key: str | None
    leaves: list[Any]
    source: str | None
    statics: list[Any] | None
    requests: int
    hits: int
    misses: int
    uncacheable: int
    repeats: int
    first_seen: datetime
    last_seen: datetime


def signature_usage(
    index: Index, cache: str, since: timedelta, *, function: str | None = None
) -> list[SignatureRow]:
    """Every signature seen since ``since`` ago in ``cache``, per environment."""
    start = utcnow() - since
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    with index.read_session() as s:
        q = (
            select(EnvRow.digest, SignatureRecord)
            .join(SignatureRecord, SignatureRecord.environment_id == EnvRow.id)
            .join(Cache, Cache.id == EnvRow.cache_id)
            .where(Cache.name == cache, SignatureRecord.last_seen >= start)
        )
        if function is not None:
            q = q.where(SignatureRecord.function == function)
        for env, r in s.execute(q):
            acc = out.get((env, r.function, r.digest))
            if acc is None:
                out[(env, r.function, r.digest)] = {
                    "key": r.key,
                    "leaves": r.leaves,
                    "source": r.source,
                    "statics": r.statics,
                    "requests": r.requests,
                    "hits": r.hits,
                    "misses": r.misses,
                    "uncacheable": r.uncacheable,
                    "repeats": r.repeats,
                    "first_seen": r.first_seen,
                    "last_seen": r.last_seen,
                }
            else:
                for k in ("requests", "hits", "misses", "uncacheable", "repeats"):
                    acc[k] += getattr(r, k)
                acc["first_seen"] = min(acc["first_seen"], r.first_seen)
                acc["last_seen"] = max(acc["last_seen"], r.last_seen)
    return [SignatureRow(env, fn, digest, **v) for (env, fn, digest), v in sorted(out.items())]


@dataclass(frozen=True)
class ServingUsage:
    """cachectl.serving's calls of one function over a window, and the raw sizes per axis."""

    environment: str
    function: str
    processes: int
    calls: int
    aot: int
    fallback: int
    out_of_bucket: int
    padded: int
    sizes: dict[str, dict[int, int]]


def serving_usage(
    index: Index, cache: str, since: timedelta, *, function: str | None = None
) -> list[ServingUsage]:
    """Served calls per (environment, function) since ``since`` ago, sizes merged across flushes."""
    start = utcnow() - since
    out: dict[tuple[str, str], dict[str, Any]] = {}
    with index.read_session() as s:
        q = (
            select(
                EnvRow.digest,
                ServingRecord.function,
                ServingRecord.process,
                ServingRecord.calls,
                ServingRecord.aot,
                ServingRecord.fallback,
                ServingRecord.out_of_bucket,
                ServingRecord.padded,
                ServingRecord.sizes,
            )
            .join(EnvRow, EnvRow.id == ServingRecord.environment_id)
            .join(Cache, Cache.id == EnvRow.cache_id)
            .where(Cache.name == cache, ServingRecord.at >= start)
        )
        if function is not None:
            q = q.where(ServingRecord.function == function)
        for digest, fn, process, calls, aot, fallback, oob, padded, sizes in s.execute(q):
            acc = out.setdefault(
                (digest, fn),
                {
                    "processes": set(),
                    "calls": 0,
                    "aot": 0,
                    "fallback": 0,
                    "out_of_bucket": 0,
                    "padded": 0,
                    "sizes": {},
                },
            )
            acc["processes"].add(process)
            for name, value in (
                ("calls", calls),
                ("aot", aot),
                ("fallback", fallback),
                ("out_of_bucket", oob),
                ("padded", padded),
            ):
                acc[name] = int(acc[name]) + int(value or 0)
            merged = acc["sizes"]
            for axis, counts in (sizes or {}).items():
                target = merged.setdefault(axis, {})
                for size, n in counts.items():
                    target[int(size)] = target.get(int(size), 0) + int(n)
    return [
        ServingUsage(
            digest,
            fn,
            len(a["processes"]),
            a["calls"],
            a["aot"],
            a["fallback"],
            a["out_of_bucket"],
            a["padded"],
            a["sizes"],
        )
        for (digest, fn), a in sorted(out.items())
    ]


def telemetry_stats(index: Index, cache: str, since: timedelta) -> TelemetryStats:
    """Hit rate, misses, writes and compile time saved per environment and function."""
    return usage.telemetry_stats(index.reader, cache, since)


def prune_telemetry(index: Index, older_than: timedelta, *, now: datetime | None = None) -> int:
    """Delete telemetry rows older than ``older_than`` (the server's --telemetry-retention)."""
    cutoff = (now or utcnow()) - older_than
    with index.session() as s:
        result = s.execute(delete(TelemetryRecord).where(TelemetryRecord.at < cutoff))
        served = s.execute(delete(ServingRecord).where(ServingRecord.at < cutoff))
        return int(cast("CursorResult[Any]", result).rowcount or 0) + int(
            cast("CursorResult[Any]", served).rowcount or 0
        )
