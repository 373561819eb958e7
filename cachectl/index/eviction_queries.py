"""gc's plans from the index: which entries a size limit evicts, by least recent use or by cost.

Each cut (per environment over its limit, then the whole cache) reads candidates in (score, id)
order only up to a bound a 1-in-64 sample gives, plus a margin, and reads on if the sample fell
short; Python keeps the running total of sizes to find the exact cut (cachectl/lifecycle/gc.py
turns the cuts into a plan).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import (
    Float,
    String,
    case,
    cast,
    func,
    or_,
    select,
    type_coerce,
)
from sqlalchemy.sql.elements import ColumnElement

from cachectl.index import Index, unit_size
from cachectl.index.eviction_walk import Walk, sample_ids

# A running warm whose heartbeat is older than this is presumed dead.
from cachectl.index.lifecycle_queries import (
    COST_HALF_LIFE_DAYS,
    DEFAULT_COMPILE_MS,
    Eviction,
    as_bound,
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
            func.julianday(as_bound(now)) - func.julianday(last), 0.0
        )
    else:
        age_days = func.greatest(func.extract("epoch", as_bound(now) - last) / 86400.0, 0.0)
    return _cost_per_kib() / (1.0 + age_days / COST_HALF_LIFE_DAYS)


def _cost_per_kib() -> ColumnElement[Any]:
    unit = unit_size()
    size_kib = case((unit < 1, 1.0), else_=cast(unit, Float) / 1024.0)
    return cast(func.coalesce(Entry.compile_time_ms, DEFAULT_COMPILE_MS), Float) / size_kib


def _under_bound(dialect: str, policy: str, now: datetime) -> Any:
    """PostgreSQL, cost: a cheap test every row whose score is at most a bound passes, put before
    the exact one: the score in double precision (the age by date_part, not numeric EXTRACT) within
    a billionth of the bound, where the two scores differ by ~1e-15 of their value (EXTRACT's
    exact numeric age rounded once, date_part's rounded twice); the double-precision test is the
    cheaper one (bench/lifecycle.py). Takes the bounds, one or one per environment; None: no test."""
    if dialect != "postgresql" or policy != "cost":
        return None
    age = func.greatest(func.date_part("epoch", as_bound(now) - last_used()) / 86400.0, 0.0)
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


class _Totals(NamedTuple):
    """The cache as a cut starts from it: its live environments and their rows and bytes."""

    dialect: str
    live: list[int]  # ids of the live environments, in order
    rows: int
    nbytes: int
    top_id: int  # the highest entry id of the table


def _totals(index: Index, cid: int, bytes_total: int | None, rows_total: int | None) -> _Totals:
    """The cache's totals; a scan only for the ones the caller did not pass."""
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
    return _Totals(dialect, live, rows_total, bytes_total, top_id)


def _walk(
    index: Index, totals: _Totals, policy: str, now: datetime, protect_warm_runs: Sequence[int]
) -> Walk:
    """The candidates of the policy's score, protected warm runs' entries left out."""
    dialect = totals.dialect
    score = _score(dialect, policy, now)
    if policy == "lru" and dialect == "sqlite":
        # Return the raw text: parsing 100k datetimes costs more than the query.
        score = type_coerce(score, String)
    evictable: list[ColumnElement[bool]] = []
    if protect_warm_runs:
        evictable.append(
            or_(Entry.warm_run_id.is_(None), Entry.warm_run_id.not_in(list(protect_warm_runs)))
        )
    most_rows = dialect == "postgresql" and 2 * totals.rows >= totals.top_id
    return Walk(
        index,
        score,
        evictable,
        ordered=policy == "lru",
        label=_last_used_minute(dialect, score) if policy == "lru" else None,
        sample_ids=sample_ids(dialect, totals.top_id, totals.rows),
        under=_under_bound(dialect, policy, now),
        most_rows=frozenset(totals.live) if most_rows else None,
    )


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
    as many rows as it evicts (``Walk``), not every row of the cache.
    Protected entries count toward the totals but are never candidates.
    ``bytes_total`` and ``rows_total`` (the cache's indexed bytes and entries)
    and ``env_bytes`` (per environment) save a scan each when the caller
    already has them.
    """
    now = now or utcnow()
    cid = cache_id(index, cache)
    totals = _totals(index, cid, bytes_total, rows_total)
    global_excess = None if max_bytes is None else totals.nbytes - max_bytes
    if (global_excess is None or global_excess <= 0) and env_max_bytes is None:
        return Cuts([], set(), totals.nbytes, policy == "lru")

    walk = _walk(index, totals, policy, now, protect_warm_runs)
    excluded = set(exclude_env_ids)
    candidates = [e for e in totals.live if e not in excluded]
    by_env: list[tuple[Any, ...]] = []
    cuts = 0  # environments cut one by one: their rows need one order
    if env_max_bytes is not None:
        if env_bytes is None:
            env_bytes = _env_bytes(index, cid)
        over = {
            env: env_bytes.get(env, 0) - env_max_bytes
            for env in candidates
            if env_bytes.get(env, 0) > env_max_bytes
        }
        by_env, cuts = walk.take_each(over), len(over)
    env_taken = {row[1] for row in by_env}
    env_freed = sum(row[4] for row in by_env)
    by_cache: list[tuple[Any, ...]] = []
    if global_excess is not None and global_excess - env_freed > 0:
        by_cache = walk.take(
            candidates, global_excess - env_freed, skip=env_taken, skip_bytes=env_freed
        )
    rows = by_env + by_cache
    if by_env and (by_cache or cuts > 1):
        # One (score, id) order, as each cut was walked: the rows' own order, ids being unique.
        rows.sort()
    return Cuts(rows, env_taken, totals.nbytes, policy == "lru")


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


def _env_bytes(index: Index, cid: int) -> dict[int, int]:
    q = (
        select(Entry.environment_id, func.sum(unit_size()))
        .join(EnvRow, EnvRow.id == Entry.environment_id)
        .where(EnvRow.cache_id == cid, EnvRow.deleted_at.is_(None))
        .group_by(Entry.environment_id)
    )
    with index.read_session() as s:
        return {int(env): int(b or 0) for env, b in s.execute(q)}
