"""Service telemetry summed over a window: the records ``stats`` shows and how "saved" is estimated.

Apart from cachectl/index/telemetry_queries.py, which builds them with SQLAlchemy, so that the
CLI's renderers and the inventory can name them without importing it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime, timedelta

from cachectl.core import jax_seam
from cachectl.core.cache_info import utcnow
from cachectl.index.reads import Reader, cache_id, total


@dataclass(frozen=True)
class UsageRow:
    """Counters summed over a window, for one environment or one function in it.

    ``requests`` = ``hits`` + ``misses`` + ``uncacheable``: every program JAX looked up in the
    persistent cache. A miss was looked up and not found, whether JAX then wrote it or not (too
    fast to compile, a read-only service); ``uncacheable`` (not cacheable) are JAX-internal
    staging programs and programs with host callbacks, counted apart. ``loads`` (executables cachectl.serving loaded) were never
    looked up: they are none of these. ``host_callbacks``: the not-cacheable requests of a
    function whose programs use host callbacks (JAX never writes one, so no warm can help);
    ``cause`` says so, with the way out."""

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
    host_callbacks: int = 0
    cause: str | None = None  # why this function's requests are not cacheable, where known

    __json_extra__ = ("hit_rate", "cacheable_requests", "served_rate")

    @property
    def cacheable_requests(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float | None:
        """Hits over the requests for cacheable programs (ccache's habit: not cacheable apart).
        JAX's own ratio: what its log counts, nothing cachectl.serving loaded."""
        n = self.cacheable_requests
        return min(self.hits / n, 1.0) if n else None

    @property
    def served_rate(self) -> float | None:
        """What the cache served: hits plus loaded executables, over those and the misses."""
        return served_rate(self.hits, self.misses, self.loads)


def served_rate(hits: int, misses: int, loads: int) -> float | None:
    """A service on cachectl.serving loads its buckets without asking JAX's cache: by JAX's
    count alone (hits over lookups) it would show 0% while every bucket came from the cache."""
    n = hits + misses + loads
    return min((hits + loads) / n, 1.0) if n else None


@dataclass(frozen=True)
class TelemetryStats:
    cache: str
    since: datetime
    window_seconds: float
    environments: list[UsageRow]
    functions: list[UsageRow]


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


def telemetry_stats(reader: Reader, cache: str, since: timedelta) -> TelemetryStats:
    """Hit rate, misses, writes and compile time saved per environment and function."""
    start = utcnow() - since
    cid = cache_id(reader, cache)
    d = reader.dialect
    cols = (
        "COUNT(DISTINCT t.process), "
        f"{total(d, 't.requests')}, {total(d, 't.hits')}, {total(d, 't.misses')}, "
        f"{total(d, 't.writes')}, COALESCE(SUM(t.saved_seconds), 0.0), {total(d, 't.dropped')}, "
        "COALESCE(SUM(t.uncacheable), 0), COALESCE(SUM(t.loads), 0), "
        "COALESCE(SUM(t.miss_seconds), 0.0), COALESCE(SUM(t.hit_seconds), 0.0)"
    )
    base = (
        "FROM environments e JOIN telemetry t ON t.environment_id = e.id "
        "WHERE e.cache_id = :cid AND t.at >= :start"
    )
    params = {"cid": cid, "start": start}
    per_env = reader.rows(
        f"SELECT e.digest, e.namespace, {cols} {base} "
        "GROUP BY e.digest, e.namespace ORDER BY e.namespace",
        params,
    )
    per_fn = reader.rows(
        f"SELECT e.digest, e.namespace, t.function, {cols} {base} "
        "GROUP BY e.digest, e.namespace, t.function ORDER BY e.namespace, t.function",
        params,
    )
    # What warm knows of each manifest function: its jit module and the compile time it measured.
    warm = reader.rows(
        "SELECT e.digest, n.module, n.function, AVG(n.compile_time_ms) "
        "FROM environments e JOIN entries n ON n.environment_id = e.id "
        "WHERE e.cache_id = :cid AND n.function IS NOT NULL "
        "GROUP BY e.digest, n.module, n.function",
        {"cid": cid},
    )
    named: dict[tuple[str, str], dict[str, float | None]] = {}
    for d, m, name, ms in warm:
        named.setdefault((d, m), {})[name] = None if ms is None else float(ms)
    known = {k: next(iter(v.items())) for k, v in named.items() if len(v) == 1}
    shared = {k for k, v in named.items() if len(v) > 1}
    # The collector counts two kinds of program as not cacheable, and the telemetry rows do not
    # say which (no reason column): JAX-internal staging programs and programs with host
    # callbacks. The signatures count both as not cacheable too, and a staging program's
    # signature names JAX's eager dispatch as its source (jax_seam.is_staging): a function with
    # not-cacheable requests and no staging signature has host callbacks.
    staging = {
        (d, m)
        for d, m, source in reader.rows(
            "SELECT DISTINCT e.digest, s.function, s.source FROM environments e "
            "JOIN signatures s ON s.environment_id = e.id "
            "WHERE e.cache_id = :cid AND s.uncacheable > 0",
            {"cid": cid},
        )
        if jax_seam.is_staging(source)
    }

    def row(
        digest: str, namespace: str, fn: str | None, values: tuple, of: str | None = None
    ) -> UsageRow:
        procs, req, hits, _misses, writes, saved, dropped, uncacheable, loads, miss_s, hit_s = (
            values
        )
        name: str | None = None
        ms: float | None = None
        if fn is not None and (digest, fn) in shared:  # one of the functions it holds, or none
            name, ms = of, named[(digest, fn)].get(of) if of is not None else None
        elif fn is not None:
            name, ms = known.get((digest, fn), (None, None))
        warm_saved = max(int(hits) * (ms or 0.0) / 1000.0, 0.0)
        # Every looked-up request is a hit, a miss or not cacheable: misses are what is left.
        misses = max(int(req) - int(hits) - int(uncacheable), 0)
        estimate = saved_estimate(int(hits), misses, float(miss_s), float(hit_s), ms)
        callbacks = (
            int(uncacheable)
            if fn is not None and int(uncacheable) and (digest, fn) not in staging
            else 0
        )
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
            callbacks,
            jax_seam.host_callbacks_cause([fn]) if callbacks and fn is not None else None,
        )

    by_key = _keyed_counts(reader, cid, start, shared) if shared else {}
    fns = [
        row(r[0], r[1], r[2], values, of)
        for r in per_fn
        if r[2] is not None or int(r[4]) or int(r[-1])
        for of, values in _split(tuple(r[3:]), by_key.get((r[0], r[2]))).items()
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
                host_callbacks=sum(f.host_callbacks for f in mine),
            )
        )
    return TelemetryStats(cache, start, since.total_seconds(), envs, fns)


# A signature's counts: requests' hits, misses and not-cacheable requests.
_Counts = tuple[int, int, int]


def _keyed_counts(
    reader: Reader, cid: int, start: datetime, shared: set[tuple[str, str]]
) -> dict[tuple[str, str], dict[str | None, _Counts]]:
    """{(environment, jit name): {manifest function or None: (hits, misses, not cacheable)}}
    for the jit names several manifest functions compile under: each signature's key looked up
    among the entries warm recorded with their manifest function (None: a key none holds)."""
    rows = reader.rows(
        "SELECT e.digest, s.function, n.function, COALESCE(SUM(s.hits), 0), "
        "COALESCE(SUM(s.misses), 0), COALESCE(SUM(s.uncacheable), 0) "
        "FROM environments e JOIN signatures s ON s.environment_id = e.id "
        "LEFT JOIN entries n ON n.environment_id = e.id AND n.key = s.key "
        "AND n.function IS NOT NULL "
        "WHERE e.cache_id = :cid AND s.last_seen >= :start AND s.function IN :modules "
        "GROUP BY e.digest, s.function, n.function",
        {"cid": cid, "start": start, "modules": sorted({m for _, m in shared})},
    )
    out: dict[tuple[str, str], dict[str | None, _Counts]] = {}
    for digest, module, name, hits, misses, uncacheable in rows:
        if (digest, module) in shared:
            out.setdefault((digest, module), {})[name] = (int(hits), int(misses), int(uncacheable))
    return out


def _split(values: tuple, keyed: dict[str | None, _Counts] | None) -> dict[str | None, tuple]:
    """One jit name's telemetry counters split among the manifest functions whose keys its
    calls looked up, in proportion to the signatures' counts (the signatures hold keys, the
    telemetry rows do not): hits, the compile time saved and a hit's cost by hits; misses,
    writes and a miss's cost by misses; not-cacheable requests by theirs. What no signature
    weighs (loads, dropped events, a count whose signatures hold no key of a manifest
    function) stays with the jit name (None). Each part sums to the telemetry's total."""
    if not keyed or not any(name is not None for name in keyed):
        return {None: values}
    procs, req, hits, _misses, writes, saved, dropped, uncacheable, loads, miss_s, hit_s = values
    misses = max(int(req) - int(hits) - int(uncacheable), 0)
    names = sorted((n for n in keyed if n is not None), key=str)
    weights = [keyed[n] for n in names] + [keyed.get(None, (0, 0, 0))]  # None last
    by_hits = _apportion(int(hits), [w[0] for w in weights])
    by_misses = _apportion(misses, [w[1] for w in weights])
    by_unc = _apportion(int(uncacheable), [w[2] for w in weights])
    by_writes = _apportion(int(writes), [w[1] for w in weights])
    out: dict[str | None, tuple] = {}
    for i, name in enumerate([*names, None]):
        h, m, u = by_hits[i], by_misses[i], by_unc[i]
        hit_share = h / int(hits) if int(hits) else 0.0
        miss_share = m / misses if misses else 0.0
        rest = name is None
        if rest and not (h or m or u or by_writes[i] or int(loads) or int(dropped)):
            continue
        out[name] = (
            procs,
            h + m + u,
            h,
            m,
            by_writes[i],
            float(saved) * hit_share,
            dropped if rest else 0,
            u,
            loads if rest else 0,
            float(miss_s) * miss_share,
            float(hit_s) * hit_share,
        )
    return out


def _apportion(total: int, weights: list[int]) -> list[int]:
    """``total`` in whole parts proportional to ``weights`` (largest remainders first), summing
    to ``total``; with no weight at all, everything to the last part (the jit name's own)."""
    whole = sum(weights)
    if not whole:
        return [0] * (len(weights) - 1) + [total]
    exact = [total * w / whole for w in weights]
    parts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: parts[i] - exact[i])
    for i in by_remainder[: total - sum(parts)]:
        parts[i] += 1
    return parts
