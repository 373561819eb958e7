"""SQLite's bulk insert of new entry rows, one statement per 10,000 rows, through any driver.

The rows reach SQLite as one JSON array to one ``INSERT ... SELECT`` over ``json_each``, which
SQLite reads without binding a parameter a value from Python and runs without holding the GIL.
Apart from cachectl.index.bulk_rows (SQLAlchemy's bind processors, other databases) so that sync's
stdlib driver (cachectl.index.sync_stdlib) runs the same statements through the sqlite3 module.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

Row = tuple[Any, ...]  # the varying columns' values as the driver takes them, the key first
TABLE = "entries"
_JSON_ROWS = 10_000  # rows per statement: one JSON array of a few MB
# Runs one driver-level statement with positional parameters; returns a cursor (rowcount, rows).
Execute = Callable[..., Any]


def insert_json(
    execute: Execute,
    key_column: str,
    columns: str,
    width: int,
    constants: tuple[Any, ...],
    env_id: int,
    rows: Sequence[Row],
) -> tuple[int, list[Row]]:
    """Each batch tried whole under a savepoint, skipping keys that exist: if it inserted
    every row (nearly always), no key was looked up; else it is rolled back and its existing keys
    are found first. ``execute``: SQLAlchemy's ``exec_driver_sql`` or a sqlite3 connection's
    ``execute`` (``constants`` bound for that driver); SQLite 3.38 or later."""
    table = TABLE
    lookup = (
        f"SELECT {key_column} FROM {table} WHERE environment_id = ? "
        f"AND {key_column} IN (SELECT value FROM json_each(?))"
    )
    picks = ", ".join(f"json_extract(value, '$[{i}]')" for i in range(width))
    insert = (
        f"INSERT INTO {table} ({columns}) SELECT {picks}, {', '.join('?' * len(constants))} "
        "FROM json_each(?)"
    )
    # "WHERE true": SQLite parses ON CONFLICT after a bare SELECT's FROM as a join's constraint
    insert_new = f"{insert} WHERE true ON CONFLICT DO NOTHING"
    inserted = 0
    existing: list[Row] = []
    for start in range(0, len(rows), _JSON_ROWS):
        chunk = rows[start : start + _JSON_ROWS]
        payload = json.dumps(chunk, ensure_ascii=False)
        execute("SAVEPOINT bulk_rows")
        if execute(insert_new, (*constants, payload)).rowcount == len(chunk):
            execute("RELEASE bulk_rows")
            inserted += len(chunk)
            continue
        execute("ROLLBACK TO bulk_rows")
        execute("RELEASE bulk_rows")
        keys = json.dumps([r[0] for r in chunk], ensure_ascii=False)
        found = {k for (k,) in execute(lookup, (env_id, keys))}
        new: list[Row] = []
        for r in chunk:
            if r[0] in found:
                existing.append(r)
            else:
                new.append(r)
        if new:
            execute(insert, (*constants, json.dumps(new, ensure_ascii=False)))
            inserted += len(new)
    return inserted, existing
