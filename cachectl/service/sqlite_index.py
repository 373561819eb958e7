"""A service's SQLite index through the stdlib driver: read the policy, touch the environment, store telemetry.

Importing SQLAlchemy and the index models costs a service 0.3-0.5 s, more than its whole start
on a warmed cache, and a service needs only a handful of statements. For ``sqlite:///PATH``
indexes whose schema is exactly SCHEMA_REVISION, activate() and the telemetry sink run them here.
Anything else (another database, an older or newer schema, a missing cache or environment row,
any sqlite3 error) makes ``open_service_sqlite`` or a method return None, and the caller takes the
SQLAlchemy path, which creates, migrates and revives. The rows and their rules come from
cachectl.telemetry.rows, shared with the SQLAlchemy writer; tests/test_service_sqlite.py checks
that both write the same rows.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from datetime import datetime
from typing import Any

from cachectl.core.cache_info import CACHE_COLUMNS, CacheInfo, utcnow
from cachectl.core.fingerprint import Environment
from cachectl.core.sqlite_file import connect, stamp
from cachectl.telemetry.batch import TelemetryBatch
from cachectl.telemetry.rows import (
    SIGNATURE_COUNTERS,
    by_function,
    flush_rows,
    hit_times,
    merged_signatures,
    placed_signatures,
)


def _json(value: Any) -> str:
    """A JSON column as SQLAlchemy's JSON type writes it (None becomes JSON null, not SQL NULL)."""
    return json.dumps(value)


class ServiceSqlite:
    """One connection to an SQLite index at SCHEMA_REVISION; every method is one short transaction."""

    def __init__(self, conn: sqlite3.Connection, url: str) -> None:
        self.conn = conn
        self.url = url

    def close(self) -> None:
        self.conn.close()

    def get_cache(self, name: str) -> CacheInfo | None:
        row = self.conn.execute(
            f"SELECT {', '.join(CACHE_COLUMNS)} FROM caches WHERE name = ?", (name,)
        ).fetchone()
        if row is None:
            return None
        return CacheInfo.from_row(row)

    def touch_environment(self, cache: str, digest: str, now: datetime) -> int | None:
        """The environment's id, marked seen (and revived); None when it has no row yet."""
        with self.conn:
            self.conn.execute("BEGIN IMMEDIATE")
            return self._touch(cache, digest, now)

    def _touch(self, cache: str, digest: str, now: datetime) -> int | None:
        """touch_environment's statements, inside the caller's transaction."""
        env_id = self.environment_id(cache, digest)
        if env_id is None:
            return None
        self.conn.execute(
            "UPDATE environments SET last_seen_at = ?, deleted_at = NULL WHERE id = ?",
            (stamp(now), env_id),
        )
        return env_id

    def flush(self, cache: str, digest: str, batch: TelemetryBatch, now: datetime) -> int | None:
        """touch_environment then record_telemetry, in one transaction: a flush at exit commits
        once. None (nothing written) when the environment has no row yet."""
        with self.conn:
            self.conn.execute("BEGIN IMMEDIATE")
            env_id = self._touch(cache, digest, now)
            if env_id is not None:
                self._insert_telemetry(env_id, batch, now)
            return env_id

    def environment_id(self, cache: str, digest: str) -> int | None:
        """The environment's id, read only (no transaction to commit); None when it has no row."""
        row = self.conn.execute(
            "SELECT e.id FROM environments e JOIN caches c ON c.id = e.cache_id "
            "WHERE c.name = ? AND e.digest = ?",
            (cache, digest),
        ).fetchone()
        return None if row is None else int(row[0])

    def ensure_environment(self, cache: str, env: Environment) -> int | None:
        """Index.ensure_environment for a known environment; None for a new one (the caller
        creates it the SQLAlchemy way: its row has every fingerprint field)."""
        return self.touch_environment(cache, env.digest, utcnow())

    def record_telemetry(self, env_id: int, batch: TelemetryBatch, now: datetime) -> int:
        """What cachectl.index.telemetry_queries.record_telemetry writes, in one transaction."""
        with self.conn:
            self.conn.execute("BEGIN IMMEDIATE")
            return self._insert_telemetry(env_id, batch, now)

    def _insert_telemetry(self, env_id: int, batch: TelemetryBatch, now: datetime) -> int:
        """record_telemetry's statements, inside the caller's transaction."""
        rows, serving = flush_rows(env_id, batch, now)
        _insert(self.conn, "telemetry", _TELEMETRY_COLUMNS, rows)
        _insert(self.conn, "serving_telemetry", _SERVING_COLUMNS, serving)
        # Last access never moves backwards, nor before the entry was created (Index.record_hits).
        self.conn.executemany(
            "UPDATE entries SET hit_count = hit_count + ?, last_access_at = CASE "
            "WHEN COALESCE(last_access_at, created_at) < ? THEN ? ELSE COALESCE(last_access_at, created_at) END "
            "WHERE environment_id = ? AND key = ?",
            [
                (n, stamp(at), stamp(at), env_id, key)
                for key, (n, at) in hit_times(batch, now).items()
            ],
        )
        for module, mine in by_function(merged_signatures(batch)):
            self._merge_signatures(env_id, module, mine)
        return len(rows) + len(serving)

    def _merge_signatures(self, env_id: int, module: str, mine: dict[str, dict[str, Any]]) -> None:
        """One function's call signatures: new ones inserted (past the per-function cap they add
        up in '*', as placed_signatures says), known ones' counters added."""
        c = self.conn
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
        for digest, v, new in placed_signatures(mine, existing, total):
            counters = tuple(v[k] for k in SIGNATURE_COUNTERS)
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


def touch(url: str, cache: str, digest: str) -> bool:
    """Mark a known environment seen through its own connection; False where it could not
    (no stdlib path, no row, an sqlite3 error): the caller records it the SQLAlchemy way."""
    fast = open_service_sqlite(url)
    if fast is None:
        return False
    try:
        return fast.touch_environment(cache, digest, utcnow()) is not None
    except sqlite3.Error:
        return False
    finally:
        fast.close()


def open_service_sqlite(url: str) -> ServiceSqlite | None:
    """The index through sqlite3, or None when the SQLAlchemy path must handle it."""
    conn = connect(url, "foreign_keys = ON", "synchronous = NORMAL")
    return None if conn is None else ServiceSqlite(conn, url)
