"""Index queries the server needs beyond the core Index: pages, jobs, telemetry series.

Kept out of index/__init__.py so the core layer stays small; every function
takes an Index and uses its session(), returning typed records.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, func, literal_column, select, update

from cachectl.core.errors import EntryConflict, NotFound, QuotaExceeded
from cachectl.core.units import format_size
from cachectl.index import CacheInfo, EntryInfo, EnvironmentInfo, NewEntry
from cachectl.index.models import Cache, Entry, Job, TelemetryRecord, utcnow
from cachectl.index.models import Environment as EnvRow
from cachectl.index.row_records import cache_info, entry_info, env_info
from cachectl.index.sql import Index, unit_size
from cachectl.index.telemetry_queries import counter_sum

QUEUED = "queued"
RUNNING = "running"
SUCCEEDED = "succeeded"
FAILED = "failed"
ACTIVE_STATUSES = (QUEUED, RUNNING)


# -- the entry hot path ----------------------------------------------------------


@dataclass(frozen=True)
class Located:
    """A cache, one of its environments (without totals) and, if asked, one entry's recorded row."""

    cache: CacheInfo
    environment: EnvironmentInfo
    entry: EntryInfo | None


def locate(index: Index, cache: str, prefix: str, key: str | None = None) -> Located:
    """Cache + environment (+ entry) in one query: what every entry GET/HEAD/PUT needs.

    Index.find_environment computes every environment's totals to pick one;
    here only a unique digest-prefix match is looked up. Anything else (unknown
    cache, no or several matches, a bad prefix) is left to the Index calls, so
    errors read exactly as in direct mode.
    """
    prefix = prefix.strip().lower()
    if prefix and all(c in "0123456789abcdef" for c in prefix):
        columns: list[Any] = [Cache, EnvRow]
        q = (
            select(*columns)
            .join(EnvRow, EnvRow.cache_id == Cache.id)
            .where(
                Cache.name == cache, EnvRow.digest.startswith(prefix), EnvRow.deleted_at.is_(None)
            )
            .limit(2)
        )
        with index.read_session() as s:
            rows = s.execute(q).all()
            if len(rows) == 1:
                cache_row, env_row = rows[0]
                entry = None
                if key is not None:
                    found = s.scalar(
                        select(Entry).where(Entry.environment_id == env_row.id, Entry.key == key)
                    )
                    entry = entry_info(found) if found is not None else None
                return Located(cache_info(cache_row), env_info(env_row, cache), entry)
    info = index.get_cache(cache)  # raises the standard errors
    env = index.find_environment(cache, prefix)
    return Located(info, env, index.get_entry(env.id, key) if key is not None else None)


def _digest_statement(size: Any, sha: Any) -> Any:
    t = Entry.__table__
    return select(size, sha).where(
        t.c.environment_id == bindparam("env"), t.c.key == bindparam("key")
    )


# Built once, run on a Core connection: every GET and HEAD of an entry runs one (an ORM session and a
# statement built per call cost about three times as much CPU).
_ENTRY_DIGEST = _digest_statement(Entry.__table__.c.size_bytes, Entry.__table__.c.sha256)
_EXECUTABLE_DIGEST = _digest_statement(
    Entry.__table__.c.aot_size_bytes, Entry.__table__.c.aot_sha256
)


def recorded_digest(
    index: Index, env_id: int, key: str, *, executable: bool = False
) -> tuple[int, str] | None:
    """(size, sha256) the index recorded for an entry, or for its stored executable: all a
    download's headers need, two columns."""
    with index.connection(write=False) as conn:
        row = conn.execute(
            _EXECUTABLE_DIGEST if executable else _ENTRY_DIGEST, {"env": env_id, "key": key}
        ).first()
    return None if row is None or row[0] is None else (int(row[0]), str(row[1]))


def environment_cache(index: Index, env_id: int) -> str | None:
    """The name of the cache an environment (by id) belongs to."""
    with index.read_session() as s:
        return s.scalar(
            select(Cache.name).join(EnvRow, EnvRow.cache_id == Cache.id).where(EnvRow.id == env_id)
        )


# -- entries ------------------------------------------------------------------


@dataclass(frozen=True)
class EntryPage:
    items: list[EntryInfo]
    total: int
    limit: int
    offset: int

    @property
    def next_offset(self) -> int | None:
        following = self.offset + len(self.items)
        return following if following < self.total else None

    __json_extra__ = ("next_offset",)


def entries_page(
    index: Index,
    env_id: int,
    *,
    limit: int = 100,
    offset: int = 0,
    module: str | None = None,
    function: str | None = None,
    origin: str | None = None,
    key_prefix: str | None = None,
    created_after: datetime | None = None,
    unused_since: datetime | None = None,
    order: str = "key",
) -> EntryPage:
    """One page of an environment's entries, filtered; ordered by key (stable) or recency."""
    conditions: list[Any] = [Entry.environment_id == env_id]
    if module:
        conditions.append(Entry.module == module)
    if function:
        conditions.append(Entry.function == function)
    if origin:
        conditions.append(Entry.origin == origin)
    if key_prefix:
        conditions.append(Entry.key.startswith(key_prefix, autoescape=True))
    if created_after:
        conditions.append(Entry.created_at >= created_after)
    if unused_since:
        conditions.append(func.coalesce(Entry.last_access_at, Entry.created_at) < unused_since)
    ordering = {
        "key": (Entry.key,),
        "-created": (Entry.created_at.desc(), Entry.key),
        "-size": (Entry.size_bytes.desc(), Entry.key),
        "-hits": (Entry.hit_count.desc(), Entry.key),
    }[order]
    with index.read_session() as s:
        total = s.scalar(select(func.count(Entry.id)).where(*conditions)) or 0
        rows = s.scalars(
            select(Entry).where(*conditions).order_by(*ordering).limit(limit).offset(offset)
        )
        return EntryPage([entry_info(r) for r in rows], int(total), limit, offset)


def cache_usage(index: Index, cache: str) -> tuple[int, int]:
    """(entries, bytes) of a cache's live environments, in one query."""
    with index.read_session() as s:
        q = (
            select(func.count(Entry.id), func.coalesce(func.sum(unit_size()), 0))
            .join(EnvRow, EnvRow.id == Entry.environment_id)
            .join(Cache, Cache.id == EnvRow.cache_id)
            .where(Cache.name == cache, EnvRow.deleted_at.is_(None))
        )
        n, b = s.execute(q).one()
        return int(n or 0), int(b or 0)


def environment_usage(index: Index, env_id: int) -> tuple[int, int]:
    with index.read_session() as s:
        q = select(func.count(Entry.id), func.coalesce(func.sum(unit_size()), 0)).where(
            Entry.environment_id == env_id
        )
        n, b = s.execute(q).one()
        return int(n or 0), int(b or 0)


def _fmt(n: int) -> str:
    return format_size(n)


@dataclass(frozen=True)
class Reservation:
    """What reserve_entry() did: ``inserted`` a new row, ``replaced`` one with other bytes, or
    found the same bytes already recorded (``unchanged``); ``previous`` is the row before."""

    outcome: str
    previous: EntryInfo | None


def reserve_entry(
    index: Index, cache: str, env_id: int, entry: NewEntry, *, replace: bool = False
) -> Reservation:
    """Record ``entry`` before its bytes are written, so quota is taken atomically.

    One transaction locks the cache's row (SELECT ... FOR UPDATE on PostgreSQL; SQLite write
    transactions are exclusive already), so concurrent uploads reserve one after another: each
    sees the bytes the others reserved, and the cache and environment limits hold. An existing
    row with other bytes is EntryConflict unless ``replace``; a replacement is a new entry
    (origin, function, bucket, hits and times reset). A failed write gives the space back
    with release_entry().
    """
    with index.session() as s:
        cache_row = s.scalar(select(Cache).where(Cache.name == cache).with_for_update())
        if cache_row is None:
            raise NotFound(f"no cache named {cache!r}")
        row = s.scalar(select(Entry).where(Entry.environment_id == env_id, Entry.key == entry.key))
        previous = entry_info(row) if row is not None else None
        if row is not None and (row.sha256, row.size_bytes) == (entry.sha256, entry.size):
            return Reservation("unchanged", previous)
        if row is not None and not replace:
            raise EntryConflict(
                f"entry {entry.key} is already stored with other bytes (sha256 {row.sha256[:16]}): "
                "entries are immutable; an admin may replace it explicitly"
            )
        # A replacement drops the old entry and its stored executable (one unit).
        replaced = row.size_bytes + (row.aot_size_bytes or 0) if row is not None else 0
        _check_quota(s, cache, cache_row, env_id, replaced, entry.size)
        values = {
            "module": entry.module,
            "size_bytes": entry.size,
            "sha256": entry.sha256,
            "origin": entry.origin,
            "compile_time_ms": entry.compile_time_ms,
            "function": entry.function,
            "bucket": entry.bucket,
            "warm_run_id": entry.warm_run_id,
            "created_at": entry.created_at or utcnow(),
            "last_access_at": None,
            "hit_count": 0,
        }
        if row is None:
            s.execute(
                Entry.__table__.insert(), [{"environment_id": env_id, "key": entry.key, **values}]
            )
            return Reservation("inserted", None)
        s.execute(update(Entry).where(Entry.id == row.id).values(**values))
        return Reservation("replaced", previous)


def _check_quota(s: Any, cache: str, cache_row: Cache, env_id: int, freed: int, added: int) -> None:
    """QuotaExceeded when ``added`` bytes (after ``freed``) would pass the cache's or the
    environment's limit. Entries count with their stored executables (unit_size)."""
    if cache_row.max_size_bytes is not None:
        used = int(
            s.scalar(
                select(func.coalesce(func.sum(unit_size()), 0))
                .join(EnvRow, EnvRow.id == Entry.environment_id)
                .where(EnvRow.cache_id == cache_row.id, EnvRow.deleted_at.is_(None))
            )
            or 0
        )
        if used - freed + added > cache_row.max_size_bytes:
            raise QuotaExceeded(
                f"cache {cache!r} is at {_fmt(used)} of its {_fmt(cache_row.max_size_bytes)} quota; "
                f"{_fmt(added)} more does not fit: run gc, or raise max_size"
            )
    if cache_row.env_max_size_bytes is not None:
        used = int(
            s.scalar(
                select(func.coalesce(func.sum(unit_size()), 0)).where(
                    Entry.environment_id == env_id
                )
            )
            or 0
        )
        if used - freed + added > cache_row.env_max_size_bytes:
            digest = s.scalar(select(EnvRow.digest).where(EnvRow.id == env_id)) or ""
            raise QuotaExceeded(
                f"environment {digest[:16]} is at {_fmt(used)} of its "
                f"{_fmt(cache_row.env_max_size_bytes)} quota: run gc, or raise env_max_size"
            )


def check_quota(index: Index, cache: str, env_id: int, added: int) -> None:
    """QuotaExceeded when ``added`` more bytes do not fit the cache's or the environment's limit:
    a batch's check before it writes (push, bundle install), which index only after writing."""
    with index.read_session() as s:
        cache_row = s.scalar(select(Cache).where(Cache.name == cache))
        if cache_row is None:
            raise NotFound(f"no cache named {cache!r}")
        _check_quota(s, cache, cache_row, env_id, 0, added)


def reserve_executable(
    index: Index, cache: str, env_id: int, key: str, size: int, sha256: str
) -> tuple[int, str] | None:
    """Record an entry's stored executable before its bytes are written (quota taken atomically,
    as reserve_entry does); returns what it replaces, for release_executable()."""
    with index.session() as s:
        cache_row = s.scalar(select(Cache).where(Cache.name == cache).with_for_update())
        if cache_row is None:
            raise NotFound(f"no cache named {cache!r}")
        row = s.scalar(select(Entry).where(Entry.environment_id == env_id, Entry.key == key))
        if row is None:
            raise NotFound(f"no entry {key}: upload the entry first, then its executable")
        previous = (row.aot_size_bytes, row.aot_sha256) if row.aot_sha256 is not None else None
        _check_quota(s, cache, cache_row, env_id, row.aot_size_bytes or 0, size)
        s.execute(
            update(Entry).where(Entry.id == row.id).values(aot_size_bytes=size, aot_sha256=sha256)
        )
        return previous  # type: ignore[return-value]


def release_executable(
    index: Index, env_id: int, key: str, previous: tuple[int, str] | None
) -> None:
    """Undo reserve_executable() after the bytes could not be written."""
    size, sha = previous if previous is not None else (None, None)
    with index.session() as s:
        s.execute(
            update(Entry)
            .where(Entry.environment_id == env_id, Entry.key == key)
            .values(aot_size_bytes=size, aot_sha256=sha)
        )


def release_entry(index: Index, env_id: int, key: str, reservation: Reservation) -> None:
    """Undo reserve_entry() after the bytes could not be written: the row as it was before."""
    prev = reservation.previous
    with index.session() as s:
        if reservation.outcome == "inserted":
            s.execute(
                Entry.__table__.delete().where(Entry.environment_id == env_id, Entry.key == key)
            )
        elif reservation.outcome == "replaced" and prev is not None:
            s.execute(
                update(Entry)
                .where(Entry.environment_id == env_id, Entry.key == key)
                .values(
                    module=prev.module,
                    size_bytes=prev.size,
                    sha256=prev.sha256,
                    origin=prev.origin,
                    compile_time_ms=prev.compile_time_ms,
                    function=prev.function,
                    bucket=prev.bucket,
                    created_at=prev.created_at,
                    last_access_at=prev.last_access_at,
                    hit_count=prev.hit_count,
                )
            )


# -- jobs -----------------------------------------------------------------------


@dataclass(frozen=True)
class JobInfo:
    id: str
    cache: str
    kind: str
    status: str
    params: dict[str, Any]
    result: dict[str, Any] | None
    error: str | None
    created_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None


def _job(row: Job) -> JobInfo:
    return JobInfo(
        row.id,
        row.cache_name,
        row.kind,
        row.status,
        dict(row.params or {}),
        dict(row.result) if row.result is not None else None,
        row.error,
        row.created_at,
        row.started_at,
        row.finished_at,
    )


def create_job(index: Index, cache: str, kind: str, params: dict[str, Any]) -> JobInfo:
    with index.session() as s:
        row = Job(id=str(uuid.uuid4()), cache_name=cache, kind=kind, status=QUEUED, params=params)
        s.add(row)
        s.flush()
        return _job(row)


def get_job(index: Index, job_id: str) -> JobInfo:
    with index.read_session() as s:
        row = s.get(Job, job_id)
        if row is None:
            raise NotFound(f"no job {job_id!r}")
        return _job(row)


def list_jobs(
    index: Index, *, cache: str | None = None, caches: Sequence[str] | None = None, limit: int = 50
) -> list[JobInfo]:
    with index.read_session() as s:
        q = select(Job).order_by(Job.created_at.desc()).limit(limit)
        if cache is not None:
            q = q.where(Job.cache_name == cache)
        if caches is not None:
            q = q.where(Job.cache_name.in_(list(caches)))
        return [_job(r) for r in s.scalars(q)]


def active_jobs(index: Index, cache: str) -> list[JobInfo]:
    with index.read_session() as s:
        q = select(Job).where(Job.cache_name == cache, Job.status.in_(ACTIVE_STATUSES))
        return [_job(r) for r in s.scalars(q)]


def set_job_status(
    index: Index,
    job_id: str,
    status: str,
    *,
    result: dict[str, Any] | None = None,
    error: str | None = None,
) -> None:
    values: dict[str, Any] = {"status": status}
    if status == RUNNING:
        values["started_at"] = utcnow()
    if status in (SUCCEEDED, FAILED):
        values["finished_at"] = utcnow()
        values["result"] = result
        values["error"] = error
    with index.session() as s:
        s.execute(update(Job).where(Job.id == job_id).values(**values))


def last_scheduled_job(index: Index, cache: str, schedule: str) -> JobInfo | None:
    """The newest job the scheduler started for ``schedule`` (params.scheduled): what says a run is not due."""
    with index.read_session() as s:
        q = select(Job).where(Job.cache_name == cache).order_by(Job.created_at.desc()).limit(200)
        for row in s.scalars(q):
            if (row.params or {}).get("scheduled") == schedule:
                return _job(row)
        return None


# -- telemetry ------------------------------------------------------------------


@dataclass(frozen=True)
class TelemetryPoint:
    at: datetime
    requests: int
    hits: int
    misses: int


def _bucket_expr(dialect: str, column: Any, hours: bool) -> Any:
    if dialect == "postgresql":
        return func.date_trunc("hour" if hours else "day", column)
    fmt = "%Y-%m-%d %H:00:00" if hours else "%Y-%m-%d 00:00:00"
    return func.strftime(literal_column(f"'{fmt}'"), column)


def _as_datetime(value: Any) -> datetime:
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    return datetime.fromisoformat(str(value)).replace(tzinfo=UTC)


def telemetry_series(
    index: Index, cache: str, *, since: timedelta = timedelta(days=7), hourly: bool = True
) -> list[TelemetryPoint]:
    """Requests, hits and misses per hour (or day) for a cache, oldest first."""
    bucket = _bucket_expr(index.dialect, TelemetryRecord.at, hourly).label("bucket")
    with index.read_session() as s:
        q = (
            select(
                bucket,
                counter_sum(index.dialect, TelemetryRecord.requests),
                counter_sum(index.dialect, TelemetryRecord.hits),
                counter_sum(index.dialect, TelemetryRecord.misses),
            )
            .join(EnvRow, EnvRow.id == TelemetryRecord.environment_id)
            .join(Cache, Cache.id == EnvRow.cache_id)
            .where(Cache.name == cache, TelemetryRecord.at >= utcnow() - since)
            .group_by(bucket)
            .order_by(bucket)
        )
        return [
            TelemetryPoint(_as_datetime(b), int(r or 0), int(h or 0), int(m or 0))
            for b, r, h, m in s.execute(q)
        ]


def hit_rates(index: Index, cache: str) -> dict[int, tuple[int, int, int, int]]:
    """environment id -> (cacheable requests, hits, misses, loads) over all recorded telemetry:
    the requests for not-cacheable (JAX-internal staging) programs are left out, as `stats`
    does; loads are the executables cachectl.serving loaded (never requests)."""
    with index.read_session() as s:
        q = (
            select(
                TelemetryRecord.environment_id,
                counter_sum(index.dialect, TelemetryRecord.requests),
                counter_sum(index.dialect, TelemetryRecord.hits),
                counter_sum(index.dialect, TelemetryRecord.uncacheable),
                counter_sum(index.dialect, TelemetryRecord.loads),
            )
            .join(EnvRow, EnvRow.id == TelemetryRecord.environment_id)
            .join(Cache, Cache.id == EnvRow.cache_id)
            .where(Cache.name == cache)
            .group_by(TelemetryRecord.environment_id)
        )
        out = {}
        for env, r, h, u, loads in s.execute(q):
            cacheable = max(int(r or 0) - int(u or 0), 0)
            out[env] = (cacheable, int(h or 0), max(cacheable - int(h or 0), 0), int(loads or 0))
        return out


@dataclass(frozen=True)
class BytesPoint:
    at: datetime
    added_bytes: int
    total_bytes: int


def bytes_series(index: Index, cache: str, *, hourly: bool = False) -> list[BytesPoint]:
    """Bytes of the entries held now, by when they were created (cumulative), oldest first."""
    bucket = _bucket_expr(index.dialect, Entry.created_at, hourly).label("bucket")
    with index.read_session() as s:
        q = (
            select(bucket, func.sum(unit_size()))
            .join(EnvRow, EnvRow.id == Entry.environment_id)
            .join(Cache, Cache.id == EnvRow.cache_id)
            .where(Cache.name == cache, EnvRow.deleted_at.is_(None))
            .group_by(bucket)
            .order_by(bucket)
        )
        total = 0
        out = []
        for b, added in s.execute(q):
            total += int(added or 0)
            out.append(BytesPoint(_as_datetime(b), int(added or 0), total))
        return out
