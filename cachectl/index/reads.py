"""The index's read queries, written once in portable SQL and run by either driver.

A query here is SQL text with ``:name`` parameters (a list parameter expands to ``(:p_0, ...)``)
that SQLite and PostgreSQL both run as written. Two :class:`Reader` s run it: the SQL index's
engine (cachectl.index.sql.EngineReader, any database) and :class:`SqliteReader`, the stdlib
driver's (cachectl.index.stdlib) on a plain ``sqlite:///PATH`` index at SCHEMA_REVISION. Both
drivers inherit :class:`ReaderQueries`, the queries an IndexBackend answers. The CLI's read
commands (``ls``, ``stats``, ``cache list``, ``prune --dry-run``) take the second and never import SQLAlchemy,
which costs more than the whole command otherwise (BENCHMARKS.md, "CLI startup"). Values come
back as each driver gives them (SQLite: text for times and JSON); :func:`when` and
:func:`from_json` read both.
"""

from __future__ import annotations

import re
import sqlite3
import threading
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

from cachectl.core.cache_info import CACHE_COLUMNS, CacheInfo
from cachectl.core.errors import NotFound, Unreachable
from cachectl.core.fingerprint import ENVIRONMENT_FIELDS, Environment
from cachectl.core.records import EnvironmentInfo, pick_environment, proofs_from_row
from cachectl.core.sqlite_file import connect, from_json, sqlite_path, stamp, when


class Reader(Protocol):
    """Runs one read statement and returns its rows (tuples, or rows indexed like tuples)."""

    @property
    def dialect(self) -> str: ...

    def rows(self, sql: str, params: Mapping[str, Any] | None = None) -> Sequence[Any]: ...


class HasReader(Protocol):
    """An index that can run this module's queries (the sqlalchemy and stdlib drivers)."""

    @property
    def reader(self) -> Reader: ...


# -- values -------------------------------------------------------------------------------------


def total(dialect: str, column: str) -> str:
    """SUM of a counter column that can never fail: SQLite's SUM raises "integer overflow" past
    2**63, its TOTAL() is a float that cannot; PostgreSQL's SUM(bigint) is numeric already."""
    return f"TOTAL({column})" if dialect == "sqlite" else f"COALESCE(SUM({column}), 0)"


# An entry's bytes with its stored executable's: the one unit limits, gc and prune count
# (cachectl.index.sql.unit_size is the same sum for SQLAlchemy's statements).
UNIT_SIZE = "size_bytes + COALESCE(aot_size_bytes, 0)"


# -- the stdlib driver --------------------------------------------------------------------------

_LIST_PARAM = re.compile(r":([A-Za-z_][A-Za-z0-9_]*)\b")


def expand(sql: str, params: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``sql`` with each list parameter spelled out, ``IN :ids`` -> ``IN (:ids_0, :ids_1)``."""
    out: dict[str, Any] = {}
    lists: dict[str, Sequence[Any]] = {}
    for name, value in params.items():
        if isinstance(value, list | tuple):
            lists[name] = value
            out.update({f"{name}_{i}": v for i, v in enumerate(value)})
        else:
            out[name] = value
    if lists:

        def spelled(m: re.Match[str]) -> str:
            name = m.group(1)
            if name not in lists:
                return m.group(0)
            return "(" + ", ".join(f":{name}_{i}" for i in range(len(lists[name]))) + ")"

        sql = _LIST_PARAM.sub(spelled, sql)
    return sql, out


class SqliteReader:
    """The stdlib driver on an SQLite index, for reads only (``PRAGMA query_only``). No
    transaction is held between statements, so each sees what writers committed before it.
    Opened read-write, as the SQL index opens it, so that closing the last connection
    checkpoints the WAL and removes ``-wal``/``-shm`` (a ``mode=ro`` connection leaves them)."""

    dialect = "sqlite"

    def __init__(
        self, conn: sqlite3.Connection, path: str = "?", lock: threading.RLock | None = None
    ) -> None:
        self.conn = conn
        self.path = path
        # Shared with the connection's writers (StdlibReads): one statement at a time.
        self._lock = lock or threading.RLock()

    @classmethod
    def open(cls, url: str) -> SqliteReader | None:
        """A reader on ``url``, or None where the stdlib cannot serve it: not a plain SQLite file,
        no file yet, another schema revision (the SQLAlchemy index creates and migrates)."""
        conn = connect(url, "query_only = ON")
        return None if conn is None else cls(conn, str(sqlite_path(url)))

    def rows(self, sql: str, params: Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]:
        sql, bound = expand(sql, params or {})
        values = {k: stamp(v) if isinstance(v, datetime) else v for k, v in bound.items()}
        try:
            with self._lock:
                return self.conn.execute(sql, values).fetchall()
        except sqlite3.Error as exc:  # as the SQL index reports its failures
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise Unreachable(f"index sqlite:///{self.path} failed: {first}") from exc

    def close(self) -> None:
        self.conn.close()


# -- caches -------------------------------------------------------------------------------------

_CACHE_SELECT = ", ".join(CACHE_COLUMNS)


def no_such_cache(reader: Reader, name: str) -> NotFound:
    known = ", ".join(r[0] for r in reader.rows("SELECT name FROM caches ORDER BY name")) or "none"
    return NotFound(
        f"no cache named {name!r} (known: {known}): add it with `cachectl cache add {name} URL`"
    )


def cache_id(reader: Reader, cache: str) -> int:
    rows = reader.rows("SELECT id FROM caches WHERE name = :name", {"name": cache})
    if not rows:
        raise no_such_cache(reader, cache)
    return int(rows[0][0])


# -- environments -------------------------------------------------------------------------------

_ENV_COLUMNS = (
    ", ".join(f"e.{c}" for c in ("id", "digest", "namespace", *ENVIRONMENT_FIELDS))
    + ", e.created_at, e.last_seen_at, e.deleted_at"
)


def environment(row: Sequence[Any]) -> Environment:
    """The fingerprint fields of an ``environments`` row (``_ENV_COLUMNS`` from the fourth on)."""
    return Environment.from_columns(row[3 : 3 + len(ENVIRONMENT_FIELDS)])


class ReaderQueries:
    """The read queries both SQL drivers run over ``reader`` (the SQL text written once): the
    SQLAlchemy index (cachectl.index.sql.Index) and the stdlib one (cachectl.index.stdlib) inherit them."""

    @property
    def reader(self) -> Reader:
        raise NotImplementedError

    def get_cache(self, name: str) -> CacheInfo:
        rows = self.reader.rows(
            f"SELECT {_CACHE_SELECT} FROM caches WHERE name = :name", {"name": name}
        )
        if not rows:
            raise no_such_cache(self.reader, name)
        return CacheInfo.from_row(rows[0])

    def list_caches(self) -> list[CacheInfo]:
        return [
            CacheInfo.from_row(r)
            for r in self.reader.rows(f"SELECT {_CACHE_SELECT} FROM caches ORDER BY name")
        ]

    def environment_stats(
        self, cache: str, *, include_deleted: bool = False
    ) -> list[EnvironmentInfo]:
        """Environments of a cache with entry counts, bytes, stored executables and last access."""
        return self._environment_stats(cache, include_deleted, None)

    def _environment_stats(
        self, cache: str, include_deleted: bool, prefix: str | None
    ) -> list[EnvironmentInfo]:
        """``environment_stats``, of the environments whose digest starts with ``prefix`` (hex,
        checked by pick_environment) when given: the totals are summed over their entries
        alone, not over the whole cache's, which one environment's lookup (an install, a pull)
        does not need (0.9 CPU s at 1,000,000 rows in SQLite; BENCHMARKS.md, "Planning")."""
        cid = cache_id(self.reader, cache)
        live = "" if include_deleted else " AND e.deleted_at IS NULL"
        only, only_e = (
            ("", "")
            if prefix is None
            else (" AND digest LIKE :prefix", " AND e.digest LIKE :prefix")
        )
        sql = (
            f"SELECT {_ENV_COLUMNS}, a.n, a.b, a.la, a.x, a.xb, e.proof FROM environments e "
            "LEFT OUTER JOIN (SELECT environment_id, COUNT(id) AS n, "
            f"COALESCE(SUM({UNIT_SIZE}), 0) AS b, MAX(COALESCE(last_access_at, created_at)) AS la, "
            "COUNT(aot_sha256) AS x, COALESCE(SUM(aot_size_bytes), 0) AS xb FROM entries "
            f"WHERE environment_id IN (SELECT id FROM environments WHERE cache_id = :cid{only}) "
            "GROUP BY environment_id) a ON a.environment_id = e.id "
            f"WHERE e.cache_id = :cid{live}{only_e} "
            "ORDER BY e.jax_version, e.backend, e.created_at"
        )
        params: dict[str, Any] = {"cid": cid}
        if prefix is not None:
            params["prefix"] = prefix + "%"
        n = len(ENVIRONMENT_FIELDS)
        return [
            EnvironmentInfo(
                id=int(r[0]),
                cache=cache,
                digest=r[1],
                namespace=r[2],
                environment=environment(r),
                created_at=when(r[3 + n]),
                last_seen_at=when(r[4 + n]),
                deleted_at=when(r[5 + n]),
                entries=int(r[6 + n] or 0),
                bytes=int(r[7 + n] or 0),
                last_access_at=when(r[8 + n]),
                executables=int(r[9 + n] or 0),
                aot_bytes=int(r[10 + n] or 0),
                **proofs_from_row(from_json(r[11 + n])),
            )
            for r in self.reader.rows(sql, params)
        ]

    def find_environment(
        self, cache: str, prefix: str, *, include_deleted: bool = False
    ) -> EnvironmentInfo:
        """One environment by digest prefix; ambiguous or unknown prefixes are bad input."""
        return pick_environment(
            cache,
            prefix,
            lambda checked: self._environment_stats(cache, include_deleted, checked),
        )

    def get_environment(self, cache: str, digest: str) -> EnvironmentInfo:
        return self.find_environment(cache, digest)

    def content_signature(self, env_id: int) -> dict[str, Any] | None:
        """The environment's signed content list as last signed (cachectl/trust/signing.py), or None."""
        rows = self.reader.rows(
            "SELECT content_signature FROM environments WHERE id = :id", {"id": env_id}
        )
        return from_json(rows[0][0]) if rows and rows[0][0] is not None else None


class Queries(ReaderQueries):
    """The read queries over any Reader (for callers that hold a reader, not an index)."""

    def __init__(self, reader: Reader) -> None:
        self._reader = reader

    @property
    def reader(self) -> Reader:
        return self._reader


# -- what a service loads -----------------------------------------------------------------------


def executable_digests(
    reader: Reader, env_id: int
) -> dict[str, tuple[str, str | None, str | None]]:
    """key -> (entry sha256, stored executable sha256, warm-check's unusable mark) of every entry:
    what cachectl.serving checks files against before it loads one."""
    rows = reader.rows(
        "SELECT key, sha256, aot_sha256, aot_unusable FROM entries WHERE environment_id = :id",
        {"id": env_id},
    )
    return {key: (sha, aot, unusable) for key, sha, aot, unusable in rows}
