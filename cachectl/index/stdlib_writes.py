"""The stdlib driver's writes (cachectl.index.reads.StdlibReads): marking an environment seen and
a telemetry flush, the only writes a service makes on a known environment.

Importing SQLAlchemy and the index models costs a service 0.3-0.5 s, more than its whole start on
a warmed cache, and these are a handful of statements. The rows and their rules come from
cachectl.telemetry.rows, shared with the SQLAlchemy writer (index/telemetry_queries.py);
tests/test_service_sqlite.py checks that both write the same rows. Each function runs inside
the caller's transaction.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from datetime import datetime
from typing import Any

from cachectl.core.sqlite_file import stamp
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
    rows, serving = flush_rows(env_id, batch, now)
    _insert(conn, "telemetry", _TELEMETRY_COLUMNS, rows)
    _insert(conn, "serving_telemetry", _SERVING_COLUMNS, serving)
    # Last access never moves backwards, nor before the entry was created (Index.record_hits).
    conn.executemany(
        "UPDATE entries SET hit_count = hit_count + ?, last_access_at = CASE "
        "WHEN COALESCE(last_access_at, created_at) < ? THEN ? ELSE COALESCE(last_access_at, created_at) END "
        "WHERE environment_id = ? AND key = ?",
        [(n, stamp(at), stamp(at), env_id, key) for key, (n, at) in hit_times(batch, now).items()],
    )
    for module, mine in by_function(merged_signatures(batch)):
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
