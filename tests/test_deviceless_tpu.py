"""``warm --topology``: compiles for a TPU slice on this CPU machine, with libtpu's compile-only
devices, into the namespace the slice's own ``cachectl fingerprint`` names.

Runs in the libtpu virtualenv (``scripts/test --deviceless``: .venv-tpu, jax[tpu] of .venv's JAX),
where a missing libtpu FAILS; in the plain .venv (no libtpu) the module is skipped. Each warm runs
in a fresh process, as a CI job would: LIBTPU_INIT_ARGS is set for the process and libtpu starts
once. The environment a real TPU v5e 1x1 recorded (tests/fixtures/tpu-v5e-1x1-env.json,
``cachectl fingerprint --json`` on the chip, JAX 0.10.2, libtpu 0.0.42.1) is what the derived
one must equal, field for field: then the namespaces are the same and the chip finds the entries.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cachectl.core import jax_seam
from cachectl.core.fingerprint import ADDED_FIELDS
from cachectl.storage import executables

IN_TPU_VENV = os.environ.get("CACHECTL_TEST_TPU_VENV") == "1"
# The registry scripts/test starts (read at import: the suite's fixtures clear CACHECTL_* per test).
OCI = {k: os.environ.get(f"CACHECTL_TEST_OCI_{k}", "") for k in ("URL", "USER", "PASSWORD", "CA")}
if jax_seam.libtpu_version() is None:
    if IN_TPU_VENV:
        pytest.fail("libtpu is not installed in the deviceless virtualenv", pytrace=False)
    pytest.skip(
        "needs libtpu: runs in .venv-tpu (scripts/test --deviceless)", allow_module_level=True
    )

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "tpu-v5e-1x1-env.json"
BARRIER = "--xla_tpu_use_enhanced_launch_barrier=true"
# What a TPU VM's metadata server tells libtpu at start-up; a deviceless warm sets them.
STARTUP_VARIABLES = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES")

MODULE = """
import jax
import jax.numpy as jnp

def affine(x, w, mode="relu"):
    y = x @ w
    return jnp.maximum(y, 0.0) if mode == "relu" else jnp.tanh(y)

def layer(x, p):
    return jnp.tanh(x @ p["w"] + p["b"])

def weights():
    return {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32),
            "b": jax.ShapeDtypeStruct((64,), jnp.float32)}
"""

MANIFEST = """
version: 1
target: {backend: tpu, device_kind: "TPU v5 lite"}
functions:
  - fn: dl_tiny:affine
    jit: {static_argnames: [mode]}
    args:
      - {shape: [batch, 8], dtype: float32}
      - {shape: [8, 8], dtype: float32}
    kwargs: {mode: {axis: mode}}
    buckets: {batch: [1, 2], mode: [relu, tanh]}
  - fn: dl_tiny:layer
    args:
      - {shape: [batch, 64], dtype: float32}
      - {pytree: dl_tiny:weights}
    buckets: {batch: [3]}
"""

MESH_MANIFEST = """
version: 1
target: {backend: tpu, topology: TOPOLOGY}
functions:
  - fn: dl_tiny:layer
    mesh: {axes: AXES}
    args:
      - {shape: [batch, 64], dtype: float32, sharding: SHARDING}
      - {pytree: dl_tiny:weights}
    buckets: {batch: [16]}
"""


def cachectl(*args: str, cwd: Path, env: dict[str, str] | None = None) -> Any:
    """``python -m cachectl ARGS --json`` in a fresh process: (exit code, parsed JSON, stderr)."""
    proc = subprocess.run(
        [sys.executable, "-m", "cachectl", *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    data = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else None
    return proc.returncode, data, proc.stderr


def tiny(tmp_path: Path, text: str = MANIFEST) -> Path:
    (tmp_path / "dl_tiny.py").write_text(MODULE)
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(text)
    return manifest


def environment_of(topology: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The Environment warm derives for ``topology``, in a fresh process."""
    code = (
        "import json\n"
        "from cachectl.warm.deviceless import resolve\n"
        f"t = resolve({topology!r})\n"
        "import jax\n"
        "print(json.dumps({'env': t.environment.to_dict(), 'digest': t.environment.digest,"
        " 'namespace': t.environment.namespace, 'default_backend': jax.default_backend(),"
        " 'ids': [d.id for d in t.devices]}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_derived_environment_is_the_real_v5e_chips_field_for_field() -> None:
    chip = json.loads(FIXTURE.read_text())
    derived = environment_of("v5e:1x1")
    assert derived["default_backend"] == "cpu"  # no accelerator was opened
    fields = {k: v for k, v in chip.items() if k not in ("digest", "namespace")}
    fields.pop("fingerprint_version", None)
    # Recorded before the environment named x64 and the CPU's instruction set: the chip's
    # values are those fields' defaults (x64 off, no CPU), with which its digest was computed.
    fields = {**ADDED_FIELDS, **fields}
    assert derived["env"] == fields
    assert derived["digest"] == chip["digest"]
    assert derived["namespace"] == chip["namespace"]
    # What cloud_tpu_init adds on the TPU VM is what makes the keys equal.
    assert BARRIER in derived["env"]["xla_flags"]


def test_a_users_libtpu_flags_are_kept_beside_cloud_tpu_inits() -> None:
    derived = environment_of(
        "v5e:1x1", {"LIBTPU_INIT_ARGS": "--xla_tpu_enable_latency_hiding_scheduler=true"}
    )
    assert derived["env"]["xla_flags"] == [  # sorted, as JAX hashes them
        "--xla_tpu_enable_latency_hiding_scheduler=true",
        BARRIER,
    ]
    chip = json.loads(FIXTURE.read_text())
    assert derived["digest"] != chip["digest"]  # another namespace: the keys would differ


@pytest.mark.parametrize(
    ("topology", "count", "kind"),
    [
        ("v5litepod-4", 4, "TPU v5 lite"),
        ("v5e:2x4", 8, "TPU v5 lite"),
        ("v6e:2x2", 4, "TPU v6 lite"),
    ],
)
def test_topology_names_give_that_many_compile_only_devices(
    topology: str, count: int, kind: str
) -> None:
    derived = environment_of(topology)
    assert derived["default_backend"] == "cpu"
    assert derived["env"]["device_count"] == count and derived["env"]["device_kind"] == kind
    assert derived["ids"] == list(range(count))
    assert derived["env"]["backend"] == "tpu" and derived["env"]["process_count"] == 1


def test_warm_topology_writes_the_chips_namespace_and_rewarm_compiles_nothing(
    tmp_path: Path,
) -> None:
    chip = json.loads(FIXTURE.read_text())
    manifest = tiny(tmp_path)
    code, report, err = cachectl(
        "warm", str(manifest), "--topology", "v5e:1x1", "--json", cwd=tmp_path
    )
    assert code == 0, err
    assert report["environment"]["digest"] == chip["digest"]
    assert report["namespace"].endswith(chip["namespace"])
    summary = report["summary"]
    assert (summary["buckets"], summary["compiled"], summary["failed"]) == (5, 5, 0), report
    assert all(b["aot_bytes"] for b in report["buckets"]), report["buckets"]
    namespace = Path(report["namespace"])
    keys = {b["key"] for b in report["buckets"]}
    assert {p.name[: -len("-cache")] for p in namespace.glob("*-cache")} == keys
    assert {p.name[: -len("-aot")] for p in namespace.glob("*-aot")} == keys
    assert json.loads((namespace / "env.json").read_text())["digest"] == chip["digest"]

    # Indexed: ls lists the namespace with its 5 entries and 5 executables.
    code, listing, err = cachectl("ls", "--json", cwd=tmp_path)
    assert code == 0, err
    (row,) = [e for e in listing["environments"] if e["digest"] == chip["digest"]]
    assert row["entries"] == 5 and row["executables"] == 5

    # Warmed again, also through target.topology: every key is computed first and found.
    manifest.write_text(MANIFEST.replace("device_kind:", "topology: v5e:1x1, device_kind:"))
    code, again, err = cachectl("warm", str(manifest), "--json", cwd=tmp_path)
    assert code == 0, err
    assert again["environment"]["digest"] == chip["digest"]
    assert (again["summary"]["compiled"], again["summary"]["cached"]) == (0, 5), again["summary"]


@pytest.mark.parametrize(
    ("topology", "axes", "sharding", "devices"),
    [("v5e:2x2", "{data: 4}", "[data]", 4), ("v5e:2x4", "{data: 2, model: 4}", "[data, model]", 8)],
)
def test_multi_chip_topologies_compile_with_the_manifests_mesh(
    tmp_path: Path, topology: str, axes: str, sharding: str, devices: int
) -> None:
    text = MESH_MANIFEST.replace("TOPOLOGY", topology).replace("AXES", axes)
    manifest = tiny(tmp_path, text.replace("SHARDING", sharding))
    code, report, err = cachectl("warm", str(manifest), "--json", cwd=tmp_path)
    assert code == 0, err
    assert report["environment"]["device_count"] == devices
    assert report["summary"]["compiled"] == 1, report
    (bucket,) = report["buckets"]
    assert bucket["aot_bytes"], bucket
    # The program is the sharded one: it runs on every device of the slice, not on one.
    ns = Path(report["namespace"])
    _, payload = executables.split_artifact((ns / f"{bucket['key']}-aot").read_bytes())
    device_ids = pickle.loads(payload)[3]
    # (in jax.devices() order, as a service's Mesh(jax.devices()) lays them out)
    assert device_ids == list(range(devices))


CONCRETE_MODULE = """
import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

def _forward(x, w):
    return jnp.tanh(x @ w)

if len(jax.devices()) >= 4:  # pre-jitted over this machine's own devices (a Mesh of jax.devices())
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    forward_tp = jax.jit(_forward, in_shardings=(NamedSharding(mesh, P("data", None)),
                                                 NamedSharding(mesh, P(None, "model"))))
else:
    forward_tp = None

def table():  # computed on this machine's CPU while tracing: JAX compiles and writes side programs
    with jax.ensure_compile_time_eval(), jax.default_device(jax.devices("cpu")[0]):
        return np.asarray(jnp.cos(jnp.arange(64.0, dtype=jnp.float32)))

def step(x, p):
    return jnp.tanh(x @ p["w"] + table())

def params(batch):  # big batches: over the module's own mesh of this machine's devices
    w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    if batch >= 16:
        mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
        w = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P(None, "model")))
    return {"w": w}
"""

CONCRETE_MANIFEST = """
version: 1
target: {backend: tpu, topology: v5e:2x2}
functions:
  - fn: dl_concrete:forward_tp
    args:
      - {shape: [batch, 64], dtype: float32}
      - {shape: [64, 64], dtype: float32}
    buckets: {batch: [8, 16]}
"""

STEP_MANIFEST = """
version: 1
target: {backend: tpu, topology: v5e:2x2}
functions:
  - fn: dl_concrete:step
    args:
      - {shape: [batch, 64], dtype: float32}
      - {pytree: dl_concrete:params}
    buckets: {batch: [8, 16]}
"""


def test_nothing_compiled_for_this_machines_devices_lands_in_the_slices_namespace(
    tmp_path: Path,
) -> None:
    """A function over this machine's own devices is refused before anything compiles (one line,
    exit 2, the fix named); a bucket that lowers for them fails alone, and what JAX compiles for
    this CPU while tracing is not written: the TPU namespace holds the TPU bucket's files only."""
    (tmp_path / "dl_concrete.py").write_text(CONCRETE_MODULE)
    manifest = tmp_path / "concrete.yaml"
    manifest.write_text(CONCRETE_MANIFEST)
    four = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    fix = "jax.sharding.AbstractMesh"
    # One host device: the module builds no mesh, and the message says why that matters here.
    code, _, err = cachectl("warm", str(manifest), cwd=tmp_path)
    assert code == 2 and err.count("\n") == 1, err
    said = "forward_tp is None, not a function, when 'dl_concrete' is imported on this machine"
    assert said in err and "to warm for the TPU slice v5e:2x2" in err and fix in err, err
    # Four: pre-jitted over them. Refused, nothing compiled.
    code, _, err = cachectl("warm", str(manifest), cwd=tmp_path, env=four)
    assert code == 2 and err.count("\n") == 1, err
    assert "forward_tp cannot be warmed for a TPU slice: it lowers for this machine's cpu" in err
    assert fix in err, err
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(("-cache", "-aot"))]

    manifest.write_text(STEP_MANIFEST)
    code, report, err = cachectl(
        "warm", str(manifest), "--json", "--jobs", "1", cwd=tmp_path, env=four
    )
    assert code == 1, err
    ok, foreign = report["buckets"]
    assert ok["status"] == "compiled" and ok["aot_bytes"], ok
    assert foreign["status"] == "failed" and foreign["key"] is None, foreign
    assert foreign["error"].startswith("not compiled: it lowers for this machine's cpu devices")
    assert "not written to the TPU namespace: JAX compiled it for this machine's cpu" in err, err
    names = {p.name for p in Path(report["namespace"]).iterdir()}
    assert names == {"env.json", f"{ok['key']}-cache", f"{ok['key']}-aot"}, names


ORDER_MANIFEST = """
version: 1
target: {backend: tpu, topology: v5e:2x2}
functions:
  - fn: dl_tiny:layer
    mesh: {axes: {data: 2, model: 2}}
    args:
      - {shape: [16, 64], dtype: float32, sharding: [data, null]}
      - {pytree: dl_tiny:weights}
  - name: layer_make_mesh
    fn: dl_tiny:layer
    mesh: {axes: {data: 2, model: 2}, axis_types: explicit, device_order: make_mesh}
    args:
      - {shape: [16, 64], dtype: float32, sharding: [data, null]}
      - {pytree: dl_tiny:weights}
  - name: layer_leaves
    fn: dl_tiny:layer
    mesh: {axes: {data: 2, model: 2}}
    args:
      - {shape: [16, 64], dtype: float32, sharding: [data, null]}
      - {pytree: dl_leaves:weights}
"""

# Per-leaf PartitionSpecs over an AbstractMesh: no devices, so they import on the CPU runner.
LEAVES_MODULE = """
import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

SPECS = {"w": P(None, "model"), "b": P("model")}

def weights():
    mesh = AbstractMesh((2, 2), ("data", "model"))
    return {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, SPECS["w"])),
            "b": jax.ShapeDtypeStruct((64,), jnp.float32, sharding=NamedSharding(mesh, SPECS["b"]))}
"""

# A service on the slice, its keys computed here: the slice's devices in jax.devices() order.
SERVICE_KEYS = """
import json, sys
import numpy as np
from cachectl.warm.deviceless import resolve
devices = list(resolve("v5e:2x2").devices)
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from cachectl.core import jax_seam
sys.path.insert(0, ".")
import dl_leaves, dl_tiny

def key(mesh, specs={}):
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))
    p = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, specs.get(k, P())))
         for k, v in dl_tiny.weights().items()}
    return jax_seam.persistent_cache_key(jax.jit(dl_tiny.layer).lower(x, p))

own = Mesh(np.array(devices).reshape(2, 2), ("data", "model"))
made = jax.make_mesh((2, 2), ("data", "model"), devices=devices)
print(json.dumps({"mesh": key(own), "make_mesh": key(made), "leaves": key(own, dl_leaves.SPECS),
                  "orders": [[d.id for d in own.devices.flat], [d.id for d in made.devices.flat]]}))
"""


def test_the_slices_mesh_is_the_one_a_service_builds_over_jax_devices(tmp_path: Path) -> None:
    """warm's v5e:2x2 mesh is Mesh(jax.devices()) with Auto axes, key for key; a service that
    calls jax.make_mesh (Explicit axes, the slice's physical order) matches the manifest's
    ``axis_types: explicit, device_order: make_mesh``; per-leaf PartitionSpecs over an
    AbstractMesh are the service's own leaf shardings."""
    manifest = tiny(tmp_path, ORDER_MANIFEST)
    (tmp_path / "dl_leaves.py").write_text(LEAVES_MODULE)
    code, report, err = cachectl("warm", str(manifest), "--json", cwd=tmp_path)
    assert code == 0, err
    warmed = {b["function"]: b["key"] for b in report["buckets"]}
    proc = subprocess.run(
        [sys.executable, "-c", SERVICE_KEYS],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    service = json.loads(proc.stdout.strip().splitlines()[-1])
    assert service["orders"] == [[0, 1, 2, 3], [0, 1, 3, 2]]  # the two orders differ here
    assert warmed == {
        "layer": service["mesh"],
        "layer_make_mesh": service["make_mesh"],
        "layer_leaves": service["leaves"],
    }
    assert len({service["mesh"], service["make_mesh"], service["leaves"]}) == 3


def test_a_mesh_bigger_than_the_topology_is_refused(tmp_path: Path) -> None:
    text = MESH_MANIFEST.replace("TOPOLOGY", "v5e:2x2").replace("AXES", "{data: 8}")
    manifest = tiny(tmp_path, text.replace("SHARDING", "[data]"))
    code, _, err = cachectl("warm", str(manifest), cwd=tmp_path)
    assert code == 3, err
    assert "needs a mesh of 8 devices; this machine has 4" in err
    assert not list(tmp_path.rglob("*-cache"))


def test_doctor_names_the_libtpu_this_machine_compiles_with(tmp_path: Path) -> None:
    code, report, err = cachectl("doctor", "--json", cwd=tmp_path)
    (finding,) = [f for f in report["findings"] if f["check"] == "tpu-compile"]
    assert finding["message"] == (
        f"libtpu {jax_seam.libtpu_version()}: warm --topology compiles for TPU here"
    ), err


def test_the_process_executor_is_refused_for_a_topology(tmp_path: Path) -> None:
    manifest = tiny(tmp_path)
    code, _, err = cachectl(
        "warm", str(manifest), "--topology", "v5e:1x1", "--executor", "process", cwd=tmp_path
    )
    assert code == 2, err
    assert "--executor process cannot compile for a TPU topology" in err
    assert not list(tmp_path.rglob("*-cache"))


def test_warm_topology_push_sends_the_slices_namespace_not_this_machines(tmp_path: Path) -> None:
    """`warm --topology --push oci://…` (a CPU runner warming for the fleet) pushes the slice's
    namespace, tagged by the slice's environment; a CPU machine pulling it is refused."""
    import base64

    url = OCI["URL"]
    if not url:
        pytest.fail("CACHECTL_TEST_OCI_URL is not set: run through scripts/test --deviceless")
    auth = base64.b64encode(f"{OCI['USER']}:{OCI['PASSWORD']}".encode()).decode()
    docker = tmp_path / "docker"
    docker.mkdir()
    (docker / "config.json").write_text(json.dumps({"auths": {url: {"auth": auth}}}))
    env = {
        "DOCKER_CONFIG": str(docker),
        "CACHECTL_OCI_CA_FILE": OCI["CA"],
    }
    chip = json.loads(FIXTURE.read_text())
    ref = f"oci://{url}/cachectl/deviceless-{os.getpid()}:v1"
    code, report, err = cachectl(
        "warm", str(tiny(tmp_path)), "--topology", "v5e:1x1", "--json", "--push", ref,
        cwd=tmp_path, env=env,
    )  # fmt: skip
    assert code == 0, err
    assert report["environment"]["digest"] == chip["digest"]
    assert "pushed oci://" in err, err
    # The slice's tag is there; a CPU machine asking for its own environment finds none.
    code, _, err = cachectl(
        "bundle", "pull", ref.rsplit(":", 1)[0], "--for-this-machine", cwd=tmp_path, env=env
    )
    assert code != 0 and "TPU v5 lite" in err, err


def test_libtpus_start_up_warnings_show_only_with_verbose(tmp_path: Path) -> None:
    """On a machine that is no TPU VM libtpu finds no metadata server and says so at start-up
    (accelerator type, worker hostnames); warm tells libtpu the slice's instead, unless -v."""
    one = MANIFEST.split("  - fn: dl_tiny:layer")[0].replace(
        "[1, 2], mode: [relu, tanh]", "[1], mode: [relu]"
    )
    manifest = tiny(tmp_path, one)
    # (a user's own settings are kept: the test's process has none)
    env = {k: v for k, v in os.environ.items() if k not in STARTUP_VARIABLES}
    noise = ("could not determine TPU", "Logging before InitGoogle", "common_lib.cc")
    for verbose in ((), ("-v",)):
        proc = subprocess.run(
            [sys.executable, "-m", "cachectl", *verbose, "warm", str(manifest), "--topology", "v5e:1x1"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert "1 bucket(s): " in proc.stdout and " 0 failed" in proc.stdout, proc.stdout
        shown = [n for n in noise if n in proc.stderr]
        assert shown == (list(noise) if verbose else []), proc.stderr
    # What libtpu says when it fails still reaches the user without -v.
    env["LIBTPU_INIT_ARGS"] = "--xla_no_such_flag=1"
    code, _, err = cachectl("warm", str(manifest), "--topology", "v5e:1x1", cwd=tmp_path, env=env)
    assert code != 0 and "Unknown command line flag 'xla_no_such_flag'" in err, err
