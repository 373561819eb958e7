"""Programs with host callbacks, and programs a function runs eagerly while it is traced.

JAX never writes a program with host callbacks to its persistent cache (diffrax's default
``throw=True`` compiles them through equinox's runtime checks; ``jax.debug.callback`` here).
warm, warm-run, warm-check --replay, misses and serving's fallback each name them as the
cause, with the way out, and warm-run exits non-zero when nothing could be written. A
function that runs small programs eagerly while traced (equinox's ``jit_convert_element_type``,
``jit_bitwise_or``) makes JAX write them into the namespace during a warm: warm indexes them,
so ``verify`` right after it finds no unknown writer, and only them: what another warm writes
into the namespace meanwhile is that warm's. Every process is a real one.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.infra import held, run_cachectl, run_py

from cachectl.core import jax_seam
from cachectl.storage.entries import parse_key

pytestmark = [pytest.mark.timeout(600)]


def jax_version() -> str:
    import jax

    return jax.__version__


MODULE = """
import os, pathlib, threading, time
import numpy as np
import jax, jax.numpy as jnp

def checked(x):
    jax.debug.callback(lambda v: None, x.sum())  # a host callback, as equinox's checks compile
    return jnp.tanh(x) * 2

def eager(x):
    # As equinox does while tracing: each operation runs eagerly, a small program of its own.
    with jax.ensure_compile_time_eval():
        scale = (jnp.asarray(3, jnp.int32) | jnp.asarray(4, jnp.int32)).astype(jnp.float32)
    return x * scale

def held(x):
    # eager's programs, then a mark that tracing has begun and a wait for the test's "go".
    with jax.ensure_compile_time_eval():
        scale = (jnp.asarray(3, jnp.int32) | jnp.asarray(4, jnp.int32)).astype(jnp.float32)
    gate = pathlib.Path(os.environ["HC_GATE"])
    (gate / f"tracing-{os.getpid()}-{threading.get_ident()}").touch()
    deadline = time.monotonic() + 300
    while not (gate / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return x * scale

def other(x):
    return jnp.sin(x) + 1
"""

MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: hc:%s
    args:
      - {shape: [batch, 4], dtype: float32}
    buckets: {batch: [1, 4]}
"""

WARMUP = """
import numpy as np, jax, hc
print(jax.jit(hc.checked)(np.ones((4, 4), np.float32)).shape)
"""

SERVICE = """
import sys, logging, numpy as np, jax
sys.path.insert(0, {dir!r})
import cachectl, hc
rt = cachectl.serving({manifest!r})
x = np.ones((3, 4), np.float32)
out = rt["checked"](x)
assert np.allclose(np.asarray(out)[:3], jax.jit(hc.checked)(np.pad(x, ((0, 1), (0, 0))))[:3])
print(rt.report().to_dict()["functions"]["checked"]["fallback_reason"])
"""

CAUSE = "uses host callbacks"
WAY_OUT = "EQX_ON_ERROR=nan"


def _setup(tmp_path: Path) -> None:
    (tmp_path / "hc.py").write_text(textwrap.dedent(MODULE))
    (tmp_path / "checked.yaml").write_text(textwrap.dedent(MANIFEST % "checked"))
    for name in ("eager", "held", "other"):
        (tmp_path / f"{name}.yaml").write_text(textwrap.dedent(MANIFEST % name))
    (tmp_path / "warmup.py").write_text(textwrap.dedent(WARMUP))


def _pythonpath(cwd: Path) -> str:
    return os.pathsep.join(p for p in (str(cwd), os.environ.get("PYTHONPATH")) if p)


def _cachectl(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cachectl(cwd, *args, env={"PYTHONPATH": _pythonpath(cwd)})


def test_host_callbacks_are_named_by_warm_warm_run_replay_misses_and_serving(
    tmp_path: Path,
) -> None:
    if not jax_seam.never_writes_host_callbacks():
        pytest.skip(f"jax {jax_version()} writes programs with host callbacks")
    _setup(tmp_path)
    warm = _cachectl(tmp_path, "warm", "checked.yaml", "--json")
    assert warm.returncode == 1, warm.stdout + warm.stderr
    report = json.loads(warm.stdout)
    for b in report["buckets"]:
        assert b["status"] == "failed" and CAUSE in b["error"] and WAY_OUT in b["error"], b
    # The summary counts what the failed buckets compiled, as their column does.
    per_bucket = sum(b["compile_seconds"] for b in report["buckets"])
    # (each figure is rounded to milliseconds, so their sum may differ in the last place)
    assert report["summary"]["compile_seconds"] == pytest.approx(per_bucket, abs=0.002)
    assert per_bucket > 0, report["summary"]

    run = _cachectl(tmp_path, "warm-run", "--json", "--", sys.executable, "warmup.py")
    assert run.returncode == 1, run.stdout + run.stderr  # nothing could be written
    assert "nothing could be written" in run.stderr and CAUSE in run.stderr, run.stderr
    assert WAY_OUT in run.stderr
    ran = json.loads(run.stdout)
    assert ran["host_callbacks"] == ["jit_checked"] and ran["exit_code"] == 0, ran

    replay = _cachectl(tmp_path, "warm-check", "--replay")
    assert replay.returncode == 1, replay.stdout + replay.stderr
    assert "missed the cache" in replay.stderr and CAUSE in replay.stderr, replay.stderr
    assert "jit_checked" in replay.stdout and WAY_OUT in replay.stdout, replay.stdout

    served = run_py(
        SERVICE.format(dir=str(tmp_path), manifest=str(tmp_path / "checked.yaml")),
        cwd=tmp_path,
        check=True,
    )
    reason = served.stdout.strip().splitlines()[-1]
    assert CAUSE in reason and WAY_OUT in reason and "cachectl warm" not in reason, reason
    assert CAUSE in served.stderr  # the one warning says the same

    # not cacheable and never a miss, as `stats` counts it: said with its cause, exit 0
    missed = _cachectl(tmp_path, "misses", "--manifest", "checked.yaml", "--json")
    report = json.loads(missed.stdout)
    assert missed.returncode == 0 and report["misses"] == 0, report
    assert list(report["host_callback_functions"]) == ["jit_checked"], report
    assert WAY_OUT in report["host_callbacks_cause"] and not report["findings"], report


def test_what_a_function_runs_eagerly_while_traced_is_indexed_and_verify_is_clean(
    tmp_path: Path,
) -> None:
    _setup(tmp_path)
    warm = _cachectl(tmp_path, "warm", "eager.yaml", "--json")
    assert warm.returncode == 0, warm.stdout + warm.stderr
    side = json.loads(warm.stdout)["side_programs"]
    assert "jit_bitwise_or" in side, side
    verify = _cachectl(tmp_path, "verify", "--json")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    again = _cachectl(tmp_path, "warm", "eager.yaml", "--json")  # already indexed: nothing new
    assert again.returncode == 0 and json.loads(again.stdout)["side_programs"] == []


def _module(key: str) -> str:
    parsed = parse_key(key)
    assert parsed is not None, key
    return parsed.module


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_warm_indexes_as_side_programs_only_what_it_wrote_while_another_writes_there(
    tmp_path: Path, executor: str
) -> None:
    """A second warm (a sharded warm's other pod) writes into the namespace while the first one
    traces: the first run's side_programs, and the entries indexed under its warm run, are its
    own eager programs and buckets; the second run's bucket stays the second run's."""
    _setup(tmp_path)
    gate = tmp_path / "gate"
    gate.mkdir()
    out, err = tmp_path / "held.out", tmp_path / "held.err"
    env = {**os.environ, "PYTHONPATH": _pythonpath(tmp_path), "HC_GATE": str(gate)}
    argv = [sys.executable, "-m", "cachectl", "warm", "held.yaml", "--json"]
    with out.open("w") as stdout, err.open("w") as stderr:
        first = subprocess.Popen(
            [*argv, "--executor", executor, "--jobs", "2"],
            cwd=tmp_path,
            env=env,
            stdout=stdout,
            stderr=stderr,
        )
    # Once its eager programs are written, it waits.
    with held(first, lambda: any(gate.glob("tracing-*")), gate / "go", err):
        second = _cachectl(tmp_path, "warm", "other.yaml", "--json")
        assert second.returncode == 0, second.stdout + second.stderr
    assert first.returncode == 0, out.read_text() + err.read_text()
    ours, theirs = json.loads(out.read_text()), json.loads(second.stdout)
    their_keys = {b["key"] for b in theirs["buckets"]}
    assert {_module(k) for k in their_keys} == {"jit_other"}, theirs
    assert theirs["side_programs"] == [], theirs
    assert "jit_bitwise_or" in ours["side_programs"], ours["side_programs"]
    assert "jit_other" not in ours["side_programs"], ours["side_programs"]

    db = sqlite3.connect(Path(os.environ["XDG_DATA_HOME"]) / "cachectl" / "index.db")
    try:
        runs = dict(db.execute("SELECT manifest_path, id FROM warm_runs").fetchall())
        rows = dict(db.execute("SELECT key, warm_run_id FROM entries").fetchall())
    finally:
        db.close()
    mine = runs[str((tmp_path / "held.yaml").resolve())]
    assert {rows[k] for k in their_keys} == {runs[str((tmp_path / "other.yaml").resolve())]}
    indexed_mine = {_module(k) for k, run in rows.items() if run == mine}
    assert indexed_mine == {"jit_held", *ours["side_programs"]}, rows
    verify = _cachectl(tmp_path, "verify", "--json")  # each file indexed, by its own writer
    assert verify.returncode == 0, verify.stdout + verify.stderr
