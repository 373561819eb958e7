"""The index queries prune, gc and verify plan from.

Planning never scans storage: it asks the index. Every query here is scoped
to one cache, filters on indexed columns (``entries(environment_id, ...)``),
aggregates in the database and returns Core rows, so a plan over 1,000,000
entry rows costs index scans plus about one Python object per row it deletes.
gc's cuts read candidates in score order only up to a bound a 1-in-64 sample
gives (``_Walk``): the database filters and sorts, and returns about the rows
to evict (10% over), whose running sum then picks the exact cut.

An entry and its stored executable (``<key>-aot``, on the same row) are one
unit: every size here is ``size_bytes + coalesce(aot_size_bytes, 0)``, and
each planned entry carries the executable's bytes so execution deletes both.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from operator import itemgetter
from typing import Any, NamedTuple

from sqlalchemy import (
    Float,
    String,
    and_,
    case,
    cast,
    func,
    literal,
    or_,
    select,
    type_coerce,
)
from sqlalchemy.sql.elements import ColumnElement

from cachectl.errors import NotFound
from cachectl.index import Index, unit_size
from cachectl.index.models import (
    Cache,
    Entry,
    TelemetryRecord,
    UTCDateTime,
    WarmRun,
    last_used,
    utcnow,
)
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


class EntryRef(NamedTuple):
    """The little planning needs to know about one entry row (a Core row has this shape)."""

    environment_id: int
    key: str
    size: int  # the JAX entry's bytes
    aot_size: int | None = None  # its stored executable's, if it has one


class Eviction(NamedTuple):
    """One entry gc evicts, with the score that ordered it and why it goes (a tuple: 100k are cheap)."""

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
    """Live (not deleted) environments of ``cache`` with entry counts and bytes.

    Two statements: the environments, then the totals grouped over
    ``environment_id IN (...)``, which SQLite reads off the covering index in
    environment order (a join would make it sort every row for the GROUP BY).
    """
    cid = cache_id(index, cache)
    q = (
        select(EnvRow.id, EnvRow.digest, EnvRow.namespace, EnvRow.jax_version, EnvRow.backend,
               EnvRow.device_kind, EnvRow.device_count, EnvRow.xla_flags)
        .where(EnvRow.cache_id == cid, EnvRow.deleted_at.is_(None))
        .order_by(EnvRow.namespace)
    )
    with index.read_session() as s:
        conn = s.connection()
        envs = conn.execute(q).all()
        totals: dict[int, tuple[int, int]] = {}
        if envs:
            grouped = (select(Entry.environment_id, func.count(), func.coalesce(func.sum(unit_size()), 0))
                       .where(Entry.environment_id.in_([e[0] for e in envs]))
                       .group_by(Entry.environment_id))
            totals = {int(e): (int(n), int(b)) for e, n, b in conn.execute(grouped)}
    return [
        EnvSummary(int(i), d, ns, jv, be, dk, int(dc), tuple(fl or ()), *totals.get(int(i), (0, 0)))
        for i, d, ns, jv, be, dk, dc, fl in envs
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
        where.append(last_used() < _as_bound(unused_before))
    if function is not None:
        where.append(Entry.function == function)
    return where


def _as_bound(value: datetime) -> ColumnElement[datetime]:
    # A bound value compared with a COALESCE has no column type to borrow:
    # give it ours, so SQLite gets the same naive-UTC text the columns hold.
    return literal(value, type_=UTCDateTime())


def selected_counts(index: Index, env_ids: Sequence[int], *, created_before: datetime | None = None,
                    unused_before: datetime | None = None, function: str | None = None) -> dict[int, int]:
    """environment id -> entries matching the entry selectors, counted in SQL.

    A count, not bytes: the selectors' indexes (``ix_entries_env_created``,
    ``ix_entries_env_last_used``) answer it without reading the table.
    """
    if not env_ids:
        return {}
    q = (
        select(Entry.environment_id, func.count())
        .where(Entry.environment_id.in_(list(env_ids)),
               *_entry_filters(created_before, unused_before, function))
        .group_by(Entry.environment_id)
    )
    with index.read_session() as s:
        return {int(e): int(n) for e, n in s.connection().execute(q)}


def selected_entries(index: Index, env_ids: Sequence[int], *, created_before: datetime | None = None,
                     unused_before: datetime | None = None,
                     function: str | None = None) -> dict[int, list[EntryRef]]:
    """environment id -> its entry rows matching the selectors, each list sorted by key.

    Core rows, grouped and sorted here: no ORDER BY on purpose, since ordering
    by key would make SQLite walk the (environment, key) index and visit every
    row, where the filter alone range-scans (environment, created_at).
    """
    out: dict[int, list[EntryRef]] = {}
    if not env_ids:
        return out
    q = (
        select(Entry.environment_id, Entry.key, Entry.size_bytes, Entry.aot_size_bytes)
        .where(Entry.environment_id.in_(list(env_ids)),
               *_entry_filters(created_before, unused_before, function))
    )
    with index.read_session() as s:
        result = s.connection().execute(q, execution_options={"yield_per": _STREAM_ROWS})
        for part in result.partitions():
            for row in part:
                out.setdefault(row[0], []).append(row)  # type: ignore[arg-type]
    for rows in out.values():
        rows.sort(key=_by_key)
    return out


_by_key = itemgetter(1)


def _score(dialect: str, policy: str, now: datetime) -> ColumnElement[float]:
    """What gc evicts first (lowest score first).

    lru: last access (created when never accessed). cost: GreedyDual-Size's
    cost per byte, compile milliseconds per KiB, decayed by time since last
    access (halved after COST_HALF_LIFE_DAYS): a big entry that compiled in a
    second goes before a small one that took a minute, and a stale expensive
    entry eventually goes too.
    """
    last = last_used()
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


class Cuts(NamedTuple):
    """gc's cuts as the database returned them: rows (score, id, environment, key, unit bytes,
    aot bytes) in (score, id) order, plain DBAPI tuples (no per-row object for 100k rows)."""

    rows: list[tuple[Any, ...]]  # lru: a 7th column, the last use to the minute as text
    env_taken: set[int]  # ids of the rows the per-environment pass took ("env-max-size")
    bytes_before: int
    # lru: the last use (SQLite: its text; PostgreSQL: a UTC datetime); cost: a float.
    lru: bool


def eviction_cuts(index: Index, cache: str, *, policy: str, max_bytes: int | None,
                  env_max_bytes: int | None, exclude_env_ids: Sequence[int] = (),
                  protect_warm_runs: Sequence[int] = (), now: datetime | None = None,
                  bytes_total: int | None = None, env_bytes: dict[int, int] | None = None) -> Cuts:
    """The rows to evict so the cache fits ``max_bytes`` and each environment ``env_max_bytes``.

    Greedy in score order (lowest first, ties by id): each over-limit
    environment gives up its lowest-scored entries until it fits; then the
    cache as a whole gives up the lowest-scored of the rest until it fits,
    counting what the environments already gave up. Each cut reads only about
    as many rows as it evicts (``_Walk``), not every row of the cache.
    Protected entries count toward the totals but are never candidates.
    ``bytes_total`` (the cache's indexed bytes) and ``env_bytes`` (per
    environment) save a scan each when the caller already has them.
    """
    now = now or utcnow()
    cid = cache_id(index, cache)
    with index.read_session() as s:
        dialect = s.get_bind().dialect.name
        live = [int(i) for i in s.scalars(
            select(EnvRow.id).where(EnvRow.cache_id == cid, EnvRow.deleted_at.is_(None)).order_by(EnvRow.id))]
        if bytes_total is None:
            bytes_total = int(s.scalar(select(func.coalesce(func.sum(unit_size()), 0))
                                       .where(Entry.environment_id.in_(live))) or 0)
    total = bytes_total
    global_excess = None if max_bytes is None else total - max_bytes
    if (global_excess is None or global_excess <= 0) and env_max_bytes is None:
        return Cuts([], set(), total, policy == "lru")

    score = _score(dialect, policy, now)
    if policy == "lru" and dialect == "sqlite":
        # Return the raw text: parsing 100k datetimes costs more than the query.
        score = type_coerce(score, String)
    excluded = set(exclude_env_ids)
    evictable: list[ColumnElement[bool]] = []
    if protect_warm_runs:
        evictable.append(or_(Entry.warm_run_id.is_(None), Entry.warm_run_id.not_in(list(protect_warm_runs))))
    walk = _Walk(index, score, evictable, ordered=policy == "lru",
                 label=_last_used_minute(dialect, score) if policy == "lru" else None)
    by_env: list[tuple[Any, ...]] = []
    cuts = 0  # environments cut one by one: their rows need one order
    if env_max_bytes is not None:
        if env_bytes is None:
            env_bytes = _env_bytes(index, cid)
        over = {env: env_bytes.get(env, 0) - env_max_bytes for env in live
                if env not in excluded and env_bytes.get(env, 0) > env_max_bytes}
        by_env, cuts = walk.take_each(over), len(over)
    env_taken = {row[1] for row in by_env}
    env_freed = sum(row[4] for row in by_env)
    by_cache: list[tuple[Any, ...]] = []
    if global_excess is not None and global_excess - env_freed > 0:
        by_cache = walk.take([e for e in live if e not in excluded], global_excess - env_freed,
                             skip=env_taken, skip_bytes=env_freed)
    rows = by_env + by_cache
    if by_env and (by_cache or cuts > 1):
        # One (score, id) order, as each cut was walked: the rows' own order, ids being unique.
        rows.sort()
    return Cuts(rows, env_taken, total, policy == "lru")


def _last_used_minute(dialect: str, score: ColumnElement[Any]) -> ColumnElement[str]:
    """The last use to the minute, 'YYYY-MM-DD HH:MM' (UTC), as text the database writes: printing
    100k datetimes in Python costs more than reading them."""
    if dialect == "postgresql":
        return func.to_char(func.timezone("UTC", last_used()), "YYYY-MM-DD HH24:MI")
    return func.substr(func.replace(score, "T", " "), 1, 16)


def plan_evictions(index: Index, cache: str, *, policy: str, max_bytes: int | None,
                   env_max_bytes: int | None, exclude_env_ids: Sequence[int] = (),
                   protect_warm_runs: Sequence[int] = (), now: datetime | None = None,
                   bytes_total: int | None = None,
                   env_bytes: dict[int, int] | None = None) -> tuple[list[Eviction], dict[str, int]]:
    """``eviction_cuts`` as one ``Eviction`` per entry, in score order, and the bytes before."""
    cuts = eviction_cuts(index, cache, policy=policy, max_bytes=max_bytes, env_max_bytes=env_max_bytes,
                         exclude_env_ids=exclude_env_ids, protect_warm_runs=protect_warm_runs, now=now,
                         bytes_total=bytes_total, env_bytes=env_bytes)
    taken = cuts.env_taken
    out = [Eviction(env_id, key, unit - (aot or 0), score_value(sc, cuts.lru),
                    "env-max-size" if id_ in taken else "max-size", aot)
           for sc, id_, env_id, key, unit, aot, *_ in cuts.rows]
    return out, {"bytes_before": cuts.bytes_before}


def score_value(score: Any, lru: bool) -> float | str:
    """A cut row's score as ``Eviction.score``: lru the last use as ISO text, cost a float."""
    if not lru:
        return float(score)
    return score if isinstance(score, str) else score.isoformat()


# gc's cuts estimate how far to read from a 1-in-_SAMPLE_EVERY sample of the candidates, and
# read _SAMPLE_MARGIN times what the sample says the cut needs.
_SAMPLE_EVERY = 64
_SAMPLE_MARGIN = 1.1
_PG_SORT_MEM = "64MB"
# Rows the first read past a short sample's bound takes at least (more when the shortfall needs it).
_FOLLOW_ROWS = 1000
_FIRST_FETCH = 1000


class _Walk:
    """Evictable entries in (score, id) order, read only as far as a cut needs.

    A 1-in-64 sample (read from the covering ``ix_entries_env_plan``, so cheap)
    gives a score under which the cut should end; the database returns only the
    rows up to it, sorted, so it never sorts 1,000,000 rows to evict 100,000.
    Should the sample fall short, the rest follows in order (keyset: score above
    the bound); the cut itself is exact either way.
    """

    def __init__(self, index: Index, score: ColumnElement[Any], where: list[ColumnElement[bool]],
                 label: ColumnElement[str] | None,
                 ordered: bool) -> None:
        self.index, self.score, self.where = index, score, where
        self.ordered = ordered  # an index holds the score order (lru: ix_entries_last_used)
        self.label = label  # lru: the last use as the plan prints it, a 7th column

    def take_each(self, targets: dict[int, int]) -> list[tuple[Any, ...]]:
        """Each environment's own cut (environment id -> bytes), as ``take([env], bytes)`` would
        give them. PostgreSQL: one sample and one read serve every environment (a bound each),
        not two queries (and two parallel plans' start-up) per environment; whoever's sample fell
        short reads on alone. SQLite: one walk each (one combined sort measured slower)."""
        if not targets:
            return []
        if self.index.dialect != "postgresql":
            return [row for env in sorted(targets) for row in self.take([env], targets[env])]
        envs = sorted(targets)
        out: list[tuple[Any, ...]] = []
        acc = dict.fromkeys(envs, 0)
        with self.index.read_session() as s:
            conn = s.connection()
            self._settings(conn)
            bounds = self._bounds(conn, envs, targets)
            if bounds:
                result = conn.execute(self._query_each(bounds))
                try:
                    for part in iter(partial(result.cursor.fetchmany, _STREAM_ROWS), []):  # type: ignore[attr-defined]
                        for row in part:
                            env = row[2]
                            if acc[env] < targets[env]:
                                out.append(row)
                                acc[env] += row[4]
                finally:
                    result.close()
        short = [env for env in envs if acc[env] < targets[env]]
        for env in short:
            out.extend(self.take([env], targets[env] - acc[env], past=bounds.get(env)))
        return out

    def _settings(self, conn: Any) -> None:
        if conn.dialect.name == "postgresql":
            # A 10% cut of 1,000,000 rows is ~100k sorted rows: sort them in memory, not on disk
            # (the default 4 MB spills); lru scores in UTC, as the column type gives them; for
            # this read transaction only.
            conn.exec_driver_sql(f"SELECT set_config('work_mem', '{_PG_SORT_MEM}', true), "
                                 "set_config('TimeZone', 'UTC', true)")

    def _bounds(self, conn: Any, envs: list[int], targets: dict[int, int]) -> dict[int, Any]:
        """Each environment's bound from one sample query (an environment whose sample gives none
        is left out)."""
        q = (select(Entry.environment_id, self.score, unit_size())
             .where(Entry.environment_id.in_(envs), *self.where, Entry.id % _SAMPLE_EVERY == 0)
             .order_by(Entry.environment_id, self.score))
        acc = dict.fromkeys(envs, 0)
        want = {env: targets[env] * _SAMPLE_MARGIN for env in envs}
        bounds: dict[int, Any] = {}
        for env, sc, unit in conn.execute(q).cursor.fetchall():
            if env not in bounds:
                acc[env] += unit * _SAMPLE_EVERY
                if acc[env] >= want[env]:
                    bounds[env] = sc
        return bounds

    def _query_each(self, bounds: dict[int, Any]) -> Any:
        """The candidates of each environment in ``bounds`` up to its bound, in (score, id) order."""
        envs = sorted(bounds)
        if self.ordered:
            upto = case(bounds, value=Entry.environment_id)
            return (select(self.score.label("score"), Entry.id, Entry.environment_id, Entry.key, unit_size(),
                           Entry.aot_size_bytes, *([] if self.label is None else [self.label]))
                    .where(Entry.environment_id.in_(envs), *self.where, self.score <= upto)
                    .order_by(self.score, Entry.id))
        scored = (select(self.score.label("score"), Entry.id.label("id"), Entry.environment_id.label("env"))
                  .where(Entry.environment_id.in_(envs), *self.where).subquery("c"))
        return (select(scored.c.score, Entry.id, Entry.environment_id, Entry.key, unit_size(), Entry.aot_size_bytes)
                .join_from(scored, Entry, Entry.id == scored.c.id)
                .where(scored.c.score <= case(bounds, value=scored.c.env))
                .order_by(scored.c.score, scored.c.id))

    def take(self, env_ids: list[int], target: int, skip: Collection[int] = (),
             skip_bytes: int = 0, past: Any = None) -> list[tuple[Any, ...]]:
        """Rows (score, id, environment, key, unit bytes, aot bytes[, label]) whose running sum of unit
        bytes *before* them is under ``target``; rows in ``skip`` (``skip_bytes`` in all) are
        passed over and count 0.

        Plain DBAPI tuples off the driver's cursor, not Rows: the only column a result type
        would convert is PostgreSQL's lru score, which comes back in UTC (``TimeZone`` is set
        for the transaction), as the column type would give it.
        """
        out: list[tuple[Any, ...]] = []
        if not env_ids or target <= 0:
            return out
        by_env = Entry.environment_id.in_(env_ids) if len(env_ids) > 1 else Entry.environment_id == env_ids[0]
        acc = 0
        with self.index.read_session() as s:
            conn = s.connection()
            postgres = conn.dialect.name == "postgresql"
            self._settings(conn)
            # SQLite walks an lru cut's index in order and hands rows over as they are read: it can
            # stop at the cut by itself, no bound needed. Anything else sorts: bounded by a sample.
            lazy = self.ordered and not postgres
            bound = None if lazy or past is not None else self._bound(conn, [by_env, *self.where],
                                                                      target + skip_bytes)
            # First every row up to the bound; then, should the sample have fallen short (or given
            # no bound), the next rows in (score, id) order, a LIMIT at a time, each read about
            # what the shortfall needs: never a cursor over every candidate. ``past``: the rows up
            # to that score are read already (take_each's bound).
            upto, after = bound, None if past is None else (past, None)
            limit = 0
            while True:
                q = self._query(env_ids, by_env, upto, after)
                if upto is None and not lazy:
                    per_row = acc // len(out) if out else 0
                    limit = max(_FOLLOW_ROWS, 2 * limit, 2 * (target - acc) // per_row if per_row else 0)
                    q = q.limit(limit)
                result = conn.execute(q)
                read, last = 0, None
                fetch, size = result.cursor.fetchmany, _FIRST_FETCH  # type: ignore[attr-defined]
                try:
                    while part := fetch(size):
                        read += len(part)
                        last = part[-1]
                        for row in part:
                            if acc >= target:
                                return out
                            if not skip or row[1] not in skip:
                                out.append(row)
                                acc += row[4]
                        # Next, about the rows the rest of the cut needs at the mean so far (5% more):
                        # SQLite looks up each row fetched, so a fixed batch would overshoot every cut.
                        size = (min(_STREAM_ROWS, max(64, (target - acc) * len(out) // acc * 21 // 20 + 32))
                                if acc else _STREAM_ROWS)
                finally:
                    result.close()
                if upto is not None:
                    upto, after = None, (bound, None)
                elif lazy or read < limit or last is None:
                    return out  # every candidate read
                else:
                    after = (last[0], last[1])

    def _query(self, env_ids: list[int], by_env: ColumnElement[bool], upto: Any,
               after: tuple[Any, Any] | None) -> Any:
        """The candidates with score <= ``upto`` (None: unbounded) and after ``after`` (score, id
        or score, None: past that score), in (score, id) order."""
        def within(score: Any, id_: Any) -> list[ColumnElement[bool]]:
            out: list[ColumnElement[bool]] = [] if upto is None else [score <= upto]
            if after is not None:
                at, last_id = after
                out.append(score > at if last_id is None else or_(score > at, and_(score == at, id_ > last_id)))
            return out

        if self.ordered:
            # ``+ 0``: not an index term, so the databases range-scan the score index in order
            # instead of each environment's rows, then sorting them.
            in_order = (Entry.environment_id + 0).in_(env_ids) if len(env_ids) > 1 else by_env
            return (select(self.score.label("score"), Entry.id, Entry.environment_id, Entry.key, unit_size(),
                           Entry.aot_size_bytes, *([] if self.label is None else [self.label]))
                    .where(in_order, *self.where, *within(self.score, Entry.id)).order_by(self.score, Entry.id))
        # The score is computed once per row over the covering index; only the rows it keeps
        # are looked up for their key.
        scored = select(self.score.label("score"), Entry.id.label("id")).where(by_env, *self.where).subquery("c")
        return (select(scored.c.score, Entry.id, Entry.environment_id, Entry.key, unit_size(), Entry.aot_size_bytes)
                .join_from(scored, Entry, Entry.id == scored.c.id).where(*within(scored.c.score, scored.c.id))
                .order_by(scored.c.score, scored.c.id))

    def _bound(self, conn: Any, where: list[ColumnElement[bool]], need: int) -> Any:
        """A score at or under which, by the sample, ``need`` bytes (with margin) lie; None: no bound."""
        sample = conn.execute(select(self.score, unit_size()).where(*where, Entry.id % _SAMPLE_EVERY == 0)
                              .order_by(self.score))
        acc, want = 0, need * _SAMPLE_MARGIN
        try:
            # The driver's cursor a batch at a time: SQLite stops walking the lru index at the bound.
            for part in iter(partial(sample.cursor.fetchmany, 256), []):
                for sc, unit in part:
                    acc += unit * _SAMPLE_EVERY
                    if acc >= want:
                        return sc
        finally:
            sample.close()
        return None


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
