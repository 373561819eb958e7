"""Telemetry in the index: what services write on each flush, and the stats over a window.

A flush writes one ``telemetry`` row per (process, environment, function) that
saw activity, and adds the hit counts and last-access times it learned to the
entries it hit (object stores keep no access times; JAX writes ``-atime``
files only with its own size limit on). Stats aggregate in the database.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, func, select

from cachectl.index import Index
from cachectl.index.models import Cache, ServingRecord, TelemetryRecord, utcnow
from cachectl.index.models import Environment as EnvRow

if TYPE_CHECKING:
    from cachectl.telemetry import TelemetryBatch


def counter_sum(dialect: str, column: Any) -> Any:
    """SUM of a counter column that can never fail: SQLite's SUM raises "integer overflow" past
    2**63, its TOTAL() is a float that cannot; PostgreSQL's SUM(bigint) is numeric already."""
    return func.total(column) if dialect == "sqlite" else func.coalesce(func.sum(column), 0)


@dataclass(frozen=True)
class UsageRow:
    """Counters summed over a window, for one environment or one function in it."""

    environment: str
    namespace: str
    function: str | None
    processes: int
    requests: int
    hits: int
    misses: int
    writes: int
    saved_seconds: float
    dropped: int

    __json_extra__ = ("hit_rate",)

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.requests if self.requests else None


@dataclass(frozen=True)
class TelemetryStats:
    cache: str
    since: datetime
    window_seconds: float
    environments: list[UsageRow]
    functions: list[UsageRow]


def record_telemetry(index: Index, env_id: int, batch: TelemetryBatch) -> int:
    """Store one flush; returns how many telemetry rows were written.

    Every counter must be one a process can report in one flush (check_batch: BadInput
    otherwise), so no sum over the table can overflow."""
    from cachectl.telemetry import check_batch

    check_batch(batch)
    # When the flush ended is the process's claim too: a row dated in the future would
    # outlive every retention, so it is never later than now.
    at = min(batch.ended_at, utcnow())
    rows = [
        {"environment_id": env_id, "at": at, "process": batch.process, "function": fn,
         "requests": c.requests, "hits": c.hits, "misses": c.misses, "writes": c.writes,
         "saved_seconds": float(c.saved_seconds), "dropped": 0}
        for fn, c in batch.functions.items()
        if c.requests or c.hits or c.writes
    ]
    if batch.dropped:
        if rows:
            rows[0]["dropped"] = batch.dropped
        else:
            rows.append({"environment_id": env_id, "at": at, "process": batch.process, "function": None,
                         "requests": 0, "hits": 0, "misses": 0, "writes": 0, "saved_seconds": 0.0,
                         "dropped": batch.dropped})
    serving = [
        {"environment_id": env_id, "at": at, "process": batch.process, "function": fn,
         "calls": c.calls, "aot": c.aot, "fallback": c.fallback, "out_of_bucket": c.out_of_bucket,
         "padded": c.padded,
         "sizes": {axis: {str(size): n for size, n in sizes.items()} for axis, sizes in c.sizes.items()}}
        for fn, c in batch.serving.items()
    ]
    if rows or serving:
        with index.session() as s:
            if rows:
                s.execute(TelemetryRecord.__table__.insert(), rows)
            if serving:
                s.execute(ServingRecord.__table__.insert(), serving)
    if batch.hit_keys:
        # A process reports when it hit each key: a claim, clamped to now (and to the entry's creation).
        index.record_hits(env_id, dict(batch.hit_keys), not_after=utcnow())
    return len(rows) + len(serving)


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


def serving_usage(index: Index, cache: str, since: timedelta, *, function: str | None = None
                  ) -> list[ServingUsage]:
    """Served calls per (environment, function) since ``since`` ago, sizes merged across flushes."""
    start = utcnow() - since
    out: dict[tuple[str, str], dict[str, object]] = {}
    with index.read_session() as s:
        q = (select(EnvRow.digest, ServingRecord.function, ServingRecord.process, ServingRecord.calls,
                    ServingRecord.aot, ServingRecord.fallback, ServingRecord.out_of_bucket,
                    ServingRecord.padded, ServingRecord.sizes)
             .join(EnvRow, EnvRow.id == ServingRecord.environment_id)
             .join(Cache, Cache.id == EnvRow.cache_id)
             .where(Cache.name == cache, ServingRecord.at >= start))
        if function is not None:
            q = q.where(ServingRecord.function == function)
        for digest, fn, process, calls, aot, fallback, oob, padded, sizes in s.execute(q):
            acc = out.setdefault((digest, fn), {"processes": set(), "calls": 0, "aot": 0, "fallback": 0,
                                                "out_of_bucket": 0, "padded": 0, "sizes": {}})
            acc["processes"].add(process)  # type: ignore[union-attr]
            for name, value in (("calls", calls), ("aot", aot), ("fallback", fallback),
                                ("out_of_bucket", oob), ("padded", padded)):
                acc[name] = int(acc[name]) + int(value or 0)  # type: ignore[call-overload]
            merged = acc["sizes"]
            for axis, counts in (sizes or {}).items():
                target = merged.setdefault(axis, {})  # type: ignore[union-attr]
                for size, n in counts.items():
                    target[int(size)] = target.get(int(size), 0) + int(n)
    return [ServingUsage(digest, fn, len(a["processes"]), a["calls"], a["aot"], a["fallback"],  # type: ignore[arg-type]
                         a["out_of_bucket"], a["padded"], a["sizes"])  # type: ignore[arg-type]
            for (digest, fn), a in sorted(out.items())]


def telemetry_stats(index: Index, cache: str, since: timedelta) -> TelemetryStats:
    """Hit rate, misses, writes and compile time saved per environment and function."""
    start = utcnow() - since
    with index.read_session() as s:
        cache_id = s.scalar(select(Cache.id).where(Cache.name == cache))
        if cache_id is None:
            index.get_cache(cache)  # raises the standard NotFound
        total = counter_sum
        cols = (
            func.count(func.distinct(TelemetryRecord.process)),
            total(index.dialect, TelemetryRecord.requests),
            total(index.dialect, TelemetryRecord.hits),
            total(index.dialect, TelemetryRecord.misses),
            total(index.dialect, TelemetryRecord.writes),
            func.coalesce(func.sum(TelemetryRecord.saved_seconds), 0.0),
            total(index.dialect, TelemetryRecord.dropped),
        )
        base = (
            select(EnvRow.digest, EnvRow.namespace)
            .join(TelemetryRecord, TelemetryRecord.environment_id == EnvRow.id)
            .where(EnvRow.cache_id == cache_id, TelemetryRecord.at >= start)
        )
        per_env = s.execute(
            base.add_columns(*cols).group_by(EnvRow.digest, EnvRow.namespace).order_by(EnvRow.namespace)
        ).all()
        per_fn = s.execute(
            base.add_columns(TelemetryRecord.function, *cols)
            .group_by(EnvRow.digest, EnvRow.namespace, TelemetryRecord.function)
            .order_by(EnvRow.namespace, TelemetryRecord.function)
        ).all()

    def row(digest: str, namespace: str, fn: str | None, values: tuple) -> UsageRow:
        procs, req, hits, misses, writes, saved, dropped = values
        return UsageRow(digest, namespace, fn, int(procs), int(req), int(hits), int(misses),
                        int(writes), float(saved), int(dropped))

    envs = [row(r[0], r[1], None, tuple(r[2:])) for r in per_env]
    fns = [row(r[0], r[1], r[2], tuple(r[3:])) for r in per_fn if r[2] is not None or int(r[4])]
    return TelemetryStats(cache, start, since.total_seconds(), envs, fns)


def prune_telemetry(index: Index, older_than: timedelta, *, now: datetime | None = None) -> int:
    """Delete telemetry rows older than ``older_than`` (the server's --telemetry-retention)."""
    cutoff = (now or utcnow()) - older_than
    with index.session() as s:
        result = s.execute(delete(TelemetryRecord).where(TelemetryRecord.at < cutoff))
        served = s.execute(delete(ServingRecord).where(ServingRecord.at < cutoff))
        return int(result.rowcount or 0) + int(served.rowcount or 0)
