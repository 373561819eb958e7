"""A tiny manifest, its module and a service that calls it; the CLI in-process; for warm's tests."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from click.testing import CliRunner, Result

from cachectl.cli import cli
from support.infra import run_py

REPO = Path(__file__).resolve().parents[2]

TINY_MODULE = """
import jax
import jax.numpy as jnp

def affine(x, w, mode="relu"):
    y = x @ w
    return jnp.maximum(y, 0.0) if mode == "relu" else jnp.tanh(y)

def weights():
    return {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32), "b": jax.ShapeDtypeStruct((8,), jnp.float32)}

def layer(x, p):
    return x @ p["w"] + p["b"]
"""

TINY_MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: wm_tiny:affine
    jit: {static_argnames: [mode]}
    args:
      - {shape: [batch, 8], dtype: float32}
      - {shape: [8, 8], dtype: float32}
    kwargs: {mode: {axis: mode}}
    buckets: {batch: [1, 2], mode: [relu, tanh]}
  - fn: wm_tiny:layer
    args:
      - {shape: [batch, 8], dtype: float32}
      - {pytree: wm_tiny:weights}
    buckets: {batch: [3]}
"""

# What a service runs: the real functions under its own jax.jit, on real arrays.
TINY_SERVICE = """
import json, sys
import numpy as np
import jax
import cachectl
sys.path.insert(0, {dir!r})
import wm_tiny
activation = cachectl.activate({cache})
calls = []
affine = jax.jit(wm_tiny.affine, static_argnames=["mode"])
layer = jax.jit(wm_tiny.layer)
w = np.ones((8, 8), np.float32)
p = {{"w": w, "b": np.zeros((8,), np.float32)}}
counts = {{}}
jax.monitoring.register_event_listener(lambda e, **kw: counts.__setitem__(e, counts.get(e, 0) + 1))
for batch in (1, 2):
    for mode in ("relu", "tanh"):
        affine(np.ones((batch, 8), np.float32), w, mode=mode).block_until_ready()
layer(np.ones((3, 8), np.float32), p).block_until_ready()
print(json.dumps({{"path": activation.path, "warning": activation.warning,
                  "requests": counts.get("/jax/compilation_cache/compile_requests_use_cache", 0),
                  "hits": counts.get("/jax/compilation_cache/cache_hits", 0)}}))
"""


def invoke(*args: str, code: int | None = 0) -> Result:
    result = CliRunner().invoke(cli, list(args))
    if code is not None:
        assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    return result


def warm_json(*args: str, code: int = 0) -> dict[str, Any]:
    return json.loads(invoke("warm", *args, "--json", code=code).stdout)


def tiny(tmp_path: Path, manifest: str = TINY_MANIFEST, name: str = "manifest.yaml") -> Path:
    (tmp_path / "wm_tiny.py").write_text(TINY_MODULE)
    path = tmp_path / name
    path.write_text(manifest)
    return path


def service(tmp_path: Path, cache: str = "", env: dict[str, str] | None = None) -> dict[str, Any]:
    code = TINY_SERVICE.format(dir=str(tmp_path), cache=repr(cache) if cache else "")
    proc = run_py(code, env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# `cachectl ARGS` in a fresh process, with every open of one file counted (sys.addaudithook sees
# each open() of the interpreter, pathlib's included); the count goes to stderr at the end.
_COUNTED = """
import os, runpy, sys
counted = os.path.realpath({path!r})
opens = []

def hook(event, args):
    if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        if os.path.realpath(os.fsdecode(args[0])) == counted:
            opens.append(args[1])

sys.addaudithook(hook)
{before}
sys.argv = ["cachectl", *{args!r}]
try:
    runpy.run_module("cachectl", run_name="__main__")
finally:
    sys.stderr.write(f"\\nOPENS={{len(opens)}}\\n")
"""


def counting_opens(
    path: Path,
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    before: str = "",
) -> tuple[subprocess.CompletedProcess, int]:
    """(the finished `cachectl ARGS`, how many times it opened ``path``); ``before``: Python
    run in that process before the command (after the hook is installed)."""
    code = _COUNTED.format(path=str(path), args=list(args), before=before)
    proc = run_py(code, dict(env or {}), cwd=cwd)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("OPENS=")]
    assert len(lines) == 1, (
        f"`cachectl {' '.join(args)}` exited {proc.returncode} before its count (a negative exit "
        f"is the signal that ended it)\n--- stdout ---\n{proc.stdout[-2000:]}\n"
        f"--- stderr ---\n{proc.stderr[-3000:]}"
    )
    return proc, int(lines[0].split("=", 1)[1])
