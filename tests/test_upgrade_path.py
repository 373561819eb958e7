"""The JAX upgrade path, end to end, with two real virtualenvs.

Warm a small manifest with an older JAX, warm it again with a newer one into
the same cache root and the same SQLite index; both namespaces exist and a
service in either venv hits. `prune --superseded --keep 1` then keeps exactly
the new namespace: the new JAX's service still hits, the old one's misses.

Needs two virtualenvs with different JAX versions, so it runs only under
`scripts/test --matrix` (entry py313: .venv's jax 0.10.2 is the old one, the
entry's own the new one), which sets CACHECTL_TEST_UPGRADE_OLD_PYTHON and
CACHECTL_TEST_UPGRADE_NEW_PYTHON. Anywhere else it skips, saying why.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

# Read at import: the autouse isolated_home fixture drops every CACHECTL_* variable.
OLD_PY = os.environ.get("CACHECTL_TEST_UPGRADE_OLD_PYTHON") or None
NEW_PY = os.environ.get("CACHECTL_TEST_UPGRADE_NEW_PYTHON") or None

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (OLD_PY and NEW_PY),
        reason="needs two venvs with different JAX versions: runs under `scripts/test --matrix` "
        "(entry py313), which sets CACHECTL_TEST_UPGRADE_OLD_PYTHON/_NEW_PYTHON",
    ),
]

MODULE = """
import jax.numpy as jnp

def affine(x, w, mode="relu"):
    y = x @ w
    return jnp.maximum(y, 0.0) if mode == "relu" else jnp.tanh(y)
"""

MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: up_tiny:affine
    jit: {static_argnames: [mode]}
    args:
      - {shape: [batch, 8], dtype: float32}
      - {shape: [8, 8], dtype: float32}
    kwargs: {mode: {axis: mode}}
    buckets: {batch: [1, 2], mode: [relu, tanh]}
"""

# A read-only service: the same functions under its own jax.jit, on real arrays.
SERVICE = """
import json, sys
import numpy as np
import jax
import cachectl
sys.path.insert(0, {dir!r})
import up_tiny
activation = cachectl.activate("up", db={db!r}, readonly=True)
counts = {{}}
jax.monitoring.register_event_listener(lambda e, **kw: counts.__setitem__(e, counts.get(e, 0) + 1))
affine = jax.jit(up_tiny.affine, static_argnames=["mode"])
w = np.ones((8, 8), np.float32)
for batch in (1, 2):
    for mode in ("relu", "tanh"):
        affine(np.ones((batch, 8), np.float32), w, mode=mode).block_until_ready()
print(json.dumps({{"jax": jax.__version__, "path": activation.path,
                  "requests": counts.get("/jax/compilation_cache/compile_requests_use_cache", 0),
                  "hits": counts.get("/jax/compilation_cache/cache_hits", 0)}}))
"""


def run(python: str, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [python, *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, (python, args, proc.stdout, proc.stderr)
    return proc


def cli(python: str, db: str, *args: str) -> dict:
    return json.loads(
        run(python, "-m", "cachectl", "--db", db, "--cache", "up", *args, "--json").stdout
    )


def jax_version(python: str) -> str:
    return run(python, "-c", "import jax; print(jax.__version__)").stdout.strip()


def service(python: str, tmp_path: Path, db: str) -> dict:
    proc = run(python, "-c", SERVICE.format(dir=str(tmp_path), db=db))
    assert "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def namespaces(root: Path) -> set[str]:
    """<root>/jax-<version>/<hardware>/<digest16> directories holding an env.json."""
    return {str(p.parent.relative_to(root)) for p in root.glob("jax-*/*/*/env.json")}


def test_warm_old_upgrade_warm_new_prune_superseded(tmp_path: Path) -> None:
    old_v, new_v = jax_version(OLD_PY), jax_version(NEW_PY)
    from packaging.version import Version

    assert Version(old_v) < Version(new_v), (old_v, new_v)

    (tmp_path / "up_tiny.py").write_text(MODULE)
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(MANIFEST)
    db = f"sqlite:///{tmp_path / 'index.db'}"
    root = tmp_path / "cache"
    run(OLD_PY, "-m", "cachectl", "--db", db, "cache", "add", "up", str(root))

    # 1. The old JAX warms its namespace; its service hits every bucket.
    first = cli(OLD_PY, db, "warm", str(manifest))
    assert first["summary"]["compiled"] == 4, first["summary"]
    old_service = service(OLD_PY, tmp_path, db)
    assert old_service["jax"] == old_v
    assert old_service["hits"] == 4 and old_service["requests"] == 4, old_service
    (old_ns,) = namespaces(root)
    assert old_ns.startswith(f"jax-{old_v}/")

    # 2. Upgrade: the new JAX compiles everything again into its own namespace.
    second = cli(NEW_PY, db, "warm", str(manifest))
    assert second["summary"]["compiled"] == 4, second["summary"]
    assert namespaces(root) - {old_ns} and len(namespaces(root)) == 2
    (new_ns,) = namespaces(root) - {old_ns}
    assert new_ns.startswith(f"jax-{new_v}/")
    listing = cli(NEW_PY, db, "ls")
    assert len(listing["environments"]) == 2, listing

    # Both services hit, each in its own namespace: the old JAX keeps serving until pruned.
    new_service = service(NEW_PY, tmp_path, db)
    assert new_service["hits"] == 4 and new_service["requests"] == 4, new_service
    old_again = service(OLD_PY, tmp_path, db)
    assert old_again["hits"] == 4, old_again
    assert Path(old_again["path"]) == root / old_ns and Path(new_service["path"]) == root / new_ns

    # 3. prune --superseded --keep 1 keeps exactly the new namespace.
    plan = cli(NEW_PY, db, "prune", "--superseded", "--keep", "1", "--dry-run")["plan"]
    assert [n["jax_version"] for n in plan["namespaces"]] == [old_v], plan
    cli(NEW_PY, db, "prune", "--superseded", "--keep", "1")
    assert namespaces(root) == {new_ns}
    listing = cli(NEW_PY, db, "ls")
    assert [e["environment"]["jax_version"] for e in listing["environments"]] == [new_v], listing

    # The new JAX still hits everything; the old one's programs are gone.
    assert service(NEW_PY, tmp_path, db)["hits"] == 4
    pruned = service(OLD_PY, tmp_path, db)
    assert pruned["hits"] == 0 and pruned["requests"] == 4, pruned
