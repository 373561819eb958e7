"""`cachectl stats` names, per function, the programs a service compiled with host callbacks.

JAX never writes a program with host callbacks to its persistent cache (equinox's runtime
checks, ``jax.debug.callback``), so its requests miss every time and no warm can help. The
collector in a real service process reads JAX's own "Not writing ... host callbacks" log call
and counts those requests as not cacheable; `stats` (table and --json) names the function and
the way out, while a plain function's miss stays a miss and nothing else is blamed.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
from support.infra import run_cachectl, run_py

from cachectl.core import jax_seam

pytestmark = [pytest.mark.timeout(600)]

MODULE = """
import jax, jax.numpy as jnp

def checked(x):
    jax.debug.callback(lambda v: None, x.sum())  # a host callback, as equinox's checks compile
    return jnp.tanh(x) * 2

def plain(x):
    return jnp.cos(x) + 1
"""

SERVICE = """
import sys
sys.path.insert(0, {dir!r})
import numpy as np
import cachectl
cachectl.activate()
import jax, jax.numpy as jnp
import hc
counts = dict(requests=0, hits=0)
def _event(event, **kw):
    if event == "/jax/compilation_cache/compile_requests_use_cache":
        counts["requests"] += 1
    elif event == "/jax/compilation_cache/cache_hits":
        counts["hits"] += 1
jax.monitoring.register_event_listener(_event)
checked = jax.jit(hc.checked)
for n in (2, 3, 2):  # two programs with host callbacks; the third call is jit's own cache
    checked(np.ones((n, 4), np.float32)).block_until_ready()
after_checked = dict(counts)
jax.jit(hc.plain)(np.ones((2, 4), np.float32)).block_until_ready()
jnp.asarray(np.ones(3, np.float32)).block_until_ready()  # a staging program, where JAX makes one
print(after_checked["requests"] - after_checked["hits"])
"""

CAUSE = "uses host callbacks"
WAY_OUT = "EQX_ON_ERROR=nan"


def _cachectl(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(p for p in (str(cwd), os.environ.get("PYTHONPATH")) if p)
    return run_cachectl(cwd, *args, env={"PYTHONPATH": path})


def test_stats_names_the_functions_whose_programs_use_host_callbacks(tmp_path: Path) -> None:
    if not jax_seam.never_writes_host_callbacks():
        pytest.skip("this JAX writes programs with host callbacks: nothing to explain")
    (tmp_path / "hc.py").write_text(textwrap.dedent(MODULE))
    served = run_py(SERVICE.format(dir=str(tmp_path)), cwd=tmp_path, check=True)
    jax_missed = int(served.stdout.strip().splitlines()[-1])
    assert jax_missed == 2, served.stdout + served.stderr  # JAX looked both up and missed

    out = _cachectl(tmp_path, "stats", "--since", "1h", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    fns = {f["function"]: f for f in json.loads(out.stdout)["functions"]}
    checked = fns["jit_checked"]
    # Not cacheable, not misses: no warm can serve them, and the hit rate leaves them out.
    assert checked["host_callbacks"] == checked["uncacheable"] == jax_missed, checked
    assert checked["misses"] == 0 and checked["hit_rate"] is None, checked
    assert CAUSE in checked["cause"] and WAY_OUT in checked["cause"], checked
    assert "jit_checked" in checked["cause"], checked
    plain = fns["jit_plain"]
    assert plain["misses"] == 1 and plain["host_callbacks"] == 0, plain
    assert plain["cause"] is None, plain
    # Nothing else is blamed: a staging program stays plain "not cacheable".
    assert [f for f, r in fns.items() if r["cause"] or r["host_callbacks"]] == ["jit_checked"]
    env = json.loads(out.stdout)["environments"][0]
    assert env["host_callbacks"] == jax_missed, env

    table = _cachectl(tmp_path, "stats", "--since", "1h")
    assert table.returncode == 0, table.stdout + table.stderr
    text = " ".join(table.stdout.split())  # the table wraps long lines
    assert f"jit_checked: {jax_missed} not cacheable: jit_checked {CAUSE}" in text, table.stdout
    assert WAY_OUT in text, table.stdout
    assert "jit_plain:" not in text, table.stdout

    # `misses` counts what `stats` counts: the host-callback programs are not cacheable, never
    # misses, each counted once; only jit_plain's miss is a miss
    missed = _cachectl(tmp_path, "misses", "--since", "1h", "--json")
    assert missed.returncode == 1, missed.stdout + missed.stderr  # jit_plain missed
    report = json.loads(missed.stdout)
    assert report["host_callback_functions"] == {"jit_checked": jax_missed}, report
    assert [m["function"] for m in report["missed"]] == ["jit_plain"], report["missed"]
    assert report["misses"] == sum(f["misses"] for f in fns.values()) == 1, report
    assert report["uncacheable"] == sum(f["uncacheable"] for f in fns.values()), report
    assert CAUSE in report["host_callbacks_cause"], report


REGISTER = """
version: 1
cache: main
target: {backend: cpu}
functions:
  - fn: hc:plain
    args: [{shape: [batch, 4], dtype: float32}]
    buckets: {batch: [1]}
"""

SERVER_SERVICE = """
import json, sys
sys.path.insert(0, {dir!r})
import numpy as np
import cachectl
from cachectl import telemetry
act = cachectl.activate("main", readonly=True)
import jax, hc
checked = jax.jit(hc.checked)
for n in (2, 3):
    checked(np.ones((n, 4), np.float32)).block_until_ready()
stats = telemetry.stop(flush=True)
print(json.dumps(dict(telemetry=act.telemetry, failed=stats.failed_flushes, warning=act.warning)))
"""


def test_stats_names_host_callbacks_through_the_server(tmp_path: Path) -> None:
    """Server mode: the service's telemetry goes to a real server on loopback, and `stats`
    asked through it names the same function."""
    if not jax_seam.never_writes_host_callbacks():
        pytest.skip("this JAX writes programs with host callbacks: nothing to explain")
    from click.testing import CliRunner
    from support.server_kit import MAIN, LiveServer, seed

    from cachectl.cli import cli
    from cachectl_server.app import create_app

    (tmp_path / "hc.py").write_text(textwrap.dedent(MODULE))
    (tmp_path / "register.yaml").write_text(textwrap.dedent(REGISTER))
    s = seed(f"sqlite:///{tmp_path}/index.db", str(tmp_path / "main"), str(tmp_path / "other"))
    app = create_app(s.db)
    try:
        with LiveServer(app) as live:
            env = {"CACHECTL_SERVER": live.url, "CACHECTL_DB": None}
            path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
            # warm registers this machine's environment with the server (telemetry for an
            # environment the server does not know is dropped)
            warm = run_py(
                f"""
                import sys
                from cachectl.cli import main
                sys.argv = ["cachectl", "warm", {str(tmp_path / "register.yaml")!r},
                            "--path", {str(tmp_path)!r}, "--jobs", "1", "--json"]
                main()
                """,
                env={**env, "CACHECTL_TOKEN": s.tokens["writer"], "PYTHONPATH": path},
                timeout=300,
            )
            assert warm.returncode == 0, warm.stdout + warm.stderr
            out = run_py(
                SERVER_SERVICE.format(dir=str(tmp_path)),
                env={**env, "CACHECTL_TOKEN": s.tokens["reader"]},
                check=True,
            )
            result = json.loads(out.stdout.strip().splitlines()[-1])
            assert result["telemetry"] == f"server {live.url}" and result["failed"] == 0, (
                result,
                out.stderr[-3000:],
            )
            stats = CliRunner().invoke(
                cli,
                ["--cache", MAIN, "stats", "--since", "1h", "--json"],
                env={"CACHECTL_SERVER": live.url, "CACHECTL_TOKEN": s.tokens["reader"]},
            )
            assert stats.exit_code == 0, stats.output
            fns = {f["function"]: f for f in json.loads(stats.output)["functions"]}
            checked = fns["jit_checked"]
            assert checked["host_callbacks"] == 2 and checked["misses"] == 0, checked
            assert CAUSE in checked["cause"] and WAY_OUT in checked["cause"], checked
    finally:
        app.state.cachectl.index.close()
