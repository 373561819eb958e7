"""Telemetry in the index: what services write on each flush, and the stats over a window.

A flush writes one ``telemetry`` row per (process, environment, function) that
saw activity, and adds the hit counts and last-access times it learned to the
entries it hit (object stores keep no access times; JAX writes ``-atime``
files only with its own size limit on). Stats aggregate in the database.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import CursorResult, delete, func, select

from cachectl.index import Index
from cachectl.index.models import (
    Cache,
    Entry,
    ServingRecord,
    SignatureRecord,
    TelemetryRecord,
    utcnow,
)
from cachectl.index.models import Environment as EnvRow
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
    from cachectl.telemetry.records import TelemetryBatch


def counter_sum(dialect: str, column: Any) -> Any:
    """SUM of a counter column that can never fail: SQLite's SUM raises "integer overflow" past
    2**63, its TOTAL() is a float that cannot; PostgreSQL's SUM(bigint) is numeric already."""
    return func.total(column) if dialect == "sqlite" else func.coalesce(func.sum(column), 0)


@dataclass(frozen=True)
class UsageRow:
    """Counters summed over a window, for one environment or one function in it.

    ``requests`` = ``hits`` + ``misses`` + ``uncacheable``: every program JAX looked up in the
    persistent cache. A miss was looked up and not found, whether JAX then wrote it or not (too
    fast to compile, a read-only service); ``uncacheable`` (not cacheable) are JAX-internal
    staging programs, counted apart. ``loads`` (executables cachectl.serving loaded) were never
    looked up: they are none of these."""

    environment: str
    namespace: str
    function: str | None
    processes: int
    requests: int
    hits: int
    misses: int
    writes: int
    saved_seconds: float  # as JAX reported it (compile_time_saved_sec; can be negative)
    dropped: int
    uncacheable: int = 0  # requests for not-cacheable programs: apart from the hit rate
    name: str | None = None  # the manifest's function name, where warm recorded it
    saved_warm_seconds: float = 0.0  # hits x the compile time the index measured at warm (>= 0)
    loads: int = 0  # stored executables cachectl.serving loaded: never requests nor hits
    # The compile time hits saved, estimated (see saved_estimate): what `stats` shows as saved.
    saved_estimate_seconds: float = 0.0

    __json_extra__ = ("hit_rate", "cacheable_requests")

    @property
    def cacheable_requests(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float | None:
        """Hits over the requests for cacheable programs (ccache's habit: not cacheable apart)."""
        n = self.cacheable_requests
        return min(self.hits / n, 1.0) if n else None


@dataclass(frozen=True)
class TelemetryStats:
    cache: str
    since: datetime
    window_seconds: float
    environments: list[UsageRow]
    functions: list[UsageRow]


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


def saved_estimate(
    hits: int, misses: int, miss_seconds: float, hit_seconds: float, warm_ms: float | None
) -> float:
    """The compile time ``hits`` saved: hits x (what a miss cost - what a hit still costs).

    A miss's cost is this function's compile stage as services measured it on their misses in the
    window (lookup, XLA compile, write), else the compile time warm measured (which contention
    between warm's compile threads inflates); a hit still pays its compile stage (lookup and
    load), measured on the hits. Tracing and lowering are paid by both, so they cancel."""
    if not hits:
        return 0.0
    if misses and miss_seconds > 0:
        per_miss = miss_seconds / misses
    elif warm_ms is not None:
        per_miss = warm_ms / 1000.0
    else:
        return 0.0
    return max(hits * per_miss - hit_seconds, 0.0)


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
            func.coalesce(func.sum(TelemetryRecord.uncacheable), 0),
            func.coalesce(func.sum(TelemetryRecord.loads), 0),
            func.coalesce(func.sum(TelemetryRecord.miss_seconds), 0.0),
            func.coalesce(func.sum(TelemetryRecord.hit_seconds), 0.0),
        )
        base = (
            select(EnvRow.digest, EnvRow.namespace)
            .join(TelemetryRecord, TelemetryRecord.environment_id == EnvRow.id)
            .where(EnvRow.cache_id == cache_id, TelemetryRecord.at >= start)
        )
        per_env = s.execute(
            base.add_columns(*cols)
            .group_by(EnvRow.digest, EnvRow.namespace)
            .order_by(EnvRow.namespace)
        ).all()
        per_fn = s.execute(
            base.add_columns(TelemetryRecord.function, *cols)
            .group_by(EnvRow.digest, EnvRow.namespace, TelemetryRecord.function)
            .order_by(EnvRow.namespace, TelemetryRecord.function)
        ).all()

        # What warm knows of each module: the manifest's name and the compile time it measured.
        warm = s.execute(
            select(
                EnvRow.digest,
                Entry.module,
                func.max(Entry.function),
                func.avg(Entry.compile_time_ms),
            )
            .join(Entry, Entry.environment_id == EnvRow.id)
            .where(EnvRow.cache_id == cache_id, Entry.function.is_not(None))
            .group_by(EnvRow.digest, Entry.module)
        ).all()
    known = {(d, m): (name, None if ms is None else float(ms)) for d, m, name, ms in warm}

    def row(digest: str, namespace: str, fn: str | None, values: tuple) -> UsageRow:
        procs, req, hits, _misses, writes, saved, dropped, uncacheable, loads, miss_s, hit_s = (
            values
        )
        name, ms = known.get((digest, fn), (None, None)) if fn is not None else (None, None)
        warm_saved = max(int(hits) * (ms or 0.0) / 1000.0, 0.0)
        # Every looked-up request is a hit, a miss or not cacheable: misses are what is left.
        misses = max(int(req) - int(hits) - int(uncacheable), 0)
        estimate = saved_estimate(int(hits), misses, float(miss_s), float(hit_s), ms)
        return UsageRow(
            digest,
            namespace,
            fn,
            int(procs),
            int(req),
            int(hits),
            misses,
            int(writes),
            float(saved),
            int(dropped),
            int(uncacheable),
            name,
            warm_saved,
            int(loads),
            estimate,
        )

    fns = [
        row(r[0], r[1], r[2], tuple(r[3:]))
        for r in per_fn
        if r[2] is not None or int(r[4]) or int(r[-1])
    ]
    envs = []
    for r in per_env:
        env = row(r[0], r[1], None, tuple(r[2:]))
        mine = [f for f in fns if f.environment == env.environment]
        envs.append(
            dataclasses.replace(
                env,
                saved_warm_seconds=sum(f.saved_warm_seconds for f in mine),
                saved_estimate_seconds=sum(f.saved_estimate_seconds for f in mine),
            )
        )
    return TelemetryStats(cache, start, since.total_seconds(), envs, fns)


def prune_telemetry(index: Index, older_than: timedelta, *, now: datetime | None = None) -> int:
    """Delete telemetry rows older than ``older_than`` (the server's --telemetry-retention)."""
    cutoff = (now or utcnow()) - older_than
    with index.session() as s:
        result = s.execute(delete(TelemetryRecord).where(TelemetryRecord.at < cutoff))
        served = s.execute(delete(ServingRecord).where(ServingRecord.at < cutoff))
        return int(cast("CursorResult[Any]", result).rowcount or 0) + int(
            cast("CursorResult[Any]", served).rowcount or 0
        )
