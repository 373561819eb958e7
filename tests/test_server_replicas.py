"""Replicas: two `cachectl serve` processes over one PostgreSQL index, scheduled gc due in both.

Exactly one of them runs it: each takes the index lease for the schedule
and checks, under it, whether a run already happened this interval.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
from sqlalchemy import select
from support import infra
from support.server_kit import MAIN, bearer, seed

from cachectl.index import open_index
from cachectl.index.models import AuditRecord, Job


def _serve(db: str, port: int, log_path, env: dict[str, str]) -> subprocess.Popen:
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cachectl",
                "serve",
                "--db",
                db,
                "--port",
                str(port),
                "--maintenance-interval",
                "1h",
                "--log-level",
                "info",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env},
        )


def test_two_replicas_run_a_due_gc_exactly_once(pg_url, tmp_path) -> None:
    open_index(pg_url, auto_migrate=True).close()
    s = seed(pg_url, str(tmp_path / "main"), str(tmp_path / "other"), entries=6)
    index = open_index(pg_url)
    total = sum(len(b) for b in s.entry_bytes.values())
    index.update_cache(MAIN, max_size=total // 2)
    # Both replicas tick ~4 s after start, at nearly the same moment; a slow
    # delete keeps the first one inside its lease while the other one ticks.
    env = {"CACHECTL_SERVER_MAINTENANCE_DELAY": "4s", "CACHECTL_TEST_BATCH_DELAY_S": "0.5"}
    ports = [infra.free_port(), infra.free_port()]
    procs = [
        _serve(pg_url, port, tmp_path / f"replica-{i}.log", env) for i, port in enumerate(ports)
    ]
    try:
        for port in ports:
            deadline = time.monotonic() + 60
            while not infra.port_open(port):
                assert time.monotonic() < deadline, "replica did not start"
                assert all(p.poll() is None for p in procs), [
                    (tmp_path / f"replica-{i}.log").read_text() for i in (0, 1)
                ]
                time.sleep(0.1)
        deadline = time.monotonic() + 90
        while True:
            with index.session() as sess:
                jobs = list(
                    sess.scalars(select(Job).where(Job.cache_name == MAIN, Job.kind == "gc"))
                )
            if jobs and all(j.status in ("succeeded", "failed") for j in jobs):
                break
            assert time.monotonic() < deadline, "no scheduled gc finished"
            time.sleep(0.2)
        time.sleep(3)  # give the other replica every chance to run it a second time
        with index.session() as sess:
            jobs = list(sess.scalars(select(Job).where(Job.cache_name == MAIN, Job.kind == "gc")))
            audits = list(sess.scalars(select(AuditRecord).where(AuditRecord.cache_name == MAIN)))
        assert len(jobs) == 1 and jobs[0].status == "succeeded", [(j.status, j.error) for j in jobs]
        assert jobs[0].params["scheduled"] == "size"
        assert [a.operation for a in audits].count("maintenance") == 1
        assert [a.operation for a in audits].count("gc") == 1
        assert sum(e.bytes for e in index.environment_stats(MAIN)) <= total // 2
        runs = 0.0
        for port in ports:
            text = httpx.get(
                f"http://127.0.0.1:{port}/metrics", headers=bearer(s.tokens["admin"])
            ).text
            for line in text.splitlines():
                if line.startswith("cachectl_maintenance_runs_total{"):
                    runs += float(line.rsplit(" ", 1)[1])
        assert runs == 1.0
        logs = "".join((tmp_path / f"replica-{i}.log").read_text() for i in (0, 1))
        assert logs.count("maintenance size on main: succeeded") == 1
        for token in s.tokens.values():
            assert token not in logs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        index.close()
