"""Bucket axes inside pytree arguments: an environment state of n parallel envs, a batch in a tuple.

A pytree argument declares its bucket dimensions with ``leaf_axes`` (every leaf, or by leaf
path); cachectl.serving then picks the bucket from those leaves and pads them. A pytree that
varies with the buckets but declares none is said at warm and at serving start, and a call whose
leaves are not a bucket's goes through jax.jit at its own shapes with one warning, never a TypeError from deep in JAX. Every
service is a fresh process (infra.run_py); compiles are counted as in tests/test_serving.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
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
report = rt.report().to_dict()
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


def test_a_pytree_without_leaf_axes_is_said_and_its_calls_go_through_jit(
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
    assert got["errors"] == {}, got["errors"]  # answered, never raised
    step = got["report"]["functions"]["step"]
    assert (step["aot"], step["fallback"], step["out_of_bucket"]) == (0, 2, 0), step
    assert [len(got["out"][n]["obs"]) for n in ("step5", "step8")] == [5, 8]  # their own shapes
    fallback = [line for line in stderr.splitlines() if "serving through jax.jit" in line]
    assert len(fallback) == 1 and "leaf_axes" in fallback[0], stderr
    before, during = got["compiles"]  # jit compiled them at their shapes: what plain JAX does
    assert during.get("/jax/core/compile/backend_compile_duration", 0) > before.get(
        "/jax/core/compile/backend_compile_duration", 0
    ), got["compiles"]
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


# ------------------------------------------------------------------ what serving may pad with

# A graph network on a dict "graph" (jraph's GraphsTuple, without jraph): senders and receivers
# index the nodes, n_node says which nodes are whose. Zeros in the padded edges attach them to
# node 0 of graph 0, and padded nodes join the last graph: a zero-padded answer is wrong.
GRAPHS = """
import numpy as np
import jax, jax.numpy as jnp

F32, I32 = jnp.float32, jnp.int32

def graph_specs(n_node, n_edge, n_graph):
    S = jax.ShapeDtypeStruct
    return {"nodes": S((n_node, 4), F32), "senders": S((n_edge,), I32),
            "receivers": S((n_edge,), I32), "n_node": S((n_graph,), I32)}

def param_specs():
    return {"w": jax.ShapeDtypeStruct((4, 4), F32), "b": jax.ShapeDtypeStruct((4,), F32)}

def params():
    return {"w": np.eye(4, dtype=np.float32) * 0.5, "b": np.full(4, 0.3, np.float32)}

def predict(params, g):
    h = jnp.tanh(g["nodes"] @ params["w"] + params["b"])
    n, n_graph = g["nodes"].shape[0], g["n_node"].shape[0]
    h = h + jax.ops.segment_sum(h[g["senders"]], g["receivers"], num_segments=n)
    owner = jnp.repeat(jnp.arange(n_graph), g["n_node"], total_repeat_length=n)
    return jax.ops.segment_sum(h, owner, num_segments=n_graph).sum(-1)

def pad(g, n_node, n_edge, n_graph):
    # As jraph.pad_with_graphs: one more graph holds the padded nodes, padded edges join them.
    nodes, senders = np.asarray(g["nodes"]), np.asarray(g["senders"])
    real = int(np.sum(g["n_node"]))
    if n_node <= real or n_graph <= len(g["n_node"]) or n_edge < len(senders):
        raise ValueError("the graph does not fit with a padding graph")
    edges = np.full(n_edge - len(senders), real, np.int32)
    return {
        "nodes": np.concatenate([nodes, np.zeros((n_node - real, 4), np.float32)]),
        "senders": np.concatenate([senders, edges]).astype(np.int32),
        "receivers": np.concatenate([np.asarray(g["receivers"]), edges]).astype(np.int32),
        "n_node": np.concatenate([np.asarray(g["n_node"]),
                                  [n_node - real], np.zeros(n_graph - len(g["n_node"]) - 1)]
                                 ).astype(np.int32),
    }

def graph():  # 2 graphs: 3 + 2 nodes, 4 edges
    rng = np.random.default_rng(0)
    return {"nodes": rng.standard_normal((5, 4)).astype(np.float32),
            "senders": np.array([0, 1, 3, 4], np.int32), "receivers": np.array([1, 2, 4, 3], np.int32),
            "n_node": np.array([3, 2], np.int32)}

def state_specs(n):
    # n chains: a typed PRNG key each, a float state, an empty int history, an int step count.
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), n))
    S = jax.ShapeDtypeStruct
    return {"key": keys, "x": S((n, 3), F32), "history": S((n, 0), I32), "count": S((n,), I32)}

def sample(state):
    step = jax.vmap(lambda k, x: x + jax.random.normal(k, x.shape))(state["key"], state["x"])
    return step, state["count"] + 1, state["history"].sum(-1), state["key"]

def state(n):
    return {"key": jax.random.split(jax.random.key(7), n),
            "x": np.arange(n * 3, dtype=np.float32).reshape(n, 3),
            "history": np.zeros((n, 0), np.int32), "count": np.arange(n, dtype=np.int32)}
"""

GRAPH_AXES = (
    "{nodes: {0: n_node}, senders: {0: n_edge}, receivers: {0: n_edge}, n_node: {0: n_graph}}"
)
PADDING_MANIFEST = f"""
version: 1
target: {{backend: cpu}}
functions:
  - name: refused
    fn: graphs:predict
    args:
      - {{pytree: graphs:param_specs}}
      - {{pytree: graphs:graph_specs, leaf_axes: {GRAPH_AXES}}}
    buckets: {{n_node: [8, 16], n_edge: [8], n_graph: [4]}}
    outputs: [{{shape: [n_graph]}}]
  - name: padded
    fn: graphs:predict
    args:
      - {{pytree: graphs:param_specs}}
      - {{pytree: graphs:graph_specs, leaf_axes: {GRAPH_AXES}, pad_fn: "graphs:pad"}}
    buckets: {{n_node: [5, 6], n_edge: [6], n_graph: [3]}}
    outputs: [{{shape: [n_graph]}}]
  - fn: graphs:sample
    args:
      - {{pytree: graphs:state_specs, leaf_axes: {{0: n}}, leaf_pad: {{count: 0}}}}
    buckets: {{n: [4, 8]}}
    outputs: [{{shape: [n, 3]}}, {{shape: [n]}}, {{shape: [n]}}, {{shape: [n]}}]
"""

PADDING_SERVICE = (
    COUNT_EVENTS
    + """
import numpy as np
sys.path.insert(0, {dir!r})
import cachectl, graphs
def flat(tree):  # typed keys as their key data
    data = lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    return [np.asarray(data(x)).tolist() for x in jax.tree_util.tree_leaves(tree)]
rt = cachectl.serving({manifest!r})
state = graphs.state(3)  # jax.random.split compiles: before the count
before = compiles()
out = dict(padded=flat(rt["padded"](graphs.params(), graphs.graph())),
           sample=flat(rt["sample"](state)))
during = compiles()
out["refused"] = [flat(rt["refused"](graphs.params(), graphs.graph())) for _ in range(2)]
# plain jax.jit at the call's own shapes: the right answers
expected = dict(graph=flat(jax.jit(graphs.predict)(graphs.params(), graphs.graph())),
                sample=flat(jax.jit(graphs.sample)(state)))
report = rt.report().to_dict()
print(json.dumps(dict(out=out, expected=expected, report=report, compiles=[before, during])))
"""
)


def test_serving_pads_only_what_is_safe_and_refuses_the_rest_with_one_warning(
    tmp_path: Path,
) -> None:
    """Integer index leaves are never zero-padded: a call that would need it goes through
    jax.jit at its own shapes (the right answer) with one warning naming the leaf and the fix;
    a pad_fn pads the graph right, from the stored executables; typed keys, an empty leaf and
    an integer leaf with a declared leaf_pad are padded from the stored executables too."""
    (tmp_path / "graphs.py").write_text(GRAPHS)
    manifest = tmp_path / "padding.yaml"
    manifest.write_text(PADDING_MANIFEST)
    result = _warm(manifest)
    assert result.exit_code == 0, result.output
    warmed = json.loads(result.stdout)
    assert len(warmed["buckets"]) == 6 and warmed["summary"]["failed"] == 0, warmed["summary"]

    proc = run_py(PADDING_SERVICE.format(dir=str(tmp_path), manifest=str(manifest)), check=True)
    got, stderr = last_json(proc), proc.stderr
    before, during = got["compiles"]
    assert during == before, (got["report"], stderr[-3000:])
    functions = got["report"]["functions"]

    padded = functions["padded"]  # 5 nodes: bucket 5 is refused by pad (no room), 6 is used
    assert (padded["aot"], padded["fallback"], padded["padded"]) == (1, 0, 1), padded
    assert np.allclose(got["out"]["padded"], got["expected"]["graph"], atol=1e-5), got

    refused = functions["refused"]
    assert (refused["aot"], refused["fallback"], refused["padded"]) == (0, 2, 0), refused
    for answer in got["out"]["refused"]:
        assert np.allclose(answer, got["expected"]["graph"], atol=1e-5), got
    said = [line for line in stderr.splitlines() if "not zero-padded" in line]
    assert len(said) == 1, stderr  # one warning, not one per call
    assert (
        "refused: argument 1's integer leaves n_node (int32), receivers (int32), senders (int32) "
        "are not zero-padded" in said[0]
    ), said
    assert "pad_fn: module:fn" in said[0] and "n_edge=..., n_graph=..., n_node=..." in said[0]
    assert "leaf_pad: {n_node: VALUE, receivers: VALUE, senders: VALUE}" in said[0], said

    sample = functions["sample"]
    assert (sample["aot"], sample["fallback"], sample["padded"]) == (1, 0, 1), sample
    assert np.allclose(got["out"]["sample"][0], got["expected"]["sample"][0], atol=1e-5)
    assert got["out"]["sample"][1:] == got["expected"]["sample"][1:]  # the keys cut back too
    assert len(got["out"]["sample"][3]) == 3


UNDECLARED = """
version: 1
target: {backend: cpu}
functions:
  - fn: graphs:predict
    args:
      - {pytree: graphs:param_specs}
      - {pytree: graphs:graph_specs}
    buckets: {n_node: [8], n_edge: [8], n_graph: [4]}
"""

UNDECLARED_SERVICE = """
import json, sys
sys.path.insert(0, {dir!r})
import jax, numpy as np
import cachectl, graphs
rt = cachectl.serving({manifest!r})
params, graph = graphs.params(), graphs.graph()
got = [np.asarray(rt["predict"](params, graph)).tolist() for _ in range(2)]
want = np.asarray(jax.jit(graphs.predict)(params, graph)).tolist()
print(json.dumps([got, want, rt.report().to_dict()["functions"]["predict"]]))
"""

# A Brax/MJX-like environment state without leaf_axes, beside an action array that carries the
# bucket axis: a call for 5 environments picks bucket 8 by the actions, and the state's leaves
# (5 rows) are not the executable's (8 rows).
UNDECLARED_STATE_MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: undeclared_envs:env_step
    args:
      - {pytree: undeclared_envs:state_specs}
      - {shape: [n, 3], dtype: float32}
    buckets: {n: [1, 8, 32]}
"""

UNDECLARED_STATE_MODULE = """
import jax, jax.numpy as jnp

def state_specs(n):
    return {"pipeline_state": {"q": jax.ShapeDtypeStruct((n, 3), jnp.float32),
                               "time": jax.ShapeDtypeStruct((n,), jnp.float32)}}

def env_step(state, action):
    ps = state["pipeline_state"]
    return {"pipeline_state": {"q": ps["q"] + action, "time": ps["time"] + 1.0}}
"""

UNDECLARED_STATE_SERVICE = """
import json, sys, warnings
sys.path.insert(0, {dir!r})
import jax, numpy as np
import cachectl, undeclared_envs as envs
rt = cachectl.serving({manifest!r})
n = 5
state = {{"pipeline_state": {{"q": np.ones((n, 3), np.float32), "time": np.zeros((n,), np.float32)}}}}
action = np.full((n, 3), 0.5, np.float32)
got = [jax.tree_util.tree_map(lambda a: np.asarray(a).tolist(), rt["env_step"](state, action)) for _ in range(2)]
want = jax.tree_util.tree_map(lambda a: np.asarray(a).tolist(), jax.jit(envs.env_step)(state, action))
print(json.dumps([got, want, rt.report().to_dict()["functions"]["env_step"]]))
"""


def test_an_undeclared_pytree_is_named_by_the_argument_and_leaf_that_differ(
    tmp_path: Path,
) -> None:
    """Two pytree arguments without leaf_axes (the params, then the graph): the warning at start
    names both, and a call refused names the graph's leaf that differs, with a leaf_axes entry
    by its path and the bucket axis its compiled size matches (not the params, not {0: AXIS})."""
    (tmp_path / "graphs.py").write_text(GRAPHS)
    manifest = tmp_path / "undeclared.yaml"
    manifest.write_text(UNDECLARED)
    assert _warm(manifest).exit_code == 0
    proc = run_py(UNDECLARED_SERVICE.format(dir=str(tmp_path), manifest=str(manifest)), check=True)
    said = [line for line in proc.stderr.splitlines() if "shapes no array argument" in line]
    assert len(said) == 1 and "pytree argument 0 and pytree argument 1 declare no" in said[0]
    said = [line for line in proc.stderr.splitlines() if "serving through jax.jit" in line]
    assert len(said) == 1, proc.stderr  # one warning, not one per call
    assert (
        "argument 1's leaf n_node is int32[2], compiled as int32[4]; declare its bucket "
        "dimensions (leaf_axes: {n_node: {0: n_graph}})" in said[0]
    ), said
    got, want, counts = last_json(proc)
    assert got == [want, want], (got, want)  # the call at its own shapes, never a raise
    assert (counts["aot"], counts["fallback"], counts["out_of_bucket"]) == (0, 2, 0), counts


def test_a_pytree_state_without_leaf_axes_between_buckets_goes_through_jit_with_one_warning(
    tmp_path: Path,
) -> None:
    """Brax/MJX's case: 5 environments, buckets 1/8/32, the state declares no leaf_axes. The
    actions pick bucket 8, the state's leaves are 5 rows: JAX's own TypeError ('compiled with
    float32[8] and called with float32[5]') was raised to the service; now the call is answered
    by jit, equal to plain jit, with one warning naming the argument, the leaf and leaf_axes."""
    (tmp_path / "undeclared_envs.py").write_text(UNDECLARED_STATE_MODULE)
    manifest = tmp_path / "state.yaml"
    manifest.write_text(UNDECLARED_STATE_MANIFEST)
    assert _warm(manifest).exit_code == 0
    proc = run_py(
        UNDECLARED_STATE_SERVICE.format(dir=str(tmp_path), manifest=str(manifest)), check=True
    )
    got, want, counts = last_json(proc)
    assert got == [want, want], (got, want)
    assert (counts["fallback"], counts["out_of_bucket"]) == (2, 0), counts
    said = [line for line in proc.stderr.splitlines() if "serving through jax.jit" in line]
    assert len(said) == 1, proc.stderr
    assert (
        "argument 0's leaf pipeline_state.q is float32[5, 3], compiled as float32[8, 3]" in said[0]
    )
    assert "leaf_axes: {pipeline_state.q: {0: n}}" in said[0], said
