"""The field suite, round five: a service that calls a `jax.export` artifact it reads at import.

The artifact (``model.export``: a model's forward exported with a symbolic batch, then
serialized) is named in the manifest's ``depends_on:``. Served from stored executables, the
answers equal plain jit's with JAX compiling nothing; then a new model is exported to the same
file: a fresh service refuses the old executables with one warning naming the file, answers
with the new model's outputs through jit (never the old model's), and after the deploy's warm it
is served from stored executables again, the new model's answers. JAX's own counts say what
compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from support.infra import run_cachectl, run_py

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EXPORT = """
import sys
import numpy as np
import jax, jax.numpy as jnp
seed = int(sys.argv[1])
w = np.random.default_rng(seed).standard_normal((16, 4)).astype(np.float32)
def forward(x):
    return jnp.tanh(x @ w)
(b,) = jax.export.symbolic_shape("b")
exported = jax.export.export(jax.jit(forward))(jax.ShapeDtypeStruct((b, 16), jnp.float32))
open("model.export", "wb").write(exported.serialize())
"""

MODULE = """
import pathlib
import jax
EXPORTED = jax.export.deserialize(bytearray((pathlib.Path(__file__).parent / "model.export").read_bytes()))

def predict(x):
    return EXPORTED.call(x)
"""

MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: svc:predict
    depends_on: [model.export]
    args: [{shape: [batch, 16], dtype: float32}]
    outputs: [{shape: [batch, 4]}]
    buckets: {batch: [1, 8]}
"""

SERVICE = """
import json, sys
counts = dict(compiles=0)
def _duration(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
        counts["compiles"] += 1
import jax
jax.monitoring.register_event_duration_secs_listener(_duration)
sys.path.insert(0, {dir!r})
import numpy as np
import cachectl
rt = cachectl.serving({manifest!r})
import svc
rng = np.random.default_rng(7)
xs = [rng.standard_normal((n, 16)).astype(np.float32) for n in (1, 5)]
served = [np.asarray(rt["predict"](x)).tolist() for x in xs]
during = dict(counts)
pad = lambda x, n: np.concatenate([x, np.zeros((n - len(x), 16), np.float32)])
plain = [np.asarray(jax.jit(svc.predict)(pad(x, 1 if len(x) == 1 else 8)))[: len(x)].tolist()
         for x in xs]
report = rt.report().to_dict()["functions"]["predict"]
print(json.dumps(dict(served=served, plain=plain, compiles=during["compiles"],
                      aot=report["aot"], fallback=report["fallback"],
                      reason=report["fallback_reason"])))
"""


def _cachectl(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(p for p in (str(cwd), os.environ.get("PYTHONPATH")) if p)
    return run_cachectl(cwd, *args, env={"PYTHONPATH": path})


def _export(tmp_path: Path, seed: int) -> None:
    subprocess.run(
        [sys.executable, "-c", textwrap.dedent(EXPORT), str(seed)], cwd=tmp_path, check=True
    )


def _serve(tmp_path: Path) -> dict[str, Any]:
    code = SERVICE.format(dir=str(tmp_path), manifest=str(tmp_path / "field.yaml"))
    proc = run_py(code, cwd=tmp_path, timeout=600, check=True)
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]), stderr=proc.stderr)


def _close(a: list[Any], b: list[Any]) -> bool:
    import numpy as np

    return all(np.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b, strict=True))


def test_a_jax_export_artifact_is_never_served_stale(tmp_path: Path) -> None:
    (tmp_path / "svc.py").write_text(textwrap.dedent(MODULE))
    (tmp_path / "field.yaml").write_text(textwrap.dedent(MANIFEST))
    _export(tmp_path, seed=1)
    warm = _cachectl(tmp_path, "warm", "field.yaml", "--json")
    assert warm.returncode == 0, warm.stdout + warm.stderr
    assert json.loads(warm.stdout)["summary"]["compiled"] == 2

    first = _serve(tmp_path)  # stored executables: JAX compiles nothing, plain jit's answers
    assert (first["aot"], first["fallback"], first["compiles"]) == (2, 0, 0), first
    assert _close(first["served"], first["plain"]), first

    _export(tmp_path, seed=2)  # a new model, exported to the same file
    stale = _serve(tmp_path)
    assert (stale["aot"], stale["fallback"]) == (0, 2), stale
    assert "model.export" in stale["reason"], stale["reason"]
    assert _close(stale["served"], stale["plain"]), stale  # the new model's answers
    assert not _close(stale["served"], first["served"]), "served the old model's outputs"
    check = _cachectl(tmp_path, "warm-check", "field.yaml")
    assert check.returncode == 1, check.stdout + check.stderr

    again = _cachectl(tmp_path, "warm", "field.yaml", "--json")  # the deploy's warm
    assert again.returncode == 0, again.stdout + again.stderr
    fresh = _serve(tmp_path)
    assert (fresh["aot"], fresh["fallback"], fresh["compiles"]) == (2, 0, 0), fresh
    assert _close(fresh["served"], stale["served"]), fresh
