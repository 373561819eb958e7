"""The compile lease's statements: one row per (cache/environment, key) in ``compile_leases``.

Written once as SQL text, run by whichever driver the process holds: the stdlib driver's
sqlite3 connection (a service on an SQLite file imports no SQLAlchemy), or the SQLAlchemy index
(PostgreSQL, or SQLite behind it); the server runs the same calls for a process in server mode
(server/lease_routes.py). The take is one atomic statement on both databases, as
cachectl/lifecycle/lease.py's: ``INSERT ... ON CONFLICT DO UPDATE ... WHERE expired
RETURNING``, so of several takers only one sees its row come back. It runs only when a plain read
of the row finds it takeable: on PostgreSQL, ``ON CONFLICT DO UPDATE`` locks the row even when its
WHERE is false, so hundreds of takers of a key another holds would queue on that lock, and the
holder's heartbeat behind them (bench/lease_scale.py measured leases expiring under live holders).
PostgreSQL's clock decides expiry there (hosts with skewed clocks agree); on SQLite, one file on
one host, this process's.

States: ``compiling`` (held until ``expires_at``; the holder's heartbeat pushes it out),
``written`` (the entry is stored; ``sha256`` is its digest) and ``unwritten`` (the compile ended
without an entry: JAX did not write it, or it failed). A finished row stays for RETAIN_S, so a
waiter that polls late still reads the outcome; rows expired a day are deleted at the next take.

Bounds: a take or renew asks for at most ``max_ttl_s`` (MAX_TTL_S, or the server's setting; a
larger ask is clamped), so a holder whose heartbeat stops loses the lease within it whatever it
asked; only the holder finishes or releases its lease (and a hedger records its write); on
PostgreSQL each transaction waits at most LOCK_TIMEOUT_MS for a lock and STATEMENT_TIMEOUT_MS for
a statement (SET LOCAL), on SQLite at most the connection's busy timeout; past it the call raises
and the caller turns the lease off for its process.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from cachectl.core.cache_info import utcnow
from cachectl.core.sqlite_file import stamp

# How long a finished row answers late waiters (and spares a later miss a compile: `written`).
RETAIN_S = 3600.0
# Rows expired this long ago are deleted by the next take.
PURGE_AFTER_S = 86400.0
# The longest ttl a take or renew is granted (the server's CACHECTL_SERVER_LEASE_MAX_TTL): a holder
# whose heartbeat stops loses its lease within this, whatever ttl it asked for.
MAX_TTL_S = 60.0
# How long one lease transaction on PostgreSQL waits for a row lock, and how long one statement may
# run: a lease that cannot answer within them is turned off for the process, not awaited.
LOCK_TIMEOUT_MS = 2000
STATEMENT_TIMEOUT_MS = 5000
COMPILING, WRITTEN, UNWRITTEN = "compiling", "written", "unwritten"


@dataclass(frozen=True)
class Seen:
    """A lease row as one caller saw it. ``mine``: this call took it. ``age_s``: since the holder
    took it; ``left_s``: until it expires (negative: expired, the heartbeat stopped).
    ``compile_ms``: the key's last finished compile (a waiter's hedge bound without another call;
    None where none finished, or from a server that does not say)."""

    mine: bool
    holder: str
    state: str
    sha256: str | None
    hedger: str | None
    age_s: float
    left_s: float
    compile_ms: int | None = None

    def takeable(self, stale_sha256: str | None) -> bool:
        """Whether a take would win this row: expired, or ``written`` with the stale digest."""
        return self.left_s <= 0 or (
            self.state == WRITTEN and stale_sha256 is not None and self.sha256 == stale_sha256
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "mine": self.mine,
            "holder": self.holder,
            "state": self.state,
            "sha256": self.sha256,
            "hedger": self.hedger,
            "age_s": self.age_s,
            "left_s": self.left_s,
            "compile_ms": self.compile_ms,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Seen:
        return cls(
            bool(doc["mine"]),
            str(doc["holder"]),
            str(doc["state"]),
            doc.get("sha256"),
            doc.get("hedger"),
            float(doc["age_s"]),
            float(doc["left_s"]),
            int(doc["compile_ms"]) if doc.get("compile_ms") is not None else None,
        )


class _Sql:
    """The time expressions of one dialect: the database's clock on PostgreSQL, bound
    parameters on SQLite (its DateTime columns are text that sorts as time)."""

    def __init__(self, dialect: str) -> None:
        self.postgres = dialect == "postgresql"

    def now(self) -> str:
        return "now()" if self.postgres else ":now"

    def later(self, param: str) -> str:
        return f"now() + make_interval(secs => :{param})" if self.postgres else f":{param}_at"

    def seconds_since(self, column: str) -> str:
        if self.postgres:
            return f"EXTRACT(EPOCH FROM (now() - {column}))"
        return f"(julianday(:now) - julianday({column})) * 86400.0"

    def seconds_until(self, column: str) -> str:
        if self.postgres:
            return f"EXTRACT(EPOCH FROM ({column} - now()))"
        return f"(julianday({column}) - julianday(:now)) * 86400.0"

    def params(self, **values: Any) -> dict[str, Any]:
        """``values`` with what SQLite binds for the time expressions: now, and each ``*_s``
        duration as ``*_s_at`` (now plus it)."""
        if self.postgres:
            return values
        now = utcnow()
        out = dict(values, now=stamp(now))
        for name, value in values.items():
            if name.endswith("_s") and isinstance(value, int | float):
                out[name + "_at"] = stamp(now + timedelta(seconds=float(value)))
        return out


class Runner:
    """Runs the statements in one transaction each, on whichever driver the index is."""

    def __init__(self, dialect: str, transaction: Callable[[], Any]) -> None:
        self.sql = _Sql(dialect)
        self._transaction = transaction

    @contextmanager
    def tx(self) -> Iterator[Any]:
        with self._transaction() as run:
            yield run


def _sqlite3_tx(conn: sqlite3.Connection, lock: Any) -> Callable[[], Any]:
    @contextmanager
    def tx() -> Iterator[Callable[[str, dict[str, Any]], tuple[Sequence[Any], int]]]:
        with lock, conn:
            conn.execute("BEGIN IMMEDIATE")  # waits at most the connection's busy timeout

            def run(sql: str, params: dict[str, Any]) -> tuple[Sequence[Any], int]:
                cur = conn.execute(sql, params)
                rows = cur.fetchall()
                return rows, cur.rowcount

            yield run

    return tx


def _engine_tx(index: Any) -> Callable[[], Any]:
    from sqlalchemy import text

    @contextmanager
    def tx() -> Iterator[Callable[[str, dict[str, Any]], tuple[Sequence[Any], int]]]:
        with index.connection() as conn:
            if index.dialect == "postgresql":  # a held row lock costs at most the lock timeout
                conn.execute(text(f"SET LOCAL lock_timeout = {LOCK_TIMEOUT_MS}"))
                conn.execute(text(f"SET LOCAL statement_timeout = {STATEMENT_TIMEOUT_MS}"))

            def run(sql: str, params: dict[str, Any]) -> tuple[Sequence[Any], int]:
                result = conn.execute(text(sql), params)
                rows = result.fetchall() if result.returns_rows else []
                return rows, result.rowcount

            yield run

    return tx


def runner_for(index: Any) -> Runner | None:
    """The runner for an index a process holds: the stdlib driver's connection, else the
    SQLAlchemy index's engine; None for one that runs no SQL here (the server's http driver)."""
    conn = getattr(index, "conn", None)
    if isinstance(conn, sqlite3.Connection):
        return Runner("sqlite", _sqlite3_tx(conn, index._lock))
    if getattr(index, "engine", None) is not None:
        return Runner(index.dialect, _engine_tx(index))
    return None


_COLUMNS = "holder, state, sha256, hedger, {age} AS age_s, {left} AS left_s, compile_ms"


def _seen(sql: _Sql, run: Any, scope: str, key: str, mine: bool) -> Seen | None:
    cols = _COLUMNS.format(
        age=sql.seconds_since("acquired_at"), left=sql.seconds_until("expires_at")
    )
    rows, _ = run(
        f"SELECT {cols} FROM compile_leases WHERE scope = :scope AND key = :key",
        sql.params(scope=scope, key=key),
    )
    if not rows:
        return None
    holder, state, sha, hedger, age, left, ms = rows[0]
    return Seen(
        mine,
        holder,
        state,
        sha,
        hedger,
        float(age or 0.0),
        float(left or 0.0),
        int(ms) if ms is not None else None,
    )


def take(
    r: Runner,
    scope: str,
    key: str,
    holder: str,
    *,
    ttl_s: float,
    module: str | None,
    stale_sha256: str | None = None,
    max_ttl_s: float = MAX_TTL_S,
) -> Seen | None:
    """Take the lease when nobody holds it (no row, or it expired, or it says ``written`` with
    ``stale_sha256``, an entry the caller found gone or different); else the row as it is. None
    only when the row vanished between the two statements (the caller asks again). The lease
    lives ``ttl_s``, at most ``max_ttl_s``. The row keeps the key's last ``compile_ms``."""
    sql = r.sql
    ttl_s = min(ttl_s, max_ttl_s)
    statement = (
        "INSERT INTO compile_leases (scope, key, holder, state, module, acquired_at, expires_at) "
        f"VALUES (:scope, :key, :holder, '{COMPILING}', :module, {sql.now()}, {sql.later('ttl_s')}) "
        "ON CONFLICT (scope, key) DO UPDATE SET holder = excluded.holder, "
        f"state = '{COMPILING}', module = excluded.module, hedger = NULL, sha256 = NULL, "
        "acquired_at = excluded.acquired_at, expires_at = excluded.expires_at "
        f"WHERE compile_leases.expires_at <= {sql.now()} OR (compile_leases.state = '{WRITTEN}' "
        "AND compile_leases.sha256 = :stale) RETURNING holder"
    )
    with r.tx() as run:
        seen = _seen(sql, run, scope, key, False)  # a plain read: no row lock
        if seen is not None and not seen.takeable(stale_sha256):
            return seen  # held, or written: what nearly every taker of a shared key finds
        got, _ = run(
            statement,
            sql.params(
                scope=scope, key=key, holder=holder, module=module, ttl_s=ttl_s, stale=stale_sha256
            ),
        )
        if got:
            run(
                f"DELETE FROM compile_leases WHERE expires_at < {sql.later('purge_s')}",
                sql.params(purge_s=-PURGE_AFTER_S),
            )
        return _seen(sql, run, scope, key, bool(got))


def look(r: Runner, scope: str, key: str) -> Seen | None:
    """The row as it is (a waiter's poll, a read-only process's only question)."""
    with r.tx() as run:
        return _seen(r.sql, run, scope, key, False)


def renew(
    r: Runner, scope: str, key: str, holder: str, *, ttl_s: float, max_ttl_s: float = MAX_TTL_S
) -> bool:
    """The heartbeat: push the expiry out (at most ``max_ttl_s``); False once the lease is not
    this holder's compile."""
    sql = r.sql
    ttl_s = min(ttl_s, max_ttl_s)
    with r.tx() as run:
        _, n = run(
            f"UPDATE compile_leases SET expires_at = {sql.later('ttl_s')} WHERE scope = :scope "
            f"AND key = :key AND holder = :holder AND state = '{COMPILING}'",
            sql.params(scope=scope, key=key, holder=holder, ttl_s=ttl_s),
        )
    return n > 0


def release(r: Runner, scope: str, key: str, holder: str) -> bool:
    """End ``holder``'s compile now, as if its heartbeat had stopped a ttl ago: its process
    exits, or is gone from this host (a waiter saw it). The next take wins it; True if it was
    ``holder``'s compile."""
    sql = r.sql
    with r.tx() as run:
        _, n = run(
            f"UPDATE compile_leases SET expires_at = {sql.now()} WHERE scope = :scope "
            f"AND key = :key AND holder = :holder AND state = '{COMPILING}'",
            sql.params(scope=scope, key=key, holder=holder),
        )
    return n > 0


def hedge(r: Runner, scope: str, key: str, who: str) -> bool:
    """Claim the one hedge of a compile in progress: True for the one waiter that compiles too."""
    with r.tx() as run:
        _, n = run(
            f"UPDATE compile_leases SET hedger = :who WHERE scope = :scope AND key = :key "
            f"AND state = '{COMPILING}' AND hedger IS NULL",
            {"scope": scope, "key": key, "who": who},
        )
    return n > 0


def owners(r: Runner, scope: str, key: str) -> tuple[str, str | None] | None:
    """(holder, hedger) of the key's row; None when there is none (the server's check that only
    the holder finishes or releases, and only it or its hedger records a write)."""
    with r.tx() as run:
        rows, _ = run(
            "SELECT holder, hedger FROM compile_leases WHERE scope = :scope AND key = :key",
            {"scope": scope, "key": key},
        )
    return (str(rows[0][0]), rows[0][1]) if rows else None


def finish(
    r: Runner,
    scope: str,
    key: str,
    holder: str,
    *,
    sha256: str | None,
    compile_ms: int | None,
) -> bool:
    """The compile ended: ``written`` with the sha256 of the bytes ``holder`` handed JAX's put
    (the first writer's stays: a hedger's or a late holder's bytes were not stored), else
    ``unwritten``. Only the row's holder, or its hedger for a write, changes it (a hedger that
    wrote nothing leaves the holder to finish). True when the row changed."""
    sql = r.sql
    with r.tx() as run:
        if sha256 is not None:
            _, n = run(
                f"UPDATE compile_leases SET state = '{WRITTEN}', sha256 = :sha, "
                f"compile_ms = :ms, expires_at = {sql.later('retain_s')} "
                f"WHERE scope = :scope AND key = :key AND state <> '{WRITTEN}' "
                "AND (holder = :holder OR hedger = :holder)",
                sql.params(
                    scope=scope,
                    key=key,
                    holder=holder,
                    sha=sha256,
                    ms=compile_ms,
                    retain_s=RETAIN_S,
                ),
            )
        else:
            _, n = run(
                f"UPDATE compile_leases SET state = '{UNWRITTEN}', compile_ms = :ms, "
                f"expires_at = {sql.later('retain_s')} WHERE scope = :scope AND key = :key "
                f"AND holder = :holder AND state = '{COMPILING}'",
                sql.params(scope=scope, key=key, holder=holder, ms=compile_ms, retain_s=RETAIN_S),
            )
    return n > 0


def recorded_ms(r: Runner, scope: str, cache: str, digest: str, key: str) -> int | None:
    """How long ``key`` took to compile: its last lease's record, else warm's (the entry row
    warm wrote for that bucket, ``entries.compile_time_ms``); None when neither recorded it."""
    with r.tx() as run:
        rows, _ = run(
            "SELECT compile_ms FROM compile_leases WHERE scope = :scope AND key = :key "
            "AND compile_ms IS NOT NULL",
            {"scope": scope, "key": key},
        )
        if not rows:
            rows, _ = run(
                "SELECT MAX(e.compile_time_ms) FROM entries e "
                "JOIN environments v ON v.id = e.environment_id JOIN caches c ON c.id = v.cache_id "
                "WHERE c.name = :cache AND v.digest = :digest AND e.key = :key",
                {"cache": cache, "digest": digest, "key": key},
            )
    value = rows[0][0] if rows else None
    return int(value) if value is not None else None
