"""The index queries prune, gc and verify plan from.

Planning never scans storage: it asks the index. Every query here is scoped
to one cache, filters on indexed columns (``entries(environment_id, ...)``),
aggregates in the database and returns Core rows, so a plan over 1,000,000
entry rows costs index scans plus about one Python object per row it deletes.
gc's cuts read candidates in score order only up to a bound a 1-in-64 sample
gives (``index/eviction_queries.py``): the database filters and sorts, and returns about the rows
to evict (10% over), whose running sum then picks the exact cut.

An entry and its stored executable (``<key>-aot``, on the same row) are one
unit: every size here is ``size_bytes + coalesce(aot_size_bytes, 0)``, and
each planned entry carries the executable's bytes so execution deletes both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from operator import itemgetter
from typing import Any, NamedTuple, cast

from sqlalchemy import (
    CursorResult,
    func,
    literal,
    select,
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
from cachectl.index.warm_runs import HEARTBEAT_WINDOW

# A running warm whose heartbeat is older than this is presumed dead.
WARM_HEARTBEAT_WINDOW = HEARTBEAT_WINDOW
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
        select(
            EnvRow.id,
            EnvRow.digest,
            EnvRow.namespace,
            EnvRow.jax_version,
            EnvRow.backend,
            EnvRow.device_kind,
            EnvRow.device_count,
            EnvRow.xla_flags,
        )
        .where(EnvRow.cache_id == cid, EnvRow.deleted_at.is_(None))
        .order_by(EnvRow.namespace)
    )
    with index.read_session() as s:
        conn = s.connection()
        envs = conn.execute(q).all()
        totals: dict[int, tuple[int, int]] = {}
        if envs:
            grouped = (
                select(Entry.environment_id, func.count(), func.coalesce(func.sum(unit_size()), 0))
                .where(Entry.environment_id.in_([e[0] for e in envs]))
                .group_by(Entry.environment_id)
            )
            totals = {int(e): (int(n), int(b)) for e, n, b in conn.execute(grouped)}
    return [
        EnvSummary(int(i), d, ns, jv, be, dk, int(dc), tuple(fl or ()), *totals.get(int(i), (0, 0)))
        for i, d, ns, jv, be, dk, dc, fl in envs
    ]


def warms_in_progress(
    index: Index,
    env_ids: Sequence[int],
    *,
    now: datetime | None = None,
    window: timedelta = WARM_HEARTBEAT_WINDOW,
) -> dict[int, WarmInProgress]:
    """Environments with a warm running right now (a heartbeat within ``window``)."""
    if not env_ids:
        return {}
    since = (now or utcnow()) - window
    q = (
        select(
            WarmRun.environment_id,
            WarmRun.id,
            WarmRun.host,
            WarmRun.user,
            func.coalesce(WarmRun.heartbeat_at, WarmRun.started_at),
        )
        .where(
            WarmRun.environment_id.in_(list(env_ids)),
            WarmRun.status == "running",
            func.coalesce(WarmRun.heartbeat_at, WarmRun.started_at) >= since,
        )
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
            func.row_number()
            .over(
                partition_by=WarmRun.environment_id,
                order_by=(
                    func.coalesce(WarmRun.finished_at, WarmRun.started_at).desc(),
                    WarmRun.id.desc(),
                ),
            )
            .label("rn"),
        )
        .where(
            WarmRun.environment_id.in_(list(env_ids)), WarmRun.status.in_(COMPLETED_WARM_STATUSES)
        )
        .subquery()
    )
    with index.read_session() as s:
        rows = s.execute(select(ranked.c.environment_id, ranked.c.id).where(ranked.c.rn == 1))
        return {int(env): int(run) for env, run in rows}


def _entry_filters(
    created_before: datetime | None, unused_before: datetime | None, function: str | None
) -> list[ColumnElement[bool]]:
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


def selected_counts(
    index: Index,
    env_ids: Sequence[int],
    *,
    created_before: datetime | None = None,
    unused_before: datetime | None = None,
    function: str | None = None,
) -> dict[int, int]:
    """environment id -> entries matching the entry selectors, counted in SQL.

    A count, not bytes: the selectors' indexes (``ix_entries_env_created``,
    ``ix_entries_env_last_used``) answer it without reading the table.
    """
    if not env_ids:
        return {}
    q = (
        select(Entry.environment_id, func.count())
        .where(
            Entry.environment_id.in_(list(env_ids)),
            *_entry_filters(created_before, unused_before, function),
        )
        .group_by(Entry.environment_id)
    )
    with index.read_session() as s:
        return {int(e): int(n) for e, n in s.connection().execute(q)}


def selected_entries(
    index: Index,
    env_ids: Sequence[int],
    *,
    created_before: datetime | None = None,
    unused_before: datetime | None = None,
    function: str | None = None,
) -> dict[int, list[EntryRef]]:
    """environment id -> its entry rows matching the selectors, each list sorted by key.

    Core rows, grouped and sorted here: no ORDER BY on purpose, since ordering
    by key would make SQLite walk the (environment, key) index and visit every
    row, where the filter alone range-scans (environment, created_at).
    """
    out: dict[int, list[EntryRef]] = {}
    if not env_ids:
        return out
    q = select(Entry.environment_id, Entry.key, Entry.size_bytes, Entry.aot_size_bytes).where(
        Entry.environment_id.in_(list(env_ids)),
        *_entry_filters(created_before, unused_before, function),
    )
    with index.read_session() as s:
        result = s.connection().execute(q, execution_options={"yield_per": _STREAM_ROWS})
        for part in result.partitions():
            for row in part:
                out.setdefault(row[0], []).append(row)
    for rows in out.values():
        rows.sort(key=_by_key)
    return out


_by_key = itemgetter(1)


def entry_digests(index: Index, env_id: int) -> dict[str, tuple[int, str]]:
    """key -> (size, sha256) of one environment: what verify checks files against (a read)."""
    q = select(Entry.key, Entry.size_bytes, Entry.sha256).where(Entry.environment_id == env_id)
    with index.read_session() as s:
        # The driver's rows in one fetch (strings and integers need no result processing): iterating
        # the Result cost a fetch and a Row per entry, a tenth of verifying an entry.
        result = s.connection().execute(q)
        rows = result.cursor.fetchall()
        result.close()
        return {k: (int(size), sha) for k, size, sha in rows}


def service_written_entries(index: Index, env_id: int) -> list[tuple[str, datetime]]:
    """(key, created) of entries a service wrote after the environment's newest finished warm:
    origin 'observed' (sync found them in storage), created after that warm ended."""
    last = (
        select(func.max(WarmRun.finished_at))
        .where(WarmRun.environment_id == env_id, WarmRun.finished_at.is_not(None))
        .scalar_subquery()
    )
    q = (
        select(Entry.key, Entry.created_at)
        .where(Entry.environment_id == env_id, Entry.origin == "observed", Entry.created_at > last)
        .order_by(Entry.key)
    )
    with index.read_session() as s:
        return [(k, at) for k, at in s.execute(q)]


def executable_digests(index: Index, env_id: int) -> dict[str, tuple[int, str, str]]:
    """key -> (aot size, aot sha256, entry sha256) of one environment's indexed executables (a read)."""
    q = select(Entry.key, Entry.aot_size_bytes, Entry.aot_sha256, Entry.sha256).where(
        Entry.environment_id == env_id, Entry.aot_sha256.is_not(None)
    )
    with index.read_session() as s:
        return {
            k: (int(size or 0), sha, entry_sha)
            for k, size, sha, entry_sha in s.connection().execute(q)
        }


def delete_entry_rows(index: Index, by_env: dict[int, list[str]]) -> int:
    """Drop index rows of entries already gone from storage, in one transaction."""
    removed = 0
    with index.session() as s:
        for env_id, keys in by_env.items():
            for start in range(0, len(keys), 500):
                chunk = keys[start : start + 500]
                result = s.execute(
                    Entry.__table__.delete().where(
                        Entry.environment_id == env_id, Entry.key.in_(chunk)
                    )
                )
                removed += cast("CursorResult[Any]", result).rowcount or 0
    return removed


def environments_with_recent_hits(
    index: Index, env_ids: Sequence[int], since: datetime
) -> set[int]:
    """The environments among ``env_ids`` that served a hit since ``since`` (telemetry or entry access)."""
    if not env_ids:
        return set()
    ids = list(env_ids)
    with index.read_session() as s:
        by_telemetry = s.scalars(
            select(TelemetryRecord.environment_id)
            .distinct()
            .where(
                TelemetryRecord.environment_id.in_(ids),
                TelemetryRecord.hits > 0,
                TelemetryRecord.at >= since,
            )
        )
        found = {int(e) for e in by_telemetry}
        by_access = s.scalars(
            select(Entry.environment_id)
            .distinct()
            .where(Entry.environment_id.in_(ids), Entry.last_access_at >= since)
        )
        found.update(int(e) for e in by_access)
    return found
