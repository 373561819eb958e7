"""The index access layer: every query the rest of cachectl runs lives here.

Callers get typed records (records.py, built from the rows by row_records.py), never ORM
objects or sessions, so the same functions can later be served over HTTP.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import CursorResult, bindparam, delete, func, select, text, update
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import DatabaseError, IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from cachectl.core.errors import BadInput, NotFound, Unreachable
from cachectl.core.fingerprint import Environment
from cachectl.core.jsonable import bounded
from cachectl.core.records import (  # noqa: F401 - actor is re-exported
    AuditInfo,
    CacheInfo,
    EntryInfo,
    EnvironmentInfo,
    HeldEntry,
    NewEntry,
    Proof,
    WarmRunInfo,
    actor,
    pick_environment,
    proofs_to_row,
)
from cachectl.index import (
    db,
    entry_writes,
    reads,
    warm_runs,  # noqa: E402 - after the records it imports
)
from cachectl.index.models import AuditRecord, Cache, Entry, utcnow
from cachectl.index.models import Environment as EnvRow
from cachectl.index.row_records import (
    ENTRY_INFO_COLUMNS,
    cache_info,
    entry_info,
    entry_infos,
    env_info,
)

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TypeVar

    from cachectl.core.config import Settings

    T = TypeVar("T")

__all__ = ["Index", "index_with", "open_url", "unit_size"]

_CACHE_POLICY_FIELDS = {
    "max_size": "max_size_bytes",
    "max_entry_size": "max_entry_size_bytes",
    "env_max_size": "env_max_size_bytes",
    "retention_seconds": "retention_seconds",
    "keep_versions": "keep_versions",
    "writers": "writers",
    "service_writes": "service_writes",
    "group": "group_name",
    "storage_options": "storage_options",
    "root_url": "root_url",
    "trusted_keys": "trusted_keys",
}


def open_url(url: str, *, auto_migrate: bool | None = None) -> Index:
    """Open (and for SQLite files, create and migrate) the index at ``url``."""
    engine = db.make_engine(url)
    if auto_migrate is None:
        auto_migrate = make_url(url).get_backend_name() == "sqlite"
    db.ensure_schema(engine, auto_migrate=auto_migrate)
    return Index(engine)


def _missing_schema(exc: Exception) -> bool:
    text = str(exc).lower()
    return (
        "no such table" in text
        or "undefinedtable" in text
        or ("does not exist" in text and "relation" in text)
    )


def index_with(url: str, first: Callable[[Index], T]) -> tuple[Index, T]:
    """Open the index without Alembic's schema check (importing Alembic alone costs a service
    ~0.5 s at start) and run ``first`` on it; migrate a schema-less SQLite file once.

    The caller owns (and closes) the returned index.
    """
    index = Index(db.make_engine(url))
    try:
        return index, first(index)
    except Exception as exc:
        index.close()
        if not _missing_schema(exc):
            raise
    index = open_url(url)  # a new SQLite file: create the schema, then retry
    try:
        return index, first(index)
    except Exception:
        index.close()
        raise


def unit_size() -> Any:
    """An entry's bytes with its stored executable's: the one unit limits, gc and prune count."""
    return Entry.size_bytes + func.coalesce(Entry.aot_size_bytes, 0)


# A statement that fails with "no such table" on a file without the schema, and reads no row.
_SCHEMA_PROBE = "SELECT id FROM caches WHERE 1 = 0"


class EngineReader:
    """cachectl.index.reads' queries on any database, through the engine (with text(), so each
    driver gets its own parameter style); list parameters expand, times bind as the columns hold them."""

    def __init__(self, index: Index) -> None:
        self.index = index

    @property
    def dialect(self) -> str:
        return self.index.dialect

    def rows(self, sql: str, params: Mapping[str, Any] | None = None) -> Sequence[Any]:
        bound = dict(params or {})
        statement = text(sql)
        lists = [k for k, v in bound.items() if isinstance(v, list | tuple)]
        if lists:
            statement = statement.bindparams(*(bindparam(k, expanding=True) for k in lists))
        if self.dialect == "sqlite":
            bound = {k: reads.stamp(v) if isinstance(v, datetime) else v for k, v in bound.items()}
        with self.index.connection(write=False) as conn:
            # The driver's rows as they are: a text() statement has no result types to process,
            # and a Row per row cost planning at 1M entries a second more.
            return conn.execute(statement, bound).cursor.fetchall()


class Index(reads.ReaderQueries):
    """One index database (SQLite or PostgreSQL): the ``sqlalchemy`` driver (cachectl.index.open)."""

    @classmethod
    def open_for(cls, settings: Settings, role: str) -> Index:
        """The driver's opener: a command's index is checked (and an SQLite file migrated) now;
        a service's only when a table is missing (cachectl.index.open)."""
        if role == "command":
            return open_url(settings.db)
        index, _ = index_with(settings.db, lambda i: i.reader.rows(_SCHEMA_PROBE))
        return index

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        # SQLite takes one writer at a time: this process's threads queue here, in order, rather
        # than in SQLite's busy handler, whose growing sleeps made a server's p99.
        self._sqlite_writer = threading.RLock() if engine.dialect.name == "sqlite" else None

    @property
    def url(self) -> str:
        return db.safe_url(self.engine)

    @property
    def reader(self) -> EngineReader:
        """This index for cachectl.index.reads' portable queries."""
        return EngineReader(self)

    @property
    def sql(self) -> Index:
        """This index: what only the SQL index runs (leases, deletions) takes it."""
        return self

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def session(self, *, write: bool = True) -> Iterator[Session]:
        """A transaction; ``write=False`` lets SQLite readers run deferred."""
        with self._mapped_errors(write), self._sessions.begin() as session:
            yield session

    @contextmanager
    def connection(self, *, write: bool = True) -> Iterator[Connection]:
        """A Core transaction, without the ORM session's cost: for hot paths of plain statements."""
        with self._mapped_errors(write), self.engine.begin() as conn:
            yield conn

    @contextmanager
    def _mapped_errors(self, write: bool) -> Iterator[None]:
        """Database failures as cachectl errors (Unreachable, an unusable index)."""
        token = db.sqlite_immediate.set(write)
        lock = self._sqlite_writer if write else None
        # Bounded: past the busy timeout the transaction goes ahead and SQLite's own rules apply.
        held = lock is not None and lock.acquire(timeout=db.SQLITE_BUSY_TIMEOUT_MS / 1000)
        try:
            yield
        except OperationalError as exc:
            raise Unreachable(f"index {self.url} failed: {db._first_line(exc)}") from exc
        except DatabaseError as exc:
            if db.is_unusable(exc):
                raise db.unusable(self.engine, exc) from exc
            raise
        finally:
            db.sqlite_immediate.reset(token)
            if held:
                lock.release()  # type: ignore[union-attr]

    def read_session(self) -> Any:
        return self.session(write=False)

    # -- caches ---------------------------------------------------------------

    def add_cache(self, name: str, root_url: str, **policy: Any) -> CacheInfo:
        with self.session() as s:
            if s.scalar(select(Cache).where(Cache.name == name)) is not None:
                raise BadInput(
                    f"cache {name!r} already exists: use `cachectl cache set {name} ...` to change it"
                )
            row = Cache(name=name, root_url=root_url, writers=[], storage_options={})
            self._apply_policy(row, policy)
            s.add(row)
            s.flush()
            return cache_info(row)

    def ensure_cache(self, name: str, root_url: str) -> CacheInfo:
        """Get a cache, creating it with defaults if missing (the embedded default)."""
        try:
            return self.get_cache(name)
        except NotFound:
            try:
                return self.add_cache(name, root_url)
            except (BadInput, IntegrityError):
                return self.get_cache(name)  # another process created it first

    def update_cache(self, name: str, **policy: Any) -> CacheInfo:
        with self.session() as s:
            row = s.scalar(select(Cache).where(Cache.name == name))
            if row is None:
                raise NotFound(f"no cache named {name!r}")
            self._apply_policy(row, policy)
            s.flush()
            return cache_info(row)

    def remove_cache(self, name: str) -> None:
        with self.session() as s:
            row = s.scalar(select(Cache).where(Cache.name == name))
            if row is None:
                raise NotFound(f"no cache named {name!r}")
            env_ids = select(EnvRow.id).where(EnvRow.cache_id == row.id)
            s.execute(delete(Entry).where(Entry.environment_id.in_(env_ids)))
            s.execute(delete(EnvRow).where(EnvRow.cache_id == row.id))
            s.delete(row)

    @staticmethod
    def _apply_policy(row: Cache, policy: dict[str, Any]) -> None:
        for key, value in policy.items():
            if key not in _CACHE_POLICY_FIELDS:
                raise BadInput(f"unknown cache setting {key!r}")
            if key in ("writers", "trusted_keys") and value is not None:
                value = list(value)
            setattr(row, _CACHE_POLICY_FIELDS[key], value)

    # -- environments ---------------------------------------------------------

    def _cache_row(self, s: Session, name: str) -> Cache:
        row = s.scalar(select(Cache).where(Cache.name == name))
        if row is None:
            raise NotFound(f"no cache named {name!r}: add it with `cachectl cache add {name} URL`")
        return row

    def ensure_environment(self, cache: str, env: Environment) -> EnvironmentInfo:
        """The environment's row, created if new; revived if it was pruned."""
        digest = env.digest
        for _attempt in range(2):
            try:
                with self.session() as s:
                    cache_row = self._cache_row(s, cache)
                    row = s.scalar(
                        select(EnvRow).where(
                            EnvRow.cache_id == cache_row.id, EnvRow.digest == digest
                        )
                    )
                    if row is None:
                        data = env.to_dict()
                        row = EnvRow(
                            cache_id=cache_row.id, digest=digest, namespace=env.namespace, **data
                        )
                        s.add(row)
                    row.last_seen_at = utcnow()
                    row.deleted_at = None
                    s.flush()
                    return env_info(row, cache)
            except IntegrityError:
                continue  # created concurrently by another process: read it
        raise Unreachable(f"could not record environment {digest[:16]} in cache {cache!r}")

    def set_content_signature(self, env_id: int, signed: dict[str, Any] | None) -> None:
        with self.session() as s:
            s.execute(update(EnvRow).where(EnvRow.id == env_id).values(content_signature=signed))

    def record_proof(self, env_id: int, proof: Proof) -> None:
        """Keep warm-check's result on the namespace's row: the last check of a manifest replaces
        that manifest's before (``proofs_to_row``)."""
        with self.session() as s:
            stored = s.execute(
                select(EnvRow.proof).where(EnvRow.id == env_id).with_for_update()
            ).scalar()
            row = proofs_to_row(stored, proof)
            s.execute(update(EnvRow).where(EnvRow.id == env_id).values(proof=row))

    def mark_environment_deleted(self, env_id: int) -> None:
        with self.session() as s:
            s.execute(delete(Entry).where(Entry.environment_id == env_id))
            s.execute(update(EnvRow).where(EnvRow.id == env_id).values(deleted_at=utcnow()))

    # -- entries --------------------------------------------------------------

    def list_entries(self, env_id: int) -> list[EntryInfo]:
        with self.read_session() as s:
            # Core rows, not ORM objects: a namespace of thousands of entries loads in a third of the time.
            q = (
                select(*ENTRY_INFO_COLUMNS)
                .where(Entry.environment_id == env_id)
                .order_by(Entry.key)
            )
            return entry_infos(s.connection().execute(q))

    def entry_keys(self, env_id: int) -> dict[str, tuple[int, str]]:
        """key -> (size, sha256) for one environment: what sync diffs against."""
        with self.read_session() as s:
            q = select(Entry.key, Entry.size_bytes, Entry.sha256).where(
                Entry.environment_id == env_id
            )
            return {k: (size, sha) for k, size, sha in s.execute(q)}

    def aot_keys(self, env_id: int) -> dict[str, tuple[int, str]]:
        """key -> (size, sha256) of the stored executables of one environment."""
        with self.read_session() as s:
            q = select(Entry.key, Entry.aot_size_bytes, Entry.aot_sha256).where(
                Entry.environment_id == env_id, Entry.aot_sha256.is_not(None)
            )
            return {k: (size, sha) for k, size, sha in s.execute(q)}

    def held_entries(self, env_id: int, keys: Iterable[str]) -> dict[str, HeldEntry]:
        """The rows of ``keys`` the environment holds, looked up by key (its unique index), 500
        keys a statement: an install of a bundle into a namespace of many thousands reads its own
        keys' rows, not the namespace's (BENCHMARKS.md, "Planning": an install's delta)."""
        wanted = list(dict.fromkeys(keys))
        held: dict[str, HeldEntry] = {}
        q = select(
            Entry.key, Entry.size_bytes, Entry.sha256, Entry.aot_size_bytes, Entry.aot_sha256
        ).where(Entry.environment_id == env_id, Entry.key.in_(bindparam("keys", expanding=True)))
        with self.read_session() as s:
            for chunk in entry_writes.chunks(wanted):
                for key, size, sha, aot_size, aot_sha in s.execute(q, {"keys": list(chunk)}):
                    held[key] = HeldEntry(size, sha, aot_size, aot_sha)
        return held

    def set_executables(self, env_id: int, executables: dict[str, tuple[int, str] | None]) -> int:
        """Record (size, sha256) of entries' stored executables, or clear them (None); rows touched.

        Only rows that exist and differ are written, so re-running is harmless.
        """
        with self.session() as s:
            return entry_writes.set_executables(s, env_id, executables)

    def mark_executables(self, env_id: int, verdicts: dict[str, str | None]) -> int:
        """Record warm-check's verdict on stored executables: why one is unusable, or None (it
        ran); rows touched. Only rows that exist and differ are written."""
        with self.session() as s:
            return entry_writes.mark_executables(s, env_id, verdicts)

    def get_entry(self, env_id: int, key: str) -> EntryInfo | None:
        with self.read_session() as s:
            row = s.scalar(select(Entry).where(Entry.environment_id == env_id, Entry.key == key))
            return entry_info(row) if row else None

    def upsert_entries(self, env_id: int, entries: Iterable[NewEntry]) -> tuple[int, int]:
        """Record entries; returns (inserted, updated). Re-running is harmless."""
        with self.session() as s:
            return entry_writes.upsert_entries(s, env_id, entries)

    def delete_entries(self, env_id: int, keys: Iterable[str]) -> int:
        removed = 0
        key_list = list(keys)
        with self.session() as s:
            for chunk in entry_writes.chunks(key_list):
                result = s.execute(
                    delete(Entry).where(Entry.environment_id == env_id, Entry.key.in_(chunk))
                )
                removed += cast("CursorResult[Any]", result).rowcount or 0
        return removed

    def record_hits(
        self,
        env_id: int,
        hits: dict[str, tuple[int, datetime]],
        *,
        not_after: datetime | None = None,
        session: Session | Connection | None = None,
    ) -> int:
        """Add hit counts and last-access times learned from telemetry.

        Last access never moves backwards, nor before the entry was created; with
        ``not_after`` (telemetry passes now: a reported time is only a claim) it never moves
        past that either, so no reader can make an entry look fresh (or stale) to gc.
        One Core statement for all keys (telemetry's hot path), in ``session`` if given.
        """
        if session is not None:
            return entry_writes.record_hits(session, env_id, hits, not_after=not_after)
        with self.connection() as conn:
            return entry_writes.record_hits(conn, env_id, hits, not_after=not_after)

    # -- warm runs (cachectl.index.warm_runs) ------------------------------------

    def start_warm_run(
        self, environment_id: int, *, manifest_digest: str, manifest_path: str | None, buckets: int
    ) -> WarmRunInfo:
        return warm_runs.start_run(
            self,
            environment_id,
            manifest_digest=manifest_digest,
            manifest_path=manifest_path,
            buckets=buckets,
        )

    def heartbeat_warm_run(
        self,
        run_id: int,
        *,
        compiled: int | None = None,
        cached: int | None = None,
        failed: int | None = None,
    ) -> None:
        warm_runs.heartbeat(self, run_id, compiled=compiled, cached=cached, failed=failed)

    def finish_warm_run(
        self, run_id: int, status: str, *, compiled: int, cached: int, failed: int
    ) -> WarmRunInfo:
        return warm_runs.finish_run(
            self, run_id, status, compiled=compiled, cached=cached, failed=failed
        )

    # -- audit ----------------------------------------------------------------

    def audit(
        self,
        operation: str,
        *,
        cache: str | None,
        entries: int = 0,
        nbytes: int = 0,
        duration_ms: int | None = None,
        details: dict[str, Any] | None = None,
        who: str | None = None,
    ) -> None:
        with self.session() as s:
            s.add(
                AuditRecord(
                    actor=who or actor(),
                    operation=operation,
                    cache_name=cache,
                    entries=entries,
                    bytes=nbytes,
                    duration_ms=duration_ms,
                    details=details or {},
                )
            )

    def audit_log(
        self, cache: str | None = None, since: timedelta | None = None, limit: int = 100
    ) -> list[AuditInfo]:
        with self.read_session() as s:
            q = (
                select(AuditRecord)
                .order_by(AuditRecord.at.desc(), AuditRecord.id.desc())
                .limit(limit)
            )
            if cache:
                q = q.where(AuditRecord.cache_name == cache)
            if since:
                q = q.where(AuditRecord.at >= utcnow() - since)
            return [
                AuditInfo(
                    r.at,
                    r.actor,
                    r.operation,
                    r.cache_name,
                    r.entries,
                    r.bytes,
                    r.duration_ms,
                    bounded(dict(r.details or {})),
                )
                for r in s.scalars(q)
            ]
