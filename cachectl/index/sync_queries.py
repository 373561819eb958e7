"""Index reads and writes for `cachectl sync`, each query's SQL written once, run by either driver.

A query here is SQL text with ``:name`` parameters (a list parameter expands, as in
cachectl.index.reads) that SQLite and PostgreSQL both run as written. Two drivers run them, chosen
by cachectl.lifecycle.sync.open_sync_index from a table of modules imported only when chosen: ``stdlib``
(index/sync_stdlib.py: the sqlite3 module on a plain ``sqlite:///PATH`` index at SCHEMA_REVISION,
so `cachectl sync` never imports SQLAlchemy nor the ORM models, which cost it more CPU than
hashing every file) and ``sqlalchemy`` (index/sync_engine.py: ``text()`` on the SQL index's
engine, for PostgreSQL and any SQLite the stdlib cannot serve).

Sync's new rows differ only in key, module, size and sha256; the rest (origin, the time it saw
them) every row shares. They go through ``bulk_rows`` (one statement per 10,000 rows on SQLite,
the driver's executemany elsewhere). Keys that exist by the time the rows are written (changed
files, or a concurrent warm or sync wrote them since planning) get ``OBSERVED_UPDATE``, so
re-running stays harmless and counts stay exact.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from cachectl.core.cache_info import utcnow
from cachectl.core.errors import Unreachable
from cachectl.core.fingerprint import ENVIRONMENT_FIELDS, Environment
from cachectl.core.records import NewEntry, actor
from cachectl.index import reads

if TYPE_CHECKING:
    from cachectl.index.sql import Index

# A row sync observed: (key, module, size, sha256); a plain tuple, not a NewEntry per file.
ObservedRow = tuple[str, str, int, str]
VARYING = ("key", "module", "size_bytes", "sha256")  # strings and integers: bound as they are
# The columns every observed row shares, after ``environment_id`` (``shared_columns``).
JSON_COLUMNS = frozenset({"bucket"})  # JSON columns: SQLAlchemy's JSON type stores None as 'null'
_CHUNK = 500  # keys per IN list: within every driver's bound-parameter limit

ENTRY_KEYS = "SELECT key, size_bytes, sha256 FROM entries WHERE environment_id = :env"
AOT_KEYS = (
    "SELECT key, aot_size_bytes, aot_sha256 FROM entries "
    "WHERE environment_id = :env AND aot_sha256 IS NOT NULL"
)
ENVIRONMENT_ROW = "SELECT id FROM environments WHERE cache_id = :cid AND digest = :digest"
ENVIRONMENT_NEW = (
    "INSERT INTO environments (cache_id, digest, namespace, "
    f"{', '.join(ENVIRONMENT_FIELDS)}, created_at, last_seen_at) VALUES (:cid, :digest, "
    f":namespace, {', '.join(':' + f for f in ENVIRONMENT_FIELDS)}, :now, :now) "
    "ON CONFLICT DO NOTHING"
)
ENVIRONMENT_SEEN = "UPDATE environments SET last_seen_at = :now, deleted_at = NULL WHERE id = :id"
ENVIRONMENT_ENTRIES_DELETE = "DELETE FROM entries WHERE environment_id = :id"
ENVIRONMENT_DELETED = "UPDATE environments SET deleted_at = :now WHERE id = :id"
ENTRIES_DELETE = "DELETE FROM entries WHERE environment_id = :env AND key IN :keys"
# A row held already: brought to the file's size and digest (what sync does not know stays), as
# ``upsert_entries`` does for an observed entry; counted only where it changed.
OBSERVED_UPDATE = (
    "UPDATE entries SET size_bytes = :size, sha256 = :sha WHERE environment_id = :env "
    "AND key = :key AND (size_bytes <> :size OR sha256 <> :sha)"
)
_OBSERVED_COLUMNS = (
    "environment_id",
    *VARYING,
    *(
        "origin",
        "created_at",
        "hit_count",
        "compile_time_ms",
        "function",
        "bucket",
        "warm_run_id",
        "aot_size_bytes",
        "aot_sha256",
    ),
)
# One new row at a time, for a driver bulk_rows is not written for: (1 row changed: inserted).
OBSERVED_INSERT = (
    f"INSERT INTO entries ({', '.join(_OBSERVED_COLUMNS)}) "
    f"VALUES ({', '.join(':' + c for c in _OBSERVED_COLUMNS)}) ON CONFLICT DO NOTHING"
)
EXECUTABLE_ROWS = (
    "SELECT id, key, aot_size_bytes, aot_sha256 FROM entries "
    "WHERE environment_id = :env AND key IN :keys"
)
# Another executable (or none): warm-check's verdict was not on it.
EXECUTABLE_SET = (
    "UPDATE entries SET aot_size_bytes = :size, aot_sha256 = :sha, aot_unusable = NULL "
    "WHERE id = :id"
)
AUDIT = (
    "INSERT INTO audit_log (at, actor, operation, cache_name, entries, bytes, duration_ms, "
    "details) VALUES (:at, :actor, :operation, :cache, :entries, :nbytes, :duration_ms, :details)"
)


class Statements(Protocol):
    """One write transaction's statements (a driver's ``write()``); SQL as this module writes it.
    JSON values are passed as their text (``json.dumps``), times as aware datetimes. A
    cachectl.index.reads Reader too, so the portable reads run inside the transaction."""

    @property
    def dialect(self) -> str: ...

    def rows(self, sql: str, params: Mapping[str, Any] | None = None) -> Sequence[Any]: ...

    def run(self, sql: str, params: Mapping[str, Any] | None = None) -> int:
        """Runs one statement; the rows it changed."""
        ...

    def insert_new(
        self, env_id: int, shared: dict[str, Any], rows: Sequence[ObservedRow]
    ) -> tuple[int, list[ObservedRow]]:
        """``rows`` with the ``shared`` columns' values (JSON ones in JSON_COLUMNS) into
        environment ``env_id``'s entries at driver speed (``bulk_rows``): (inserted, rows whose
        key exists, not written)."""
        ...


class Driver(Protocol):
    """Where sync's statements run: ``reader`` outside any transaction (any thread), ``write()``
    one transaction on the calling thread, committed when its block ends without an error."""

    @property
    def reader(self) -> reads.Reader: ...

    def write(self) -> AbstractContextManager[Statements]: ...

    def close(self) -> None: ...


def _chunks(items: Sequence[Any]) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), _CHUNK):
        yield items[start : start + _CHUNK]


def observed_entry(row: Sequence[Any]) -> NewEntry:
    """The NewEntry of a row sync observed (for ``upsert_entries``: the server's index)."""
    return NewEntry(key=row[0], module=row[1], size=row[2], sha256=row[3], origin="observed")


def shared_columns() -> dict[str, Any]:
    """The values of every column an observed row shares but ``environment_id``."""
    return {
        "origin": "observed",
        "created_at": utcnow(),
        "hit_count": 0,
        "compile_time_ms": None,
        "function": None,
        "bucket": None,
        "warm_run_id": None,
        "aot_size_bytes": None,
        "aot_sha256": None,
    }


def observed_inserts(
    w: Statements, env_id: int, shared: dict[str, Any], rows: Sequence[ObservedRow]
) -> tuple[int, list[ObservedRow]]:
    """``Statements.insert_new`` a row a statement (OBSERVED_INSERT)."""
    values = {k: json.dumps(v) if k in JSON_COLUMNS else v for k, v in shared.items()}
    inserted = 0
    existing: list[ObservedRow] = []
    for row in rows:
        named = dict(zip(VARYING, row, strict=True))
        if w.run(OBSERVED_INSERT, {"environment_id": env_id, **named, **values}):
            inserted += 1
        else:
            existing.append(row)
    return inserted, existing


class SyncIndex(reads.ReaderQueries):
    """What sync asks of an index this process opens, through one ``Driver``."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver

    @property
    def reader(self) -> reads.Reader:
        return self.driver.reader

    def close(self) -> None:
        self.driver.close()

    # -- reads (the planning thread) -------------------------------------------------------

    def entry_keys(self, env_id: int) -> dict[str, tuple[int, str]]:
        """key -> (size, sha256) for one environment: what sync diffs against."""
        return {k: (size, sha) for k, size, sha in self.reader.rows(ENTRY_KEYS, {"env": env_id})}

    def aot_keys(self, env_id: int) -> dict[str, tuple[int, str]]:
        """key -> (size, sha256) of the stored executables of one environment."""
        return {k: (size, sha) for k, size, sha in self.reader.rows(AOT_KEYS, {"env": env_id})}

    # -- writes (the writing thread) -------------------------------------------------------

    def ensure_environment(self, cache: str, env: Environment) -> int:
        """The environment's row id, created if new (with every fingerprint field), revived if it
        was pruned, and marked seen. A row another process creates meanwhile is taken."""
        now = utcnow()
        with self.driver.write() as w:  # this thread's connection: the reader is the planner's
            cid = reads.cache_id(w, cache)
            params = {"cid": cid, "digest": env.digest}
            found = w.rows(ENVIRONMENT_ROW, params)
            if not found:
                fields = env.to_dict()
                fields["xla_flags"] = json.dumps(fields["xla_flags"])
                w.run(ENVIRONMENT_NEW, {**params, "namespace": env.namespace, "now": now, **fields})
                found = w.rows(ENVIRONMENT_ROW, params)
            if not found:
                raise Unreachable(
                    f"could not record environment {env.digest[:16]} in cache {cache!r}"
                )
            env_id = int(found[0][0])
            w.run(ENVIRONMENT_SEEN, {"now": now, "id": env_id})
        return env_id

    def insert_observed_rows(self, env_id: int, rows: Sequence[ObservedRow]) -> tuple[int, int]:
        """Record entries sync found in storage, in one transaction; (inserted, updated) like
        ``upsert_entries``. Every new row gets the same ``created_at`` (now) and origin."""
        if not rows:
            return 0, 0
        updated = 0
        with self.driver.write() as w:
            inserted, existing = w.insert_new(env_id, shared_columns(), rows)
            for key, _module, size, sha in existing:
                updated += w.run(
                    OBSERVED_UPDATE, {"size": size, "sha": sha, "env": env_id, "key": key}
                )
        return inserted, updated

    def delete_entries(self, env_id: int, keys: Sequence[str]) -> int:
        removed = 0
        with self.driver.write() as w:
            for chunk in _chunks(list(keys)):
                removed += w.run(ENTRIES_DELETE, {"env": env_id, "keys": list(chunk)})
        return removed

    def set_executables(self, env_id: int, executables: dict[str, tuple[int, str] | None]) -> int:
        """Record (size, sha256) of entries' stored executables, or clear them (None); rows
        touched. Only rows that exist and differ are written, so re-running is harmless."""
        touched = 0
        with self.driver.write() as w:
            for chunk in _chunks(list(executables)):
                found = w.rows(EXECUTABLE_ROWS, {"env": env_id, "keys": list(chunk)})
                for row_id, key, size, sha in found:
                    want = executables[key]
                    new = (None, None) if want is None else (int(want[0]), want[1])
                    if (size, sha) != new:
                        w.run(EXECUTABLE_SET, {"size": new[0], "sha": new[1], "id": row_id})
                        touched += 1
        return touched

    def mark_environment_deleted(self, env_id: int) -> None:
        with self.driver.write() as w:
            w.run(ENVIRONMENT_ENTRIES_DELETE, {"id": env_id})
            w.run(ENVIRONMENT_DELETED, {"now": utcnow(), "id": env_id})

    def audit(
        self,
        operation: str,
        *,
        cache: str | None,
        entries: int = 0,
        nbytes: int = 0,
        duration_ms: int | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        with self.driver.write() as w:
            w.run(
                AUDIT,
                {
                    "at": utcnow(),
                    "actor": actor(),
                    "operation": operation,
                    "cache": cache,
                    "entries": entries,
                    "nbytes": nbytes,
                    "duration_ms": duration_ms,
                    "details": json.dumps(details or {}),
                },
            )


def insert_observed_rows(
    index: SyncIndex, env_id: int, rows: Sequence[ObservedRow]
) -> tuple[int, int]:
    """``index.insert_observed_rows``: sync's one call per transaction of new rows."""
    return index.insert_observed_rows(env_id, rows)


def insert_observed_entries(index: Index, env_id: int, rows: Sequence[NewEntry]) -> tuple[int, int]:
    """Sync's row writes on the SQL index (its engine: benchmarks and tests that hold an Index)."""
    driver = open_driver("sqlalchemy", index)
    assert driver is not None
    return SyncIndex(driver).insert_observed_rows(
        env_id, [(r.key, r.module, r.size, r.sha256) for r in rows]
    )


# The drivers, each a module imported only when chosen (cachectl.lifecycle.sync.open_sync_index
# chooses): its ``open_driver`` returns None where it cannot serve the index it is given.
DRIVERS = {
    "stdlib": "cachectl.index.sync_stdlib",  # (url, the CLI's SqliteReader)
    "sqlalchemy": "cachectl.index.sync_engine",  # (the context's index)
}


def open_driver(name: str, *args: Any) -> Driver | None:
    """The ``name`` driver on ``args``, or None where it cannot serve them."""
    driver: Driver | None = importlib.import_module(DRIVERS[name]).open_driver(*args)
    return driver
