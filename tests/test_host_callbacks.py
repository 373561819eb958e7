"""Programs with host callbacks, and programs a function runs eagerly while it is traced.

JAX never writes a program with host callbacks to its persistent cache (diffrax's default
``throw=True`` compiles them through equinox's runtime checks; ``jax.debug.callback`` here).
warm, warm-run, warm-check --replay, misses and serving's fallback each name them as the
cause, with the way out, and warm-run exits non-zero when nothing could be written. A
function that runs small programs eagerly while traced (equinox's ``jit_convert_element_type``,
``jit_bitwise_or``) makes JAX write them into the namespace during a warm: warm indexes them,
so ``verify`` right after it finds no unknown writer. Every process is a real one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.infra import run_cachectl, run_py

from cachectl.core import jax_seam

pytestmark = [pytest.mark.timeout(600)]


def jax_version() -> str:
    import jax

    return jax.__version__


MODULE = """
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
print(rt.report().to_json()["functions"]["checked"]["fallback_reason"])
"""

CAUSE = "uses host callbacks"
WAY_OUT = "EQX_ON_ERROR=nan"


def _setup(tmp_path: Path) -> None:
    (tmp_path / "hc.py").write_text(textwrap.dedent(MODULE))
    (tmp_path / "checked.yaml").write_text(textwrap.dedent(MANIFEST % "checked"))
    (tmp_path / "eager.yaml").write_text(textwrap.dedent(MANIFEST % "eager"))
    (tmp_path / "warmup.py").write_text(textwrap.dedent(WARMUP))


def _cachectl(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(p for p in (str(cwd), os.environ.get("PYTHONPATH")) if p)
    return run_cachectl(cwd, *args, env={"PYTHONPATH": path})


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

    missed = _cachectl(tmp_path, "misses", "--manifest", "checked.yaml", "--json")
    findings = json.loads(missed.stdout)["findings"]
    assert findings and all(f["kind"] == "host-callbacks" for f in findings), findings
    assert WAY_OUT in findings[0]["message"] and "static" not in findings[0]["message"]


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
