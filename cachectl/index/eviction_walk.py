"""gc's walk over eviction candidates in (score, id) order, read only as far as a cut needs.

A 1-in-64 sample of the candidates gives each cut a score under which it should end, plus a
margin; the database returns only the rows up to it, sorted, and the walk reads on in order
should the sample fall short (cachectl/index/eviction_queries.py makes the cuts with it).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from functools import partial
from typing import Any

from sqlalchemy import and_, case, literal, or_, select
from sqlalchemy.orm import InstrumentedAttribute
from sqlalchemy.sql.elements import ColumnElement

from cachectl.index import Index, unit_size
from cachectl.index.lifecycle_queries import STREAM_ROWS
from cachectl.index.models import Entry

# gc's cuts estimate how far to read from a 1-in-SAMPLE_EVERY sample of the candidates, and
# read a margin more than the sample says the cut needs (``_margin``).
SAMPLE_EVERY = 64
_SAMPLE_MARGIN = 1.1
# The sample's estimate of the bytes under a score, from n sampled rows of sizes as varied as a
# cache's, is off by about 1.2/sqrt(n) of itself (one standard deviation). A cut whose sample falls
# short reads on (PostgreSQL: a scan of its environment again), where
# 10% fell short for some environments; every row of margin is sorted and sent. Of 1, 2, 3
# and 4 over sqrt(n) (2: about 1.7 deviations), 2 was best for the lru cut with
# per-environment limits and within the noise for the cost cut (4: no environment short, but more
# rows read; bench/lifecycle.py).
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


class Walk:
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
        combined sort was slower); its lru walk needs no bound."""
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
                    for part in iter(partial(result.cursor.fetchmany, STREAM_ROWS), []):
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
                acc[env] += unit * SAMPLE_EVERY
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
                select(*self._columns(), *([] if self.label is None else [self.label]))
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
        hashed every kept row (bench/lifecycle.py)."""
        return select(*self._columns()).where(*where).order_by(self.score, Entry.id)

    def _columns(self) -> list[Any]:
        """What a candidate row holds: its score, id, environment, key, size and executable size."""
        return [
            self.score.label("score"),
            Entry.id,
            Entry.environment_id,
            Entry.key,
            unit_size(),
            Entry.aot_size_bytes,
        ]

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
                                STREAM_ROWS,
                                max(64, (target - acc) * len(out) // acc * 21 // 20 + 32),
                            )
                            if acc
                            else STREAM_ROWS
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
        # up each row kept, which cost more than scoring it); with a LIMIT, a top-N sort.
        return self._one_scan([by_env, *self.where, *within(self.score, Entry.id)]).limit(limit)

    def _sample(
        self,
        columns: list[ColumnElement[Any] | InstrumentedAttribute[Any]],
        where: list[ColumnElement[bool]],
    ) -> Any:
        """The candidates whose id is a multiple of 64 (the same rows either way): looked up by id
        when ``sample_ids`` says ids are dense (SQLite), else found by a scan testing every candidate's
        id (PostgreSQL: its sequential scan is cheaper than the lookups for a cost plan with
        per-environment limits; bench/lifecycle.py)."""
        if self.sample_ids is None:
            return select(*columns).where(*where, Entry.id % SAMPLE_EVERY == 0)
        first = select(literal(SAMPLE_EVERY).label("i")).cte("ids", recursive=True)
        ids = first.union_all(
            select(first.c.i + SAMPLE_EVERY).where(first.c.i + SAMPLE_EVERY <= self.sample_ids)
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
                    acc += unit * SAMPLE_EVERY
                    rows += 1
                    if acc >= need * _margin(rows):
                        return sc
        finally:
            sample.close()
        return None


def sample_ids(dialect: str, top_id: int, rows: int) -> int | None:
    """The highest id when gc's sample is read by id (SQLite, ids dense: see ``_SAMPLE_BY_ID``),
    else None (a scan)."""
    return top_id if dialect == "sqlite" and top_id <= _SAMPLE_BY_ID * rows else None
