"""The index queries prune, gc and verify plan from.

Planning never scans storage: it asks the index. Every query here is scoped
to one cache, filters on indexed columns (``entries(environment_id, ...)``),
aggregates or windows in the database, and streams rows, so a plan over
1,000,000 entry rows costs a few sorted scans, not a million Python objects.
gc's eviction cut (``SUM(size) OVER (ORDER BY score)``) is computed by the
database, which returns only the rows to evict.

An entry and its stored executable (``<key>-aot``, on the same row) are one
unit: every size here is ``size_bytes + coalesce(aot_size_bytes, 0)``, and
each planned entry carries the executable's bytes so execution deletes both.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import (
    Float,
    String,
    and_,
    case,
    cast,
    false,
    func,
    literal,
    or_,
    select,
    type_coerce,
)
from sqlalchemy.sql.elements import ColumnElement

from cachectl.errors import NotFound
from cachectl.index import Index, unit_size
from cachectl.index.models import Cache, Entry, TelemetryRecord, UTCDateTime, WarmRun, utcnow
from cachectl.index.models import Environment as EnvRow

# A running warm whose heartbeat is older than this is presumed dead.
WARM_HEARTBEAT_WINDOW = timedelta(minutes=10)
# Compile time assumed for entries that recorded none: JAX writes nothing that
# compiled faster than its default threshold of 1 s.
DEFAULT_COMPILE_MS = 1000
# Cost policy: an entry's value halves after this many days without access.
COST_HALF_LIFE_DAYS = 7.0
_STREAM_ROWS = 5000
# Warm runs that ran to the end (cachectl/index/warm_runs.py): "interrupted"
# runs are partial, so they do not displace the last complete run.
COMPLETED_WARM_STATUSES = ("succeeded", "failed")


@dataclass(frozen=True, slots=True)
class EnvSummary:
    """A live environment of a cache with its indexed totals."""

    id: int
    digest: str
    namespace: str
    jax_version: str
    backend: str
    device_kind: str
    device_count: int
    xla_flags: tuple[str, ...]
    entries: int
    bytes: int


@dataclass(frozen=True, slots=True)
class EntryRef:
    """The little planning needs to know about one entry row."""

    environment_id: int
    key: str
    size: int  # the JAX entry's bytes
    aot_size: int | None = None  # its stored executable's, if it has one


@dataclass(frozen=True, slots=True)
class Eviction:
    """One entry gc evicts, with the score that ordered it and why it goes."""

    environment_id: int
    key: str
    size: int  # the JAX entry's bytes
    score: float | str
    reason: str
    aot_size: int | None = None  # its stored executable's, evicted with it


@dataclass(frozen=True, slots=True)
class WarmInProgress:
    environment_id: int
    run_id: int
    host: str
    user: str
    heartbeat_at: datetime | None


def cache_id(index: Index, cache: str) -> int:
    with index.read_session() as s:
        found = s.scalar(select(Cache.id).where(Cache.name == cache))
    if found is None:
        raise NotFound(f"no cache named {cache!r}: add it with `cachectl cache add {cache} URL`")
    return int(found)


def environments(index: Index, cache: str) -> list[EnvSummary]:
    """Live (not deleted) environments of ``cache`` with entry counts and bytes."""
    cid = cache_id(index, cache)
    totals = (
        select(
            Entry.environment_id.label("env_id"),
            func.count(Entry.id).label("n"),
            func.coalesce(func.sum(unit_size()), 0).label("b"),
        )
        .join(EnvRow, EnvRow.id == Entry.environment_id)
        .where(EnvRow.cache_id == cid, EnvRow.deleted_at.is_(None))
        .group_by(Entry.environment_id)
        .subquery()
    )
    q = (
        select(EnvRow.id, EnvRow.digest, EnvRow.namespace, EnvRow.jax_version, EnvRow.backend,
               EnvRow.device_kind, EnvRow.device_count, EnvRow.xla_flags, totals.c.n, totals.c.b)
        .outerjoin(totals, totals.c.env_id == EnvRow.id)
        .where(EnvRow.cache_id == cid, EnvRow.deleted_at.is_(None))
        .order_by(EnvRow.namespace)
    )
    with index.read_session() as s:
        return [
            EnvSummary(int(i), d, ns, jv, be, dk, int(dc), tuple(fl or ()), int(n or 0), int(b or 0))
            for i, d, ns, jv, be, dk, dc, fl, n, b in s.execute(q)
        ]


def warms_in_progress(index: Index, env_ids: Sequence[int], *, now: datetime | None = None,
                      window: timedelta = WARM_HEARTBEAT_WINDOW) -> dict[int, WarmInProgress]:
    """Environments with a warm running right now (a heartbeat within ``window``)."""
    if not env_ids:
        return {}
    since = (now or utcnow()) - window
    q = (
        select(WarmRun.environment_id, WarmRun.id, WarmRun.host, WarmRun.user,
               func.coalesce(WarmRun.heartbeat_at, WarmRun.started_at))
        .where(WarmRun.environment_id.in_(list(env_ids)), WarmRun.status == "running",
               func.coalesce(WarmRun.heartbeat_at, WarmRun.started_at) >= since)
        .order_by(WarmRun.id)
    )
    out: dict[int, WarmInProgress] = {}
    with index.read_session() as s:
        for env_id, run_id, host, user, beat in s.execute(q):
            out[int(env_id)] = WarmInProgress(int(env_id), int(run_id), host, user, beat)
    return out


def newest_finished_warm_runs(index: Index, env_ids: Sequence[int]) -> dict[int, int]:
    """environment id -> id of its newest completed warm run (what --protect-warm keeps)."""
    if not env_ids:
        return {}
    ranked = (
        select(
            WarmRun.environment_id,
            WarmRun.id,
            func.row_number().over(
                partition_by=WarmRun.environment_id,
                order_by=(func.coalesce(WarmRun.finished_at, WarmRun.started_at).desc(), WarmRun.id.desc()),
            ).label("rn"),
        )
        .where(WarmRun.environment_id.in_(list(env_ids)), WarmRun.status.in_(COMPLETED_WARM_STATUSES))
        .subquery()
    )
    with index.read_session() as s:
        rows = s.execute(select(ranked.c.environment_id, ranked.c.id).where(ranked.c.rn == 1))
        return {int(env): int(run) for env, run in rows}


def _entry_filters(created_before: datetime | None, unused_before: datetime | None,
                   function: str | None) -> list[ColumnElement[bool]]:
    # created_at alone is indexed with environment_id (ix_entries_env_created).
    where: list[ColumnElement[bool]] = []
    if created_before is not None:
        where.append(Entry.created_at < created_before)
    if unused_before is not None:
        where.append(func.coalesce(Entry.last_access_at, Entry.created_at) < _as_bound(unused_before))
    if function is not None:
        where.append(Entry.function == function)
    return where


def _as_bound(value: datetime) -> ColumnElement[datetime]:
    # A bound value compared with a COALESCE has no column type to borrow:
    # give it ours, so SQLite gets the same naive-UTC text the columns hold.
    return literal(value, type_=UTCDateTime())


def selected_totals(index: Index, env_ids: Sequence[int], *, created_before: datetime | None = None,
                    unused_before: datetime | None = None,
                    function: str | None = None) -> dict[int, tuple[int, int]]:
    """environment id -> (entries, bytes) matching the entry selectors, aggregated in SQL."""
    if not env_ids:
        return {}
    q = (
        select(Entry.environment_id, func.count(Entry.id), func.coalesce(func.sum(unit_size()), 0))
        .where(Entry.environment_id.in_(list(env_ids)),
               *_entry_filters(created_before, unused_before, function))
        .group_by(Entry.environment_id)
    )
    with index.read_session() as s:
        return {int(e): (int(n), int(b)) for e, n, b in s.execute(q)}


def iter_selected_entries(index: Index, env_ids: Sequence[int], *, created_before: datetime | None = None,
                          unused_before: datetime | None = None,
                          function: str | None = None) -> Iterator[EntryRef]:
    """Entry rows matching the selectors, streamed (in no particular order).

    No ORDER BY on purpose: ordering by key would make SQLite walk the
    (environment, key) index and visit every row, where the filter alone can
    range-scan (environment, created_at).
    """
    if not env_ids:
        return
    q = (
        select(Entry.environment_id, Entry.key, Entry.size_bytes, Entry.aot_size_bytes)
        .where(Entry.environment_id.in_(list(env_ids)),
               *_entry_filters(created_before, unused_before, function))
    )
    with index.read_session() as s:
        result = s.connection().execution_options(yield_per=_STREAM_ROWS).execute(q)
        for env_id, key, size, aot_size in result:
            yield EntryRef(env_id, key, size, aot_size)


def _score(dialect: str, policy: str, now: datetime) -> ColumnElement[float]:
    """What gc evicts first (lowest score first).

    lru: last access (created when never accessed). cost: GreedyDual-Size's
    cost per byte, compile milliseconds per KiB, decayed by time since last
    access (halved after COST_HALF_LIFE_DAYS): a big entry that compiled in a
    second goes before a small one that took a minute, and a stale expensive
    entry eventually goes too.
    """
    last = func.coalesce(Entry.last_access_at, Entry.created_at)
    if policy == "lru":
        return last
    if dialect == "sqlite":
        age_days = func.julianday(_as_bound(now)) - func.julianday(last)
    else:
        age_days = func.extract("epoch", _as_bound(now) - last) / 86400.0
    age_days = case((age_days < 0, 0.0), else_=age_days)
    unit = unit_size()
    size_kib = case((unit < 1, 1.0), else_=cast(unit, Float) / 1024.0)
    cost = cast(func.coalesce(Entry.compile_time_ms, DEFAULT_COMPILE_MS), Float)
    return cost / size_kib / (1.0 + age_days / COST_HALF_LIFE_DAYS)


def plan_evictions(index: Index, cache: str, *, policy: str, max_bytes: int | None,
                   env_max_bytes: int | None, exclude_env_ids: Sequence[int] = (),
                   protect_warm_runs: Sequence[int] = (), now: datetime | None = None,
                   bytes_total: int | None = None,
                   env_bytes: dict[int, int] | None = None) -> tuple[list[Eviction], dict[str, int]]:
    """The entries to evict so the cache fits ``max_bytes`` and each environment ``env_max_bytes``.

    One statement: candidates are scored; with a per-environment limit, a
    running sum per environment marks what each over-limit environment must
    give up; then a running sum over the rest, in score order, marks what the
    cache as a whole must give up. The database returns only the rows to
    evict. Protected entries count toward the totals but are never
    candidates. Returns the evictions in score order and the bytes before.
    ``bytes_total`` (the cache's indexed bytes) and ``env_bytes`` (per
    environment) save a scan each when the caller already has them.
    """
    now = now or utcnow()
    cid = cache_id(index, cache)
    live = and_(EnvRow.cache_id == cid, EnvRow.deleted_at.is_(None))
    with index.read_session() as s:
        dialect = s.get_bind().dialect.name
        if bytes_total is None:
            bytes_total = int(s.scalar(
                select(func.coalesce(func.sum(unit_size()), 0))
                .join(EnvRow, EnvRow.id == Entry.environment_id).where(live)) or 0)
    total = bytes_total
    global_excess = None if max_bytes is None else total - max_bytes
    if (global_excess is None or global_excess <= 0) and env_max_bytes is None:
        return [], {"bytes_before": total}

    score = _score(dialect, policy, now)
    if policy == "lru":
        # Return the raw value: parsing 100k datetimes costs more than the query.
        score = type_coerce(score, String) if dialect == "sqlite" else score
    evictable = [live]
    if exclude_env_ids:
        evictable.append(EnvRow.id.not_in(list(exclude_env_ids)))
    if protect_warm_runs:
        evictable.append(or_(Entry.warm_run_id.is_(None), Entry.warm_run_id.not_in(list(protect_warm_runs))))
    # ``size`` is the unit (entry + executable) the running sums count; ``aot`` splits it again.
    cols = [Entry.id.label("id"), Entry.environment_id.label("env_id"), Entry.key.label("key"),
            unit_size().label("size"), Entry.aot_size_bytes.label("aot"), score.label("score")]
    base_q = select(*cols).join(EnvRow, EnvRow.id == Entry.environment_id).where(*evictable)

    if env_max_bytes is None:
        # Only the cache limit: one running sum in score order.
        base = base_q.subquery("base")
        before = func.sum(base.c.size).over(order_by=(base.c.score, base.c.id), rows=(None, 0)) - base.c.size
        cut = select(base.c.id, base.c.env_id, base.c.key, base.c.size, base.c.aot, base.c.score,
                     literal(0).label("env_evict"), before.label("before")).subquery("cut")
        assert global_excess is not None
        q = (select(cut.c.env_id, cut.c.key, cut.c.size, cut.c.aot, cut.c.score, cut.c.env_evict)
             .where(cut.c.before < global_excess).order_by(cut.c.score, cut.c.id))
    else:
        if env_bytes is None:
            env_bytes = _env_bytes(index, cid)
        # Each environment's excess as a constant per row: no second scan to join.
        over = {env: b - env_max_bytes for env, b in env_bytes.items() if b > env_max_bytes}
        excess_of: ColumnElement[int] = (
            case(*((Entry.environment_id == env, x) for env, x in over.items()), else_=0) if over else literal(0))
        base = base_q.add_columns(excess_of.label("env_excess")).cte("base")
        env_before = func.sum(base.c.size).over(
            partition_by=base.c.env_id, order_by=(base.c.score, base.c.id), rows=(None, 0)) - base.c.size
        env_evict = case((env_before < base.c.env_excess, 1), else_=0)
        marked = select(base.c.id, base.c.env_id, base.c.key, base.c.size, base.c.aot, base.c.score,
                        env_evict.label("env_evict")).cte("marked")
        rest_size = case((marked.c.env_evict == 1, 0), else_=marked.c.size)
        glob_before = func.sum(rest_size).over(order_by=(marked.c.score, marked.c.id), rows=(None, 0)) - rest_size
        env_freed = func.sum(marked.c.size - rest_size).over()
        cut = select(marked.c.id, marked.c.env_id, marked.c.key, marked.c.size, marked.c.aot, marked.c.score,
                     marked.c.env_evict, glob_before.label("glob_before"),
                     env_freed.label("env_freed")).cte("cut")
        global_cond: ColumnElement[bool] = (
            false() if global_excess is None else cut.c.glob_before < global_excess - cut.c.env_freed)
        q = (select(cut.c.env_id, cut.c.key, cut.c.size, cut.c.aot, cut.c.score, cut.c.env_evict)
             .where(or_(cut.c.env_evict == 1, global_cond)).order_by(cut.c.score, cut.c.id))
    out: list[Eviction] = []
    with index.read_session() as s:
        result = s.connection().execution_options(yield_per=_STREAM_ROWS).execute(q)
        for env_id, key, unit, aot, sc, by_env in result:
            if isinstance(sc, datetime):
                sc = sc.isoformat()
            aot = None if aot is None else int(aot)
            out.append(Eviction(env_id, key, int(unit) - (aot or 0), sc if isinstance(sc, str) else float(sc),
                                "env-max-size" if by_env else "max-size", aot))
    return out, {"bytes_before": total}


def _env_bytes(index: Index, cid: int) -> dict[int, int]:
    q = (select(Entry.environment_id, func.sum(unit_size()))
         .join(EnvRow, EnvRow.id == Entry.environment_id)
         .where(EnvRow.cache_id == cid, EnvRow.deleted_at.is_(None))
         .group_by(Entry.environment_id))
    with index.read_session() as s:
        return {int(env): int(b or 0) for env, b in s.execute(q)}


def entry_digests(index: Index, env_id: int) -> dict[str, tuple[int, str]]:
    """key -> (size, sha256) of one environment: what verify checks files against (a read)."""
    q = select(Entry.key, Entry.size_bytes, Entry.sha256).where(Entry.environment_id == env_id)
    with index.read_session() as s:
        return {k: (int(size), sha) for k, size, sha in s.connection().execute(q)}


def service_written_entries(index: Index, env_id: int) -> list[tuple[str, datetime]]:
    """(key, created) of entries a service wrote after the environment's newest finished warm:
    origin 'observed' (sync found them in storage), created after that warm ended."""
    last = (select(func.max(WarmRun.finished_at))
            .where(WarmRun.environment_id == env_id, WarmRun.finished_at.is_not(None))
            .scalar_subquery())
    q = (select(Entry.key, Entry.created_at)
         .where(Entry.environment_id == env_id, Entry.origin == "observed", Entry.created_at > last)
         .order_by(Entry.key))
    with index.read_session() as s:
        return [(k, at) for k, at in s.execute(q)]


def executable_digests(index: Index, env_id: int) -> dict[str, tuple[int, str, str]]:
    """key -> (aot size, aot sha256, entry sha256) of one environment's indexed executables (a read)."""
    q = select(Entry.key, Entry.aot_size_bytes, Entry.aot_sha256, Entry.sha256).where(
        Entry.environment_id == env_id, Entry.aot_sha256.is_not(None))
    with index.read_session() as s:
        return {k: (int(size or 0), sha, entry_sha) for k, size, sha, entry_sha in s.connection().execute(q)}


def delete_entry_rows(index: Index, by_env: dict[int, list[str]]) -> int:
    """Drop index rows of entries already gone from storage, in one transaction."""
    removed = 0
    with index.session() as s:
        for env_id, keys in by_env.items():
            for start in range(0, len(keys), 500):
                chunk = keys[start:start + 500]
                result = s.execute(
                    Entry.__table__.delete().where(Entry.environment_id == env_id, Entry.key.in_(chunk)))
                removed += result.rowcount or 0
    return removed


def environments_with_recent_hits(index: Index, env_ids: Sequence[int], since: datetime) -> set[int]:
    """The environments among ``env_ids`` that served a hit since ``since`` (telemetry or entry access)."""
    if not env_ids:
        return set()
    ids = list(env_ids)
    with index.read_session() as s:
        by_telemetry = s.scalars(select(TelemetryRecord.environment_id).distinct().where(
            TelemetryRecord.environment_id.in_(ids), TelemetryRecord.hits > 0, TelemetryRecord.at >= since))
        found = {int(e) for e in by_telemetry}
        by_access = s.scalars(select(Entry.environment_id).distinct().where(
            Entry.environment_id.in_(ids), Entry.last_access_at >= since))
        found.update(int(e) for e in by_access)
    return found
