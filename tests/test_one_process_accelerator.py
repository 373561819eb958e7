"""Commands that start JAX children never open a backend themselves (a TPU is held by one
process at a time).

On a TPU, a second process that opens the chip fails with "The TPU is already in use by
process N". CPU has no such rule, so these tests give it one: a sitecustomize on PYTHONPATH
takes an exclusive lock on a file when a process first opens a JAX backend and fails as
the TPU does when another process holds it. Every command then runs as a user runs it, in
a fresh process, and its children (the coverage check, the calling child, the user's
command, its replay, the deep loader, exec's service) must each get the "accelerator";
the backends the parent opened (``jax._src.xla_bridge._backends``, each time it grows) are
written when it exits or execs, and must be none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.infra import run_cachectl  # noqa: E402
from support.one_holder import one_holder_env as _env

MODULE = """
import jax.numpy as jnp

def score(x):
    return jnp.tanh(x @ x.T).sum(axis=-1)
"""

MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - name: score
    fn: onehold:score
    args:
      - {shape: [n, 4], dtype: float32}
    buckets:
      n: [2, 8]
"""

WARMUP = """
import jax, jax.numpy as jnp
print(jax.jit(lambda v: jnp.cos(v).sum())(jnp.ones((3, 5))))
"""

USES_JAX = "import jax; print('devices', len(jax.devices()))"


def _run(tmp_path: Path, name: str, *args: str) -> tuple[subprocess.CompletedProcess[str], list]:
    """``cachectl ARGS`` under the one-holder rule; (result, backends its process opened)."""
    report = tmp_path / f"backends-{name}.json"
    result = run_cachectl(tmp_path, *args, env=_env(tmp_path, report))
    opened = json.loads(report.read_text()) if report.exists() else ["(no report)"]
    return result, opened


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "onehold.py").write_text(textwrap.dedent(MODULE))
    (tmp_path / "manifest.yaml").write_text(textwrap.dedent(MANIFEST))
    (tmp_path / "warmup.py").write_text(textwrap.dedent(WARMUP))
    return tmp_path


def test_the_one_holder_rule_refuses_a_child_while_its_parent_holds_the_backend(
    tmp_path: Path,
) -> None:
    """The rule itself can fail: a parent that opened JAX's backend starves its child."""
    code = (
        "import jax, subprocess, sys; jax.devices(); "
        f"sys.exit(subprocess.run([sys.executable, '-c', {USES_JAX!r}]).returncode)"
    )
    held = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **_env(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert held.returncode != 0
    assert "already in use by another process" in held.stderr
    after = subprocess.run(  # released when its holder exited
        [sys.executable, "-c", USES_JAX],
        env={**os.environ, **_env(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert after.returncode == 0, after.stderr


def test_commands_that_start_jax_children_never_open_a_backend_themselves(
    project: Path,
) -> None:
    warm, opened = _run(project, "warm", "warm", "manifest.yaml", "--json")
    assert warm.returncode == 0, warm.stderr
    assert json.loads(warm.stdout)["summary"]["compiled"] == 2
    assert opened == ["cpu"]  # warm compiles in its own process: the control

    check, opened = _run(project, "check", "warm-check", "manifest.yaml", "--json")
    assert check.returncode == 0, check.stderr
    report = json.loads(check.stdout)
    assert [b["status"] for b in report["buckets"]] == ["hit", "hit"]
    assert [b["aot_call"] for b in report["buckets"]] == ["ok", "ok"]
    assert report["environment"]["backend"] == "cpu"
    assert opened == []

    run, opened = _run(project, "run", "warm-run", "--json", "--", sys.executable, "warmup.py")
    assert run.returncode == 0, run.stderr
    written = [e["status"] for e in json.loads(run.stdout)["entries"]]
    assert written and set(written) == {"written"}  # the jit, and jnp.ones's own program
    assert opened == []

    replay, opened = _run(project, "replay", "warm-check", "--replay", "--json")
    assert replay.returncode == 0, replay.stderr
    assert json.loads(replay.stdout)["hits"] == len(written)
    assert opened == []

    deep, opened = _run(project, "deep", "verify", "--deep", "--json")
    assert deep.returncode == 0, deep.stderr
    assert json.loads(deep.stdout)["plan"]["findings"] == []
    assert opened == []

    served, opened = _run(project, "exec", "exec", "--", sys.executable, "-c", USES_JAX)
    assert served.returncode == 0, served.stderr
    assert "devices 1" in served.stdout
    assert opened == []


def test_a_target_mismatch_is_found_by_the_check_child_before_it_compiles(
    project: Path,
) -> None:
    """warm-check's target check moved into its child; it still exits 3 and names the file."""
    (project / "manifest.yaml").write_text(
        textwrap.dedent(MANIFEST).replace("{backend: cpu}", "{backend: tpu}")
    )
    check, opened = _run(project, "check", "warm-check", "manifest.yaml")
    assert check.returncode == 3, check.stderr
    assert check.stderr.startswith("cachectl: error: manifest.yaml: this machine does not match")
    assert "Traceback" not in check.stderr
    assert opened == []


def test_the_benchmarks_read_the_backend_without_opening_it(tmp_path: Path) -> None:
    """`python -m bench` reads the machine first; its parent then starts every service."""
    repo = str(Path(__file__).resolve().parent.parent)
    code = (
        f"import json, sys; sys.path.insert(0, {repo!r}); from bench.common import machine; "
        "info = machine(); bridge = sys.modules.get('jax._src.xla_bridge'); "
        "print(json.dumps([info['backend'], sorted(getattr(bridge, '_backends', None) or {})]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **_env(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == ["cpu", []]
