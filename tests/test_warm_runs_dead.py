"""Issue 22, item 13: a warm that is killed (or aborted by XLA) never finishes its warm-runs row;
the row must not say "running" for ever. A real `cachectl warm` in its own process, killed with
SIGKILL while it traces; the index's own clock moved by rewriting the row's heartbeat."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from sqlalchemy import update

from cachectl.index import open_index, warm_runs
from cachectl.index.models import WarmRun

SLOW_MODULE = """
import time


def slow(x):
    time.sleep(120)  # while JAX traces it: the warm is running, its row says so
    return x
"""

MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: dead_slow:slow
    args:
      - {shape: [batch, 4], dtype: float32}
    buckets: {batch: [1]}
"""


def test_a_killed_warm_is_closed_as_interrupted_once_its_heartbeat_stops(tmp_path: Path) -> None:
    (tmp_path / "dead_slow.py").write_text(SLOW_MODULE)
    manifest = tmp_path / "m.yaml"
    manifest.write_text(MANIFEST)
    db = f"sqlite:///{tmp_path}/index.db"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cachectl", "--db", db, "warm", str(manifest)]
        + ["--path", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        running = []
        while time.monotonic() < deadline and not running:
            assert proc.poll() is None, "the warm ended before it was killed"
            time.sleep(0.5)
            if (tmp_path / "index.db").exists():
                try:
                    index = open_index(db)
                    running = warm_runs.list_runs(index, status=warm_runs.RUNNING)
                    index.close()
                except Exception:  # noqa: BLE001 - the warm is still creating the index
                    running = []
        assert running, "no running warm row appeared"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    (run,) = running

    index = open_index(db)
    try:
        # Just killed: its heartbeat is recent, so it may still be alive for all anyone knows.
        assert warm_runs.get_run(index, run.id).status == warm_runs.RUNNING
        assert [r.id for r in warm_runs.list_runs(index)] == [run.id]
        assert warm_runs.get_run(index, run.id).status == warm_runs.RUNNING
        # Eleven minutes later (its heartbeat every 30 s stopped): listing closes it.
        last = warm_runs.get_run(index, run.id).heartbeat_at
        assert last is not None
        stale = last - timedelta(minutes=11)
        with index.session() as s:
            s.execute(
                update(WarmRun)
                .where(WarmRun.id == run.id)
                .values(heartbeat_at=stale, started_at=stale)
            )
        alive = warm_runs.start_run(
            index, run.environment_id, manifest_digest="ab" * 32, manifest_path=None, buckets=1
        )
        closed = warm_runs.get_run(index, run.id)
        assert closed.status == warm_runs.INTERRUPTED and closed.finished_at == stale
        # a live run (a recent heartbeat) is left running; listing changes nothing more
        listed = {r.id: r.status for r in warm_runs.list_runs(index)}
        assert listed == {run.id: warm_runs.INTERRUPTED, alive.id: warm_runs.RUNNING}
        assert warm_runs.close_dead_runs(index) == 0
    finally:
        index.close()
