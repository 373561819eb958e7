"""The one index suite, run against SQLite and a real PostgreSQL server."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import event, inspect
from support.environments import ENV

from cachectl.core.errors import BadInput, NotFound
from cachectl.core.records import HeldEntry
from cachectl.index import NewEntry, open_index
from cachectl.index import db as index_db
from cachectl.index.reads import Queries, SqliteReader


def entry(i: int, **kw) -> NewEntry:
    return NewEntry(
        key=f"jit_f-{i:064x}", module="jit_f", size=100 + i, sha256=f"{i:064x}", origin="warm", **kw
    )


@pytest.fixture
def index(db_url: str):
    engine = index_db.make_engine(db_url)
    index_db.upgrade(engine)
    idx = open_index(db_url)
    yield idx
    idx.close()
    engine.dispose()


def test_the_script_head_is_alembics_head() -> None:
    """ensure_schema's check reads the head off the scripts; Alembic must agree."""
    assert index_db._script_head() == index_db.head_revision()


def test_migrations_upgrade_from_empty(db_url: str) -> None:
    engine = index_db.make_engine(db_url)
    assert index_db.current_revision(engine) is None
    index_db.upgrade(engine)
    assert index_db.current_revision(engine) == index_db.head_revision()
    tables = set(inspect(engine).get_table_names())
    assert {"caches", "environments", "entries", "audit_log", "warm_runs", "leases"} <= tables
    index_db.upgrade(engine)  # idempotent
    engine.dispose()


def test_caches(index) -> None:
    index.add_cache("prod", "s3://bucket/prod", max_size=10, writers=["alice", "@mlops"])
    with pytest.raises(BadInput):
        index.add_cache("prod", "s3://bucket/other")
    info = index.get_cache("prod")
    assert info.max_size == 10 and info.writers == ("alice", "@mlops")
    assert info.effective_service_writes == "deny"
    index.update_cache("prod", max_entry_size=5, service_writes="allow")
    assert index.get_cache("prod").max_entry_size == 5
    assert index.get_cache("prod").effective_service_writes == "allow"
    assert [c.name for c in index.list_caches()] == ["prod"]
    with pytest.raises(NotFound):
        index.get_cache("nope")
    index.remove_cache("prod")
    assert index.list_caches() == []


def test_environments_are_unique_per_cache(index) -> None:
    index.add_cache("a", "/tmp/a")
    index.add_cache("b", "/tmp/b")
    first = index.ensure_environment("a", ENV)
    again = index.ensure_environment("a", ENV)
    other = index.ensure_environment("b", ENV)
    assert first.id == again.id != other.id
    assert first.environment == ENV
    assert first.namespace == ENV.namespace


def test_concurrent_ensure_environment(index) -> None:
    index.add_cache("a", "/tmp/a")
    ids: list[int] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            ids.append(index.ensure_environment("a", ENV).id)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(ids)) == 1


def test_entries_upsert_list_delete(index) -> None:
    index.add_cache("a", "/tmp/a")
    env = index.ensure_environment("a", ENV)
    assert index.upsert_entries(env.id, [entry(i) for i in range(1200)]) == (1200, 0)
    assert index.upsert_entries(env.id, [entry(i) for i in range(1200)]) == (0, 0)
    changed = dataclasses.replace(
        entry(5), size=1, sha256="f" * 64, function="decode", bucket={"batch": 4}
    )
    assert index.upsert_entries(env.id, [changed]) == (0, 1)
    got = index.get_entry(env.id, changed.key)
    assert (
        got is not None
        and got.size == 1
        and got.function == "decode"
        and got.bucket == {"batch": 4}
    )
    keys = index.entry_keys(env.id)
    assert len(keys) == 1200 and keys[changed.key] == (1, "f" * 64)
    assert index.delete_entries(env.id, [entry(i).key for i in range(600)]) == 600
    assert index.delete_entries(env.id, [entry(i).key for i in range(600)]) == 0
    assert len(index.list_entries(env.id)) == 600


def test_environment_stats_and_prefix_lookup(index) -> None:
    index.add_cache("a", "/tmp/a")
    env = index.ensure_environment("a", ENV)
    other = index.ensure_environment("a", dataclasses.replace(ENV, jax_version="0.9.0"))
    index.upsert_entries(env.id, [entry(1), entry(2)])
    at = datetime(2030, 1, 1, tzinfo=UTC)
    assert index.record_hits(env.id, {entry(1).key: (3, at)}) == 1
    stats = {e.digest: e for e in index.environment_stats("a")}
    assert stats[env.digest].entries == 2 and stats[env.digest].bytes == 101 + 102
    assert stats[env.digest].last_access_at == at
    assert stats[other.digest].entries == 0
    assert index.find_environment("a", env.digest[:12]).id == env.id
    with pytest.raises(NotFound):
        index.find_environment("a", "0" * 20 if not env.digest.startswith("0" * 20) else "1" * 20)
    with pytest.raises(BadInput):
        index.find_environment("a", "xyz!")
    hit = index.get_entry(env.id, entry(1).key)
    assert hit is not None and hit.hit_count == 3 and hit.last_access_at == at
    index.mark_environment_deleted(other.id)
    assert [e.digest for e in index.environment_stats("a")] == [env.digest]


def test_one_environments_lookup_visits_its_own_entries_only(tmp_path) -> None:
    """find_environment (install's and pull's lookup by digest) sums the entries of the
    environment it names, not the whole cache's: over 1,000,000 rows the whole cache's sums
    took 0.9 CPU s (BENCHMARKS.md, "Planning"). Counted in SQLite's virtual-machine steps, which grow
    with the rows a statement visits: the lookup costs the same beside 20 or 2,020 entries of
    another environment."""
    url = f"sqlite:///{tmp_path}/index.db"
    idx = open_index(url)
    idx.add_cache("a", str(tmp_path / "a"))
    env = idx.ensure_environment("a", ENV)
    other = idx.ensure_environment("a", dataclasses.replace(ENV, jax_version="0.9.0"))
    idx.upsert_entries(env.id, [entry(1), entry(2)])
    reader = SqliteReader.open(url)
    assert reader is not None

    def steps() -> int:
        ticks = [0]

        def tick() -> int:
            ticks[0] += 1
            return 0  # go on

        reader.conn.set_progress_handler(tick, 10)
        try:
            found = Queries(reader).find_environment("a", env.digest)
        finally:
            reader.conn.set_progress_handler(None, 0)
        assert (found.id, found.entries, found.bytes) == (env.id, 2, 101 + 102)
        return ticks[0]

    try:
        _costs_the_same_beside_few_and_many(lambda rows: idx.upsert_entries(other.id, rows), steps)
    finally:
        reader.close()
        idx.close()


def _costs_the_same_beside_few_and_many(
    add: Callable[[list[NewEntry]], object], steps: Callable[[], int]
) -> None:
    """``steps()`` after ``add`` wrote 20 other entries, then again after 2,000 more: a lookup
    that reads only what it asks for costs the same (SQLite's steps) both times."""
    add([entry(i) for i in range(100, 120)])
    beside_few = steps()
    add([entry(i) for i in range(1000, 3000)])
    beside_many = steps()
    assert 0 < beside_many <= beside_few + 2, (beside_few, beside_many)


def test_held_entries_are_the_asked_keys_rows(index) -> None:
    """What an install's delta compares a bundle with: the asked keys the environment holds, each
    with its size, sha256 and stored executable's; a key it does not hold is absent, another
    environment's row is not read as this one's."""
    index.add_cache("a", "/tmp/a")
    env = index.ensure_environment("a", ENV)
    other = index.ensure_environment("a", dataclasses.replace(ENV, jax_version="0.9.0"))
    index.upsert_entries(env.id, [entry(1), entry(2, aot_size=7, aot_sha256="e" * 64)])
    index.upsert_entries(other.id, [entry(3)])
    keys = [entry(i).key for i in (1, 2, 3, 4)]
    assert index.held_entries(env.id, keys + keys[:1]) == {
        keys[0]: HeldEntry(101, f"{1:064x}"),
        keys[1]: HeldEntry(102, f"{2:064x}", 7, "e" * 64),
    }
    many = [entry(i) for i in range(10, 1210)]  # more keys than one statement's chunk
    index.upsert_entries(env.id, many)
    held = index.held_entries(env.id, [e.key for e in many])
    assert len(held) == 1200 and held[many[-1].key] == HeldEntry(many[-1].size, many[-1].sha256)
    assert index.held_entries(env.id, []) == {}


def test_held_entries_read_the_asked_keys_only(tmp_path) -> None:
    """An install into a namespace of many thousands of entries looks up its own keys' rows: it
    read the whole namespace's before (132 ms at 55,555 entries, BENCHMARKS.md "Planning").
    Counted in SQLite's virtual-machine steps, which grow with the rows a statement visits: the
    lookup of two keys costs the same beside 20 or 2,020 other entries of the same environment."""
    idx = open_index(f"sqlite:///{tmp_path}/index.db")
    idx.add_cache("a", str(tmp_path / "a"))
    env = idx.ensure_environment("a", ENV)
    idx.upsert_entries(env.id, [entry(1), entry(2)])
    ticks = [0]

    def tick() -> int:
        ticks[0] += 1
        return 0  # go on

    @event.listens_for(idx.engine, "before_cursor_execute")
    def count(conn, cursor, statement, parameters, context, executemany) -> None:
        conn.connection.driver_connection.set_progress_handler(tick, 10)

    def steps() -> int:
        ticks[0] = 0
        held = idx.held_entries(env.id, [entry(1).key, entry(2).key])
        assert set(held) == {entry(1).key, entry(2).key}
        return ticks[0]

    try:
        _costs_the_same_beside_few_and_many(lambda rows: idx.upsert_entries(env.id, rows), steps)
    finally:
        idx.close()


def test_ambiguous_prefix(index) -> None:
    index.add_cache("a", "/tmp/a")
    digests = set()
    version = 0
    # Find two environments whose digests share a first hex digit.
    while True:
        e = index.ensure_environment("a", dataclasses.replace(ENV, jax_version=f"0.{version}"))
        version += 1
        if e.digest[0] in digests:
            break
        digests.add(e.digest[0])
    with pytest.raises(BadInput, match="matches"):
        index.find_environment("a", e.digest[0])


def test_audit_log(index) -> None:
    index.audit("prune", cache="a", entries=3, nbytes=300, duration_ms=5, details={"why": "test"})
    log = index.audit_log(cache="a", since=timedelta(hours=1))
    assert len(log) == 1 and log[0].operation == "prune" and log[0].bytes == 300
    assert "@" in log[0].actor


def test_timestamps_are_utc_aware(index) -> None:
    index.add_cache("a", "/tmp/a")
    env = index.ensure_environment("a", ENV)
    index.upsert_entries(env.id, [entry(1)])
    e = index.list_entries(env.id)[0]
    assert e.created_at is not None and e.created_at.tzinfo is not None
    assert abs(e.created_at - datetime.now(UTC)) < timedelta(minutes=5)


def test_postgres_needs_explicit_upgrade(pg_url: str) -> None:
    with pytest.raises(BadInput, match="cachectl db upgrade"):
        open_index(pg_url)


def test_migrations_match_the_models(db_url: str) -> None:
    """Alembic's autogenerate finds nothing to add: the models and the migrations agree."""
    from alembic import command

    engine = index_db.make_engine(db_url)
    index_db.upgrade(engine)
    with engine.begin() as conn:
        command.check(index_db._alembic_config(engine, conn))
    engine.dispose()


def test_processes_opening_one_fresh_sqlite_index_at_once_all_succeed(tmp_path) -> None:
    """The pods of a job on one host: one migrates, the others wait for it and find the head."""
    import subprocess
    import sys
    import time

    url = f"sqlite:///{tmp_path}/fresh.db"
    start = time.time() + 3
    code = (
        "import time, sys; from cachectl.index import open_index\n"
        f"time.sleep(max(0, {start} - time.time()))\n"
        f"i = open_index({url!r}); i.ensure_cache('default', '/tmp/x'); i.close(); print('ok')"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], [err[-500:] for _, err in outs]


def test_listed_entries_are_what_one_entry_reads(index) -> None:
    """list_entries unpacks its rows by position (ENTRY_INFO_COLUMNS' order): every field of
    every listed entry is what get_entry reads by name from the ORM row."""
    index.add_cache("a", "/tmp/a")
    env = index.ensure_environment("a", ENV)
    index.upsert_entries(
        env.id,
        [
            entry(1),
            entry(
                2,
                compile_time_ms=1234,
                function="f",
                bucket={"batch": 4, "seq": [1, 2]},
                aot_size=77,
                aot_sha256="b" * 64,
            ),  # fmt: skip
        ],
    )
    index.mark_executables(env.id, {entry(2).key: "it crashed"})
    listed = index.list_entries(env.id)
    assert [e.key for e in listed] == [entry(1).key, entry(2).key]
    assert listed == [index.get_entry(env.id, e.key) for e in listed]
    second = listed[1]
    assert (second.function, second.bucket, second.aot_size, second.aot_unusable) == (
        "f", {"batch": 4, "seq": [1, 2]}, 77, "it crashed",
    )  # fmt: skip
    assert second.compile_time_ms == 1234 and second.size == 102


@pytest.mark.parametrize("count", [1, 100])  # the ORM batch, and the bulk path from BULK_MIN rows
def test_keys_another_writer_records_between_lookup_and_insert_are_updated(
    pg_url: str, count: int
) -> None:
    """Two warm processes (or pods) into one PostgreSQL index record the same keys at once: the
    one whose insert meets keys the other committed after its lookup looks again and updates them,
    instead of failing on the unique key (seen in a sharded warm of three processes)."""
    from sqlalchemy import event

    engine = index_db.make_engine(pg_url)
    index_db.upgrade(engine)
    engine.dispose()
    first, other = open_index(pg_url), open_index(pg_url)
    try:
        first.add_cache("a", "/tmp/a")
        env = first.ensure_environment("a", ENV)
        mine = [entry(i) for i in range(count)]
        theirs = [dataclasses.replace(e, size=e.size + 1) for e in mine[::2]]
        raced: list[str] = []

        @event.listens_for(first.engine, "before_cursor_execute")
        def other_writer(conn, cursor, statement, params, context, executemany) -> None:
            # between this writer's lookup and its insert, the other commits some of the keys
            if statement.lstrip().upper().startswith("INSERT INTO ENTRIES") and not raced:
                raced.append(statement)
                assert other.upsert_entries(env.id, theirs) == (len(theirs), 0)

        assert first.upsert_entries(env.id, mine) == (count - len(theirs), len(theirs))
        assert raced
        rows = {e.key: e for e in first.list_entries(env.id)}
        assert {k: rows[k].size for k in rows} == {e.key: e.size for e in mine}
    finally:
        first.close()
        other.close()


def test_a_burst_of_requests_reuses_the_pools_postgresql_sessions(pg_url: str) -> None:
    """A server's threads check out up to PG_POOL_SIZE connections at once; every one is kept,
    so a second burst opens no PostgreSQL session (SQLAlchemy's default kept 5 and opened and
    closed the rest per burst: a backend forked each time)."""
    import time

    import sqlalchemy as sa

    from cachectl.index import db

    engine = db.make_engine(pg_url)
    name = sa.engine.make_url(pg_url).database

    def sessions() -> int:
        with engine.connect() as c:
            c.execute(sa.text("SELECT pg_stat_clear_snapshot()"))
            found = c.execute(
                sa.text("SELECT sessions FROM pg_stat_database WHERE datname = :n"), {"n": name}
            ).scalar()
        return int(found or 0)

    def burst(n: int) -> None:
        ready, go = threading.Barrier(n), threading.Event()

        def hold() -> None:
            with engine.connect() as c:
                c.execute(sa.text("SELECT 1"))
                ready.wait(timeout=30)
                go.wait(timeout=30)

        threads = [threading.Thread(target=hold) for _ in range(n)]
        for t in threads:
            t.start()
        try:
            time.sleep(0.5)
        finally:
            go.set()
            for t in threads:
                t.join(timeout=60)

    try:
        n = 14  # within db.PG_POOL_SIZE (15), past SQLAlchemy's default 5 kept
        burst(n)  # the first burst opens its sessions
        before = sessions()
        burst(n)
        burst(n)
        opened = sessions() - before
        print(f"sessions opened by two more bursts of {n}: {opened}")
        assert opened == 0, opened
    finally:
        engine.dispose()
