"""What the SQL index writes to entry rows: upserts, stored executables' columns and verdicts, hits.

Index's methods of the same names call these, each in the session or connection the Index opened
(cachectl.index.sql keeps the transaction and the error mapping, so this module never imports it);
apart so that module stays a readable list of the index's operations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import UTC, datetime
from functools import partial
from typing import Any, TypeVar, cast

from sqlalchemy import CursorResult, bindparam, case, func, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from cachectl.core.records import NewEntry
from cachectl.index import bulk_rows
from cachectl.index.models import Entry, UTCDateTime, utcnow

_T = TypeVar("_T")

CHUNK = 500  # keys per IN (...) list: within every driver's parameter limit


def chunks(items: Sequence[Any], size: int = CHUNK) -> Iterator[Sequence[Any]]:
    """``items`` in slices of ``size``."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


# From this many rows, the new ones go in through bulk_rows (a bundle's or a warm's batch): below
# it, SQLAlchemy's per-row cost is too small to matter and one path is easier to reason about.
BULK_MIN = 64
_VARYING = (
    "key",
    "module",
    "size_bytes",
    "sha256",
    "origin",
    "compile_time_ms",
    "function",
    "bucket",
    "warm_run_id",
    "created_at",
    "aot_size_bytes",
    "aot_sha256",
)


# How often a batch is tried again when another writer recorded some of its keys between its
# lookup and its insert (two warm processes, or pods, into one PostgreSQL index).
RACES = 3


def upsert_entries(s: Session, env_id: int, entries: Iterable[NewEntry]) -> tuple[int, int]:
    """Record entries in the caller's transaction; returns (inserted, updated). Re-running is
    harmless, and so is another writer recording the same keys at the same time: each batch is
    looked up then inserted under a savepoint, and a batch that meets a key committed in between
    is rolled back to it and looked up again."""
    items = list(entries)
    inserted = updated = 0
    if len(items) >= BULK_MIN and bulk_rows.supported(s.get_bind().dialect):
        bulk = items
        # s.connection() inside the savepoint: the session emits SAVEPOINT when it next connects
        inserted, items = _raced(s, lambda: _insert_new(s.connection(), env_id, bulk))
    for chunk in chunks(items):
        added, changed = _raced(s, partial(_upsert_chunk, s, env_id, chunk))
        inserted += added
        updated += changed
    return inserted, updated


def _raced(s: Session, write: Callable[[], _T]) -> _T:
    """``write`` under a savepoint; tried again (at most ``RACES`` times) while it meets a key
    another writer committed after ``write`` looked for it."""
    for attempt in range(RACES):
        try:
            with s.begin_nested():
                return write()
        except IntegrityError:
            if attempt == RACES - 1:
                raise
    raise AssertionError("unreachable")


def _upsert_chunk(s: Session, env_id: int, chunk: Sequence[NewEntry]) -> tuple[int, int]:
    """One batch: the keys the environment holds are updated, the others inserted."""
    keys = [e.key for e in chunk]
    existing = {
        row.key: row
        for row in s.scalars(
            select(Entry).where(Entry.environment_id == env_id, Entry.key.in_(keys))
        )
    }
    new_rows = []
    updated = 0
    for e in chunk:
        row = existing.get(e.key)
        if row is None:
            new_rows.append(_new_row(env_id, e))
        else:
            updated += _update_row(row, e)
    if new_rows:
        s.execute(Entry.__table__.insert(), new_rows)
    return len(new_rows), updated


def _insert_new(conn: Connection, env_id: int, items: list[NewEntry]) -> tuple[int, list[NewEntry]]:
    """The rows whose keys the environment does not hold, inserted at driver speed (bulk_rows):
    (how many, the entries whose keys it holds, for the upsert)."""
    dialect = conn.dialect
    bucket = bulk_rows.json_processor("bucket", dialect) or (lambda value: value)
    stamp = bulk_rows.bind_processor("created_at", dialect) or (lambda value: value)
    no_bucket, now = bucket(None), stamp(utcnow())  # most rows': converted once
    rows = [
        (
            e.key,
            e.module,
            e.size,
            e.sha256,
            e.origin,
            e.compile_time_ms,
            e.function,
            no_bucket if e.bucket is None else bucket(e.bucket),
            e.warm_run_id,
            now if e.created_at is None else stamp(e.created_at),
            e.aot_size,
            e.aot_sha256,
        )
        for e in items
    ]
    inserted, existing = bulk_rows.insert_rows(conn, env_id, _VARYING, {"hit_count": 0}, rows)
    held = {r[0] for r in existing}
    return inserted, [e for e in items if e.key in held]


def _new_row(env_id: int, e: NewEntry) -> dict[str, Any]:
    """The ``entries`` row of an entry the index does not hold yet."""
    return {
        "environment_id": env_id,
        "key": e.key,
        "module": e.module,
        "size_bytes": e.size,
        "sha256": e.sha256,
        "origin": e.origin,
        "compile_time_ms": e.compile_time_ms,
        "function": e.function,
        "bucket": e.bucket,
        "warm_run_id": e.warm_run_id,
        "created_at": e.created_at or utcnow(),
        "hit_count": 0,
        "aot_size_bytes": e.aot_size,
        "aot_sha256": e.aot_sha256,
    }


def _update_row(row: Entry, e: NewEntry) -> bool:
    """Bring a held row to what the writer knows (what it does not know stays); whether it changed."""
    changed = False
    if (row.size_bytes, row.sha256) != (e.size, e.sha256):
        row.size_bytes, row.sha256 = e.size, e.sha256
        changed = True
    if e.aot_sha256 is not None and (row.aot_size_bytes, row.aot_sha256) != (
        e.aot_size,
        e.aot_sha256,
    ):
        row.aot_size_bytes, row.aot_sha256 = e.aot_size, e.aot_sha256
        row.aot_unusable = None  # another executable: warm-check's verdict was not on it
        changed = True
    for attr in ("compile_time_ms", "function", "bucket", "warm_run_id"):
        value = getattr(e, attr)
        if value is not None and getattr(row, attr) != value:
            setattr(row, attr, value)
            changed = True
    return changed


def set_executables(s: Session, env_id: int, executables: dict[str, tuple[int, str] | None]) -> int:
    """Record (size, sha256) of entries' stored executables, or clear them (None), in the
    caller's transaction; rows touched."""
    touched = 0
    for chunk in chunks(list(executables)):
        q = select(Entry.id, Entry.key, Entry.aot_size_bytes, Entry.aot_sha256).where(
            Entry.environment_id == env_id, Entry.key.in_(chunk)
        )
        for row_id, key, size, sha in s.execute(q).all():
            want = executables[key]
            new = (None, None) if want is None else (int(want[0]), want[1])
            if (size, sha) != new:
                s.execute(
                    update(Entry)
                    .where(Entry.id == row_id)
                    .values(aot_size_bytes=new[0], aot_sha256=new[1], aot_unusable=None)
                )
                touched += 1
    return touched


def mark_executables(s: Session, env_id: int, verdicts: dict[str, str | None]) -> int:
    """Record warm-check's verdicts on stored executables, in the caller's transaction; rows
    touched."""
    touched = 0
    for chunk in chunks(list(verdicts)):
        q = select(Entry.id, Entry.key, Entry.aot_unusable).where(
            Entry.environment_id == env_id, Entry.key.in_(chunk)
        )
        for row_id, key, current in s.execute(q).all():
            if current != verdicts[key]:
                s.execute(
                    update(Entry).where(Entry.id == row_id).values(aot_unusable=verdicts[key])
                )
                touched += 1
    return touched


def _add_hits_statement() -> Any:
    """Hits added to one entry; last access moves forward only, never before creation. Built once:
    telemetry runs it on every flush."""
    t = Entry.__table__
    seen = bindparam("b_seen", type_=UTCDateTime())
    last = func.coalesce(t.c.last_access_at, t.c.created_at)
    return (
        t.update()
        .where(t.c.environment_id == bindparam("b_env"), t.c.key == bindparam("b_key"))
        .values(
            hit_count=t.c.hit_count + bindparam("b_count"),
            last_access_at=case((last < seen, seen), else_=last),
        )
    )


_ADD_HITS = _add_hits_statement()


def record_hits(
    conn: Session | Connection,
    env_id: int,
    hits: dict[str, tuple[int, datetime]],
    *,
    not_after: datetime | None = None,
) -> int:
    """Add hit counts and last-access times learned from telemetry, in the caller's transaction
    (Index.record_hits says how)."""
    params = []
    for key, (count, at) in hits.items():
        if at.tzinfo is None:
            at = at.replace(tzinfo=UTC)
        params.append(
            {
                "b_env": env_id,
                "b_key": key,
                "b_count": count,
                "b_seen": at if not_after is None else min(at, not_after),
            }
        )
    if not params:
        return 0
    return _add_hits(conn, params)


def _add_hits(s: Session | Connection, params: list[dict[str, Any]]) -> int:
    """Run the hits statement; the rows it touched (counted again where the driver cannot say)."""
    t = Entry.__table__
    result = s.execute(_ADD_HITS, params[0] if len(params) == 1 else params)
    dialect = s.get_bind().dialect if isinstance(s, Session) else s.dialect
    if len(params) == 1 or dialect.supports_sane_multi_rowcount:
        return cast("CursorResult[Any]", result).rowcount or 0
    keys = [p["b_key"] for p in params]  # a driver that does not sum an executemany's rowcount
    return (
        s.scalar(
            select(func.count())
            .select_from(t)
            .where(t.c.environment_id == params[0]["b_env"], t.c.key.in_(keys))
        )
        or 0
    )
