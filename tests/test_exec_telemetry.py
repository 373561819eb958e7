"""`cachectl exec` records service telemetry for a Python service that never calls activate()."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

MODULE = """
import jax.numpy as jnp

def affine(x, w):
    return jnp.tanh(x @ w)
"""

MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: ex_tiny:affine
    args:
      - {shape: [2, 8], dtype: float32}
      - {shape: [8, 8], dtype: float32}
"""

SERVICE = """
import sys
sys.path.insert(0, {dir!r})
import numpy as np, jax, ex_tiny
jax.jit(ex_tiny.affine)(np.ones((2, 8), np.float32), np.eye(8, dtype=np.float32)).block_until_ready()
jax.jit(ex_tiny.affine)(np.ones((3, 8), np.float32), np.eye(8, dtype=np.float32)).block_until_ready()
print("served")
"""


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cachectl", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
        stdin=subprocess.DEVNULL,
    )


def test_exec_records_hits_misses_and_signatures_of_a_plain_jit_service(tmp_path: Path) -> None:
    (tmp_path / "ex_tiny.py").write_text(MODULE)
    (tmp_path / "m.yaml").write_text(MANIFEST)
    assert cli("warm", str(tmp_path / "m.yaml")).returncode == 0
    # A sitecustomize of the user's own must still run under exec.
    user_site = tmp_path / "site"
    user_site.mkdir()
    (user_site / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = 'yes'\n")
    code = SERVICE.format(dir=str(tmp_path)) + "import os; print(os.environ.get('USER_SITE_RAN'))\n"
    # The caller's PYTHONPATH stays after it: the child imports the cachectl under test.
    path = os.pathsep.join(p for p in (str(user_site), os.environ.get("PYTHONPATH")) if p)
    run = cli("exec", "--", sys.executable, "-c", code, env={"PYTHONPATH": path})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["served", "yes"], run.stdout
    stats = json.loads(cli("stats", "--since", "1h", "--json").stdout)
    (row,) = [f for f in stats["functions"] if f["function"] == "jit_affine"]
    assert (row["requests"], row["hits"]) == (2, 1), row  # [2, 8] was warmed, [3, 8] was not
    misses = cli("misses", "--since", "1h", "--manifest", str(tmp_path / "m.yaml"), "--json")
    assert misses.returncode == 1, misses.stderr
    assert "3" in json.dumps(json.loads(misses.stdout))


def test_exec_no_telemetry_and_non_python_commands_are_left_alone(tmp_path: Path) -> None:
    run = cli("exec", "--no-telemetry", "--", "sh", "-c", "echo ${CACHECTL_EXEC_TELEMETRY:-off}")
    assert run.returncode == 0 and run.stdout.strip() == "off", run.stderr
    run = cli("exec", "--", "sh", "-c", "echo $CACHECTL_EXEC_TELEMETRY")
    assert run.returncode == 0 and run.stdout.strip() == "1"
    stats = cli("stats", "--since", "1h", "--json")
    assert json.loads(stats.stdout)["functions"] == []
