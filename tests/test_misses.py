"""`cachectl misses`: a real service per cause, each against a warmed manifest.

The manifest is warmed once (module fixture); every test wipes the recorded signatures,
runs one fresh service process under cachectl.activate() that calls the functions in
one wrong way, then asks `cachectl misses --json` what it missed and why.
"""

from __future__ import annotations

import json
import sqlite3
import textwrap
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from support.infra import run_py

from cachectl.cli import cli

MODEL = """
import jax, jax.numpy as jnp

def param_specs():
    return {"embed": {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32)}}

def apply(params, tokens):
    return params["embed"]["w"][tokens].sum()

def step(x, lr):
    return x * lr

def attention(x, num_heads):
    return x.reshape(x.shape[0], num_heads, -1).sum()

def decode(x):
    return jnp.cumsum(x)

def batch_specs(batch):
    return {"x": jax.ShapeDtypeStruct((batch, 4), jnp.float32)}

def total(batch_in):
    return batch_in["x"].sum()

def state_specs():
    # a train state as eval_shape builds it: the Python-int step is a weak-typed int32
    return jax.eval_shape(lambda: {"step": 0, "k": jnp.zeros(4, jnp.int8)})

def train_step(state):
    return {"step": state["step"] + 1, "k": state["k"] * 2}  # the same program either way

def count_into(state):
    return state["k"] + state["step"]  # a weak step keeps int8, a strong one promotes to int32
"""

MANIFEST = """
# the service's programs
version: 1
functions:
  - fn: svc_model:apply
    args:
      - {pytree: svc_model:param_specs}
      - {shape: [batch, 16], dtype: int32}   # tokens
    buckets:
      batch: [16, 64]
  - fn: svc_model:step
    args:
      - {shape: [4], dtype: float32}
      - {shape: [], dtype: float32}
  - fn: svc_model:attention
    jit: {static_argnames: [num_heads]}
    args:
      - {shape: [2, 8], dtype: float32}
    kwargs:
      num_heads: {axis: num_heads}
    buckets:
      num_heads: [4, 8]
  - fn: svc_model:decode
    args:
      - {shape: [seq], dtype: float32}
    buckets:
      seq: [128, 256, 512]
  - fn: svc_model:total
    args:
      - {pytree: svc_model:batch_specs}   # the batch axis lives inside a pytree
    buckets:
      batch: [1, 4, 8]
  - fn: svc_model:train_step
    args: [{pytree: svc_model:state_specs}]
  - fn: svc_model:count_into
    args: [{pytree: svc_model:state_specs}]
"""

SERVICE = """
import sys, numpy as np
sys.path.insert(0, {dir!r})
import cachectl
cachectl.activate()
import jax, jax.numpy as jnp
import svc_model as m
params = {{"embed": {{"w": np.ones((8, 4), np.float32)}}}}
apply = jax.jit(m.apply)
step = jax.jit(m.step)
attention = jax.jit(m.attention, static_argnames=["num_heads"])
decode = jax.jit(m.decode)
total = jax.jit(m.total)
{body}
"""

MATCHING = """
apply(params, np.zeros((16, 16), np.int32)).block_until_ready()
apply(params, np.zeros((64, 16), np.int32)).block_until_ready()
step(np.ones(4, np.float32), np.float32(0.1)).block_until_ready()
attention(np.ones((2, 8), np.float32), num_heads=4).block_until_ready()
decode(np.ones(256, np.float32)).block_until_ready()
"""


@pytest.fixture(scope="module")
def warmed(tmp_path_factory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("misses-home")
    (home / "svc_model.py").write_text(MODEL)
    (home / "manifest.yaml").write_text(MANIFEST)
    env = {
        "XDG_DATA_HOME": str(home / "data"),
        "XDG_CACHE_HOME": str(home / "cache"),
        "XDG_CONFIG_HOME": str(home / "config"),
        "CACHECTL_TELEMETRY_INTERVAL": "3600",
    }
    code = f"""
        import sys
        from cachectl.cli import main
        sys.argv = ["cachectl", "warm", {str(home / "manifest.yaml")!r}, "--json"]
        main()
    """
    proc = run_py(code, env, check=True, timeout=600)
    assert json.loads(proc.stdout)["summary"]["failed"] == 0
    return {**env, "HOME_DIR": str(home)}


def _service(warmed: dict[str, str], body: str, monkeypatch) -> dict[str, Any]:
    env = {k: v for k, v in warmed.items() if k != "HOME_DIR"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    db = Path(warmed["XDG_DATA_HOME"]) / "cachectl" / "index.db"
    with sqlite3.connect(db) as conn:
        conn.execute("DELETE FROM signatures")
        conn.execute("DELETE FROM telemetry")
    code = SERVICE.format(dir=warmed["HOME_DIR"], body=textwrap.dedent(body))
    proc = run_py(code, env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = CliRunner().invoke(cli, ["misses", "--since", "1h", "--json"], catch_exceptions=False)
    assert result.exit_code in (0, 1), result.output
    report = json.loads(result.stdout)
    report["exit_code"] = result.exit_code
    return report


def _only(report: dict[str, Any]) -> dict[str, Any]:
    assert len(report["findings"]) == 1, report["findings"]
    return report["findings"][0]


def _kinds(report: dict[str, Any]) -> list[tuple[str, str]]:
    return [(f["function"], f["kind"]) for f in report["findings"]]


def test_a_matching_service_misses_nothing(warmed, monkeypatch) -> None:
    report = _service(warmed, MATCHING, monkeypatch)
    assert report["findings"] == [], report["findings"]
    assert report["exit_code"] == 0
    assert report["coverage"] == 1.0
    assert report["manifest"].endswith("manifest.yaml")


def test_committed_arrays_name_the_leaf_and_the_sharding(warmed, monkeypatch) -> None:
    body = """
    dev = jax.devices()[0]
    committed = jax.tree.map(lambda x: jax.device_put(x, dev), params)
    apply(committed, np.zeros((16, 16), np.int32)).block_until_ready()
    """
    report = _service(warmed, body, monkeypatch)
    assert report["exit_code"] == 1
    f = _only(report)
    assert f["function"] == "jit_apply" and f["name"] == "apply" and f["kind"] == "sharding"
    assert f["arg"] == 0 and f["leaf"] == "['embed']['w']" and f["bucket"] == "batch=16"
    assert f["observed"] == "SingleDeviceSharding(cpu:0)" and f["expected"] is None
    assert "add sharding: single_device" in f["message"]
    assert f["message"].startswith("jit_apply arg 0 (params) leaf ['embed']['w']: sharding")


def test_a_python_float_is_weak_typed(warmed, monkeypatch) -> None:
    report = _service(warmed, "step(np.ones(4, np.float32), 0.1).block_until_ready()", monkeypatch)
    assert report["exit_code"] == 1
    f = _only(report)
    assert (f["function"], f["kind"], f["arg"], f["field"]) == (
        "jit_step",
        "weak_type",
        1,
        "weak_type",
    )
    assert f["message"] == (
        "jit_step arg 1 (lr): float32 weak_type (a Python float) vs float32: pass np.float32(...)"
    )


def test_a_batch_between_buckets(warmed, monkeypatch) -> None:
    report = _service(
        warmed, "apply(params, np.zeros((48, 16), np.int32)).block_until_ready()", monkeypatch
    )
    assert report["exit_code"] == 1
    f = _only(report)
    assert (f["function"], f["kind"], f["arg"], f["observed"], f["expected"]) == (
        "jit_apply",
        "shape",
        1,
        48,
        [16, 64],
    )
    assert (
        f["message"]
        == "jit_apply arg 1 (tokens): batch 48 not a bucket (16, 64): pad to 64, or add 48"
    )
    human = CliRunner().invoke(cli, ["misses"])
    assert human.exit_code == 1
    assert (
        "  jit_apply arg 1 (tokens): batch 48 not a bucket (16, 64): pad to 64, or add 48 (nearest bucket "
        "[batch=64]); 1 missed" in human.stdout
    )


def test_a_static_value_that_is_not_a_bucket(warmed, monkeypatch) -> None:
    report = _service(
        warmed,
        "attention(np.ones((2, 8), np.float32), num_heads=2).block_until_ready()",
        monkeypatch,
    )
    assert report["exit_code"] == 1
    f = _only(report)
    assert (f["function"], f["kind"], f["arg"], f["observed"], f["expected"]) == (
        "jit_attention",
        "static",
        "num_heads",
        "2",
        [4, 8],
    )
    assert f["message"] == "jit_attention static num_heads=2 not among (4, 8)"


def test_a_lambda_jitted_per_call(warmed, monkeypatch) -> None:
    body = """
    for _ in range(5):
        jax.jit(lambda x: x * 2 + 1)(np.ones(3, np.float32)).block_until_ready()
    """
    report = _service(warmed, body, monkeypatch)
    assert report["exit_code"] == 1
    rejit = [f for f in report["findings"] if f["kind"] == "rejit"]
    assert len(rejit) == 1 and rejit[0]["function"] == "jit__lambda"
    assert rejit[0]["message"].startswith("jit__lambda compiled 5 programs with identical shapes")
    assert "jit it once at module level" in rejit[0]["message"]


def test_a_shape_explosion(warmed, monkeypatch) -> None:
    body = """
    for n in range(97, 512, 22):
        decode(np.ones(n, np.float32)).block_until_ready()
    """
    report = _service(warmed, body, monkeypatch)
    assert report["exit_code"] == 1
    (boom,) = [f for f in report["findings"] if f["kind"] == "explosion"]
    assert boom["function"] == "jit_decode"
    assert boom["message"] == "jit_decode compiled 19 distinct seq lengths (97..493): bucket seq"
    shapes = [f for f in report["findings"] if f["kind"] == "shape"]
    assert len(shapes) == 19 and all(f["field"] == "shape[0]:seq" for f in shapes)
    assert report["coverage"] == 0.0


def test_advise_from_the_signatures_of_a_plain_jit_service(warmed, monkeypatch) -> None:
    from cachectl.usage.advise import optimal_buckets

    sizes = [100, 100, 130, 250, 250, 251, 400, 511]
    body = "\n".join(
        f"decode(np.ones({n}, np.float32)).block_until_ready()" for n in sorted(set(sizes))
    )
    _service(warmed, body, monkeypatch)
    manifest = str(Path(warmed["HOME_DIR"]) / "manifest.yaml")
    result = CliRunner().invoke(
        cli,
        ["advise", manifest, "--function", "decode", "--max-buckets", "3", "--json"],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    (fn,) = json.loads(result.stdout)["functions"]
    (axis,) = fn["axes"]
    # a plain jit service compiles each distinct length once: the signatures count programs, not calls
    assert axis["source"] == "signatures" and axis["calls"] == len(set(sizes))
    assert axis["proposed"]["values"] == optimal_buckets(sorted(set(sizes)), max_buckets=3)
    assert axis["current"]["values"] == [128, 256, 512] and axis["current"]["coverage"] == 1.0


def test_stats_hit_rate_is_over_cacheable_programs(warmed, monkeypatch) -> None:
    """A warmed service whose inputs go through jnp.asarray(numpy): staging programs apart."""
    body = MATCHING.replace(
        "np.zeros((16, 16), np.int32)", "jnp.asarray(np.zeros((16, 16), np.int32))"
    )
    body = body.replace("np.ones(256, np.float32)", "jnp.asarray(np.ones(256, np.float32))")
    body = "params = jax.tree.map(jnp.asarray, params)\n" + body
    report = _service(warmed, body, monkeypatch)
    assert report["exit_code"] == 0, report["findings"]
    assert "jit_stage" in report["uncacheable_functions"]
    usage = json.loads(CliRunner().invoke(cli, ["stats", "--since", "1h", "--json"]).stdout)
    (env,) = usage["environments"]
    fns = {f["function"]: f for f in usage["functions"]}
    assert fns["jit_stage"]["uncacheable"] == fns["jit_stage"]["requests"] > 0
    assert fns["jit_stage"]["hit_rate"] is None
    assert env["uncacheable"] >= fns["jit_stage"]["uncacheable"]
    assert env["hit_rate"] == 1.0 and env["hits"] == env["cacheable_requests"] == 5
    assert fns["jit_apply"]["name"] == "apply" and fns["jit_apply"]["hits"] == 2
    assert fns["jit_apply"]["saved_warm_seconds"] > 0 and env["saved_warm_seconds"] >= 0
    text = CliRunner().invoke(cli, ["stats", "--since", "1h"]).stdout
    assert "apply" in text and "(jit_appl" in text and "100%" in text  # rich folds narrow columns
    assert "not cacheable: JAX-internal staging programs" not in text  # the legend: --explain
    explained = CliRunner().invoke(cli, ["stats", "--since", "1h", "--explain"]).stdout
    assert explained.count("not cacheable: JAX-internal staging programs") == 1
    plain = CliRunner().invoke(cli, ["stats"]).stdout
    assert "hit rate 100.0% over the last 24h (5 hits, 0 misses;" in plain


def test_nothing_missed_exits_0_with_staging_programs_and_rejitted_hits(
    warmed, monkeypatch
) -> None:
    """Staging programs compiled again and again, and a function re-jitted per call that hits
    every time: nothing missed, so the text says so and the exit status agrees."""
    body = (
        MATCHING
        + """
for _ in range(3):
    jnp.asarray(np.ones(3, np.float32)).block_until_ready()   # jit_stage, compiled each time
    jax.jit(m.step)(np.ones(4, np.float32), np.float32(0.1)).block_until_ready()  # a hit
    jax.clear_caches()
"""
    )
    report = _service(warmed, body, monkeypatch)
    assert report["misses"] == 0 and report["findings"] == [], report["findings"]
    assert report["exit_code"] == 0 and report["ok"] is True
    assert report["uncacheable_functions"]["jit_stage"] >= 3
    human = CliRunner().invoke(cli, ["misses"])
    assert human.exit_code == 0, human.output
    assert ", 0 misses," in human.stdout and "nothing missed" in human.stdout


def test_two_programs_that_differ_in_weak_type_name_the_argument(warmed, monkeypatch) -> None:
    body = """
step(np.ones(5, np.float32), 0.1).block_until_ready()
step(np.ones(5, np.float32), np.float32(0.1)).block_until_ready()
"""
    report = _service(warmed, body, monkeypatch)
    assert report["exit_code"] == 1
    assert not [f for f in report["findings"] if f["kind"] == "rejit"]
    (weak,) = [
        f for f in report["findings"] if f["kind"] == "weak_type" and "programs" in f["message"]
    ]
    assert weak["message"].startswith(
        "jit_step compiled 2 programs for the same shapes and dtypes that differ only in "
        "weak_type at jit_step arg 1 (lr):"
    )
    assert weak["observed"] == ["arg 1 (lr)"] and weak["misses"] == 2


WEAK_STEP = """
import os
hits = []
jax.monitoring.register_event_listener(
    lambda e, **_: hits.append(e) if e == "/jax/compilation_cache/cache_hits" else None
)
state = {"step": np.int32(3), "k": np.ones(4, np.int8)}  # restored: a strong int32 step
jax.jit(m.train_step)(state)["k"].block_until_ready()
jax.jit(m.count_into)(state).block_until_ready()
step(np.ones(4, np.float32), np.float32(0.1)).block_until_ready()
with open(os.path.join(sys.path[0], "jax-hits"), "w") as f:
    f.write(str(len(hits)))
"""


def test_a_weak_typed_leaf_is_compared_as_jax_keys_it(warmed, monkeypatch) -> None:
    """The manifest's train state comes from jax.eval_shape (a weak-typed int32 step), the
    service's is restored (a strong one). JAX's key holds the program, not the weak type: where
    the program is the same (train_step) JAX hits and the call is covered; where the weak type
    changed it (count_into's int8 sum promotes to int32) JAX misses and weak_type is named."""
    report = _service(warmed, WEAK_STEP, monkeypatch)
    jax_hits = int((Path(warmed["HOME_DIR"]) / "jax-hits").read_text())
    assert (report["requests"], report["hits"], report["misses"]) == (3, 2, 1), report
    assert jax_hits == report["hits"]
    assert report["coverage"] == 2 / 3, report
    f = _only(report)
    assert (f["function"], f["kind"], f["leaf"]) == ("jit_count_into", "weak_type", "['step']")
    assert f["message"].endswith("make that leaf jnp.int32(...) in the pytree function"), f


def test_a_pytree_axis_is_named_and_the_buckets_told_as_they_are(warmed, monkeypatch) -> None:
    report = _service(
        warmed, 'total({"x": np.ones((3, 4), np.float32)}).block_until_ready()', monkeypatch
    )
    f = _only(report)
    assert f["message"] == (
        "jit_total arg 0 (batch_in) leaf ['x']: batch 3 not a bucket (1, 4, 8): pad to 4, or add 3"
    )
    assert f["expected"] == [1, 4, 8]
    # advise finds the sizes inside the pytree too
    manifest = str(Path(warmed["HOME_DIR"]) / "manifest.yaml")
    result = CliRunner().invoke(cli, ["advise", manifest, "--function", "total", "--json"])
    assert result.exit_code == 0, result.output
    (fn,) = json.loads(result.stdout)["functions"]
    (axis,) = fn["axes"]
    assert axis["calls"] == 1 and axis["source"] == "signatures"
    assert 3 in range(1, max(axis["proposed"]["values"]) + 1)


def test_a_library_internal_program_is_said_once_with_its_library(warmed, monkeypatch) -> None:
    """jax.random's own jitted functions stand in for a library's closures: grouped, attributed."""
    body = """
for seed in range(4):
    np.asarray(jax.random.normal(jax.random.key(seed), (3,)))
"""
    report = _service(warmed, body, monkeypatch)
    internal = [f for f in report["findings"] if f["kind"] == "library_internal"]
    assert internal, report["findings"]
    modules = [f["function"] for f in internal]
    assert len(modules) == len(set(modules))  # one finding per program, however many signatures
    assert all(f["observed"] == "jax" and "internal to jax" in f["message"] for f in internal)
    assert all("warm it by running the service" in f["message"] for f in internal)
    assert not [f for f in report["findings"] if f["kind"] in ("not_in_manifest", "rejit")]


def test_advise_uses_every_source_weighted_by_calls(warmed, monkeypatch) -> None:
    """Plain jit calls at the buckets, then one failed serving call: the proposal still covers
    every size seen, and counts them all."""
    manifest = str(Path(warmed["HOME_DIR"]) / "manifest.yaml")
    body = f"""
for n in (128, 256, 512):
    for _ in range(3):
        decode(np.ones(n, np.float32)).block_until_ready()
        jax.clear_caches()
rt = cachectl.serving({manifest!r})
try:
    rt["decode"](np.ones(600, np.float32))
except Exception as exc:
    print("failed:", type(exc).__name__, file=sys.stderr)
rt.report()
from cachectl import telemetry
telemetry.current().flush()
"""
    _service(warmed, body, monkeypatch)
    result = CliRunner().invoke(cli, ["advise", manifest, "--function", "decode", "--json"])
    assert result.exit_code == 0, result.output
    (fn,) = json.loads(result.stdout)["functions"]
    (axis,) = fn["axes"]
    assert axis["source"] == "serving+signatures"
    assert axis["calls"] >= 10 and axis["distinct_sizes"] == 4
    assert axis["proposed"]["coverage"] == 1.0 and len(axis["proposed"]["values"]) == 3
    assert axis["proposed"]["values"][-1] == 600 and axis["proposed"]["values"][0] == 128


def test_json_stays_json_when_a_manifest_module_prints_on_import(warmed, monkeypatch) -> None:
    """mujoco prints a warning to stdout on import: --json output must still parse."""
    home = Path(warmed["HOME_DIR"])
    (home / "svc_loud.py").write_text(
        'print("WARNING: warp is not installed")\n'
        "import jax.numpy as jnp\n\n"
        "def scale(x):\n    return x * 2\n"
    )
    loud = home / "loud.yaml"
    loud.write_text(
        "version: 1\nfunctions:\n  - fn: svc_loud:scale\n"
        "    args:\n      - {shape: [n], dtype: float32}\n    buckets:\n      n: [8, 16]\n"
    )
    _service(warmed, MATCHING, monkeypatch)  # signatures in the window, so advise lowers too
    for args in (["misses", "--manifest", str(loud), "--json"], ["advise", str(loud), "--json"]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code in (0, 1), result.output
        assert "warp is not installed" not in result.stdout
        json.loads(result.stdout)


def test_a_function_that_fails_to_lower_is_a_finding_not_a_traceback(warmed, monkeypatch) -> None:
    """When a manifest function no longer lowers is exactly when `misses` is needed: that
    function is one finding naming its bucket and error; the others are explained as ever."""
    home = Path(warmed["HOME_DIR"])
    (home / "svc_broken.py").write_text(
        "import jax.numpy as jnp\n\n"
        "def scale(x):\n    return x * 2\n\n"
        "def broken(x):\n    raise ValueError('the reshape does not fit')\n"
    )
    broken = home / "broken.yaml"
    broken.write_text(
        "version: 1\nfunctions:\n"
        "  - fn: svc_broken:scale\n    args:\n      - {shape: [n], dtype: float32}\n"
        "    buckets:\n      n: [8]\n"
        "  - fn: svc_broken:broken\n    args:\n      - {shape: [n], dtype: float32}\n"
        "    buckets:\n      n: [8, 16]\n"
        # A mesh larger than this process's devices (a jax.distributed job's, seen from outside
        # it): the machine, not the manifest, and said so.
        "  - fn: svc_broken:scale\n    name: wide\n    mesh: {axes: {data: 4096}}\n"
        "    args:\n      - {shape: [n], dtype: float32, sharding: [data]}\n"
        "    buckets:\n      n: [4096]\n"
    )
    _service(warmed, MATCHING, monkeypatch)
    result = CliRunner().invoke(cli, ["misses", "--manifest", str(broken), "--json"])
    assert result.exit_code == 0, result.output  # nothing missed: as documented
    report = json.loads(result.stdout)
    finding, wide = [f for f in report["findings"] if f["kind"] == "lowering"]
    assert finding["function"] == "broken" and finding["bucket"] == "n=8", finding
    assert wide["function"] == "wide" and "cannot lower here" in wide["message"], wide
    assert "the mesh needs 4096 devices" in wide["message"], wide
    assert "fix the" not in wide["message"] and "JAX_COORDINATOR_ADDRESS" in wide["message"]
    assert "ValueError: the reshape does not fit" in finding["message"], finding
    human = CliRunner().invoke(cli, ["misses", "--manifest", str(broken)])
    assert human.exit_code == 0 and "Traceback" not in human.output, human.output
    assert "broken[n=8] does not lower: ValueError: the reshape does not fit" in human.output


def _row(function: str, key: str, source: str | None, leaves: list[Any]) -> Any:
    from datetime import UTC, datetime

    from cachectl.index.telemetry_queries import SignatureRow

    now = datetime.now(UTC)
    return SignatureRow("env", function, key, key, leaves, source, None, 1, 0, 1, 0, 0, now, now)


def test_with_no_manifest_a_missed_program_still_has_its_cause() -> None:
    """A service warmed by running (no manifest) missed a library's program: `misses` listed it
    with no finding at all. Now it is said as the library's, and, when the cache holds programs of
    it that the service did not look up, that they differ: other shapes or data baked in."""
    from cachectl.usage.misses_explain import not_in_manifest_finding

    leaves = [[[16], "float32", False, None]]
    source = "_fori_collect_loop at /venv/lib/python3.11/site-packages/numpyro/util.py:353"
    rows = [_row("jit__fori_collect_loop", "k1", source, leaves)]
    f = not_in_manifest_finding("jit__fori_collect_loop", rows, manifest=False, warmed=1)
    assert (f.kind, f.observed, f.misses) == ("library_internal", "numpyro", 1)
    assert "internal to numpyro" in f.message
    assert "the cache holds 1 program of it, none the one the service looked up" in f.message
    assert "jit_model_args=True" in f.message
    # Nothing warmed of it: no claim about constants.
    f = not_in_manifest_finding("jit__fori_collect_loop", rows, manifest=False, warmed=0)
    assert "constants" not in f.message and "warm it by running" in f.message
    # The service's own function, and no manifest to add it to.
    own = not_in_manifest_finding(
        "jit_step", [_row("jit_step", "k2", "step at /srv/app.py:3", leaves)], manifest=False
    )
    assert own.kind == "not_in_manifest" and "no manifest names it" in own.message


def test_a_mesh_function_missed_for_its_jit_shardings_names_the_jitted_function() -> None:
    """A service jits a mesh function with in_shardings/out_shardings, the manifest names the
    plain function: same arguments, another program (the result's sharding is in it). `misses`
    said only "a jit option differs", which `jit:` cannot declare; it now names the fix. Seen
    on the field suite's orbax-sharded service (8 host devices) with the manifest naming the
    plain function; here as the index's rows."""
    from cachectl.usage.misses_expected import ExpectedSignature
    from cachectl.usage.misses_explain import static_finding

    mesh = "NamedSharding(mesh={'data': 2, 'model': 4}, spec=('data', None))"
    for sharding, named in ((mesh, True), (None, False)):
        leaves = (((8, 16), "float32", False, sharding),)
        exp = ExpectedSignature(
            "_forward", "jit__forward", {"batch": 8}, "batch=8", leaves, None, {}
        )
        row = _row("jit__forward", "k", "_forward at /srv/case.py:3", [list(x) for x in leaves])
        f = static_finding(row, exp, {}, 1)
        assert f.kind == "static" and "a jit option differs" in f.message, f
        assert ("name its jitted function in the manifest" in f.message) is named, f.message


def test_a_bucket_missed_under_other_xla_flags_names_the_flags(tmp_path, monkeypatch) -> None:
    """Warm under one XLA_FLAGS, serve under another: every call is a bucket of the manifest and
    misses, and misses names the key component that differs, with the flags themselves."""
    (tmp_path / "svc_model.py").write_text(MODEL)
    (tmp_path / "manifest.yaml").write_text(MANIFEST)
    env = {
        "XDG_DATA_HOME": str(tmp_path / "data"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "CACHECTL_TELEMETRY_INTERVAL": "3600",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    warm = f"""
        import sys
        from cachectl.cli import main
        sys.argv = ["cachectl", "warm", {str(tmp_path / "manifest.yaml")!r}, "--json"]
        main()
    """
    built, served = "--xla_cpu_multi_thread_eigen=true", "--xla_cpu_multi_thread_eigen=false"
    run_py(warm, {**env, "XLA_FLAGS": built}, check=True, timeout=600)
    code = SERVICE.format(dir=str(tmp_path), body=textwrap.dedent(MATCHING))
    proc = run_py(code, {**env, "XLA_FLAGS": served}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = CliRunner().invoke(cli, ["misses", "--since", "1h", "--json"], catch_exceptions=False)
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    f = _only(report)
    assert f["kind"] == "environment" and f["field"] == "xla_flags", f
    assert f["misses"] == 5 and f["observed"] == [served] and f["expected"] == [built]
    assert (
        f"XLA flags: the service has {served}, the entries were built without it; "
        f"the entries were built with {built}, the service runs without it"
    ) in f["message"]


OTHER = """
version: 1
functions:
  - fn: svc_other:scale
    args:
      - {shape: [n], dtype: float32}
    buckets:
      n: [8]
"""


def test_each_function_against_the_manifest_that_warmed_it(warmed, monkeypatch) -> None:
    """Another service warmed its own manifest into the cache after this one: this service's
    calls are still explained against the manifest that warmed them (the latest warm's named
    none of them: "not in the manifest", 0% coverage), and a batch above every bucket names the
    largest bucket as the nearest, not the first."""
    home = Path(warmed["HOME_DIR"])
    (home / "svc_other.py").write_text("def scale(x):\n    return x * 3\n")
    other = home / "other.yaml"
    other.write_text(OTHER)
    env = {k: v for k, v in warmed.items() if k != "HOME_DIR"}
    warm = f"""
        import sys
        from cachectl.cli import main
        sys.argv = ["cachectl", "warm", {str(other)!r}, "--json"]
        main()
    """
    try:
        run_py(warm, env, check=True, timeout=600)
        body = MATCHING + 'total({"x": np.ones((50, 4), np.float32)}).block_until_ready()\n'
        report = _service(warmed, body, monkeypatch)
        human = CliRunner().invoke(cli, ["misses"])
    finally:
        other.unlink()  # the module's other tests see the first manifest as the latest again
    assert report["manifests"] == [str(home / "manifest.yaml")], report["manifests"]
    assert report["coverage"] == 5 / 6, report["coverage"]
    f = _only(report)
    assert (f["function"], f["kind"], f["bucket"], f["observed"]) == (
        "jit_total",
        "shape",
        "batch=8",
        50,
    )
    assert f["message"] == (
        "jit_total arg 0 (batch_in) leaf ['x']: batch 50 above the largest bucket (1, 4, 8): add 50"
    )
    assert "above the largest bucket (1, 4, 8): add 50 (nearest bucket [batch=8]); 1 missed" in (
        human.stdout
    )


def test_server_mode_explains_what_direct_mode_explains(warmed, monkeypatch, tmp_path) -> None:
    """A node that reaches the index only through `cachectl serve` (CACHECTL_SERVER and a reader
    token, no index of its own) gets the same findings and exit code as direct mode: misses reads
    the index's facts from the server (GET /caches/{cache}/misses-facts) and explains them here.
    Batch 40: a shape no other test's service compiled (a service writes what it compiles, so a
    shape an earlier test used would hit)."""
    from support.server_kit import served

    direct = _service(
        warmed, "apply(params, np.zeros((40, 16), np.int32)).block_until_ready()", monkeypatch
    )
    assert direct["exit_code"] == 1
    db = f"sqlite:///{Path(warmed['XDG_DATA_HOME']) / 'cachectl' / 'index.db'}"
    made = CliRunner().invoke(
        cli, ["token", "create", "--name", "node", "--role", "reader", "--json"]
    )
    assert made.exit_code == 0, made.output
    secret = json.loads(made.stdout)["token"]
    with served(db) as (live, _):
        for name in ("XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME"):
            monkeypatch.setenv(name, str(tmp_path / name))  # no index of the node's own
        monkeypatch.setenv("CACHECTL_SERVER", live.url)
        monkeypatch.setenv("CACHECTL_TOKEN", secret)
        remote = CliRunner().invoke(cli, ["misses", "--since", "1h", "--json"])
        human = CliRunner().invoke(cli, ["misses", "--since", "1h"])
    assert remote.exit_code == 1, remote.output
    report = json.loads(remote.stdout)
    assert report["findings"] == direct["findings"]
    assert (report["misses"], report["signatures"]) == (direct["misses"], direct["signatures"])
    assert human.exit_code == 1 and "Traceback" not in human.output
    assert "batch 40 not a bucket (16, 64): pad to 64, or add 40" in human.stdout


PAIR = """
version: 1
functions:
  - fn: svc_pair:mix
    args:
      - {shape: [batch, seq], dtype: float32}
      - {shape: [batch, seq], dtype: float32}
    buckets:
      batch: [4, 8]
      seq: [16]
"""


def test_one_line_per_missed_signature(warmed, monkeypatch) -> None:
    """Three missed signatures of a function whose two arguments share its bucket axes: three
    lines, each naming both arguments once (it printed a line per argument and axis: 8 lines
    for 3 misses), broken between clauses only at a width; --json keeps a finding per field."""
    home = Path(warmed["HOME_DIR"])
    (home / "svc_pair.py").write_text("def mix(x, y):\n    return x * y\n")
    pair = home / "pair.yaml"
    pair.write_text(PAIR)
    body = (
        "import svc_pair\nmix = jax.jit(svc_pair.mix)\n"
        "for b, s in ((3, 16), (5, 16), (6, 20)):\n"
        "    mix(np.ones((b, s), np.float32), np.ones((b, s), np.float32)).block_until_ready()\n"
    )
    _service(warmed, MATCHING + body, monkeypatch)
    report = json.loads(
        CliRunner().invoke(cli, ["misses", "--manifest", str(pair), "--json"]).stdout
    )
    mine = [f for f in report["findings"] if f["function"] == "jit_mix"]
    assert len(mine) == 8 and len({f["signature"] for f in mine}) == 3, mine  # detailed
    human = CliRunner().invoke(cli, ["misses", "--manifest", str(pair)])
    assert human.exit_code == 1, human.output
    lines = human.stdout.split("mix:\n", 1)[1].split("\n")
    lines = [line for line in lines[: lines.index("") if "" in lines else None] if line]
    mix_lines = [line for line in lines if line.startswith("  jit_mix")]
    assert sorted(mix_lines) == [
        "  jit_mix arg 0 (x), arg 1 (y): batch 3 not a bucket (4, 8): pad to 4, or add 3 "
        "(nearest bucket [batch=4,seq=16]); 1 missed",
        "  jit_mix arg 0 (x), arg 1 (y): batch 5 not a bucket (4, 8): pad to 8, or add 5 "
        "(nearest bucket [batch=8,seq=16]); 1 missed",
        "  jit_mix arg 0 (x), arg 1 (y): batch 6 not a bucket (4, 8): pad to 8, or add 6; "
        "arg 0 (x), arg 1 (y): seq 20 above the largest bucket (16): add 20 "
        "(nearest bucket [batch=8,seq=16]); 1 missed",
    ], human.stdout
    # At a width, a line breaks between clauses, continued deeper; never mid-phrase.
    monkeypatch.setenv("COLUMNS", "80")
    narrow = CliRunner().invoke(cli, ["misses", "--manifest", str(pair)]).stdout
    assert (
        "\n    arg 0 (x), arg 1 (y): seq 20 above the largest bucket (16): add 20 (nearest"
        in narrow
    )
