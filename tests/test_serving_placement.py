"""A service's own shardings: serving passes arrays placed as warm compiled them, places host
arrays itself, and answers an argument placed otherwise through jit at the service's shardings
with one warning naming it. Never JAX's "compiled for input shardings that disagree".

8 host devices (XLA_FLAGS), a real warm and a real service in fresh processes.
"""

from __future__ import annotations

from pathlib import Path

from support.infra import run_cachectl, run_py
from support.serving import last_json

DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}

MODULE = """
import jax.numpy as jnp

def forward(w, x):
    return jnp.tanh(x @ w)
"""

MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: sp_mod:forward
    mesh: {axes: {model: 8}, axis_types: auto}
    args:
      - {shape: [16, 32], dtype: float32}
      - {shape: [batch, 16], dtype: float32}
    buckets: {batch: [8]}
"""

SERVICE = """
import json, sys
sys.path.insert(0, {dir!r})
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import cachectl, sp_mod
rt = cachectl.serving({manifest!r})
mesh = Mesh(np.array(jax.devices()), ("model",))
w = np.linspace(-1, 1, 16 * 32, dtype=np.float32).reshape(16, 32)
x = np.linspace(0, 1, 8 * 16, dtype=np.float32).reshape(8, 16)
out = {{}}
for name, ww in (("host", w), ("sharded", jax.device_put(w, NamedSharding(mesh, P(None, "model"))))):
    y, ref = rt["forward"](ww, x), jax.jit(sp_mod.forward)(ww, x)
    out[name] = [np.array_equal(np.asarray(y), np.asarray(ref)), str(y.sharding.spec)
                 if hasattr(y.sharding, "spec") else None, str(getattr(ref.sharding, "spec", None))]
print(json.dumps([out, rt.report().to_dict()["functions"]["forward"]]))
"""


def test_a_service_that_shards_its_params_its_own_way_is_answered_by_jit_with_one_warning(
    tmp_path: Path,
) -> None:
    (tmp_path / "sp_mod.py").write_text(MODULE)
    manifest = tmp_path / "sp.yaml"
    manifest.write_text(MANIFEST)
    warm = run_cachectl(tmp_path, "warm", str(manifest), "--json", env=DEVICES)
    assert warm.returncode == 0, warm.stderr
    proc = run_py(SERVICE.format(dir=str(tmp_path), manifest=str(manifest)), DEVICES, check=True)
    out, counts = last_json(proc)
    assert out["host"][0] is True  # host arrays: the stored executable places them itself
    equal, spec, plain = out["sharded"]
    assert equal is True and spec == plain == "P(None, 'model')", out  # the service's placement
    assert (counts["calls"], counts["aot"], counts["fallback"]) == (2, 1, 1), counts
    said = [line for line in proc.stderr.splitlines() if "serving through jax.jit" in line]
    assert len(said) == 1, proc.stderr
    assert "argument 0 is placed NamedSharding(P(None, 'model'), mesh {'model': 8})" in said[0]
    assert "the stored executable takes NamedSharding(P" in said[0], said
    assert "Traceback" not in proc.stderr


DATA_MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: sp_mod:forward
    mesh: {axes: {data: 8}, axis_types: auto}
    args:
      - {shape: [16, 32], dtype: float32}
      - {shape: [batch, 16], dtype: float32, sharding: [data, null]}
    buckets: {batch: [8, 16]}
"""

FALLBACK_SERVICE = """
import json, sys
sys.path.insert(0, {dir!r})
events = dict()
def _on(e, *a, **kw):
    events[e] = events.get(e, 0) + 1
import jax, numpy as np
jax.monitoring.register_event_listener(_on)
import cachectl, sp_mod
rt = cachectl.serving({manifest!r})
w = np.linspace(-1, 1, 16 * 32, dtype=np.float32).reshape(16, 32)
before = dict(events)
specs = []
for n in (8, 16):
    y = rt["forward"](w, np.ones((n, 16), np.float32))
    specs.append(str(getattr(y.sharding, "spec", type(y.sharding).__name__)))
hits = events.get("/jax/compilation_cache/cache_hits", 0) - before.get("/jax/compilation_cache/cache_hits", 0)
misses = events.get("/jax/compilation_cache/cache_misses", 0) - before.get("/jax/compilation_cache/cache_misses", 0)
print(json.dumps([specs, hits, misses, rt.report().to_dict()["functions"]["forward"]]))
"""


def test_the_jit_fallback_of_a_mesh_function_places_host_arrays_as_warm_did(
    tmp_path: Path,
) -> None:
    """No stored executables (warm --no-executables): serving's jit fallback places the host
    arrays with the manifest's shardings, so jit traces warm's program (a persistent-cache hit,
    no compile) and the outputs keep warm's sharding ('data'), not a single device's."""
    (tmp_path / "sp_mod.py").write_text(MODULE)
    manifest = tmp_path / "data.yaml"
    manifest.write_text(DATA_MANIFEST)
    warm = run_cachectl(tmp_path, "warm", str(manifest), "--no-executables", env=DEVICES)
    assert warm.returncode == 0, warm.stderr
    proc = run_py(
        FALLBACK_SERVICE.format(dir=str(tmp_path), manifest=str(manifest)), DEVICES, check=True
    )
    specs, hits, misses, counts = last_json(proc)
    assert counts["fallback"] == 2 and counts["aot"] == 0, counts
    assert (hits, misses) == (2, 0), (hits, misses, proc.stderr[-2000:])
    assert specs == ["P('data',)", "P('data',)"], specs


SHARD_MAP_MODULE = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P

MESH = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))

def _block(w, x):
    return jnp.tanh(x @ w)

def forward(w, x):  # tensor-parallel: the batch split over data, the columns over model
    return jax.shard_map(_block, mesh=MESH, in_specs=(P(None, "model"), P("data", None)),
                         out_specs=P("data", "model"))(w, x)
"""

SHARD_MAP_MANIFEST = """
version: 1
target: {{backend: cpu}}
functions:
  - fn: sm_mod:forward
    name: {name}
    mesh: {{axes: {{data: 4, model: 2}}, axis_types: auto}}
    args:
      - {{shape: [16, 32], dtype: float32, sharding: [null, model]}}
      - {{shape: [batch, 16], dtype: float32, sharding: [data, null]}}
    outputs:
      - {{shape: [batch, 32]}}
    buckets: {{batch: [4, 8]}}
"""

SHARD_MAP_SERVICE = """
import json, sys
sys.path.insert(0, {dir!r})
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import cachectl, sm_mod
w = np.linspace(-1, 1, 16 * 32, dtype=np.float32).reshape(16, 32)
# The service shards its params otherwise than the manifest says (rows over model).
w_own = jax.device_put(w, NamedSharding(sm_mod.MESH, P("model", None)))
plain = jax.jit(sm_mod.forward)
out = {{}}
for manifest in ({warmed!r}, {cold!r}):
    rt = cachectl.serving(manifest)
    name = rt.names[0]
    rows = []
    for n in (1, 3, 5, 8):
        x = np.linspace(0, 1, n * 16, dtype=np.float32).reshape(n, 16)
        try:
            y = np.asarray(rt[name](w_own, x))
        except Exception as exc:
            rows.append([n, type(exc).__name__ + ": " + str(exc).splitlines()[0]])
            continue
        bucket = 4 if n <= 4 else 8
        padded = np.zeros((bucket, 16), np.float32)
        padded[:n] = x
        ref = np.asarray(plain(w_own, padded))[:n]  # plain jit at the padded shape, cut
        rows.append([n, list(y.shape), bool(np.array_equal(y, ref))])
    f = rt.report().to_dict()["functions"][name]
    out[name] = dict(rows=rows, aot=f["aot"], fallback=f["fallback"])
print(json.dumps(out))
"""


def test_the_jit_fallback_pads_to_the_bucket_so_a_shard_map_service_is_answered(
    tmp_path: Path,
) -> None:
    """A tensor-parallel service (mesh data: 4, model: 2) whose params are sharded otherwise
    than its manifest says, and the same function with nothing warmed: every request (batch 1,
    3, 5: not divisible by data's 4) is answered by jit padded to the bucket and cut, equal to
    plain jit at the padded shape; never shard_map's 'not evenly divisible' ValueError."""
    (tmp_path / "sm_mod.py").write_text(SHARD_MAP_MODULE)
    warmed, cold = tmp_path / "sm.yaml", tmp_path / "cold.yaml"
    warmed.write_text(SHARD_MAP_MANIFEST.format(name="forward"))
    cold.write_text(SHARD_MAP_MANIFEST.format(name="forward_never_warmed"))
    warm = run_cachectl(tmp_path, "warm", str(warmed), "--json", env=DEVICES)
    assert warm.returncode == 0, warm.stderr
    code = SHARD_MAP_SERVICE.format(dir=str(tmp_path), warmed=str(warmed), cold=str(cold))
    out = last_json(run_py(code, DEVICES, check=True))
    for name in ("forward", "forward_never_warmed"):
        rows = out[name]["rows"]
        assert rows == [[n, [n, 32], True] for n in (1, 3, 5, 8)], (name, rows)
        assert (out[name]["aot"], out[name]["fallback"]) == (0, 4), out
