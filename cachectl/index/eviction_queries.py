"""gc's plans from the index: which entries a size limit evicts, by least recent use or by cost.

Each cut (per environment over its limit, then the whole cache) reads candidates in (score, id)
order only up to a bound a 1-in-64 sample gives, plus a margin, and reads on if the sample fell
short; Python keeps the running total of sizes to find the exact cut (cachectl/lifecycle/gc.py
turns the cuts into a plan).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from datetime import datetime
from functools import partial
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
from sqlalchemy.orm import InstrumentedAttribute
from sqlalchemy.sql.elements import ColumnElement

from cachectl.index import Index, unit_size

# A running warm whose heartbeat is older than this is presumed dead.
from cachectl.index.lifecycle_queries import (
    _STREAM_ROWS,
    COST_HALF_LIFE_DAYS,
    DEFAULT_COMPILE_MS,
    Eviction,
    _as_bound,
    cache_id,
)
from cachectl.index.models import (
    Entry,
    last_used,
    utcnow,
)
from cachectl.index.models import Environment as EnvRow


def _score(dialect: str, policy: str, now: datetime) -> ColumnElement[Any]:
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
    # The age, clamped at 0, computed once per row: max()/greatest() of the age and 0 is the value
    # ``CASE WHEN age < 0 THEN 0.0 ELSE age END`` gives (the same operations on the same operands,
    # so the same scores, bit for bit: tests/test_lifecycle_gc.py compares the two), where the
    # CASE computed the age twice (SQLite: parsing the date twice, PostgreSQL: numeric arithmetic
    # twice) for every candidate. SQLite computes julianday(now) once per statement (a constant).
    if dialect == "sqlite":
        age_days: ColumnElement[Any] = func.max(
            func.julianday(_as_bound(now)) - func.julianday(last), 0.0
        )
    else:
        age_days = func.greatest(func.extract("epoch", _as_bound(now) - last) / 86400.0, 0.0)
    return _cost_per_kib() / (1.0 + age_days / COST_HALF_LIFE_DAYS)


def _cost_per_kib() -> ColumnElement[Any]:
    unit = unit_size()
    size_kib = case((unit < 1, 1.0), else_=cast(unit, Float) / 1024.0)
    return cast(func.coalesce(Entry.compile_time_ms, DEFAULT_COMPILE_MS), Float) / size_kib


def _under_bound(dialect: str, policy: str, now: datetime) -> Any:
    """PostgreSQL, cost: a cheap test every row whose score is at most a bound passes, put before
    the exact one: the score in double precision (the age by date_part, not numeric EXTRACT) within
    a billionth of the bound, where the two scores differ by ~1e-15 of their value (EXTRACT's
    exact numeric age rounded once, date_part's rounded twice). Scoring a 1,000,000-row scan measured
    0.27 CPU s with it, 0.39 without. Takes the bounds, one or one per environment; None: no test."""
    if dialect != "postgresql" or policy != "cost":
        return None
    age = func.greatest(func.date_part("epoch", _as_bound(now) - last_used()) / 86400.0, 0.0)
    approx = _cost_per_kib() / (1.0 + age / COST_HALF_LIFE_DAYS)

    def loose(b: float) -> float:
        return b + abs(b) * 1e-9

    def test(bound: Any) -> ColumnElement[bool]:
        # The bounds loosened here, not in SQL: PostgreSQL runs the cheaper-costed test first.
        if isinstance(bound, dict):
            return approx <= case(
                {env: loose(b) for env, b in bound.items()}, value=Entry.environment_id
            )
        return approx <= loose(bound)

    return test


class Cuts(NamedTuple):
    """gc's cuts as the database returned them: rows (score, id, environment, key, unit bytes,
    aot bytes) in (score, id) order, plain DBAPI tuples (no per-row object for 100k rows)."""

    rows: list[tuple[Any, ...]]  # lru: a 7th column, the last use to the minute as text
    env_taken: set[int]  # ids of the rows the per-environment pass took ("env-max-size")
    bytes_before: int
    # lru: the last use (SQLite: its text; PostgreSQL: a UTC datetime); cost: a float.
    lru: bool


def eviction_cuts(
    index: Index,
    cache: str,
    *,
    policy: str,
    max_bytes: int | None,
    env_max_bytes: int | None,
    exclude_env_ids: Sequence[int] = (),
    protect_warm_runs: Sequence[int] = (),
    now: datetime | None = None,
    bytes_total: int | None = None,
    env_bytes: dict[int, int] | None = None,
    rows_total: int | None = None,
) -> Cuts:
    """The rows to evict so the cache fits ``max_bytes`` and each environment ``env_max_bytes``.

    Greedy in score order (lowest first, ties by id): each over-limit
    environment gives up its lowest-scored entries until it fits; then the
    cache as a whole gives up the lowest-scored of the rest until it fits,
    counting what the environments already gave up. Each cut reads only about
    as many rows as it evicts (``_Walk``), not every row of the cache.
    Protected entries count toward the totals but are never candidates.
    ``bytes_total`` and ``rows_total`` (the cache's indexed bytes and entries)
    and ``env_bytes`` (per environment) save a scan each when the caller
    already has them.
    """
    now = now or utcnow()
    cid = cache_id(index, cache)
    with index.read_session() as s:
        dialect = s.get_bind().dialect.name
        live = [
            int(i)
            for i in s.scalars(
                select(EnvRow.id)
                .where(EnvRow.cache_id == cid, EnvRow.deleted_at.is_(None))
                .order_by(EnvRow.id)
            )
        ]
        if bytes_total is None or rows_total is None:
            counted, summed = s.execute(
                select(func.count(), func.coalesce(func.sum(unit_size()), 0)).where(
                    Entry.environment_id.in_(live)
                )
            ).one()
            rows_total, bytes_total = (
                int(counted),
                int(summed) if bytes_total is None else bytes_total,
            )
        top_id = int(s.scalar(select(func.max(Entry.id))) or 0)
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
        evictable.append(
            or_(Entry.warm_run_id.is_(None), Entry.warm_run_id.not_in(list(protect_warm_runs)))
        )
    walk = _Walk(
        index,
        score,
        evictable,
        ordered=policy == "lru",
        label=_last_used_minute(dialect, score) if policy == "lru" else None,
        sample_ids=sample_ids(dialect, top_id, rows_total),
        under=_under_bound(dialect, policy, now),
        most_rows=frozenset(live) if dialect == "postgresql" and 2 * rows_total >= top_id else None,
    )
    by_env: list[tuple[Any, ...]] = []
    cuts = 0  # environments cut one by one: their rows need one order
    if env_max_bytes is not None:
        if env_bytes is None:
            env_bytes = _env_bytes(index, cid)
        over = {
            env: env_bytes.get(env, 0) - env_max_bytes
            for env in live
            if env not in excluded and env_bytes.get(env, 0) > env_max_bytes
        }
        by_env, cuts = walk.take_each(over), len(over)
    env_taken = {row[1] for row in by_env}
    env_freed = sum(row[4] for row in by_env)
    by_cache: list[tuple[Any, ...]] = []
    if global_excess is not None and global_excess - env_freed > 0:
        by_cache = walk.take(
            [e for e in live if e not in excluded],
            global_excess - env_freed,
            skip=env_taken,
            skip_bytes=env_freed,
        )
    rows = by_env + by_cache
    if by_env and (by_cache or cuts > 1):
        # One (score, id) order, as each cut was walked: the rows' own order, ids being unique.
        rows.sort()
    return Cuts(rows, env_taken, total, policy == "lru")


def sample_ids(dialect: str, top_id: int, rows: int) -> int | None:
    """The highest id when gc's sample is read by id (SQLite, ids dense: see ``_SAMPLE_BY_ID``),
    else None (a scan)."""
    return top_id if dialect == "sqlite" and top_id <= _SAMPLE_BY_ID * rows else None


def _last_used_minute(dialect: str, score: ColumnElement[Any]) -> ColumnElement[str]:
    """The last use to the minute, 'YYYY-MM-DD HH:MM' (UTC), as text the database writes: printing
    100k datetimes in Python costs more than reading them."""
    if dialect == "postgresql":
        return func.to_char(func.timezone("UTC", last_used()), "YYYY-MM-DD HH24:MI")
    return func.substr(func.replace(score, "T", " "), 1, 16)


def plan_evictions(
    index: Index,
    cache: str,
    *,
    policy: str,
    max_bytes: int | None,
    env_max_bytes: int | None,
    exclude_env_ids: Sequence[int] = (),
    protect_warm_runs: Sequence[int] = (),
    now: datetime | None = None,
    bytes_total: int | None = None,
    env_bytes: dict[int, int] | None = None,
) -> tuple[list[Eviction], dict[str, int]]:
    """``eviction_cuts`` as one ``Eviction`` per entry, in score order, and the bytes before."""
    cuts = eviction_cuts(
        index,
        cache,
        policy=policy,
        max_bytes=max_bytes,
        env_max_bytes=env_max_bytes,
        exclude_env_ids=exclude_env_ids,
        protect_warm_runs=protect_warm_runs,
        now=now,
        bytes_total=bytes_total,
        env_bytes=env_bytes,
    )
    taken = cuts.env_taken
    out = [
        Eviction(
            env_id,
            key,
            unit - (aot or 0),
            score_value(sc, cuts.lru),
            "env-max-size" if id_ in taken else "max-size",
            aot,
        )
        for sc, id_, env_id, key, unit, aot, *_ in cuts.rows
    ]
    return out, {"bytes_before": cuts.bytes_before}


def score_value(score: Any, lru: bool) -> float | str:
    """A cut row's score as ``Eviction.score``: lru the last use as ISO text, cost a float."""
    if not lru:
        return float(score)
    return score if isinstance(score, str) else score.isoformat()


# gc's cuts estimate how far to read from a 1-in-_SAMPLE_EVERY sample of the candidates, and
# read a margin more than the sample says the cut needs (``_margin``).
_SAMPLE_EVERY = 64
_SAMPLE_MARGIN = 1.1
# The sample's estimate of the bytes under a score, from n sampled rows of sizes as varied as a
# cache's, is off by about 1.2/sqrt(n) of itself (one standard deviation). A cut whose sample falls
# short reads on (PostgreSQL: a scan of its environment again, ~0.04 s at 1,000,000 rows), where
# 10% fell short for 2-3 of 18 environments; every row of margin is sorted and sent. Of 1, 2, 3
# and 4 over sqrt(n) (2: about 1.7 deviations), 2 measured best for the lru cut with
# per-environment limits and within the noise for the cost cut (4: no environment short, but ~30%
# more rows read).
_SAMPLE_SIGMAS = 2.0


def _margin(sampled: int) -> float:
    """How much more than the sample's estimate a cut reads, by the sampled rows under its bound."""
    return 1.0 + max(_SAMPLE_MARGIN - 1.0, _SAMPLE_SIGMAS / math.sqrt(max(sampled, 1)))


_PG_SORT_MEM = "64MB"
# Rows the first read past a short sample's bound takes at least (more when the shortfall needs it).
_FOLLOW_ROWS = 1000
_FIRST_FETCH = 1000
# SQLite reads the sample by id (a lookup per multiple of 64 up to the highest id) while the
# entries table holds ids up to this many times the cache's rows, else by a scan of every
# candidate: a lookup costs ~20 index rows scanned (1,000,000 rows: 0.035 s against 0.12 s).
_SAMPLE_BY_ID = 3


class _Walk:
    """Evictable entries in (score, id) order, read only as far as a cut needs.

    A 1-in-64 sample (read from the covering ``ix_entries_env_plan``, so cheap)
    gives a score under which the cut should end; the database returns only the
    rows up to it, sorted, so it never sorts 1,000,000 rows to evict 100,000.
    Should the sample fall short, the rest follows in order (keyset: score above
    the bound); the cut itself is exact either way.
    """

    def __init__(
        self,
        index: Index,
        score: ColumnElement[Any],
        where: list[ColumnElement[bool]],
        label: ColumnElement[str] | None,
        ordered: bool,
        sample_ids: int | None = None,
        under: Any = None,
        most_rows: frozenset[int] | None = None,
    ) -> None:
        self.index, self.score, self.where = index, score, where
        self.ordered = ordered  # an index holds the score order (lru: ix_entries_last_used)
        self.label = label  # lru: the last use as the plan prints it, a 7th column
        self.sample_ids = sample_ids  # the highest id, to read the sample by id; None: by a scan
        self.under = under  # bound -> a cheap test before ``score <= bound`` (``_under_bound``)
        self.most_rows = most_rows  # environments holding most of the table's rows (PostgreSQL)

    def _in_envs(self, env_ids: Collection[int]) -> ColumnElement[bool]:
        """The environments' rows. Where they are most of the table, ``+ 0`` keeps the test off the
        environment indexes: PostgreSQL then reads the table in one sequential scan, where its
        estimate for an IN list of every environment chose a bitmap scan of one of them over
        every row (the cost cut's read at 1,000,000 rows: 0.57 against 0.67 s)."""
        ids = sorted(env_ids)
        column: Any = Entry.environment_id
        if self.most_rows is not None and self.most_rows <= set(ids):
            column = Entry.environment_id + 0
        return column.in_(ids) if len(ids) > 1 else column == ids[0]

    def take_each(self, targets: dict[int, int]) -> list[tuple[Any, ...]]:
        """Each environment's own cut (environment id -> bytes), as ``take([env], bytes)`` would
        give them. One sample query gives every environment its bound. PostgreSQL: one read
        serves every environment, not two queries (and two parallel plans' start-up) per
        environment; whoever's sample fell short reads on alone. SQLite: one walk each (one
        combined sort measured slower); its lru walk needs no bound."""
        if not targets:
            return []
        envs = sorted(targets)
        if self.index.dialect != "postgresql":
            bounds: dict[int, Any] = {}
            if not self.ordered:
                with self.index.read_session() as s:
                    bounds = self._bounds(s.connection(), envs, targets)
            return [
                row
                for env in envs
                for row in self.take(
                    [env], targets[env], bound=bounds.get(env), sampled=not self.ordered
                )
            ]
        out: list[tuple[Any, ...]] = []
        acc = dict.fromkeys(envs, 0)
        with self.index.read_session() as s:
            conn = s.connection()
            self._settings(conn)
            bounds = self._bounds(conn, envs, targets)
            if bounds:
                result = conn.execute(self._query_each(bounds))
                try:
                    for part in iter(partial(result.cursor.fetchmany, _STREAM_ROWS), []):
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
            conn.exec_driver_sql(
                f"SELECT set_config('work_mem', '{_PG_SORT_MEM}', true), "
                "set_config('TimeZone', 'UTC', true)"
            )

    def _bounds(self, conn: Any, envs: list[int], targets: dict[int, int]) -> dict[int, Any]:
        """Each environment's bound from one sample query (an environment whose sample gives none
        is left out)."""
        q = self._sample(
            [Entry.environment_id, self.score, unit_size()],
            [Entry.environment_id.in_(envs), *self.where],
        ).order_by(Entry.environment_id, self.score)
        acc = dict.fromkeys(envs, 0)
        rows = dict.fromkeys(envs, 0)
        bounds: dict[int, Any] = {}
        for env, sc, unit in conn.execute(q).cursor.fetchall():
            if env not in bounds:
                acc[env] += unit * _SAMPLE_EVERY
                rows[env] += 1
                if acc[env] >= targets[env] * _margin(rows[env]):
                    bounds[env] = sc
        return bounds

    def _query_each(self, bounds: dict[int, Any]) -> Any:
        """The candidates of each environment in ``bounds`` up to its bound, in (score, id) order."""
        envs = sorted(bounds)
        if self.ordered:
            upto = case(bounds, value=Entry.environment_id)
            return (
                select(
                    self.score.label("score"),
                    Entry.id,
                    Entry.environment_id,
                    Entry.key,
                    unit_size(),
                    Entry.aot_size_bytes,
                    *([] if self.label is None else [self.label]),
                )
                .where(self._in_envs(envs), *self.where, self.score <= upto)
                .order_by(self.score, Entry.id)
            )
        return self._one_scan([self._in_envs(envs), *self.where, *self._upto(bounds)])

    def _upto(self, bound: Any) -> list[ColumnElement[bool]]:
        """``score <= bound`` (a dict: each environment's bound), after the cheap test where there is one."""
        exact = self.score <= (
            case(bound, value=Entry.environment_id) if isinstance(bound, dict) else bound
        )
        return [exact] if self.under is None else [self.under(bound), exact]

    def _one_scan(self, where: list[ColumnElement[bool]]) -> Any:
        """The scored candidates in (score, id) order, the key read from the row (or index entry)
        it scores, not through a self-join: on PostgreSQL that scanned the table a second time and
        hashed every kept row (measured: half the time at 1,000,000 rows)."""
        return (
            select(
                self.score.label("score"),
                Entry.id,
                Entry.environment_id,
                Entry.key,
                unit_size(),
                Entry.aot_size_bytes,
            )
            .where(*where)
            .order_by(self.score, Entry.id)
        )

    def take(
        self,
        env_ids: list[int],
        target: int,
        skip: Collection[int] = (),
        skip_bytes: int = 0,
        past: Any = None,
        bound: Any = None,
        sampled: bool = False,
    ) -> list[tuple[Any, ...]]:
        """Rows (score, id, environment, key, unit bytes, aot bytes[, label]) whose running sum of unit
        bytes *before* them is under ``target``; rows in ``skip`` (``skip_bytes`` in all) are
        passed over and count 0. ``sampled``: ``bound`` is the sample's bound already (None: none).

        Plain DBAPI tuples off the driver's cursor, not Rows: the only column a result type
        would convert is PostgreSQL's lru score, which comes back in UTC (``TimeZone`` is set
        for the transaction), as the column type would give it.
        """
        out: list[tuple[Any, ...]] = []
        if not env_ids or target <= 0:
            return out
        by_env = self._in_envs(env_ids)
        acc = 0
        with self.index.read_session() as s:
            conn = s.connection()
            postgres = conn.dialect.name == "postgresql"
            self._settings(conn)
            # SQLite walks an lru cut's index in order and hands rows over as they are read: it can
            # stop at the cut by itself, no bound needed. Anything else sorts: bounded by a sample.
            lazy = self.ordered and not postgres
            if not (sampled or lazy or past is not None):
                bound = self._bound(conn, [by_env, *self.where], target + skip_bytes)
            # First every row up to the bound; then, should the sample have fallen short (or given
            # no bound), the next rows in (score, id) order, a LIMIT at a time, each read about
            # what the shortfall needs: never a cursor over every candidate. ``past``: the rows up
            # to that score are read already (take_each's bound).
            upto, after = bound, None if past is None else (past, None)
            limit = 0
            while True:
                if upto is None and not lazy:
                    per_row = acc // len(out) if out else 0
                    limit = max(
                        _FOLLOW_ROWS, 2 * limit, 2 * (target - acc) // per_row if per_row else 0
                    )
                result = conn.execute(
                    self._query(
                        env_ids, by_env, upto, after, limit if upto is None and not lazy else None
                    )
                )
                read, last = 0, None
                fetch, size = result.cursor.fetchmany, _FIRST_FETCH
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
                        size = (
                            min(
                                _STREAM_ROWS,
                                max(64, (target - acc) * len(out) // acc * 21 // 20 + 32),
                            )
                            if acc
                            else _STREAM_ROWS
                        )
                finally:
                    result.close()
                if upto is not None:
                    upto, after = None, (bound, None)
                elif lazy or read < limit or last is None:
                    return out  # every candidate read
                else:
                    after = (last[0], last[1])

    def _query(
        self,
        env_ids: list[int],
        by_env: ColumnElement[bool],
        upto: Any,
        after: tuple[Any, Any] | None,
        limit: int | None,
    ) -> Any:
        """The candidates with score <= ``upto`` (None: unbounded) and after ``after`` (score, id
        or score, None: past that score), in (score, id) order, the first ``limit`` of them."""

        def within(score: Any, id_: Any) -> list[ColumnElement[bool]]:
            out: list[ColumnElement[bool]] = [] if upto is None else self._upto(upto)
            if after is not None:
                at, last_id = after
                out.append(
                    score > at
                    if last_id is None
                    else or_(score > at, and_(score == at, id_ > last_id))
                )
            return out

        if self.ordered:
            # ``+ 0``: not an index term, so the databases range-scan the score index in order
            # instead of each environment's rows, then sorting them.
            in_order = (Entry.environment_id + 0).in_(env_ids) if len(env_ids) > 1 else by_env
            return (
                select(
                    self.score.label("score"),
                    Entry.id,
                    Entry.environment_id,
                    Entry.key,
                    unit_size(),
                    Entry.aot_size_bytes,
                    *([] if self.label is None else [self.label]),
                )
                .where(in_order, *self.where, *within(self.score, Entry.id))
                .order_by(self.score, Entry.id)
                .limit(limit)
            )
        # One scan over the covering ``ix_entries_env_plan``, which holds the key too (migration
        # 0008): the score computed once per row, no row looked up in the table (SQLite had looked
        # up each row kept, ~1 us a row, more than scoring it); with a LIMIT, a top-N sort.
        return self._one_scan([by_env, *self.where, *within(self.score, Entry.id)]).limit(limit)

    def _sample(
        self,
        columns: list[ColumnElement[Any] | InstrumentedAttribute[Any]],
        where: list[ColumnElement[bool]],
    ) -> Any:
        """The candidates whose id is a multiple of 64 (the same rows either way): looked up by id
        when ``sample_ids`` says ids are dense (SQLite), else found by a scan testing every candidate's
        id (PostgreSQL: its sequential scan measured cheaper than the lookups, 1.06 against 1.35 CPU s
        for a cost plan with per-environment limits at 1,000,000 rows)."""
        if self.sample_ids is None:
            return select(*columns).where(*where, Entry.id % _SAMPLE_EVERY == 0)
        first = select(literal(_SAMPLE_EVERY).label("i")).cte("ids", recursive=True)
        ids = first.union_all(
            select(first.c.i + _SAMPLE_EVERY).where(first.c.i + _SAMPLE_EVERY <= self.sample_ids)
        )
        return select(*columns).join_from(ids, Entry, Entry.id == ids.c.i).where(*where)

    def _bound(self, conn: Any, where: list[ColumnElement[bool]], need: int) -> Any:
        """A score at or under which, by the sample, ``need`` bytes (with margin) lie; None: no bound."""
        sample = conn.execute(self._sample([self.score, unit_size()], where).order_by(self.score))
        acc = rows = 0
        try:
            # The driver's cursor a batch at a time: SQLite stops walking the lru index at the bound.
            for part in iter(partial(sample.cursor.fetchmany, 256), []):
                for sc, unit in part:
                    acc += unit * _SAMPLE_EVERY
                    rows += 1
                    if acc >= need * _margin(rows):
                        return sc
        finally:
            sample.close()
        return None


def _env_bytes(index: Index, cid: int) -> dict[int, int]:
    q = (
        select(Entry.environment_id, func.sum(unit_size()))
        .join(EnvRow, EnvRow.id == Entry.environment_id)
        .where(EnvRow.cache_id == cid, EnvRow.deleted_at.is_(None))
        .group_by(Entry.environment_id)
    )
    with index.read_session() as s:
        return {int(env): int(b or 0) for env, b in s.execute(q)}
