"""Sync's ``stdlib`` driver: cachectl.index.sync_queries' statements through the sqlite3 module.

For a plain ``sqlite:///PATH`` index at SCHEMA_REVISION (core/sqlite_file.py ``connect``): the
connection writes with the SQL index's settings (busy timeout, foreign keys, ``synchronous =
NORMAL``, its page cache) and each write is one ``BEGIN IMMEDIATE`` transaction, as the SQL index
begins its writes. Values are stored as SQLAlchemy's types store them (times as ``stamp`` text,
JSON as its text, None in a JSON column as 'null'): tests/test_sync_stdlib.py compares the rows
both drivers write, column by column.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from cachectl.core.errors import Unreachable
from cachectl.core.sqlite_file import SQLITE_CACHE_KIB, connect, sqlite_path, stamp
from cachectl.index import bulk_json
from cachectl.index.reads import SqliteReader, expand
from cachectl.index.sync_queries import JSON_COLUMNS, VARYING, ObservedRow

# bulk_json's one statement per 10,000 rows reads a JSON array with SQLite's JSON functions.
_JSON_FUNCTIONS = (3, 38, 0)


class _Statements:
    """One transaction's statements on the writing connection."""

    dialect = "sqlite"

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def _bound(self, sql: str, params: Mapping[str, Any] | None) -> tuple[str, dict[str, Any]]:
        sql, values = expand(sql, params or {})
        return sql, {k: stamp(v) if isinstance(v, datetime) else v for k, v in values.items()}

    def rows(self, sql: str, params: Mapping[str, Any] | None = None) -> list[Any]:
        return self.conn.execute(*self._bound(sql, params)).fetchall()

    def run(self, sql: str, params: Mapping[str, Any] | None = None) -> int:
        return self.conn.execute(*self._bound(sql, params)).rowcount

    def insert_new(
        self, env_id: int, shared: dict[str, Any], rows: Sequence[ObservedRow]
    ) -> tuple[int, list[ObservedRow]]:
        names = ("environment_id", *shared)
        constants = (env_id, *(_stored(name, value) for name, value in shared.items()))
        columns = [f'"{name}"' for name in (*VARYING, *names)]
        return bulk_json.insert_json(
            self.conn.execute, '"key"', columns, len(VARYING), constants, env_id, rows
        )


def _stored(column: str, value: Any) -> Any:
    """A shared column's value as SQLAlchemy's type stores it on SQLite."""
    if column in JSON_COLUMNS:
        return json.dumps(value)
    return stamp(value) if isinstance(value, datetime) else value


class StdlibDriver:
    """A writing connection of its own (the writing thread's); reads go through ``reader``, the
    CLI's read-only connection (the planning thread's): in WAL mode neither waits on the other."""

    def __init__(self, conn: sqlite3.Connection, reader: SqliteReader) -> None:
        self.conn = conn
        self.reader = reader

    @contextmanager
    def write(self) -> Iterator[_Statements]:
        try:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield _Statements(self.conn)
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            self.conn.execute("COMMIT")
        except sqlite3.Error as exc:  # as the SQL index reports its failures
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise Unreachable(f"index sqlite:///{self.reader.path} failed: {first}") from exc

    def close(self) -> None:
        self.conn.close()


def open_driver(url: str, reader: SqliteReader) -> StdlibDriver | None:
    """The driver on ``url``, or None where the stdlib cannot serve it (see ``connect``; an SQLite
    without its JSON functions): the caller takes the SQLAlchemy driver."""
    if sqlite3.sqlite_version_info < _JSON_FUNCTIONS or sqlite_path(url) is None:
        return None
    conn = connect(
        url, "foreign_keys = ON", "synchronous = NORMAL", f"cache_size = -{SQLITE_CACHE_KIB}"
    )
    return None if conn is None else StdlibDriver(conn, reader)
