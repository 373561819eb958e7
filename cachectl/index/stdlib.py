"""The ``stdlib`` index driver (cachectl.index.open): sqlite3 on a plain SQLite index.

Importing SQLAlchemy and the index models costs a service 0.3-0.5 s, more than its whole start on
a warmed cache, and the CLI's read commands more than their whole run (BENCHMARKS.md, "CLI
startup"). This driver runs the read queries (cachectl.index.reads, the same SQL text the
SQLAlchemy driver runs), the only writes a service makes on a known environment (marking it
seen, a telemetry flush) and `cachectl token create`'s token and audit rows. The telemetry rows
and their rules come from cachectl.telemetry.rows, shared with the SQLAlchemy writer
(index/telemetry_queries.py; tests/test_service_sqlite.py checks that both write the same rows);
a token is made by cachectl.trust.token_rules for both writers (tests/test_server_auth.py).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from cachectl.core.cache_info import utcnow
from cachectl.core.fingerprint import Environment
from cachectl.core.records import EnvironmentInfo, NewToken, TokenInfo, actor
from cachectl.core.sqlite_file import connect, sqlite_path, stamp
from cachectl.index.open import driver
from cachectl.index.reads import ReaderQueries, SqliteReader
from cachectl.telemetry import rows as flush
from cachectl.telemetry.batch import TelemetryBatch

if TYPE_CHECKING:
    from cachectl.core.config import Settings
    from cachectl.index.open import Role
    from cachectl.index.sql import Index


def _json(value: Any) -> str:
    """A JSON column as SQLAlchemy's JSON type writes it (None becomes JSON null, not SQL NULL)."""
    return json.dumps(value)


def touch(conn: sqlite3.Connection, env_id: int | None, now: datetime) -> int | None:
    """Mark environment ``env_id`` seen (and revive it); None, writing nothing, for None."""
    if env_id is not None:
        conn.execute(
            "UPDATE environments SET last_seen_at = :now, deleted_at = NULL WHERE id = :id",
            {"now": stamp(now), "id": env_id},
        )
    return env_id


def insert_telemetry(
    conn: sqlite3.Connection, env_id: int, batch: TelemetryBatch, now: datetime
) -> int:
    """record_telemetry's statements, inside the caller's transaction."""
    rows, serving = flush.flush_rows(env_id, batch, now)
    _insert(conn, "telemetry", _TELEMETRY_COLUMNS, rows)
    _insert(conn, "serving_telemetry", _SERVING_COLUMNS, serving)
    # Last access never moves backwards, nor before the entry was created (Index.record_hits).
    conn.executemany(
        "UPDATE entries SET hit_count = hit_count + ?, last_access_at = CASE "
        "WHEN COALESCE(last_access_at, created_at) < ? THEN ? ELSE COALESCE(last_access_at, created_at) END "
        "WHERE environment_id = ? AND key = ?",
        [
            (n, stamp(at), stamp(at), env_id, key)
            for key, (n, at) in flush.hit_times(batch, now).items()
        ],
    )
    for module, mine in flush.by_function(flush.merged_signatures(batch)):
        _merge_signatures(conn, env_id, module, mine)
    return len(rows) + len(serving)


def _merge_signatures(
    conn: sqlite3.Connection, env_id: int, module: str, mine: dict[str, dict[str, Any]]
) -> None:
    """One function's call signatures: new ones inserted (past the per-function cap they add
    up in '*', as placed_signatures says), known ones' counters added."""
    c = conn
    marks = ", ".join("?" * (len(mine) + 1))
    existing = [
        d
        for (d,) in c.execute(
            f"SELECT digest FROM signatures WHERE environment_id = ? AND function = ? AND digest IN ({marks})",
            (env_id, module, *mine, "*"),
        )
    ]
    (total,) = c.execute(
        "SELECT COUNT(*) FROM signatures WHERE environment_id = ? AND function = ?",
        (env_id, module),
    ).fetchone()
    for digest, v, new in flush.placed_signatures(mine, existing, total):
        counters = tuple(v[k] for k in flush.SIGNATURE_COUNTERS)
        if new:
            c.execute(
                "INSERT INTO signatures (environment_id, function, digest, key, leaves, source, statics, "
                "requests, hits, misses, uncacheable, repeats, first_seen, last_seen) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    env_id,
                    module,
                    digest,
                    v["key"],
                    _json(v["leaves"]),
                    v["source"],
                    _json(v["statics"]),
                    *counters,
                    stamp(v["first_seen"]),
                    stamp(v["last_seen"]),
                ),
            )
        else:
            c.execute(
                "UPDATE signatures SET requests = requests + ?, hits = hits + ?, misses = misses + ?, "
                "uncacheable = uncacheable + ?, repeats = repeats + ?, last_seen = MAX(last_seen, ?) "
                "WHERE environment_id = ? AND function = ? AND digest = ?",
                (*counters, stamp(v["last_seen"]), env_id, module, digest),
            )


# The columns of flush_rows' two kinds of row, in the order their INSERTs name them.
_TELEMETRY_COLUMNS = (
    "environment_id",
    "at",
    "process",
    "function",
    "requests",
    "hits",
    "misses",
    "writes",
    "saved_seconds",
    "dropped",
    "uncacheable",
    "loads",
    "miss_seconds",
    "hit_seconds",
)
_SERVING_COLUMNS = (
    "environment_id",
    "at",
    "process",
    "function",
    "calls",
    "aot",
    "fallback",
    "out_of_bucket",
    "padded",
    "sizes",
)
# How a column's value is stored where it is not stored as it is (as SQLAlchemy's types write it).
_ENCODE: dict[str, Callable[[Any], Any]] = {"at": stamp, "sizes": _json}


def _insert(
    conn: sqlite3.Connection, table: str, columns: tuple[str, ...], rows: list[dict[str, Any]]
) -> None:
    """INSERT each row's ``columns`` into ``table``, encoded as ``_ENCODE`` says."""
    encode = [_ENCODE.get(k) for k in columns]
    conn.executemany(
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
        [
            tuple(r[k] if f is None else f(r[k]) for k, f in zip(columns, encode, strict=True))
            for r in rows
        ],
    )


# -- the stdlib driver -------------------------------------------------------------------------


class StdlibReads(ReaderQueries):
    """The ``stdlib`` driver (cachectl.index.open): one sqlite3 connection to a plain SQLite index
    at SCHEMA_REVISION. It runs the read queries and a service's writes (marking an environment
    seen, a telemetry flush) itself; anything else (creating a
    cache or an environment, entries, leases) goes to the ``sqlalchemy`` driver, opened behind
    it on first use. No transaction is held between statements, so each read sees what writers
    committed before it; the connection may be used from any thread (one statement at a time)."""

    dialect = "sqlite"

    def __init__(self, conn: sqlite3.Connection, settings: Settings, role: Role) -> None:
        self.conn = conn
        self.settings = settings
        self.role: Role = role
        self._lock = threading.RLock()
        self._reader = SqliteReader(conn, str(sqlite_path(settings.db)), self._lock)
        self._sql: Index | None = None

    @classmethod
    def open_for(cls, settings: Settings, role: Role) -> StdlibReads | None:
        """The driver's opener: None where the stdlib cannot serve ``settings.db`` (not a plain
        SQLite file, no file yet, another schema revision: the SQLAlchemy driver creates and
        migrates)."""
        conn = connect(settings.db, "foreign_keys = ON", "synchronous = NORMAL")
        return None if conn is None else cls(conn, settings, role)

    @property
    def reader(self) -> SqliteReader:
        return self._reader

    @property
    def url(self) -> str:
        return self.settings.db

    @property
    def sql(self) -> Index:
        """The ``sqlalchemy`` driver on the same file, opened on first use, closed with this."""
        with self._lock:
            if self._sql is None:
                self._sql = cast("Index", driver("sqlalchemy")(self.settings, self.role))
            return self._sql

    def __getattr__(self, name: str) -> Any:
        """What the stdlib does not run (IndexBackend's writes), on the SQLAlchemy index."""
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.sql, name)

    def environment_id(self, cache: str, digest: str) -> int | None:
        """The environment's id, read only; None when it has no row yet."""
        rows = self.reader.rows(
            "SELECT e.id FROM environments e JOIN caches c ON c.id = e.cache_id "
            "WHERE c.name = :cache AND e.digest = :digest",
            {"cache": cache, "digest": digest},
        )
        return int(rows[0][0]) if rows else None

    def touch_environment(self, cache: str, digest: str, now: datetime) -> int | None:
        """The environment's id, marked seen (and revived); None when it has no row yet."""
        with self._lock, self.conn:
            self.conn.execute("BEGIN IMMEDIATE")
            return touch(self.conn, self.environment_id(cache, digest), now)

    def ensure_environment(self, cache: str, env: Environment) -> EnvironmentInfo:
        """A known environment marked seen here; a new one created by the SQLAlchemy driver
        (its row has every fingerprint field)."""
        if self.touch_environment(cache, env.digest, utcnow()) is None:
            return self.sql.ensure_environment(cache, env)
        return self.find_environment(cache, env.digest, include_deleted=True)

    def flush(self, cache: str, digest: str, batch: TelemetryBatch, now: datetime) -> int | None:
        """Mark the environment seen and record a telemetry batch, in one transaction (a flush at
        exit commits once); None (nothing written) when the environment has no row yet."""
        with self._lock, self.conn:
            self.conn.execute("BEGIN IMMEDIATE")
            env_id = touch(self.conn, self.environment_id(cache, digest), now)
            if env_id is not None:
                insert_telemetry(self.conn, env_id, batch, now)
            return env_id

    def record_telemetry(self, env_id: int, batch: TelemetryBatch, now: datetime) -> int:
        """What cachectl.index.telemetry_queries.record_telemetry writes, in one transaction."""
        with self._lock, self.conn:
            self.conn.execute("BEGIN IMMEDIATE")
            return insert_telemetry(self.conn, env_id, batch, now)

    def create_token(self, new: NewToken, details: dict[str, Any]) -> TokenInfo | None:
        """Store a token made by cachectl.trust.token_rules and its ``token-create`` audit row, in
        one transaction, as cachectl.trust.tokens ``store_token`` and ``Index.audit`` write them;
        None, writing nothing, where a token not revoked has the name. NotFound names a scoped cache that
        does not exist (a typo would make a token that can do nothing)."""
        for cache in new.caches or ():
            self.get_cache(cache)
        now = stamp(new.created_at)
        with self._lock, self.conn:
            self.conn.execute("BEGIN IMMEDIATE")
            held = "SELECT 1 FROM tokens WHERE name = ? AND revoked_at IS NULL"
            if self.conn.execute(held, (new.name,)).fetchone():  # a revoked one's name is free
                return None
            cursor = self.conn.execute(
                "INSERT INTO tokens (name, role, caches, token_hash, created_at, expires_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (
                    new.name,
                    new.role,
                    _json(new.caches),
                    new.token_hash,
                    now,
                    stamp(new.expires_at) if new.expires_at else None,
                ),
            )
            self.conn.execute(
                "INSERT INTO audit_log (at, actor, operation, cache_name, entries, bytes, details) "
                "VALUES (?, ?, 'token-create', NULL, 0, 0, ?)",
                (now, actor(), _json(details)),
            )
            return new.info(int(cast("int", cursor.lastrowid)))

    def close(self) -> None:
        with self._lock:
            if self._sql is not None:
                self._sql.close()
                self._sql = None
            self.conn.close()
