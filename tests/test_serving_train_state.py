"""A train step whose state holds static callables (a flax TrainState: apply_fn, optax's
closures) has a stored executable all the same: pickle cannot store its outputs' structure, so
serving rebuilds it by tracing the first call (never compiling), and warm-check calls every one.

Real warm, warm-check and service in fresh processes; outputs compared with plain jit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.infra import run_py
from support.serving import COUNT_EVENTS, last_json

MODULE = """
import jax, jax.numpy as jnp
import optax
from flax.training import train_state

def apply(params, x):
    return jnp.tanh(x @ params["w"])

tx = optax.sgd(0.1)

def make(w):
    return train_state.TrainState.create(apply_fn=apply, params={"w": w}, tx=tx)

def state_specs():
    return jax.eval_shape(lambda: make(jnp.zeros((4, 2), jnp.float32)))

def step(state, x):
    grads = jax.grad(lambda p: jnp.mean(state.apply_fn(p, x) ** 2))(state.params)
    return state.apply_gradients(grads=grads)
"""

MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: ts_mod:step
    args:
      - {pytree: ts_mod:state_specs}
      - {shape: [batch, 4], dtype: float32}
    buckets: {batch: [2, 4]}
"""

SERVICE = (
    COUNT_EVENTS
    + """
import numpy as np
sys.path.insert(0, {dir!r})
import cachectl, ts_mod
rt = cachectl.serving({manifest!r})
before = compiles()
x = np.linspace(0, 1, 8, dtype=np.float32).reshape(2, 4)
served = plain = ts_mod.make(np.ones((4, 2), np.float32))
for _ in range(3):  # the returned state goes back in, as a training loop does
    served = rt["step"](served, x)
during = compiles()
for _ in range(3):
    plain = jax.jit(ts_mod.step)(plain, x)
print(json.dumps(dict(
    equal=bool(np.array_equal(np.asarray(served.params["w"]), np.asarray(plain.params["w"]))),
    step=int(served.step), counts=rt.report().to_dict()["functions"]["step"],
    compiles=[before, during])))
"""
)


def test_a_train_state_step_is_stored_checked_and_served(tmp_path: Path) -> None:
    (tmp_path / "ts_mod.py").write_text(MODULE)
    manifest = tmp_path / "ts.yaml"
    manifest.write_text(MANIFEST)

    def cachectl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "cachectl", *args],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(tmp_path)},
        )

    warm = cachectl("warm", str(manifest), "--json")
    assert warm.returncode == 0, warm.stderr
    errors = [b["aot_error"] for b in json.loads(warm.stdout)["buckets"]]
    assert errors == [None, None], errors  # was "the outputs' pytree does not survive pickling"

    check = cachectl("warm-check", str(manifest))
    assert check.returncode == 0, check.stdout + check.stderr
    assert "stored executables: 2/2 load and run (100.0%)" in check.stdout, check.stdout

    got = last_json(run_py(SERVICE.format(dir=str(tmp_path), manifest=str(manifest)), check=True))
    assert got["equal"] is True and got["step"] == 3, got
    counts = got["counts"]
    assert (counts["calls"], counts["aot"], counts["fallback"]) == (3, 3, 0), counts
    before, during = got["compiles"]
    key = "/jax/core/compile/backend_compile_duration"
    assert during.get(key, 0) == before.get(key, 0), got["compiles"]  # traced once, not compiled
