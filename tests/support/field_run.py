"""How the field suite serves a case: services built on real JAX libraries, each in fresh processes.

Per case: (a) no cache, (b) plain ``cachectl.activate()`` after the warm, (c) ``cachectl.serving``
where a manifest can name the program (a library's private jit is warmed with ``cachectl
warm-run`` instead). What is checked is what JAX itself counted in the same process
(``/jax/compilation_cache/*`` events, ``/jax/core/compile/*`` durations): no crash, zero compiles
in (c) and a hit for every program in (b), outputs equal to ``jax.jit``'s on the same padded
inputs, ``warm-check`` at 100% (for a warm-run, ``warm-check --replay`` of its command: every
compile request a hit), and ``cachectl misses`` naming nothing. The libraries are the ``field``
extra (scripts/test installs it). Wall times of (a)-(c) are printed for BENCHMARKS.md's "Field" section, never asserted.
A case's ``env`` is set in each of its processes; outputs' dtypes and shardings are plain jit's.

Used by tests/field/test_field_services.py (the library cases) and test_field_models.py.
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

import pytest

from support.field_cases import Case
from support.infra import run_cachectl, run_py

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


def field_cachectl(
    cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    # The case's directory first, then this checkout's own path (not another one installed)
    path = os.pathsep.join(p for p in (str(cwd), os.environ.get("PYTHONPATH")) if p)
    return run_cachectl(cwd, *args, env={"PYTHONPATH": path, "KERAS_BACKEND": "jax", **(env or {})})


def field_run(code: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = run_py(code, {"KERAS_BACKEND": "jax", **(env or {})}, timeout=600, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])  # a crash failed above


def check_case(tmp_path: Path, name: str, case: Case, requires: str | None = None) -> None:
    """Serve one case as (a), (b) and (c), each in a fresh process, and check what JAX counted."""
    if requires is not None and importlib.util.find_spec(requires) is None:
        pytest.skip(f"{requires} is not installed: the field extra, pip install -e '.[field]'")
    (tmp_path / "case.py").write_text(textwrap.dedent(case.module))
    plain = PLAIN.format(dir=str(tmp_path), activate=False)
    cold = field_run(plain, case.env)  # (a): no cache at all
    assert cold["counts"]["compiles"] > 0

    if case.manifest is not None:
        manifest = tmp_path / "field.yaml"
        manifest.write_text(textwrap.dedent(case.manifest))
        warm = field_cachectl(tmp_path, "warm", str(manifest), "--json", env=case.env)
        assert warm.returncode == 0, warm.stderr
        report = json.loads(warm.stdout)
        assert report["summary"]["failed"] == 0
        aot_errors = {b["aot_error"] for b in report["buckets"]}
        if case.not_stored is None:
            assert aot_errors == {None}, aot_errors
        else:
            assert all(case.not_stored in (e or "") for e in aot_errors), aot_errors
        check = field_cachectl(tmp_path, "warm-check", str(manifest), env=case.env)
        assert "coverage: " in check.stdout and "buckets hit (100.0%)" in check.stdout, (
            check.stdout + check.stderr
        )
        assert check.returncode == 0, check.stderr  # what is not stored is no failed call
        if case.not_stored is None:
            calls = len(report["buckets"])
            assert f"stored executables: {calls}/{calls} load and run (100.0%)" in check.stdout
    if case.warmup is not None:
        (tmp_path / "warmup.py").write_text(case.warmup)
        warm = field_cachectl(
            tmp_path, "warm-run", "--json", "--", sys.executable, "warmup.py", env=case.env
        )
        assert warm.returncode == 0, warm.stderr
        assert json.loads(warm.stdout)["exit_code"] == 0

    # Every program the warm wrote (eager ones a library ran while tracing included) is indexed.
    verified = field_cachectl(tmp_path, "verify", env=case.env)
    assert verified.returncode == 0 and "no problems" in verified.stdout, (
        verified.stdout + verified.stderr
    )

    activated = field_run(PLAIN.format(dir=str(tmp_path), activate=True), case.env)  # (b)
    counts = activated["counts"]
    if case.warmup is not None:  # warm-run wrote every program its run compiled, eager ones too
        # (a backend_compile_duration event fires around a persistent-cache hit too: the hit
        # count against the requests is JAX's own word on what compiled)
        assert counts["requests"] > 0 and counts["hits"] == counts["requests"], counts
    else:  # warm wrote the manifest's programs: each call of one hits
        assert counts["hits"] >= activated["calls"] > 0, counts

    if case.manifest is None:  # warm-check replays the warm-run's command read-only: all hits
        replay = field_cachectl(tmp_path, "warm-check", "--replay", "--json", env=case.env)
        assert replay.returncode == 0, replay.stdout + replay.stderr
        replayed = json.loads(replay.stdout)
        assert replayed["exit_code"] == 0 and replayed["processes"] == 1, replayed
        assert replayed["requests"] == replayed["hits"] > 0, replayed

    timings = {"a_no_cache_s": cold["wall_s"], "b_activate_s": activated["wall_s"]}
    if case.manifest is not None:  # (c)
        served = field_run(
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
    missed = field_cachectl(tmp_path, "misses", "--json", env=case.env)
    assert missed.returncode == 0, missed.stdout + missed.stderr
    seen = json.loads(missed.stdout)
    assert seen["requests"] > 0, seen  # the services' signatures were recorded at all
    assert seen["misses"] == 0 and seen["missed"] == [] and seen["findings"] == [], seen
    print(json.dumps({"case": name, **{k: round(v, 3) for k, v in timings.items()}}))
