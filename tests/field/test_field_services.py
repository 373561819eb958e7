"""The field suite: services built on real JAX libraries from the package index, each in fresh processes.

Per case: (a) no cache, (b) plain ``cachectl.activate()`` after the warm, (c) ``cachectl.serving``
where a manifest can name the program (a library's private jit is warmed with ``cachectl
warm-run`` instead). What is checked is what JAX itself counted in the same process
(``/jax/compilation_cache/*`` events, ``/jax/core/compile/*`` durations): no crash, zero compiles
in (c) and a hit for every program in (b), outputs equal to ``jax.jit``'s on the same padded
inputs, ``warm-check`` at 100% (for a warm-run, ``warm-check --replay`` of its command: every
compile request a hit), and ``cachectl misses`` naming nothing. The libraries are the ``field``
extra (scripts/test installs it). Wall times of (a)-(c) are printed for BENCHMARKS.md's "Field" section, never asserted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.infra import run_cachectl, run_py  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# JAX's own counters in a service process: compile requests that used the persistent cache,
# its hits, and the tracing / XLA compile durations (one event per traced or compiled program).
PROBE = """
import json, sys, time
t0 = time.perf_counter()
counts = dict(requests=0, hits=0, traces=0, compiles=0)
def _event(event, **kw):
    if event == "/jax/compilation_cache/compile_requests_use_cache":
        counts["requests"] += 1
    elif event == "/jax/compilation_cache/cache_hits":
        counts["hits"] += 1
def _duration(event, duration, **kw):
    if event == "/jax/core/compile/jaxpr_trace_duration":
        counts["traces"] += 1
    elif event == "/jax/core/compile/backend_compile_duration":
        counts["compiles"] += 1
import jax
jax.monitoring.register_event_listener(_event)
jax.monitoring.register_event_duration_secs_listener(_duration)
sys.path.insert(0, {dir!r})
"""

# (c): every call of the case through cachectl.serving; then jax.jit on the padded inputs.
SERVING = (
    PROBE
    + """
import numpy as np
import cachectl
rt = cachectl.serving({manifest!r})
import case
calls = case.calls()
start = dict(counts)
t1 = time.perf_counter()
served = [rt[name](*args) for name, args, _ in calls]
jax.block_until_ready(served)
first_calls = time.perf_counter() - t1
during = dict(counts)
flat = lambda tree: [np.asarray(leaf).tolist() for leaf in jax.tree_util.tree_leaves(tree)]
# the manifest's jit options where the case has them (donation), or the case's own jitted
# function (in and out shardings): the same program as warm's
jitted = lambda fn: fn if hasattr(fn, "lower") else jax.jit(fn, **getattr(case, "JIT", {{}}))
expected = [jitted(getattr(case, name))(*padded) for name, _, padded in calls]
close = all(
    all(np.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(flat(s), flat(e), strict=True))
    for s, e in zip(served, expected, strict=True)
)
# each output leaf's dtype and sharding as plain jit's (a mesh's NamedSharding, x64's float64)
placed = lambda tree: [(str(leaf.dtype), leaf.sharding, leaf.ndim)
                       for leaf in jax.tree_util.tree_leaves(tree)]
unlike = [(name, str(s), str(e))
          for (name, _, _), sv, ev in zip(calls, served, expected, strict=True)
          for s, e in zip(placed(sv), placed(ev), strict=True)
          if s[0] != e[0] or not s[1].is_equivalent_to(e[1], e[2])]
report = rt.report().to_dict()
print(json.dumps(dict(start=start, during=during, close=close, unlike=unlike, report=report,
                      ready_s=report["ready_seconds"], first_calls_s=first_calls,
                      wall_s=time.perf_counter() - t0)))
"""
)

# (a) and (b): the case's own calls through jax.jit, with no cache or under activate().
PLAIN = (
    PROBE
    + """
import numpy as np
if {activate}:
    import cachectl
    cachectl.activate(readonly=True)
import case
out = case.run()
jax.block_until_ready(out)
print(json.dumps(dict(counts=counts, calls=len(out), wall_s=time.perf_counter() - t0)))
"""
)


from support.field_cases import CASES, REQUIRES  # noqa: E402
from support.field_cases_models import MODEL_CASES, MODEL_REQUIRES  # noqa: E402

CASES = {**CASES, **MODEL_CASES}
REQUIRES = {**REQUIRES, **MODEL_REQUIRES}


def _cachectl(
    cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    # The case's directory first, then this checkout's own path (not another one installed)
    path = os.pathsep.join(p for p in (str(cwd), os.environ.get("PYTHONPATH")) if p)
    return run_cachectl(
        cwd, *args, env={"PYTHONPATH": path, "KERAS_BACKEND": "jax", **(env or {})}
    )


def _run(code: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = run_py(code, {"KERAS_BACKEND": "jax", **(env or {})}, timeout=600, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])  # a crash failed above


@pytest.mark.parametrize("name", sorted(CASES))
def test_field_service(tmp_path: Path, name: str) -> None:
    if name in REQUIRES and importlib.util.find_spec(REQUIRES[name]) is None:
        pytest.skip(
            f"{REQUIRES[name]} is not installed: the field extra, pip install -e '.[field]'"
        )
    case = CASES[name]
    (tmp_path / "case.py").write_text(textwrap.dedent(case.module))
    plain = PLAIN.format(dir=str(tmp_path), activate=False)
    cold = _run(plain, case.env)  # (a): no cache at all
    assert cold["counts"]["compiles"] > 0

    if case.manifest is not None:
        manifest = tmp_path / "field.yaml"
        manifest.write_text(textwrap.dedent(case.manifest))
        warm = _cachectl(tmp_path, "warm", str(manifest), "--json", env=case.env)
        assert warm.returncode == 0, warm.stderr
        report = json.loads(warm.stdout)
        assert report["summary"]["failed"] == 0
        aot_errors = {b["aot_error"] for b in report["buckets"]}
        if case.not_stored is None:
            assert aot_errors == {None}, aot_errors
        else:
            assert all(case.not_stored in (e or "") for e in aot_errors), aot_errors
        check = _cachectl(tmp_path, "warm-check", str(manifest), env=case.env)
        assert "coverage: " in check.stdout and "buckets hit (100.0%)" in check.stdout, (
            check.stdout + check.stderr
        )
        assert check.returncode == 0, check.stderr  # what is not stored is no failed call
        if case.not_stored is None:
            calls = len(report["buckets"])
            assert f"stored executables: {calls}/{calls} load and run (100.0%)" in check.stdout
    if case.warmup is not None:
        (tmp_path / "warmup.py").write_text(case.warmup)
        warm = _cachectl(
            tmp_path, "warm-run", "--json", "--", sys.executable, "warmup.py", env=case.env
        )
        assert warm.returncode == 0, warm.stderr
        assert json.loads(warm.stdout)["exit_code"] == 0

    # Every program the warm wrote (eager ones a library ran while tracing included) is indexed.
    verified = _cachectl(tmp_path, "verify", env=case.env)
    assert verified.returncode == 0 and "no problems" in verified.stdout, (
        verified.stdout + verified.stderr
    )

    activated = _run(PLAIN.format(dir=str(tmp_path), activate=True), case.env)  # (b)
    counts = activated["counts"]
    if case.warmup is not None:  # warm-run wrote every program its run compiled, eager ones too
        # (a backend_compile_duration event fires around a persistent-cache hit too: the hit
        # count against the requests is JAX's own word on what compiled)
        assert counts["requests"] > 0 and counts["hits"] == counts["requests"], counts
    else:  # warm wrote the manifest's programs: each call of one hits
        assert counts["hits"] >= activated["calls"] > 0, counts

    if case.manifest is None:  # warm-check replays the warm-run's command read-only: all hits
        replay = _cachectl(tmp_path, "warm-check", "--replay", "--json", env=case.env)
        assert replay.returncode == 0, replay.stdout + replay.stderr
        replayed = json.loads(replay.stdout)
        assert replayed["exit_code"] == 0 and replayed["processes"] == 1, replayed
        assert replayed["requests"] == replayed["hits"] > 0, replayed

    timings = {"a_no_cache_s": cold["wall_s"], "b_activate_s": activated["wall_s"]}
    if case.manifest is not None:  # (c)
        served = _run(
            SERVING.format(dir=str(tmp_path), manifest=str(tmp_path / "field.yaml")), case.env
        )
        assert served["close"] and served["unlike"] == [], served
        if case.not_stored is None:
            traced = served["during"]["traces"] - served["start"]["traces"]
            calls = sum(rep["calls"] for rep in served["report"]["functions"].values())
            assert traced <= (calls if case.traced_at_first_call else 0), served
            assert served["during"]["compiles"] == served["start"]["compiles"], served
            for fn, rep in served["report"]["functions"].items():
                assert rep["fallback"] == 0 and rep["aot"] == rep["calls"] > 0, (
                    fn,
                    rep,
                )
        else:  # through jax.jit: traced, and its program read from the persistent cache
            assert served["during"]["hits"] - served["start"]["hits"] >= 1, served
            assert served["during"]["requests"] - served["start"]["requests"] == (
                served["during"]["hits"] - served["start"]["hits"]
            ), served
        timings |= {"c_serving_s": served["wall_s"], "c_ready_s": served["ready_s"]}

    # What (b) and (c) recorded (telemetry is on under activate() and serving): nothing missed.
    missed = _cachectl(tmp_path, "misses", "--json", env=case.env)
    assert missed.returncode == 0, missed.stdout + missed.stderr
    seen = json.loads(missed.stdout)
    assert seen["requests"] > 0, seen  # the services' signatures were recorded at all
    assert seen["misses"] == 0 and seen["missed"] == [] and seen["findings"] == [], seen
    print(json.dumps({"case": name, **{k: round(v, 3) for k, v in timings.items()}}))


REFUSED_MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: case:predict
    args:
      - {pytree: case:param_specs}
      - pytree: case:graph_specs
        leaf_axes: {nodes: {0: n_node}, edges: {0: n_edge}, senders: {0: n_edge},
                    receivers: {0: n_edge}, globals: {0: n_graph}, n_node: {0: n_graph},
                    n_edge: {0: n_graph}}
    buckets: {n_node: [16], n_edge: [32], n_graph: [3]}
"""

REFUSED_SERVICE = """
import json, sys
sys.path.insert(0, {dir!r})
import numpy as np
import jax, jraph
import cachectl
import case
rt = cachectl.serving({manifest!r})
g = case.batch((3, 4), 0)
compiles = [0]
jax.monitoring.register_event_duration_secs_listener(
    lambda e, d, **kw: compiles.__setitem__(0, compiles[0] + (e == "/jax/core/compile/backend_compile_duration")))
served = [np.asarray(rt["predict"](case.PARAMS, g)).tolist() for _ in range(3)]
compiled = compiles[0]
right = np.asarray(jax.jit(case.predict)(case.PARAMS, g)).tolist()
# what zero-filling every leaf to the bucket computes (before: served, with no warning)
zeros = jax.tree_util.tree_map(
    lambda x, n: np.concatenate([x, np.zeros((n - len(x),) + x.shape[1:], x.dtype)]),
    g, jraph.GraphsTuple(nodes=16, edges=32, senders=32, receivers=32, globals=3, n_node=3, n_edge=3))
zero_filled = np.asarray(jax.jit(case.predict)(case.PARAMS, zeros)).tolist()[:2]
print(json.dumps(dict(served=served, right=right, zero_filled=zero_filled, compiled=compiled,
                      report=rt.report().to_dict())))
"""


def test_field_jraph_zero_fill_is_refused_with_one_warning(tmp_path: Path) -> None:
    """A GraphsTuple declared by leaf_axes alone: its senders/receivers (and graph sizes) are
    integer leaves that index others, which zeros would attach to node 0 of graph 0 (a wrong
    answer). Serving refuses to pad them: jax.jit at the call's own shapes, the right answer,
    one warning that names those leaves and the fix (pad_fn: jraph:pad_with_graphs)."""
    if importlib.util.find_spec("jraph") is None:
        pytest.skip("jraph is not installed: the field extra, pip install -e '.[field]'")
    (tmp_path / "case.py").write_text(textwrap.dedent(CASES["jraph"].module))
    manifest = tmp_path / "refused.yaml"
    manifest.write_text(textwrap.dedent(REFUSED_MANIFEST))
    warm = _cachectl(tmp_path, "warm", str(manifest), "--json")
    assert warm.returncode == 0, warm.stderr
    proc = run_py(
        REFUSED_SERVICE.format(dir=str(tmp_path), manifest=str(manifest)), timeout=600, check=True
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for answer in out["served"]:
        assert np.allclose(answer, out["right"], rtol=1e-5, atol=1e-5), out
    assert not np.allclose(out["zero_filled"], out["right"], rtol=1e-3, atol=1e-3), out
    rep = out["report"]["functions"]["predict"]
    assert (rep["calls"], rep["aot"], rep["fallback"], rep["padded"]) == (3, 0, 3, 0), rep
    assert out["compiled"] == 1, out  # JAX's own count: jax.jit at the call's shapes, once
    said = [line for line in proc.stderr.splitlines() if "not zero-padded" in line]
    assert len(said) == 1, proc.stderr
    assert (
        "argument 1's integer leaves receivers (int64), senders (int64), n_node (int32), "
        "n_edge (int32) are not zero-padded" in said[0]  # batch_np's offsets: int64
    ), said[0]
    assert "jraph:pad_with_graphs" in said[0] and "n_edge=..., n_graph=..., n_node=..." in said[0]
