"""Index writes for `cachectl sync`: many new entry rows in one transaction, at driver speed.

``Index.upsert_entries`` builds every row through SQLAlchemy's per-row parameter
processing, most of a 100,000-entry sync's index time. Sync's new rows differ only
in key, module, size and sha256: the statement is compiled once, the columns every
row shares go through their type's bind processor once, and the rows go to the
driver's ``executemany`` as plain tuples (PostgreSQL: psycopg's pipelined
executemany). Keys that exist by the time the rows are written (a concurrent warm
or sync wrote them since planning) are left to ``upsert_entries``, so re-running
stays harmless and counts stay exact.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from cachectl.index import Index, NewEntry
from cachectl.index.models import Entry, utcnow

# A row sync observed: (key, module, size, sha256); a plain tuple, not a NewEntry per file.
ObservedRow = tuple[str, str, int, str]
_CHUNK = 500  # keys per existence query: under every driver's bound-parameter limit
# The row's own values (strings and integers: no driver needs them converted), then the shared ones.
_VARYING = ("key", "module", "size_bytes", "sha256")
_MARKS = {"qmark": "?", "format": "%s", "pyformat": "%s"}


def _bound(column_type: Any, dialect: Any, value: Any) -> Any:
    """A value as the column's type hands it to the driver (SQLite: datetimes as SQLAlchemy's text,
    not the sqlite3 module's deprecated default adapter). The cached processor chains a
    TypeDecorator's own conversion with its underlying type's, as a compiled statement does."""
    process = column_type._cached_bind_processor(dialect)
    return process(value) if process is not None else value


# SQLite has its JSON functions built in from 3.38 (before, only where compiled in).
_SQLITE_JSON = (3, 38, 0)
_JSON_ROWS = 10_000  # rows per SQLite statement: one JSON array of about 2 MB


def _insert_sqlite_json(
    conn: Any,
    table: str,
    key_column: str,
    columns: str,
    constants: tuple[Any, ...],
    env_id: int,
    rows: Sequence[ObservedRow],
) -> tuple[int, list[ObservedRow]]:
    """SQLite: (rows inserted, rows whose key exists). Each batch's rows go in one JSON array to one
    ``INSERT ... SELECT`` over ``json_each``: SQLite reads the rows itself, where executemany bound 14
    parameters a row from Python (a third of the insert's time), and the statement runs without
    holding the GIL. A batch is first tried whole under a savepoint, skipping keys that exist: if it
    inserted every row (nearly always: keys that exist were written by a warm or sync since the
    plan), no key was looked up; else it is rolled back and its existing keys are found first."""
    lookup = (
        f"SELECT {key_column} FROM {table} WHERE environment_id = ? "
        f"AND {key_column} IN (SELECT value FROM json_each(?))"
    )
    picks = ", ".join(f"json_extract(value, '$[{i}]')" for i in range(len(_VARYING)))
    insert = (
        f"INSERT INTO {table} ({columns}) SELECT {picks}, {', '.join('?' * len(constants))} "
        "FROM json_each(?)"
    )
    # "WHERE true": SQLite parses ON CONFLICT after a bare SELECT's FROM as a join's constraint
    insert_new = f"{insert} WHERE true ON CONFLICT DO NOTHING"
    inserted = 0
    existing: list[ObservedRow] = []
    for start in range(0, len(rows), _JSON_ROWS):
        chunk = rows[start : start + _JSON_ROWS]
        payload = json.dumps(chunk, ensure_ascii=False)
        conn.exec_driver_sql("SAVEPOINT sync_rows")
        if conn.exec_driver_sql(insert_new, (*constants, payload)).rowcount == len(chunk):
            conn.exec_driver_sql("RELEASE sync_rows")
            inserted += len(chunk)
            continue
        conn.exec_driver_sql("ROLLBACK TO sync_rows")
        conn.exec_driver_sql("RELEASE sync_rows")
        keys = json.dumps([r[0] for r in chunk], ensure_ascii=False)
        found = {k for (k,) in conn.exec_driver_sql(lookup, (env_id, keys))}
        new: list[ObservedRow] = []
        for r in chunk:
            if r[0] in found:
                existing.append(r)
            else:
                new.append(r)
        if new:
            conn.exec_driver_sql(insert, (*constants, json.dumps(new, ensure_ascii=False)))
            inserted += len(new)
    return inserted, existing


def observed_entry(row: ObservedRow) -> NewEntry:
    """The NewEntry of a row sync observed (for ``upsert_entries``)."""
    return NewEntry(key=row[0], module=row[1], size=row[2], sha256=row[3], origin="observed")


def insert_observed_entries(index: Index, env_id: int, rows: Sequence[NewEntry]) -> tuple[int, int]:
    """Record entries sync found in storage; returns (inserted, updated) like ``upsert_entries``.

    Every row gets the same ``created_at`` (now) and origin; other optional columns stay empty."""
    return insert_observed_rows(index, env_id, [(r.key, r.module, r.size, r.sha256) for r in rows])


def insert_observed_rows(index: Index, env_id: int, rows: Sequence[ObservedRow]) -> tuple[int, int]:
    """``insert_observed_entries`` for rows as sync reads them: plain tuples."""
    if not rows:
        return 0, 0
    table = Entry.__table__
    dialect = index.engine.dialect
    mark = _MARKS.get(dialect.paramstyle)
    if mark is None:  # a driver this module was not written for: the general path
        return index.upsert_entries(env_id, [observed_entry(r) for r in rows])
    shared: dict[str, Any] = {
        "environment_id": env_id,
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
    constants = tuple(_bound(table.c[name].type, dialect, value) for name, value in shared.items())
    columns = ", ".join(dialect.identifier_preparer.quote(name) for name in (*_VARYING, *shared))
    sql = f"INSERT INTO {table.name} ({columns}) VALUES ({', '.join([mark] * (len(_VARYING) + len(shared)))})"
    key_column = dialect.identifier_preparer.quote("key")
    if (
        dialect.name == "sqlite"
        and getattr(dialect.dbapi, "sqlite_version_info", (0,)) >= _SQLITE_JSON
    ):
        with index.session() as s:
            inserted, existing = _insert_sqlite_json(
                s.connection(), table.name, key_column, columns, constants, env_id, rows
            )
        return _with_existing(index, env_id, inserted, existing)
    with index.session() as s:
        inserted, existing = _insert_executemany(
            s.connection(), table.name, key_column, mark, sql, constants, env_id, rows
        )
    return _with_existing(index, env_id, inserted, existing)


def _insert_executemany(
    conn: Any,
    table: str,
    key_column: str,
    mark: str,
    sql: str,
    constants: tuple[Any, ...],
    env_id: int,
    rows: Sequence[ObservedRow],
) -> tuple[int, list[ObservedRow]]:
    """Other drivers (psycopg: a pipelined executemany): (rows inserted, rows whose key exists)."""
    inserted = 0
    existing: list[ObservedRow] = []
    for start in range(0, len(rows), _CHUNK):
        chunk = rows[start : start + _CHUNK]
        # Which of these keys exist: a driver-level query too (an ORM IN query per 500 keys cost
        # a tenth of the insert in compiling alone).
        lookup = (
            f"SELECT {key_column} FROM {table} WHERE environment_id = {mark} "
            f"AND {key_column} IN ({', '.join([mark] * len(chunk))})"
        )
        found = {k for (k,) in conn.exec_driver_sql(lookup, (env_id, *(r[0] for r in chunk)))}
        params: list[Any] = []
        for r in chunk:
            if r[0] in found:
                existing.append(r)
                continue
            params.append((*r, *constants))
        if params:
            conn.exec_driver_sql(sql, params)
            inserted += len(params)
    return inserted, existing


def _with_existing(
    index: Index, env_id: int, inserted: int, existing: list[ObservedRow]
) -> tuple[int, int]:
    """(inserted, updated) once the rows whose keys exist (written since sync planned) are upserted."""
    if not existing:
        return inserted, 0
    more, updated = index.upsert_entries(env_id, [observed_entry(r) for r in existing])
    return inserted + more, updated
