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
from datetime import datetime
from typing import Any, NamedTuple, cast

from sqlalchemy import CursorResult, func, literal, select
from sqlalchemy.sql.elements import ColumnElement

from cachectl.index import Index, reads
from cachectl.index.models import Entry, UTCDateTime, WarmRun
from cachectl.index.plan_reads import (  # noqa: F401 - the planning reads, re-exported
    WARM_HEARTBEAT_WINDOW,
    EntryRef,
    EnvSummary,
    WarmInProgress,
    environments,
    environments_with_recent_hits,
    selected_counts,
    selected_entries,
    warms_in_progress,
)

# Compile time assumed for entries that recorded none: JAX writes nothing that
# compiled faster than its default threshold of 1 s.
DEFAULT_COMPILE_MS = 1000
# Cost policy: an entry's value halves after this many days without access.
COST_HALF_LIFE_DAYS = 7.0
STREAM_ROWS = 5000
# Warm runs that ran to the end (cachectl/index/warm_runs.py): "interrupted"
# runs are partial, so they do not displace the last complete run.
COMPLETED_WARM_STATUSES = ("succeeded", "failed")


class Eviction(NamedTuple):
    """One entry gc evicts, with the score that ordered it and why it goes (a tuple: 100k are cheap)."""

    environment_id: int
    key: str
    size: int  # the JAX entry's bytes
    score: float | str
    reason: str
    aot_size: int | None = None  # its stored executable's, evicted with it


def cache_id(index: Index, cache: str) -> int:
    return reads.cache_id(index.reader, cache)


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


def as_bound(value: datetime) -> ColumnElement[datetime]:
    # A bound value compared with a COALESCE has no column type to borrow:
    # give it ours, so SQLite gets the same naive-UTC text the columns hold.
    return literal(value, type_=UTCDateTime())


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
