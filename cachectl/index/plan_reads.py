"""The reads prune plans from, in portable SQL (cachectl.index.reads): either driver runs them.

Planning never scans storage: it asks the index. Every query is scoped to one cache's
environments, filters on indexed columns (``entries(environment_id, ...)``) and aggregates in
the database. The entry filters are spelled as the indexes are (``created_at`` with
``ix_entries_env_created``; ``COALESCE(last_access_at, created_at)`` with
``ix_entries_env_last_used``), so SQLite range-scans them. gc's and verify's queries, which only
the SQL index runs, stay in cachectl/index/lifecycle_queries.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from operator import itemgetter
from typing import Any, NamedTuple

from cachectl.core.cache_info import utcnow
from cachectl.index.reads import UNIT_SIZE, HasReader, cache_id, from_json, when

# A running warm whose heartbeat is older than this is presumed dead.
WARM_HEARTBEAT_WINDOW = timedelta(minutes=10)


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
    """The little planning needs to know about one entry row (a driver's row has this shape)."""

    environment_id: int
    key: str
    size: int  # the JAX entry's bytes
    aot_size: int | None = None  # its stored executable's, if it has one


@dataclass(frozen=True, slots=True)
class WarmInProgress:
    environment_id: int
    run_id: int
    host: str
    user: str
    heartbeat_at: datetime | None


def environments(index: HasReader, cache: str) -> list[EnvSummary]:
    """Live (not deleted) environments of ``cache`` with entry counts and bytes.

    Two statements: the environments, then the totals grouped over
    ``environment_id IN (...)``, which SQLite reads off the covering index in
    environment order (a join would make it sort every row for the GROUP BY).
    """
    reader = index.reader
    cid = cache_id(reader, cache)
    envs = reader.rows(
        "SELECT id, digest, namespace, jax_version, backend, device_kind, device_count, xla_flags "
        "FROM environments WHERE cache_id = :cid AND deleted_at IS NULL ORDER BY namespace",
        {"cid": cid},
    )
    totals: dict[int, tuple[int, int]] = {}
    if envs:
        grouped = reader.rows(
            f"SELECT environment_id, COUNT(*), COALESCE(SUM({UNIT_SIZE}), 0) FROM entries "
            "WHERE environment_id IN :ids GROUP BY environment_id",
            {"ids": [int(e[0]) for e in envs]},
        )
        totals = {int(e): (int(n), int(b)) for e, n, b in grouped}
    return [
        EnvSummary(
            int(i),
            d,
            ns,
            jv,
            be,
            dk,
            int(dc),
            tuple(from_json(fl) or ()),
            *totals.get(int(i), (0, 0)),
        )
        for i, d, ns, jv, be, dk, dc, fl in envs
    ]


def warms_in_progress(
    index: HasReader,
    env_ids: Sequence[int],
    *,
    now: datetime | None = None,
    window: timedelta = WARM_HEARTBEAT_WINDOW,
) -> dict[int, WarmInProgress]:
    """Environments with a warm running right now (a heartbeat within ``window``)."""
    if not env_ids:
        return {}
    since = (now or utcnow()) - window
    rows = index.reader.rows(
        'SELECT environment_id, id, host, "user", COALESCE(heartbeat_at, started_at) '
        "FROM warm_runs WHERE environment_id IN :ids AND status = 'running' "
        "AND COALESCE(heartbeat_at, started_at) >= :since ORDER BY id",
        {"ids": [int(i) for i in env_ids], "since": since},
    )
    return {
        int(env_id): WarmInProgress(int(env_id), int(run_id), host, user, when(beat))
        for env_id, run_id, host, user, beat in rows
    }


def _entry_filters(
    created_before: datetime | None, unused_before: datetime | None, function: str | None
) -> tuple[str, dict[str, Any]]:
    where, params = "", dict[str, Any]()
    if created_before is not None:
        where += " AND created_at < :created_before"
        params["created_before"] = created_before
    if unused_before is not None:
        where += " AND COALESCE(last_access_at, created_at) < :unused_before"
        params["unused_before"] = unused_before
    if function is not None:
        where += " AND function = :function"
        params["function"] = function
    return where, params


def selected_counts(
    index: HasReader,
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
    where, params = _entry_filters(created_before, unused_before, function)
    rows = index.reader.rows(
        f"SELECT environment_id, COUNT(*) FROM entries WHERE environment_id IN :ids{where} "
        "GROUP BY environment_id",
        {"ids": [int(i) for i in env_ids], **params},
    )
    return {int(e): int(n) for e, n in rows}


def selected_entries(
    index: HasReader,
    env_ids: Sequence[int],
    *,
    created_before: datetime | None = None,
    unused_before: datetime | None = None,
    function: str | None = None,
) -> dict[int, list[EntryRef]]:
    """environment id -> its entry rows matching the selectors, each list sorted by key.

    Rows as the driver returns them, grouped and sorted here: no ORDER BY on purpose, since
    ordering by key would make SQLite walk the (environment, key) index and visit every row,
    where the filter alone range-scans (environment, created_at).
    """
    out: dict[int, list[EntryRef]] = {}
    if not env_ids:
        return out
    where, params = _entry_filters(created_before, unused_before, function)
    rows = index.reader.rows(
        "SELECT environment_id, key, size_bytes, aot_size_bytes FROM entries "
        f"WHERE environment_id IN :ids{where}",
        {"ids": [int(i) for i in env_ids], **params},
    )
    for row in rows:
        out.setdefault(row[0], []).append(row)
    for refs in out.values():
        refs.sort(key=_by_key)
    return out


_by_key = itemgetter(1)


def environments_with_recent_hits(
    index: HasReader, env_ids: Sequence[int], since: datetime
) -> set[int]:
    """The environments among ``env_ids`` that served a hit since ``since`` (telemetry or entry access)."""
    if not env_ids:
        return set()
    params = {"ids": [int(i) for i in env_ids], "since": since}
    found = {
        int(e)
        for (e,) in index.reader.rows(
            "SELECT DISTINCT environment_id FROM telemetry "
            "WHERE environment_id IN :ids AND hits > 0 AND at >= :since",
            params,
        )
    }
    found.update(
        int(e)
        for (e,) in index.reader.rows(
            "SELECT DISTINCT environment_id FROM entries "
            "WHERE environment_id IN :ids AND last_access_at >= :since",
            params,
        )
    )
    return found
