"""Engines and schema migrations for SQLite and PostgreSQL indexes."""

from __future__ import annotations

import fcntl
import logging
import os
import re
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event, inspect, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import (
    ArgumentError,
    DatabaseError,
    IntegrityError,
    OperationalError,
    SQLAlchemyError,
)

from cachectl.core.config import data_dir
from cachectl.core.errors import BadInput, Unreachable
from cachectl.core.sqlite_file import SQLITE_CACHE_KIB
from cachectl.core.temps import makedirs, without_world_write

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5
SQLITE_BUSY_TIMEOUT_MS = 30_000
# PostgreSQL's bounds on every statement of the index (SQLite's is its busy timeout): a row lock
# held elsewhere costs at most the lock timeout, a statement at most the statement timeout, then
# the statement fails (an Unreachable index: a warning, never a hang). The compile lease's own
# transactions set shorter ones (cachectl/index/compile_leases.py); migrations run unbounded.
PG_LOCK_TIMEOUT_MS = SQLITE_BUSY_TIMEOUT_MS
PG_STATEMENT_TIMEOUT_MS = 600_000
PG_TIMEOUTS = f"-c lock_timeout={PG_LOCK_TIMEOUT_MS} -c statement_timeout={PG_STATEMENT_TIMEOUT_MS}"
# PostgreSQL connections a process keeps open, and the most it opens: the same bound as
# SQLAlchemy's default (5 kept, 10 more opened and closed per burst), but all kept. A server under
# hundreds of clients otherwise forked a PostgreSQL backend per request burst (bench/lease_scale.py:
# ~2,200 sessions a round); a command or a service opens only the few it uses.
PG_POOL_SIZE = 15


def migrations_dir() -> Path:
    """Where Alembic's scripts live: the installed cachectl_migrations package."""
    import cachectl_migrations

    return Path(cachectl_migrations.__file__).parent


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # WAL lets readers and one writer work at once across processes; the busy
    # timeout makes concurrent writers wait instead of failing.
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA synchronous=NORMAL")
    # 16 MiB of page cache per connection (the default is 2 MiB): a large sync's inserts into the
    # entries table's b-trees stop re-reading pages from the OS (writing 100,000 rows ~12% faster).
    cur.execute(f"PRAGMA cache_size=-{SQLITE_CACHE_KIB}")
    cur.close()


# Write transactions on SQLite begin IMMEDIATE: two deferred transactions that
# both read and then write deadlock, and SQLite fails one at once instead of
# waiting out the busy timeout. Read-only work clears this to run deferred.
sqlite_immediate: ContextVar[bool] = ContextVar("sqlite_immediate", default=True)


def _sqlite_begin(conn: Any) -> None:
    # pysqlite's own transaction handling defers BEGIN; issue it ourselves so
    # IMMEDIATE can be asked for (the lifecycle lease relies on it too).
    immediate = conn.info.get("immediate") or sqlite_immediate.get()
    conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def make_engine(url: str, *, create: bool = False) -> Engine:
    """An engine with the settings that make the index safe to share. An SQLite file's directory
    is made only for the default index (under the data directory) or with ``create`` (`db
    upgrade`); another missing directory is a mistyped --db, refused before anything is made."""
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise BadInput(
            f"bad index URL {url!r}: use sqlite:///PATH or postgresql+psycopg://USER@HOST/DB"
        ) from exc
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            _sqlite_directory(url, Path(parsed.database).expanduser().parent, create)
        engine = create_engine(
            url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000, "isolation_level": None}
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    if backend == "postgresql":
        if parsed.drivername == "postgresql":
            parsed = parsed.set(drivername="postgresql+psycopg")
        return create_engine(
            parsed,
            pool_pre_ping=True,
            pool_size=PG_POOL_SIZE,
            max_overflow=0,
            connect_args={"connect_timeout": CONNECT_TIMEOUT_S, "options": PG_TIMEOUTS},
        )
    raise BadInput(
        f"unsupported index database {backend!r} in {url!r}: use sqlite:/// or postgresql+psycopg://"
    )


def _sqlite_directory(url: str, directory: Path, create: bool) -> None:
    """``directory`` made (no o+w, whatever the umask) where it may be; else, when missing,
    BadInput: `--db sqlite:////no/such/x.db` must not make /no/such (as root it could)."""
    if directory.is_dir():
        return
    if create or directory.absolute() == data_dir().absolute():
        makedirs(directory)
        return
    shown = make_url(url).render_as_string(hide_password=True)
    raise BadInput(
        f"index {shown}: directory {directory} does not exist: fix --db/CACHECTL_DB, "
        f"or create the index there with `cachectl --db {shown} db upgrade`"
    )


def _alembic_config(engine: Engine, connection: Any = None) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option(
        "sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%")
    )
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    head = ScriptDirectory.from_config(cfg).get_current_head()
    assert head is not None
    return head


_REVISION_LINE = re.compile(r"^(down_revision|revision) = (?:\"([^\"]+)\"|None)$", re.MULTILINE)


def _script_head() -> str | None:
    """The head revision read off the migration scripts' ``revision``/``down_revision`` lines:
    what :func:`head_revision` finds, without importing Alembic (0.1 s, for migrating).
    None when the scripts are not one plain chain (callers then ask Alembic)."""
    revisions: set[str] = set()
    parents: set[str] = set()
    for path in (migrations_dir() / "versions").glob("*.py"):
        if path.name == "__init__.py":  # Alembic skips it too
            continue
        found: dict[str, str | None] = {
            m[1]: m[2] for m in _REVISION_LINE.finditer(path.read_text())
        }
        revision = found.get("revision")
        if revision is None or "down_revision" not in found:
            return None
        revisions.add(revision)
        if found["down_revision"] is not None:
            parents.add(found["down_revision"])
    heads = revisions - parents
    return heads.pop() if len(heads) == 1 else None


def current_revision(engine: Engine) -> str | None:
    """The index's schema revision (Alembic's version table), None before the first migration."""
    try:
        with engine.connect() as conn:
            if not inspect(conn).has_table("alembic_version"):
                return None
            heads = [
                row[0] for row in conn.execute(text("SELECT version_num FROM alembic_version"))
            ]
            if len(heads) > 1:  # Alembic's own error for a branched version table
                from alembic.runtime.migration import MigrationContext

                return MigrationContext.configure(conn).get_current_revision()
            return heads[0] if heads else None
    except OperationalError as exc:
        raise Unreachable(f"index {safe_url(engine)} is unreachable: {_first_line(exc)}") from exc
    except DatabaseError as exc:
        raise unusable(engine, exc) from exc


def upgrade(engine: Engine, revision: str = "head") -> None:
    from alembic import command

    try:
        with engine.begin() as conn:
            if engine.dialect.name == "postgresql":  # an index build on a large table takes long
                conn.exec_driver_sql("SET LOCAL statement_timeout = 0")
            command.upgrade(_alembic_config(engine, conn), revision)
    except OperationalError as exc:
        raise Unreachable(f"index {safe_url(engine)} is unreachable: {_first_line(exc)}") from exc
    except DatabaseError as exc:
        raise unusable(engine, exc) from exc


def unusable(engine: Engine, exc: DatabaseError) -> BadInput:
    """A database that answers but is corrupt, truncated, or not an index at all (exit 2)."""
    return BadInput(
        f"index {safe_url(engine)} is not a usable cachectl index ({_first_line(exc)}): "
        "restore it from a backup or move it aside"
    )


def is_unusable(exc: BaseException) -> bool:
    """Any DatabaseError except the ones callers handle (unreachable, constraint races)."""
    return isinstance(exc, DatabaseError) and not isinstance(
        exc, (OperationalError, IntegrityError)
    )


def ensure_schema(engine: Engine, auto_migrate: bool) -> None:
    """Check the schema is at head; migrate SQLite files automatically.

    Processes that open one fresh SQLite file at once (the pods of a job on one host) take
    turns through a lock file beside it: the first migrates, the others then find the head."""
    current = current_revision(engine)
    if current is not None and current == (_script_head() or head_revision()):
        return
    database = engine.url.database if engine.dialect.name == "sqlite" else None
    if not auto_migrate or not database or database == ":memory:":
        _check_or_migrate(engine, auto_migrate)
        return
    try:
        lock = open(f"{database}.migrate-lock", "a")  # noqa: SIM115 - held across the migration
        without_world_write(f"{database}.migrate-lock")
    except OSError:  # a directory we cannot write: the migration itself will say so
        _check_or_migrate(engine, auto_migrate)
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _check_or_migrate(engine, auto_migrate)  # closing the file releases the lock


def _check_or_migrate(engine: Engine, auto_migrate: bool) -> None:
    current = current_revision(engine)
    head = head_revision()
    if current == head:
        return
    if current is None and _has_tables(engine):
        # Someone else's database (or a broken one): never "migrate" it into an index.
        raise BadInput(
            f"index {safe_url(engine)} has tables but no cachectl schema version: "
            "not a cachectl index; point --db elsewhere"
        )
    if auto_migrate:
        log.info("migrating index %s from %s to %s", safe_url(engine), current, head)
        upgrade(engine)
        return
    raise BadInput(
        f"index {safe_url(engine)} is at schema revision {current or 'none'}, not {head}: "
        f"run `cachectl db upgrade --db {safe_url(engine)}`"
    )


def _has_tables(engine: Engine) -> bool:
    try:
        return bool(inspect(engine).get_table_names())
    except SQLAlchemyError:
        return False


def safe_url(engine_or_url: Engine | str) -> str:
    """The URL without its password, for messages and logs."""
    url = engine_or_url.url if isinstance(engine_or_url, Engine) else make_url(engine_or_url)
    return url.render_as_string(hide_password=True)


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def default_sqlite_url(data_dir: Path) -> str:
    return f"sqlite:///{os.path.join(data_dir, 'index.db')}"
