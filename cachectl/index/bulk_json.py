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
    columns: Sequence[str],
    width: int,
    constants: tuple[Any, ...],
    env_id: int,
    rows: Sequence[Row],
) -> tuple[int, list[Row]]:
    """Each batch tried whole under a savepoint, skipping keys that exist: if it inserted
    every row (nearly always), no key was looked up; else it is rolled back and its existing keys
    are found first. ``columns``: the quoted names, the ``width`` varying ones (the key first)
    then the constants'. ``execute``: SQLAlchemy's ``exec_driver_sql`` or a sqlite3 connection's
    ``execute`` (``constants`` bound for that driver); SQLite 3.38 or later."""
    table = TABLE
    lookup = (
        f"SELECT {key_column} FROM {table} WHERE environment_id = ? "
        f"AND {key_column} IN (SELECT value FROM json_each(?))"
    )
    inserted = 0
    existing: list[Row] = []
    for start in range(0, len(rows), _JSON_ROWS):
        chunk = rows[start : start + _JSON_ROWS]
        insert, payload = _statement(table, columns, width, constants, chunk)
        execute("SAVEPOINT bulk_rows")
        # "WHERE true": SQLite parses ON CONFLICT after a bare SELECT's FROM as a join's constraint
        if execute(f"{insert} WHERE true ON CONFLICT DO NOTHING", payload).rowcount == len(chunk):
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
            execute(*_statement(table, columns, width, constants, new))
            inserted += len(new)
    return inserted, existing


def _statement(
    table: str, columns: Sequence[str], width: int, constants: tuple[Any, ...], rows: Sequence[Row]
) -> tuple[str, tuple[Any, ...]]:
    """The ``INSERT ... SELECT`` of ``rows`` and its parameters. A varying column that holds one
    value (of one type) in every row is bound once like the constants, not read from the JSON:
    SQLite parses a row's JSON again for each ``json_extract`` (before 3.45), and a bundle's rows
    share their origin, creation time and most of their empty columns (2,000 rows: 15 ms against
    22 ms, BENCHMARKS.md "OCI")."""
    by_column = list(zip(*rows, strict=True))
    same = [i for i in range(1, width) if _one_value(by_column[i])]  # never the key
    read = [i for i in range(width) if i not in same]
    picks = ", ".join(f"json_extract(value, '$[{j}]')" for j in range(len(read)))
    names = [columns[i] for i in read] + [columns[i] for i in same] + list(columns[width:])
    bound = (*(rows[0][i] for i in same), *constants)
    insert = (
        f"INSERT INTO {table} ({', '.join(names)}) SELECT {picks}, {', '.join('?' * len(bound))} "
        "FROM json_each(?)"
    )
    payload = json.dumps(list(zip(*(by_column[i] for i in read), strict=True)), ensure_ascii=False)
    return insert, (*bound, payload)


def _one_value(values: tuple[Any, ...]) -> bool:
    """Whether ``values`` are one value of one type (1, 1.0 and True are three)."""
    try:
        return len(set(values)) == 1 and len(set(map(type, values))) == 1
    except TypeError:  # unhashable: read from the JSON as ever
        return False
