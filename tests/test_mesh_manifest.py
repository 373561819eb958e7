"""The manifest's mesh is the one a service builds with ``jax.sharding.Mesh(jax.devices()...)``
(Auto axes, jax.devices() order), pytree leaves carry their own PartitionSpecs over an
AbstractMesh, and JAX's "Mesh for all inputs should be equal" comes back naming ``axis_types``.

8 host devices (XLA_FLAGS), a real warm and a real service in fresh processes.
"""

from __future__ import annotations

import json
from pathlib import Path

from support.infra import run_cachectl, run_py
from support.serving import last_json

DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}

MODULE = """
import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

def step(x, p):
    return jnp.tanh(x @ p["w"] + p["b"])

def _leaves(mesh):
    return {"w": jax.ShapeDtypeStruct((16, 16), jnp.float32, sharding=NamedSharding(mesh, P(None, "model"))),
            "b": jax.ShapeDtypeStruct((16,), jnp.float32, sharding=NamedSharding(mesh, P("model")))}

def params():  # per-leaf PartitionSpecs over an AbstractMesh: no devices named
    return _leaves(AbstractMesh((2, 4), ("data", "model")))

def service_params():  # over the service's own mesh, as a service builds it
    return _leaves(Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model")))
"""

MANIFEST = """
version: 1
target: {backend: cpu, device_count: 8}
functions:
  - fn: mm_mod:step
    mesh: {axes: {data: 2, model: 4}}
    args:
      - {shape: [batch, 16], dtype: float32, sharding: [data, null]}
      - {pytree: mm_mod:params}
    buckets: {batch: [8, 16]}
  - name: step_explicit
    fn: mm_mod:step
    mesh: {axes: {data: 2, model: 4}, axis_types: explicit}
    args:
      - {shape: [8, 16], dtype: float32, sharding: [data, null]}
      - {pytree: mm_mod:service_params}
"""

SERVICE = """
import json, sys
import numpy as np
sys.path.insert(0, {dir!r})
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import cachectl, mm_mod
cachectl.activate()
counts = dict()
jax.monitoring.register_event_listener(lambda e, **kw: counts.__setitem__(e, counts.get(e, 0) + 1))
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
place = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
p = {{"w": place(np.ones((16, 16), np.float32), None, "model"), "b": place(np.ones(16, np.float32), "model")}}
step = jax.jit(mm_mod.step)
for n in (8, 16):
    step(place(np.ones((n, 16), np.float32), "data", None), p).block_until_ready()
# Pre-jitted over the service's mesh, called with host arrays: the same programs.
spec = lambda *s: NamedSharding(mesh, P(*s))
pinned = jax.jit(mm_mod.step, in_shardings=(spec("data", None), {{"w": spec(None, "model"), "b": spec("model")}}))
host = {{"w": np.ones((16, 16), np.float32), "b": np.ones(16, np.float32)}}
for n in (8, 16):
    pinned(np.ones((n, 16), np.float32), host).block_until_ready()
print(json.dumps([counts.get("/jax/compilation_cache/compile_requests_use_cache", 0),
                  counts.get("/jax/compilation_cache/cache_hits", 0)]))
"""


def test_the_manifests_mesh_is_the_services_with_per_leaf_specs(tmp_path: Path) -> None:
    (tmp_path / "mm_mod.py").write_text(MODULE)
    manifest = tmp_path / "mesh.yaml"
    manifest.write_text(MANIFEST)
    warm = run_cachectl(tmp_path, "warm", str(manifest), "--json", env=DEVICES)
    assert warm.returncode == 1, warm.stderr
    report = json.loads(warm.stdout)["buckets"]
    buckets = {(b["function"], b["bucket"].get("batch")): b for b in report}
    assert [b["status"] for b in buckets.values()] == ["compiled", "compiled", "failed"], buckets
    # Auto axes over Explicit ones: JAX's words, with the field and the fix.
    error = buckets[("step_explicit", None)]["error"]
    assert error.startswith(
        "the arguments are sharded over meshes whose axis_types differ: "
        "(Explicit,Explicit) and (Auto,Auto)"
    ), error
    assert "mesh: {axis_types: explicit} (or auto)" in error and "AbstractMesh" in error, error

    # A service that builds its own Mesh(jax.devices()) and places the leaves as params()
    # declares them hits both buckets: same axis types, device order and per-leaf specs; and so
    # does its jax.jit(step, in_shardings=...) over that mesh (what a deviceless warm of a
    # pre-jitted function is told to declare instead).
    proc = run_py(SERVICE.format(dir=str(tmp_path)), DEVICES, check=True)
    assert last_json(proc) == [4, 4], proc.stderr
