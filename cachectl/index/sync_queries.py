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

from collections.abc import Sequence
from typing import Any

from cachectl.index import Index, NewEntry
from cachectl.index.models import Entry, utcnow

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


def insert_observed_entries(index: Index, env_id: int, rows: Sequence[NewEntry]) -> tuple[int, int]:
    """Record entries sync found in storage; returns (inserted, updated) like ``upsert_entries``.

    Every row gets the same ``created_at`` (now) and origin; other optional columns stay empty."""
    if not rows:
        return 0, 0
    table = Entry.__table__
    dialect = index.engine.dialect
    mark = _MARKS.get(dialect.paramstyle)
    if mark is None:  # a driver this module was not written for: the general path
        return index.upsert_entries(env_id, rows)
    shared: dict[str, Any] = {"environment_id": env_id, "origin": "observed", "created_at": utcnow(),
                              "hit_count": 0, "compile_time_ms": None, "function": None, "bucket": None,
                              "warm_run_id": None, "aot_size_bytes": None, "aot_sha256": None}
    constants = tuple(_bound(table.c[name].type, dialect, value) for name, value in shared.items())
    columns = ", ".join(dialect.identifier_preparer.quote(name) for name in (*_VARYING, *shared))
    sql = f"INSERT INTO {table.name} ({columns}) VALUES ({', '.join([mark] * (len(_VARYING) + len(shared)))})"
    key_column = dialect.identifier_preparer.quote("key")
    inserted = 0
    existing: list[NewEntry] = []
    with index.session() as s:
        conn = s.connection()
        for start in range(0, len(rows), _CHUNK):
            chunk = rows[start:start + _CHUNK]
            # Which of these keys exist: a driver-level query too (an ORM IN query per 500 keys cost
            # a tenth of the insert in compiling alone).
            lookup = (f"SELECT {key_column} FROM {table.name} WHERE environment_id = {mark} "
                      f"AND {key_column} IN ({', '.join([mark] * len(chunk))})")
            found = {k for (k,) in conn.exec_driver_sql(lookup, (env_id, *(r.key for r in chunk)))}
            params: list[Any] = []
            for r in chunk:
                if r.key in found:
                    existing.append(r)
                    continue
                params.append((r.key, r.module, r.size, r.sha256, *constants))
            if params:
                conn.exec_driver_sql(sql, params)
                inserted += len(params)
    if existing:
        more, updated = index.upsert_entries(env_id, existing)
        return inserted + more, updated
    return inserted, 0
