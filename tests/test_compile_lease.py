"""The compile lease: processes started together on one index compile each program once.

Real processes, a real index (an SQLite file, and PostgreSQL), real JAX compiles of a function
that takes a second or two to compile; compiles are counted from JAX's own monitoring events
(requests that use the cache, less hits).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from support.compiles import CHILD

REPO = Path(__file__).resolve().parent.parent
# What SQLite's julianday() arithmetic resolves: 2.46e6 days in a double, about 50 microseconds.
JULIANDAY_S = 1e-3


def _env(home: Path, db: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHECTL_", "JAX_"))}
    env.update(
        CACHECTL_DB=db,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(REPO),
        SALT="0.5",
        N="1500",  # about 1.5 s to compile on an idle core
        CACHECTL_COMPILE_LEASE_TTL_S="3",
        # JAX writes only programs that took over 1 s to compile: how long depends on the machine.
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    env.update(extra)
    return env


def _start(env: dict[str, str], **extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD],
        env=dict(env, **extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _done(proc: subprocess.Popen[str]) -> tuple[dict[str, Any], str]:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def _upgrade(env: dict[str, str]) -> None:
    subprocess.run(
        [sys.executable, "-m", "cachectl", "db", "upgrade"],
        env=env,
        check=True,
        capture_output=True,
    )


def _rows(db: str) -> list[Any]:
    engine = sa.create_engine(db)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.text("SELECT holder, state, module FROM compile_leases")))
    finally:
        engine.dispose()


def _released(db: str, module: str) -> bool:
    """Whether ``module``'s lease (PostgreSQL's) is still compiling and expired already."""
    engine = sa.create_engine(db)
    try:
        with engine.connect() as conn:
            rows = list(
                conn.execute(
                    sa.text(
                        "SELECT state, expires_at <= now() FROM compile_leases WHERE module = :m"
                    ),
                    {"m": module},
                )
            )
    finally:
        engine.dispose()
    return rows == [("compiling", True)]


@pytest.mark.parametrize("index", ["sqlite", "postgresql"])
def test_processes_started_together_compile_once(tmp_path: Path, request, index: str) -> None:
    """Cold cache: 3 writers and a read-only process started together compile the program at
    most twice in all (once with the lease: the others read what the holder wrote); each
    output equals plain jit. Then the holder killed with kill -9 mid-compile: the other two
    finish, one of them compiling, with no wait for the lease's expiry: its process is gone from
    this host. A holder that exits normally mid-compile ends its lease (on PostgreSQL)."""
    db = request.getfixturevalue("sqlite_url" if index == "sqlite" else "pg_url")
    env = _env(tmp_path, db, XDG_DATA_HOME=str(tmp_path / "data"))
    _upgrade(env)
    plain = _start(env, PLAIN="1")
    procs = [_start(env) for _ in range(3)] + [_start(env, CACHECTL_READONLY="1")]
    results = [_done(p)[0] for p in procs]
    expected = _done(plain)[0]
    assert all(r["out"] == expected["out"] for r in results)
    assert all(r["requests"] == 1 for r in results)
    compiles = sum(r["compiles"] for r in results)
    assert compiles <= 2, results
    written = [r for r in _rows(db) if r[2] == "jit_slow"]
    assert [r[1] for r in written] == ["written"]
    assert f":{results[3]['pid']}:" not in written[0][0]  # the read-only process took no lease
    if index != "postgresql":
        return  # the kill runs once, on the index several hosts share (CI time is counted)

    # The holder killed mid-compile (another program: FN names it, no compile time recorded).
    # A lease of 60 s: a waiter on the holder's host sees its process gone and takes over at once.
    killed_env = dict(env, FN="slow_killed", N="6000", CACHECTL_COMPILE_LEASE_TTL_S="60")
    holder = _start(killed_env)
    deadline = time.monotonic() + 120
    while not any(r[2] == "jit_slow_killed" and r[1] == "compiling" for r in _rows(db)):
        assert time.monotonic() < deadline and holder.poll() is None, "the holder never leased"
        time.sleep(0.05)
    (row,) = [r for r in _rows(db) if r[2] == "jit_slow_killed"]
    assert f":{holder.pid}:" in row[0]
    others = [_start(killed_env) for _ in range(2)]
    time.sleep(0.3)
    os.kill(holder.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    holder.communicate()
    while any(f":{holder.pid}:" in r[0] for r in _rows(db) if r[2] == "jit_slow_killed"):
        assert time.monotonic() - killed_at < 120, _rows(db)
        time.sleep(0.1)
    took_over = time.monotonic() - killed_at
    finished = [_done(p)[0] for p in others]
    assert sum(r["compiles"] for r in finished) == 1, (finished, _rows(db))
    assert all(r["out"] == finished[0]["out"] for r in finished)
    # The waiters' start (JAX's import, on a shared machine) and a poll; never the expiry.
    assert took_over < 45, took_over

    # A normal exit while a thread compiles: the lease ends at exit (60 s left otherwise).
    exiting = _start(dict(killed_env, FN="slow_exit"), EXIT_AFTER="0.5")
    exiting.communicate(timeout=120)
    assert _released(db, "jit_slow_exit"), _rows(db)


def test_index_down_or_unable_to_lease_costs_one_warning_and_no_wait(
    tmp_path: Path, sqlite_url: str
) -> None:
    """An unreachable index (a bad URL) and an index that cannot answer the lease (its table
    gone), processes started together: every one compiles, none waits for another; the
    unreachable one warns as activate() always did, the other once that the lease is off."""
    env = _env(tmp_path, sqlite_url, XDG_DATA_HOME=str(tmp_path / "data"))
    _upgrade(env)
    engine = sa.create_engine(sqlite_url)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE compile_leases"))
    engine.dispose()
    down = dict(
        env,
        CACHECTL_DB="postgresql+psycopg://u:p@127.0.0.1:1/x",
        CACHECTL_ROOT=str(tmp_path / "root"),
    )
    done = [_done(p) for p in [_start(down), _start(down), _start(env)]]
    assert [r["compiles"] for r, _ in done] == [1, 1, 1]
    for _, err in done[:2]:
        assert err.count("cachectl: index unavailable") == 1 and "compile lease" not in err, err
    assert done[2][1].count("compile lease off") == 1, done[2][1]
    assert all(r["t"] < 60 for r, _ in done)  # a wait would last the lease's 1800 s bound


def test_server_route_leases_for_writers_and_answers_readers(
    tmp_path: Path, sqlite_url: str
) -> None:
    """Server mode's route (the same statements on the server's index): a reader may look but
    not take; one writer takes, another sees it held, one hedge lands, an expired lease is taken
    over once its holder released it, the holder's write is what everyone then sees, and warm's
    compile time of the key bounds the hedge. The server names holders (``token<id>|tag``): another
    writer token asking for the same tag is another holder, and may neither finish nor release
    the lease (403); a take asking 3600 s is granted the server's maximum ttl."""
    from support.server_kit import MAIN, bearer, seed, served

    s = seed(sqlite_url, str(tmp_path / "root"), str(tmp_path / "other"))
    base = f"/api/v1/caches/{MAIN}/environments/{s.digest}/compile-lease"
    with served(sqlite_url, lease_max_ttl_s=30.0) as (_live, client):

        def post(token: str, action: str, **body: Any) -> Any:
            path = f"{base}/read" if action in ("look", "recorded") else base
            return client.post(
                path, json={**body, "action": action}, headers=bearer(s.tokens[token])
            )

        def call(token: str, action: str, **body: Any) -> Any:
            r = post(token, action, **body)
            assert r.status_code == 200, r.text
            return r.json()["result"]

        assert post("reader", "take", key="k", holder="r").status_code == 403
        first = call("writer", "take", key="jit_train-k", holder="a", ttl_s=0.5, module="jit_train")
        assert first["mine"] and first["state"] == "compiling"
        a = first["holder"]
        assert a.startswith("token") and a.endswith("|a")  # the server's name, the tag a suffix
        second = call("writer", "take", key="jit_train-k", holder="b", ttl_s=5, module="jit_train")
        assert not second["mine"] and second["holder"] == a and second["left_s"] > 0
        assert call("reader", "look", key="jit_train-k")["holder"] == a
        # Another writer token acting as holder "a": not the holder.
        for action in ("finish", "release"):
            refused = post("scoped_writer", action, key="jit_train-k", holder="a", sha256="e" * 64)
            assert refused.status_code == 403, refused.text
        assert call("reader", "look", key="jit_train-k")["state"] == "compiling"
        assert call("writer", "hedge", key="jit_train-k", holder="b") is True
        assert call("writer", "hedge", key="jit_train-k", holder="c") is False
        assert call("reader", "recorded", key=s.keys[2]) == 3000  # warm's entry row for that key
        assert call("reader", "recorded", key="jit_train-k") is None
        assert post("writer", "release", key="jit_train-k", holder="b").status_code == 403
        assert call("writer", "release", key="jit_train-k", holder="a") is True  # a has gone
        taken = call("writer", "take", key="jit_train-k", holder="b", ttl_s=5, module="jit_train")
        assert taken["mine"] and taken["holder"].endswith("|b")
        assert call("writer", "renew", key="jit_train-k", holder="a", ttl_s=5) is False
        call("writer", "finish", key="jit_train-k", holder="b", sha256="f" * 64, compile_ms=1500)
        seen = call("reader", "look", key="jit_train-k")
        assert seen["state"] == "written" and seen["sha256"] == "f" * 64
        assert call("reader", "recorded", key="jit_train-k") == 1500  # the key's last compile
        assert call("writer", "renew", key="jit_train-k", holder="b", ttl_s=5) is False
        late = call("writer", "take", key="jit_train-k", holder="c", ttl_s=5, module="jit_train")
        assert not late["mine"] and late["state"] == "written"
        forged = call("writer", "take", key="jit_other-k", holder="x", ttl_s=3600)
        # Clamped to the server's maximum. On SQLite left_s is a difference of julianday()s, a
        # double of about 2.46e6 days: it resolves about 50 microseconds, so 30 s may read 30.00004.
        assert forged["mine"] and 0 < forged["left_s"] <= 30.0 + JULIANDAY_S
        assert call("writer", "renew", key="jit_other-k", holder="x", ttl_s=3600) is True
        assert 0 < call("reader", "look", key="jit_other-k")["left_s"] <= 30.0 + JULIANDAY_S


def test_heartbeat_renews_then_stops_at_its_bound(sqlite_url: str, monkeypatch) -> None:
    """A holder whose compile never ends (no put, no end of JAX's compile stage): its heartbeat
    keeps the lease past the ttl, then stops at CACHECTL_COMPILE_LEASE_MAX_S, and the lease
    expires a ttl later, so waiters take over instead of waiting forever."""
    from cachectl.index import compile_leases as q
    from cachectl.index import open_index
    from cachectl.service.compile_lease import CompileLeases, SqlLessor

    monkeypatch.setenv("CACHECTL_COMPILE_LEASE_TTL_S", "0.6")
    monkeypatch.setenv("CACHECTL_COMPILE_LEASE_MAX_S", "1.5")
    index = open_index(sqlite_url)
    try:
        runner = q.runner_for(index)
        assert runner is not None
        warned: list[str] = []
        holder = CompileLeases(lambda: SqlLessor(runner, "c", "d"), writer=True, warn=warned.append)
        assert holder.missed("k", lambda key: None) is None  # took it: compile here
        started = time.monotonic()
        time.sleep(1.2)  # two ttls: only the heartbeat keeps it
        alive = q.look(runner, "c/d", "k")
        assert alive is not None and alive.state == "compiling" and alive.left_s > 0
        while (seen := q.look(runner, "c/d", "k")) is not None and seen.left_s > 0:
            assert time.monotonic() - started < 1.5 + 0.6 + 2, "the heartbeat never stopped"
            time.sleep(0.05)
        taken = q.take(runner, "c/d", "k", "other", ttl_s=5, module=None)
        assert taken is not None and taken.mine and not warned
    finally:
        index.close()


def test_a_fast_program_is_compiled_once_by_processes_started_together(
    tmp_path: Path, sqlite_url: str
) -> None:
    """A program that compiles in well under JAX's 1 s minimum (its default threshold, not 0):
    the lease's holder writes it all the same, so the processes started with it read it instead
    of compiling: one compile in all, where each would compile if the holder wrote nothing."""
    env = _env(
        tmp_path,
        sqlite_url,
        XDG_DATA_HOME=str(tmp_path / "data"),
        N="40",
        FN="fast",
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="1",
    )
    _upgrade(env)
    results = [_done(p)[0] for p in [_start(env) for _ in range(3)]]
    assert all(r["out"] == results[0]["out"] for r in results)
    assert sum(r["compiles"] for r in results) == 1, (results, _rows(sqlite_url))
    assert [r[1] for r in _rows(sqlite_url) if r[2] == "jit_fast"] == ["written"]


def test_a_forged_lease_stalls_no_writer_or_reader_past_the_servers_ttl(
    tmp_path: Path, sqlite_url: str, monkeypatch
) -> None:
    """Issue 67's case 5: one take through the server with ttl_s 3600 and a made-up holder,
    never renewed. A writer of another token and a read-only process that miss that key wait no
    longer than the server's maximum ttl (2 s here; 60 s by default): the writer then takes the
    lease over and compiles, the reader compiles (or reads what the writer wrote). Nothing
    warns, and the writer's write is what the lease then says."""
    import jax.monitoring  # noqa: F401 - a service has imported JAX before its first miss
    from support.server_kit import MAIN, bearer, seed, served

    from cachectl.client.server_client import ServerClient
    from cachectl.service.compile_lease import CompileLeases, RemoteLessor

    monkeypatch.setenv("CACHECTL_COMPILE_LEASE_HEDGE_S", "30")  # no hedge within the test's bound
    s = seed(sqlite_url, str(tmp_path / "root"), str(tmp_path / "other"))
    base = f"/api/v1/caches/{MAIN}/environments/{s.digest}/compile-lease"
    key = "jit_f-" + "0" * 64
    with served(sqlite_url, lease_max_ttl_s=2.0) as (live, client):
        forged = client.post(
            base,
            json={"action": "take", "key": key, "holder": "made-up", "ttl_s": 3600},
            headers=bearer(s.tokens["writer"]),
        )
        assert forged.status_code == 200 and forged.json()["result"]["mine"], forged.text
        forged_at = time.monotonic()
        warned: list[str] = []
        clients = {
            n: ServerClient(live.url, s.tokens[t])
            for n, t in (("writer", "scoped_writer"), ("reader", "reader"))
        }
        processes = {
            name: CompileLeases(
                lambda c=c: RemoteLessor(c, MAIN, s.digest),
                writer=name == "writer",
                warn=warned.append,
            )
            for name, c in clients.items()
        }
        waited: dict[str, tuple[bytes | None, float]] = {}

        entry = b"the entry the writer compiled"

        def miss(name: str) -> None:
            waited[name] = (processes[name].missed(key, lambda _k: entry), time.monotonic())
            if name == "writer":  # it compiles (0.3 s) and JAX's put is handed the entry
                time.sleep(0.3)
                processes[name].wrote(key, hashlib.sha256(entry).hexdigest())

        threads = [threading.Thread(target=miss, args=(name,)) for name in processes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        try:
            assert set(waited) == {"writer", "reader"}, waited
            # The writer took it over and compiles; the reader compiles too once the forged lease
            # expired, or reads what the writer wrote if that came first.
            assert waited["writer"][0] is None and waited["reader"][0] in (None, entry)
            stalled = {name: at - forged_at for name, (_, at) in waited.items()}
            print(f"forged lease (ttl_s 3600 asked, 2 s granted): stalled {stalled}")
            assert all(v < 2.0 + 0.3 + 3.0 for v in stalled.values()), stalled
            seen = client.post(
                base + "/read",
                json={"action": "look", "key": key},
                headers=bearer(s.tokens["reader"]),
            ).json()["result"]
            assert seen["holder"].endswith("|" + processes["writer"].me), seen  # taken over
            assert seen["state"] == "written"
            assert not warned, warned
        finally:
            processes["writer"]._release_all(os.getpid())
            for c in clients.values():
                c.close()


def test_a_row_lock_on_compile_leases_costs_the_lock_timeout_then_one_warning(
    tmp_path: Path, pg_url: str
) -> None:
    """Issue 67's case 7: another connection holds a row lock on a compile_leases row. A writer
    on the PostgreSQL index, directly and through the server, waits at most the lease's lock
    timeout, warns once that the lease is off, and compiles; its next miss asks nothing. Every
    index connection carries a lock and a statement timeout."""
    from support.server_kit import MAIN, seed, served

    from cachectl.client.server_client import ServerClient
    from cachectl.index import compile_leases as q
    from cachectl.index import db, open_index
    from cachectl.service.compile_lease import CompileLeases, RemoteLessor, SqlLessor

    engine = db.make_engine(pg_url)
    db.upgrade(engine)
    engine.dispose()
    s = seed(pg_url, str(tmp_path / "root"), str(tmp_path / "other"))
    scope, key = f"{MAIN}/{s.digest}", "jit_f-" + "1" * 64
    index = open_index(pg_url)
    locker = sa.create_engine(pg_url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with index.connection() as conn:
            timeouts = [
                conn.execute(sa.text(f"SHOW {n}_timeout")).scalar() for n in ("lock", "statement")
            ]
        assert timeouts == ["30s", "10min"], timeouts
        runner = q.runner_for(index)
        assert runner is not None
        taken = q.take(runner, scope, key, "someone", ttl_s=30, module=None)
        assert taken is not None and taken.mine
        with served(pg_url) as (live, _client), locker.connect() as held:
            remote = ServerClient(live.url, s.tokens["writer"])
            # Expired: a take must write the row (a live holder's row is read without a lock).
            held.execute(
                sa.text("UPDATE compile_leases SET expires_at = now() - interval '1 second'")
            )
            held.commit()
            held.execute(
                sa.text("SELECT * FROM compile_leases WHERE key = :k FOR UPDATE"), {"k": key}
            )
            for lessor in (
                lambda: SqlLessor(runner, MAIN, s.digest),
                lambda: RemoteLessor(remote, MAIN, s.digest),  # the server's route waits
            ):
                warned: list[str] = []
                leases = CompileLeases(lessor, writer=True, warn=warned.append)
                waited: list[float] = []

                def miss(leases: CompileLeases = leases, waited: list[float] = waited) -> None:
                    started = time.monotonic()
                    assert leases.missed(key, lambda _k: None) is None
                    waited.append(time.monotonic() - started)

                thread = threading.Thread(target=miss)
                thread.start()
                thread.join(timeout=40)
                print(f"row lock held: the miss waited {waited} s; warned {warned}")
                assert waited and waited[0] < q.LOCK_TIMEOUT_MS / 1000 + 3.0, waited
                assert len(warned) == 1 and "compile lease off" in warned[0], warned
                started = time.monotonic()
                assert leases.missed(key, lambda _k: None) is None  # off: no question asked
                assert time.monotonic() - started < 0.5 and len(warned) == 1
            held.rollback()
            remote.close()
    finally:
        locker.dispose()
        index.close()


def test_takers_of_a_held_key_lock_nothing_so_its_holder_renews_at_once(pg_url: str) -> None:
    """bench/lease_scale.py at 256 replicas: on PostgreSQL ``INSERT ... ON CONFLICT DO UPDATE``
    locks the row even when its WHERE is false, so every taker of a key another replica holds
    queued on that lock and the holder's heartbeat behind them; leases expired under live
    holders. A take of a held (or written) key is now a plain read: with a taker's transaction
    still open, the holder renews and finishes at once."""
    from contextlib import contextmanager

    from cachectl.index import compile_leases as q
    from cachectl.index import db, open_index

    engine = db.make_engine(pg_url)
    db.upgrade(engine)
    index = open_index(pg_url)
    scope, key = "c/" + "d" * 64, "jit_f-" + "2" * 64
    try:
        runner = q.runner_for(index)
        assert runner is not None
        assert (held := q.take(runner, scope, key, "holder", ttl_s=30, module=None)) and held.mine
        with engine.connect() as taker:  # a taker's transaction, left open
            tx = taker.begin()

            @contextmanager
            def open_tx():  # type: ignore[no-untyped-def]
                def run(sql: str, params: dict[str, Any]) -> tuple[Any, int]:
                    result = taker.execute(sa.text(sql), params)
                    return (result.fetchall() if result.returns_rows else []), result.rowcount

                yield run

            seen = q.take(
                q.Runner("postgresql", open_tx), scope, key, "taker", ttl_s=30, module=None
            )
            assert seen is not None and not seen.mine and seen.holder == "holder"
            started = time.monotonic()
            renewed = q.renew(runner, scope, key, "holder", ttl_s=30)
            finished = q.finish(runner, scope, key, "holder", sha256="a" * 64, compile_ms=1500)
            took = time.monotonic() - started
            print(f"renew and finish with a taker's transaction open: {took:.3f} s")
            assert renewed and finished and took < 1.0, took
            tx.rollback()
        seen = q.take(runner, scope, key, "late", ttl_s=30, module=None)
        assert seen is not None and not seen.mine and seen.state == q.WRITTEN
        assert seen.compile_ms == 1500  # the waiter's hedge bound, without a "recorded" call
    finally:
        index.close()
        engine.dispose()
