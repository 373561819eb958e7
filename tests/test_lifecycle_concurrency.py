"""Leases, crash injection and concurrent runs, with real processes.

Crash: a prune is SIGKILLed right after its first storage batch, before the
index hears of it (CACHECTL_TEST_CRASH_AFTER_BATCHES, read by the executor);
a re-run finishes the job. Concurrency: two gc processes at once, slowed per
batch (CACHECTL_TEST_BATCH_DELAY_S) so they overlap; exactly one acts.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from sqlalchemy import insert
from support.lifecycle import (
    CACHE,
    assert_consistent,
    cachectl,
    cachectl_argv,
    fake_env,
    index_entries,
    setup_cache,
    storage_entries,
    total_bytes,
    write_entries,
)

from cachectl.core.errors import OperationFailed
from cachectl.index.models import Lease as LeaseRow
from cachectl.index.models import utcnow
from cachectl.lifecycle import lease as leases


def _run(argv, env=None, timeout=120):
    return subprocess.run(
        argv,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def test_lease_is_exclusive_and_released(db_url):
    from cachectl.index import open_index

    index = open_index(db_url, auto_migrate=True)
    a = leases.acquire(index, "lifecycle:x", "gc", ttl_s=60)
    with pytest.raises(leases.LeaseHeld, match="cache 'x' is busy: gc by .*@"):
        leases.acquire(index, "lifecycle:x", "prune", ttl_s=60)
    other = leases.acquire(index, "lifecycle:y", "gc", ttl_s=60)  # other caches are independent
    a.renew()
    a.release()
    b = leases.acquire(index, "lifecycle:x", "prune", ttl_s=60)
    with pytest.raises(OperationFailed, match="lost the lease"):
        a.renew()
    b.release()
    other.release()
    index.close()


def test_keepalive_renews_and_reports_a_lost_lease(sqlite_url):
    from cachectl.index import open_index

    index = open_index(sqlite_url, auto_migrate=True)
    with leases.held(index, "k", "gc", ttl_s=0.6) as lease:
        time.sleep(1.3)  # two ttls: only the keep-alive thread keeps it
        with pytest.raises(leases.LeaseHeld):
            leases.acquire(index, leases.lease_name("k"), "prune")
        lease.check()
        with index.session() as s:  # someone removes it (an operator, or expiry + takeover)
            s.query(LeaseRow).delete()
        time.sleep(0.5)
        with pytest.raises(OperationFailed, match="lost the lease"):
            lease.check()
    index.close()


def test_expired_or_dead_holder_is_taken_over(db_url):
    from cachectl.index import open_index

    index = open_index(db_url, auto_migrate=True)
    now = utcnow()
    # Another host, lease still valid: held. Another host, expired: taken over.
    with index.session() as s:
        s.execute(
            insert(LeaseRow).values(
                name="lifecycle:far",
                holder="bob@elsewhere:1:gc:abcd1234",
                acquired_at=now,
                expires_at=now + timedelta(minutes=5),
            )
        )
        s.execute(
            insert(LeaseRow).values(
                name="lifecycle:old",
                holder="bob@elsewhere:1:gc:abcd1234",
                acquired_at=now,
                expires_at=now - timedelta(seconds=1),
            )
        )
    with pytest.raises(leases.LeaseHeld, match="bob@elsewhere"):
        leases.acquire(index, "lifecycle:far", "gc")
    leases.acquire(index, "lifecycle:old", "gc").release()
    # This host, a process that has exited: taken over without waiting for expiry.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with index.session() as s:
        s.execute(
            insert(LeaseRow).values(
                name="lifecycle:crashed",
                holder=f"me@{socket.gethostname()}:{dead.pid}:prune:abcd1234",
                acquired_at=now,
                expires_at=now + timedelta(minutes=5),
            )
        )
    leases.acquire(index, "lifecycle:crashed", "prune").release()
    index.close()


@pytest.mark.parametrize(
    "db, storage", [("sqlite", "local"), ("postgresql", "s3"), ("sqlite", "gcs")]
)
def test_prune_killed_after_first_batch_is_finished_by_rerun(tmp_path, db, storage, request):
    db_url = request.getfixturevalue({"sqlite": "sqlite_url", "postgresql": "pg_url"}[db])
    root = {
        "local": lambda: str(tmp_path / "cache"),
        "s3": lambda: request.getfixturevalue("s3_bucket") + "/c",
        "gcs": lambda: request.getfixturevalue("gcs_bucket") + "/c",
    }[storage]()
    index, store = setup_cache(db_url, root)
    whole = write_entries(index, store, fake_env("0.8.0"), 3, age_days=[40, 41, 42])
    part = write_entries(index, store, fake_env("0.10.2"), 12, age_days=[1, 2] + [40] * 10)
    argv = cachectl_argv(db_url, "prune", "--older-than", "30d", "--batch-size", "3")

    crashed = _run(argv, {"CACHECTL_TEST_CRASH_AFTER_BATCHES": "2"})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    # Killed between storage and index: the namespace went and its rows were
    # updated; the first entry batch left storage but its rows are still there.
    assert whole.env.namespace not in storage_entries(store)
    assert len(storage_entries(store)[part.env.namespace]) == 12 - 3
    assert len(index_entries(index)[part.env.namespace]) == 12
    assert [a.operation for a in index.audit_log(CACHE)] == []

    if storage == "local":
        # `cachectl sync` alone reconciles what the crash left: the rows whose files went.
        synced = _run(cachectl_argv(db_url, "sync", "--min-age", "0"))
        assert synced.returncode == 0, synced.stderr
        assert_consistent(index, store)

    rerun = _run(argv)  # the crashed holder's lease is taken over: same host, pid gone
    assert rerun.returncode == 0, rerun.stderr
    assert storage_entries(store) == {part.env.namespace: set(part.keys[:2])}
    assert_consistent(index, store)
    assert [a.operation for a in index.audit_log(CACHE)][0] == "prune"


def test_two_concurrent_gc_runs_exactly_one_acts(tmp_path, db_url):
    index, store = setup_cache(db_url, str(tmp_path / "cache"))
    write_entries(index, store, fake_env("0.10.2"), 12, sizes=[200] * 12)
    limit = total_bytes(index) // 2
    argv = cachectl_argv(db_url, "gc", "--max-size", str(limit), "--batch-size", "2")
    env = {
        **os.environ,
        "CACHECTL_TEST_BATCH_DELAY_S": "1.0",
    }  # ~6 s held: starts may skew by seconds
    procs = [
        subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        for _ in range(2)
    ]
    results = [(p.returncode, *p.communicate(timeout=120)) for p in procs]
    results = [(p.returncode, out, err) for p, (_, out, err) in zip(procs, results, strict=True)]
    codes = sorted(rc for rc, _, _ in results)
    assert codes == [0, 1], results
    loser = next(err for rc, _, err in results if rc == 1)
    assert "is busy: gc by" in loser and len(loser.strip().splitlines()) == 1
    assert [a.operation for a in index.audit_log(CACHE)] == ["gc"]
    assert total_bytes(index) <= limit
    assert_consistent(index, store)
    with index.session() as s:  # the winner released its lease
        assert s.query(LeaseRow).count() == 0


def test_holder_that_stopped_renewing_stops_blocking_at_expiry(tmp_path, sqlite_url):
    """A holder that crashed on another host blocks only until its lease expires."""
    index, store = setup_cache(sqlite_url, str(tmp_path / "cache"))
    write_entries(index, store, fake_env("0.10.2"), 2)
    now = utcnow()
    with index.session() as s:
        s.execute(
            insert(LeaseRow).values(
                name=leases.lease_name(CACHE),
                holder="x@gone:7:gc:00000000",
                acquired_at=now,
                expires_at=now + timedelta(seconds=2),
            )
        )
    res = cachectl(sqlite_url, "gc", "--max-size", "1")
    assert res.exit_code == 1 and "cache 'lc' is busy: gc by x@gone (pid 7)" in res.output
    assert total_bytes(index) > 0
    time.sleep(max(0.0, (now + timedelta(seconds=2.1) - utcnow()).total_seconds()))
    res = cachectl(sqlite_url, "gc", "--max-size", "1")
    assert res.exit_code == 0, res.output
    assert total_bytes(index) == 0
