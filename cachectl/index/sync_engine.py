"""Sync's ``sqlalchemy`` driver: cachectl.index.sync_queries' statements as ``text()`` on the SQL
index's engine (PostgreSQL, and any SQLite the stdlib driver cannot serve)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection

from cachectl.core.sqlite_file import stamp
from cachectl.index import bulk_rows
from cachectl.index.reads import Reader, expand
from cachectl.index.sql import Index
from cachectl.index.sync_queries import VARYING, ObservedRow, observed_inserts


class _Statements:
    """One transaction's statements on one of the engine's connections."""

    def __init__(self, index: Index, conn: Connection) -> None:
        self.index = index
        self.conn = conn

    @property
    def dialect(self) -> str:
        return self.conn.dialect.name

    def _bound(self, sql: str, params: Mapping[str, Any] | None) -> tuple[Any, dict[str, Any]]:
        """The statement and its values; on SQLite, times as the index's UTCDateTime stores them
        (``text()`` knows no column types: the driver's own adapter would add an offset)."""
        sql, values = expand(sql, params or {})
        if self.conn.dialect.name == "sqlite":
            values = {k: stamp(v) if isinstance(v, datetime) else v for k, v in values.items()}
        return text(sql), values

    def rows(self, sql: str, params: Mapping[str, Any] | None = None) -> Sequence[Any]:
        return self.conn.execute(*self._bound(sql, params)).all()

    def run(self, sql: str, params: Mapping[str, Any] | None = None) -> int:
        return self.conn.execute(*self._bound(sql, params)).rowcount

    def insert_new(
        self, env_id: int, shared: dict[str, Any], rows: Sequence[ObservedRow]
    ) -> tuple[int, list[ObservedRow]]:
        if not bulk_rows.supported(self.conn.dialect):  # a driver bulk_rows is not written for
            return observed_inserts(self, env_id, shared, rows)
        inserted, existing = bulk_rows.insert_rows(self.conn, env_id, VARYING, shared, rows)
        return inserted, [tuple(r) for r in existing]


class EngineDriver:
    """Reads through the index's portable reader; each write one Core transaction."""

    def __init__(self, index: Index) -> None:
        self.index = index

    @property
    def reader(self) -> Reader:
        return self.index.reader

    @contextmanager
    def write(self) -> Iterator[_Statements]:
        with self.index.connection() as conn:
            yield _Statements(self.index, conn)

    def close(self) -> None:
        """The index is the context's: closed with it."""


def open_driver(index: object) -> EngineDriver | None:
    """The driver on the SQL index; None for another backend (the server's, over HTTP)."""
    return EngineDriver(index) if isinstance(index, Index) else None
