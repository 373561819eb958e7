"""The telemetry collector at interpreter exit and across fork: no new thread at exit, nothing lost."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from support.infra import run_py  # noqa: E402


def telemetry_rows() -> list[tuple[str, str, int, int]]:
    db = Path(os.environ["XDG_DATA_HOME"]) / "cachectl" / "index.db"
    with sqlite3.connect(db) as conn:
        return conn.execute(
            "SELECT process, function, requests, hits, loads FROM telemetry"
        ).fetchall()


def test_exit_flush_starts_no_thread_and_loses_nothing() -> None:
    """Python 3.12 refuses new threads at shutdown; the final flush must not need one."""
    code = """
        import atexit, threading
        import jax, cachectl
        cachectl.activate()
        jax.jit(lambda x: x * 3)(2.0).block_until_ready()
        def no_new_threads():
            def refuse(self, *a, **k):
                raise RuntimeError("can't create new thread at interpreter shutdown")
            threading.Thread.start = refuse
        atexit.register(no_new_threads)   # runs before cachectl's own handler (LIFO)
    """
    proc = run_py(code, {"CACHECTL_TELEMETRY_INTERVAL": "3600"}, check=True)
    assert "Traceback" not in proc.stderr and "RuntimeError" not in proc.stderr, proc.stderr
    rows = telemetry_rows()
    assert sum(r[2] for r in rows) >= 1, rows  # the compile request reached the index at exit


def test_a_forked_child_reports_under_its_own_process_id() -> None:
    code = """
        import os
        import cachectl
        from cachectl import telemetry
        cachectl.activate()
        collector = telemetry.current()
        collector.record_load("jit_parent", "jit_parent-" + "0" * 64)
        pid = os.fork()
        if pid == 0:
            # A forked JAX process cannot finalize (XLA's teardown hangs in a child, as JAX
            # warns): flush explicitly, then leave without interpreter shutdown.
            collector.record_load("jit_child", "jit_child-" + "1" * 64)
            os._exit(0 if collector.flush() else 3)
        _, status = os.waitpid(pid, 0)
        print("child", pid, os.waitstatus_to_exitcode(status))
    """
    proc = run_py(code, {"CACHECTL_TELEMETRY_INTERVAL": "3600"}, check=True)
    child_pid = proc.stdout.split()[1]
    assert proc.stdout.split()[2] == "0", proc.stderr
    rows = telemetry_rows()
    by_function = {r[1]: r[0] for r in rows}
    assert by_function["jit_child"].endswith(f":{child_pid}"), rows
    assert not by_function["jit_parent"].endswith(f":{child_pid}"), rows
    # counted once, by the parent, as a load: neither a compile request nor a hit
    assert [r[2:] for r in rows if r[1] == "jit_parent"] == [(0, 0, 1)]
