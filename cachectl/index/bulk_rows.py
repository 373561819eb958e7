"""Many new entry rows at driver speed: what sync and every large upsert insert.

SQLAlchemy processes every parameter of every row (14 columns a row), most of a large insert's
time. Here the statement is compiled once, the columns every row shares go through their type's
bind processor once, and the rows reach the driver as plain tuples: on SQLite (3.38+) one JSON
array per 10,000 rows to one ``INSERT ... SELECT`` over ``json_each``, which SQLite reads without
binding a parameter a value from Python and runs without holding the GIL (``bulk_json``); elsewhere the driver's
``executemany`` (psycopg pipelines it). A row whose key exists already is never written here: it
is returned, for the caller's upsert, so re-running stays harmless and counts stay exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from json import encoder as json_encoder
from json.encoder import encode_basestring_ascii
from typing import Any

from sqlalchemy.engine import Connection

from cachectl.index.bulk_json import TABLE, insert_json
from cachectl.index.models import Entry

Row = tuple[Any, ...]  # the varying columns' values as the driver takes them, the key first
_CHUNK = 500  # keys per existence query: under every driver's bound-parameter limit
_MARKS = {"qmark": "?", "format": "%s", "pyformat": "%s"}
# SQLite has its JSON functions built in from 3.38 (before, only where compiled in).
_SQLITE_JSON = (3, 38, 0)


def bind_processor(column: str, dialect: Any) -> Any:
    """How ``entries.column``'s type hands a value to the driver (None: as it is). SQLite's
    datetimes become SQLAlchemy's text, not the sqlite3 module's deprecated default adapter; the
    cached processor chains a TypeDecorator's own conversion with its underlying type's, as a
    compiled statement does."""
    return Entry.__table__.c[column].type._cached_bind_processor(dialect)


def json_processor(column: str, dialect: Any) -> Any:
    """``bind_processor`` of the JSON column ``entries.column``, with the same text for a dict or
    list value from one reused C encoder where that processor is plain ``json.dumps`` (no
    serializer of the engine's own, no string processing: SQLite). ``json.dumps`` builds an
    encoder per call, most of its time for a bucket of a few keys: 2,000 buckets took 1.7 ms
    against 5.2 ms (timeit); a bundle's rows each have one (BENCHMARKS.md, "OCI")."""
    process = bind_processor(column, dialect)
    as_text = getattr(Entry.__table__.c[column].type, "_str_impl", None)
    if (
        process is None
        or _C_ENCODER is None
        or as_text is None
        or getattr(dialect, "_json_serializer", None) is not None
        or as_text.bind_processor(dialect) is not None
    ):
        return process
    # json.dumps' defaults: ASCII only, ", " and ": ", keys as given, NaN allowed; no
    # circular check (a value read from JSON holds no cycle; one that did would recurse).
    encode = _C_ENCODER(
        None, _JSON_DEFAULT, encode_basestring_ascii, None, ": ", ", ", False, False, True
    )

    def dumps(value: Any) -> Any:
        if type(value) is dict or type(value) is list:
            return "".join(encode(value, 0))
        return process(value)

    return dumps


_C_ENCODER = getattr(json_encoder, "c_make_encoder", None)  # None without CPython's _json
_JSON_DEFAULT = json_encoder.JSONEncoder().default  # raises TypeError, as json.dumps does


def bound(column: str, dialect: Any, value: Any) -> Any:
    """``value`` as ``entries.column``'s type hands it to the driver."""
    process = bind_processor(column, dialect)
    return process(value) if process is not None else value


def supported(dialect: Any) -> bool:
    """Whether this module knows the driver's parameter style (else the caller's general path)."""
    return dialect.paramstyle in _MARKS


def insert_rows(
    conn: Connection,
    env_id: int,
    varying: Sequence[str],
    shared: dict[str, Any],
    rows: Sequence[Row],
) -> tuple[int, list[Row]]:
    """Insert ``rows`` (values of the ``varying`` columns, ``key`` first) into environment
    ``env_id``'s entries, each with the ``shared`` columns' values (bound here, once); returns
    (rows inserted, rows whose key exists). The driver must be ``supported``."""
    if not rows:
        return 0, []
    assert varying[0] == "key"
    dialect = conn.dialect
    shared = {"environment_id": env_id, **shared}
    constants = tuple(bound(name, dialect, value) for name, value in shared.items())
    quote = dialect.identifier_preparer.quote
    columns = [quote(name) for name in (*varying, *shared)]
    key_column = quote("key")
    if (
        dialect.name == "sqlite"
        and getattr(dialect.dbapi, "sqlite_version_info", (0,)) >= _SQLITE_JSON
    ):
        return insert_json(
            conn.exec_driver_sql, key_column, columns, len(varying), constants, env_id, rows
        )
    mark = _MARKS[dialect.paramstyle]
    sql = (
        f"INSERT INTO {TABLE} ({', '.join(columns)}) "
        f"VALUES ({', '.join([mark] * (len(varying) + len(constants)))})"
    )
    return _insert_executemany(conn, TABLE, key_column, mark, sql, constants, env_id, rows)


def _insert_executemany(
    conn: Connection,
    table: str,
    key_column: str,
    mark: str,
    sql: str,
    constants: tuple[Any, ...],
    env_id: int,
    rows: Sequence[Row],
) -> tuple[int, list[Row]]:
    """Other drivers (psycopg: a pipelined executemany), a lookup of existing keys per 500 rows (a
    driver-level query: an ORM IN query per 500 keys cost a tenth of the insert in compiling)."""
    inserted = 0
    existing: list[Row] = []
    for start in range(0, len(rows), _CHUNK):
        chunk = rows[start : start + _CHUNK]
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
