"""Bucket axes inside pytree arguments: an environment state of n parallel envs, a batch in a tuple.

A pytree argument declares its bucket dimensions with ``leaf_axes`` (every leaf, or by leaf
path); cachectl.serving then picks the bucket from those leaves and pads them. A pytree that
varies with the buckets but declares none is said at warm and at serving start, and a call whose
leaves are not a bucket's is refused with a message, never a TypeError from deep in JAX. Every
service is a fresh process (infra.run_py); compiles are counted as in tests/test_serving.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from support.infra import run_py  # noqa: E402
from support.serving import COUNT_EVENTS, last_json  # noqa: E402

from cachectl.cli import cli

ENVS = """
import jax, jax.numpy as jnp

def state_specs(n):
    # n parallel environments: every leaf but the shared weights and the step counter has n rows.
    return {
        "obs": jax.ShapeDtypeStruct((n, 3), jnp.float32),
        "pipeline": {"qpos": jax.ShapeDtypeStruct((n, 5), jnp.float32)},
        "done": jax.ShapeDtypeStruct((n,), jnp.bool_),
        "w": jax.ShapeDtypeStruct((3, 3), jnp.float32),
        "t": jax.ShapeDtypeStruct((), jnp.int32),
    }

def step(state):
    obs = jnp.tanh(state["obs"] @ state["w"]) + state["pipeline"]["qpos"][:, :3]
    return {
        "obs": obs,
        "pipeline": {"qpos": state["pipeline"]["qpos"] * 0.5},
        "done": state["done"] | (obs[:, 0] > 0.9),
        "w": state["w"],
        "t": state["t"] + 1,
    }

def batch_specs(batch):
    return (jax.ShapeDtypeStruct((batch, 4), jnp.float32),)

def predict_step(scale, data):
    (x,) = data
    return jnp.sum(x * scale, axis=-1)
"""

MANIFEST = """
version: 1
target: {{backend: cpu}}
functions:
  - fn: envs:step
    args:
      - {state}
    buckets: {{n: [1, 8, 32]}}
  - fn: envs:predict_step
    args:
      - {{shape: [], dtype: float32}}
      - {batch}
    buckets: {{batch: [1, 16]}}
"""

BY_PATH = "{pytree: envs:state_specs, leaf_axes: {obs: {0: n}, pipeline: {0: n}, done: {0: n}}}"
EVERY_LEAF = "{pytree: envs:batch_specs, leaf_axes: {0: batch}}"

SERVICE = (
    COUNT_EVENTS
    + """
import numpy as np
sys.path.insert(0, {dir!r})
import cachectl, envs

def state(n):
    rng = np.random.default_rng(n)
    return dict(
        obs=rng.standard_normal((n, 3)).astype(np.float32),
        pipeline=dict(qpos=rng.standard_normal((n, 5)).astype(np.float32)),
        done=np.zeros((n,), bool),
        w=np.eye(3, dtype=np.float32),
        t=np.int32(0),
    )

rt = cachectl.serving({manifest!r})
before = compiles()
out = {{}}
errors = {{}}
for n in (5, 8):
    try:
        got = rt["step"](state(n))
        out[f"step{{n}}"] = jax.tree_util.tree_map(lambda a: np.asarray(a).tolist(), got)
    except Exception as exc:
        errors[f"step{{n}}"] = [type(exc).__name__, str(exc)]
x = np.arange(4 * 4, dtype=np.float32).reshape(4, 4)
try:
    out["predict4"] = np.asarray(rt["predict_step"](np.float32(2.0), (x,))).tolist()
except Exception as exc:
    errors["predict4"] = [type(exc).__name__, str(exc)]
during = compiles()
# What jax.jit computes on the same inputs, padded by hand to the bucket (after the counts).
pad8 = jax.tree_util.tree_map(np.asarray, state(5))
for k in ("obs", "done"):
    pad8[k] = np.concatenate([pad8[k], np.zeros((3,) + pad8[k].shape[1:], pad8[k].dtype)])
pad8["pipeline"]["qpos"] = np.concatenate([pad8["pipeline"]["qpos"], np.zeros((3, 5), np.float32)])
expected = dict(
    step5=jax.tree_util.tree_map(lambda a: np.asarray(a).tolist(), jax.jit(envs.step)(pad8)),
    predict4=np.asarray(jax.jit(envs.predict_step)(np.float32(2.0), (x,))).tolist(),
)
report = rt.report().to_json()
print(json.dumps(dict(out=out, errors=errors, expected=expected, report=report,
                      compiles=[before, during])))
"""
)


def _warm(manifest: Path) -> Any:
    return CliRunner().invoke(cli, ["warm", str(manifest), "--json"])


def _setup(tmp_path: Path, state: str, batch: str = EVERY_LEAF) -> Path:
    (tmp_path / "envs.py").write_text(ENVS)
    manifest = tmp_path / "pytrees.yaml"
    manifest.write_text(MANIFEST.format(state=state, batch=batch))
    return manifest


def _serve(tmp_path: Path, manifest: Path) -> tuple[dict[str, Any], str]:
    proc = run_py(SERVICE.format(dir=str(tmp_path), manifest=str(manifest)), check=True)
    return last_json(proc), proc.stderr


def test_pytree_leaf_axes_route_and_pad_calls_with_zero_compiles(tmp_path: Path) -> None:
    manifest = _setup(tmp_path, BY_PATH)
    result = _warm(manifest)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["summary"]["compiled"] == 5

    got, stderr = _serve(tmp_path, manifest)
    assert got["errors"] == {}, got["errors"]
    before, during = got["compiles"]
    assert during == before, "a served call traced or compiled"
    step = got["report"]["functions"]["step"]
    assert (step["aot"], step["fallback"], step["padded"]) == (2, 0, 1), step
    assert step["raw_sizes"] == {"n": {"5": 1, "8": 1}}, step
    predict = got["report"]["functions"]["predict_step"]
    assert (predict["aot"], predict["fallback"], predict["padded"]) == (1, 0, 1), predict
    # n=5 ran in bucket 8 (padded rows come back: no outputs are declared), equal to jax.jit's
    # answer on the same padded state; the batch of 4 ran in bucket 16, cut by nothing either.
    assert got["out"]["step5"] == got["expected"]["step5"]
    assert len(got["out"]["step8"]["obs"]) == 8
    assert got["out"]["predict4"][:4] == got["expected"]["predict4"]
    assert len(got["out"]["predict4"]) == 16
    assert "leaf_axes" not in stderr


def test_a_pytree_without_leaf_axes_is_said_and_its_calls_refused_with_a_message(
    tmp_path: Path,
) -> None:
    manifest = _setup(tmp_path, "{pytree: envs:state_specs}")
    proc = subprocess.run(  # a real process: what a user's terminal shows
        [sys.executable, "-m", "cachectl", "warm", str(manifest)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "declares no leaf_axes" in line]
    assert len(said) == 1 and "step: argument 0" in said[0], proc.stderr  # once, not per bucket

    got, stderr = _serve(tmp_path, manifest)
    assert "declares no leaf_axes" in stderr  # said at serving start too
    for n in ("step5", "step8"):
        kind, message = got["errors"][n]
        assert kind == "OutOfBucket", got["errors"]
        assert "leaf_axes" in message and "compiled with" in message, message
    assert got["compiles"][0] == got["compiles"][1]  # refused, not compiled
    assert got["errors"].get("predict4") is None  # the declared function still serves


def test_every_leaf_leaf_axes_that_miss_a_leaf_are_bad_input_naming_it(tmp_path: Path) -> None:
    manifest = _setup(tmp_path, "{pytree: envs:state_specs, leaf_axes: {0: n}}")
    result = CliRunner().invoke(cli, ["warm", str(manifest), "--dry-run"])
    assert result.exit_code == 2, result.output  # bad input, found before anything compiles
    assert "leaf w has size 3 at dimension 0" in result.output, result.output
    assert "by path" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("state", "problem"),
    [
        ("{shape: [n, 3], dtype: float32, leaf_axes: {0: n}}", "only a pytree argument"),
        ("{pytree: envs:state_specs, leaf_axes: {0: m}}", "unknown axis 'm'"),
        ("{pytree: envs:state_specs, leaf_axes: {obs: n}}", "leaf_axes maps a dimension"),
        ("{pytree: envs:state_specs, leaf_axes: {obs: {-1: n}}}", "non-negative int"),
    ],
)
def test_bad_leaf_axes_are_bad_input(tmp_path: Path, state: str, problem: str) -> None:
    manifest = _setup(tmp_path, state)
    result = CliRunner().invoke(cli, ["warm", str(manifest), "--dry-run"])
    assert result.exit_code == 2, result.output
    assert problem in result.output and "leaf_axes" in result.output, result.output


def test_a_pytree_s_leaf_plans_are_kept_per_structure_and_bounded() -> None:
    """The declared dimensions of a pytree's leaves come from their paths, computed once per
    structure and leaf ranks, not on every call (a Brax State flattens in Python); a caller
    that sends ever new structures keeps at most MAX_LEAF_PLANS of them, and every call is
    still fitted right."""
    import numpy as np

    from cachectl.dispatch import calls
    from cachectl.manifest.schema import FunctionSpec, build

    spec = build(
        FunctionSpec,
        {"fn": "m:f", "args": [{"pytree": "m:t", "leaf_axes": {0: "n", "b.c": {1: "k"}}}]},
    )
    (plan,) = calls.arg_plans(spec)
    tree = {"a": np.zeros((3, 2)), "b": {"c": np.zeros((3, 5)), "d": 1.0}}
    for _ in range(3):
        raw: dict[str, int] = {}
        calls.pytree_sizes(plan, tree, raw)
        assert raw == {"n": 3, "k": 5}
    assert len(plan.leaf_plans) == 1
    padded, did = calls.pad_pytree(plan, tree, {"n": 4, "k": 8})
    assert did and padded["a"].shape == (4, 2) and padded["b"]["c"].shape == (4, 8)
    assert padded["b"]["d"] == 1.0 and tree["a"].shape == (3, 2)  # the caller's tree untouched
    same, did = calls.pad_pytree(plan, tree, {"n": 3, "k": 5})
    assert not did and same is tree
    for i in range(calls.MAX_LEAF_PLANS + 5):
        other = {f"x{i}": np.zeros((i + 1, 1))}
        raw = {}
        calls.pytree_sizes(plan, other, raw)
        assert raw == {"n": i + 1}
    assert len(plan.leaf_plans) == calls.MAX_LEAF_PLANS
