"""Field: the field suite's Brax/MJX and Flax NNX services, (a)-(d) side by side in one run.

The services are the field suite's cases (tests/support/field_cases.py: their module and
manifest, read from there). Every bucket of the manifest is called once on zeros of its exact shape, in
fresh processes that alternate round by round:

  (a) plain ``jax.jit``, no cache: every bucket compiles;
  (b) ``cachectl.activate()`` + ``jax.jit``: every bucket hits the persistent cache;
  (c) ``cachectl.serving`` (preload), and (c+w) the same with ``warmup=True``;
  (d) the hand-rolled floor: at warm time ``jax.jit(fn).lower(*specs).compile()`` and
      ``jax.experimental.serialize_executable.serialize`` per bucket, written to files; the
      service reads them, ``deserialize_and_load`` in a 2-thread pool, then the first calls
      (after ``jax._src.lax.linalg.initialize_lapack()``: without it the first call of an
      executable that uses LAPACK, as MJX's does, segfaults in a process that never lowered;
      cachectl.core.jax_seam does the same for stored executables).

*Overhead*, the measure the goals are stated in (bench/serving.py's): the first calls of
every bucket minus the same calls again, plus for (c) and (d) finding, checking and loading
the executables (and for (c+w) its warm-up calls). *Ready*: process start to every bucket's
first result. Per bucket, the first request's latency against the median of the next ones
(steady state), with and without ``warmup=True``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, machine_line, stats, write_section

SECTION = "## Field"
CASES = ("brax-mjx", "flax-nnx")
STEADY_CALLS = 5

# Once per case, after `cachectl warm`: the zeros every bucket is called on (pickled, numpy
# leaves) and (d)'s serialized executables, compiled here with the persistent cache off.
PREPARE = r"""
import json, pickle, sys
sys.path.insert(0, {dir!r})
import numpy as np
import jax
from jax.experimental.serialize_executable import serialize
from cachectl.manifest import build_call, expand, jit_function, load_manifest
manifest = load_manifest({manifest!r})
specs = {{s.name: s for s in manifest.functions}}
calls, floor = [], []
for bucket in expand(manifest):
    spec = specs[bucket.function]
    args, kwargs = build_call(spec, bucket, [{dir!r}])
    zeros = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), args)
    label = ",".join(f"{{k}}={{v}}" for k, v in bucket.values.items())
    calls.append((spec.name, spec.fn.split(":", 1)[1], label, zeros))
    compiled = jit_function(spec, [{dir!r}]).lower(*args, **kwargs).compile()
    floor.append(serialize(compiled))
with open({out!r}, "wb") as f:
    pickle.dump({{"calls": calls, "floor": floor}}, f)
print(json.dumps({{"buckets": len(calls)}}))
"""

SERVICE = r"""
import time
t0 = time.perf_counter()
import json, pickle, statistics, sys
sys.path.insert(0, {dir!r})
import numpy as np
import jax
mode = {mode!r}
with open({prepared!r}, "rb") as f:
    prepared = pickle.load(f)
calls = prepared["calls"]
load = loads = 0.0
if mode == "activate":
    import cachectl
    cachectl.activate(readonly=True, telemetry=False)
import case
if mode in ("serving", "serving_warmup"):
    import cachectl
    t = time.perf_counter()
    rt = cachectl.serving({manifest!r}, telemetry=False, warmup=mode == "serving_warmup")
    rt.wait_loaded()  # the loads run behind serving(): this table compares all of them
    load = time.perf_counter() - t
    loads = rt.report().loaded_seconds  # finding, checking and loading the executables alone
    fns = [rt[name] for name, _, _, _ in calls]
elif mode == "floor":
    from concurrent.futures import ThreadPoolExecutor
    from jax.experimental.serialize_executable import deserialize_and_load
    from jax._src.lax import linalg
    t = time.perf_counter()
    # A process that never lowers has LAPACK's kernels registered but not initialized:
    # calling a loaded executable that uses one (MJX's solves) segfaults without this.
    linalg.initialize_lapack()
    with ThreadPoolExecutor(2) as pool:
        fns = list(pool.map(lambda s: deserialize_and_load(*s), prepared["floor"]))
    load = loads = time.perf_counter() - t
else:
    fns = [jax.jit(getattr(case, attr)) for _, attr, _, _ in calls]
loaded = time.perf_counter() - t0
# A request's inputs arrive freshly written (decoded from the wire just before the call), so
# every timed call, first or steady, gets copies made just before it, outside the timing:
# reusing the arrays unpickled at start made each function's first call read them cold from
# memory (about 40 us more on Flax NNX's bucket 0, the same with or without warm-up).
fresh = lambda args: jax.tree_util.tree_map(np.array, args)
first = []
for fn, (_, _, _, args) in zip(fns, calls):
    args = fresh(args)
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first.append(time.perf_counter() - t)
first_all = sum(first)
ready = time.perf_counter() - t0
# Steady state as the first calls ran: every bucket in turn, {steady_calls} rounds, each bucket's median
# (a bucket called again at once finds its code and buffers in the CPU's caches; a service
# switching buckets, as the first calls did, does not).
times = [[] for _ in calls]
for _ in range({steady_calls}):
    for i, (fn, (_, _, _, args)) in enumerate(zip(fns, calls)):
        args = fresh(args)
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times[i].append(time.perf_counter() - t)
steady = [statistics.median(ts) for ts in times]
print(json.dumps({{"ready": ready, "loaded": loaded, "load": load, "loads": loads, "first": first, "steady": steady,
                  "overhead": load + first_all - sum(steady),
                  "labels": [f"{{n}}[{{l}}]" for n, _, l, _ in calls]}}))
"""

MODES = ("none", "activate", "serving", "serving_warmup", "floor")


def _cases() -> dict[str, Any]:
    """The field suite's cases, from tests/support/field_cases.py (one source for both)."""
    if str(REPO / "tests") not in sys.path:
        sys.path.insert(0, str(REPO / "tests"))
    from support.field_cases import CASES as FIELD_CASES

    return {name: FIELD_CASES[name] for name in CASES}


def _env(home: Path) -> dict[str, str]:
    """The services' environment: no CACHECTL_/JAX_ settings from outside, and Python's bytecode
    read as an installed package has it (pip compiles it at install; with
    PYTHONDONTWRITEBYTECODE=1 inherited, every process compiled cachectl's sources again,
    about 250 ms that (d), importing only installed packages, never paid)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CACHECTL_", "JAX_")) and k != "PYTHONDONTWRITEBYTECODE"
    }
    env.update(
        XDG_DATA_HOME=str(home / "data"),
        XDG_CACHE_HOME=str(home / "cache"),
        XDG_CONFIG_HOME=str(home / "config"),
        PYTHONPATH=os.pathsep.join(
            p for p in (str(home), str(REPO), os.environ.get("PYTHONPATH")) if p
        ),
    )
    return env


def _py(code: str, env: dict[str, str], cwd: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900, cwd=cwd
    )
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _one_case(case: Any, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cachectl-bench-field-") as tmp:
        home = Path(tmp)
        (home / "case.py").write_text(textwrap.dedent(case.module))
        manifest = home / "field.yaml"
        manifest.write_text(textwrap.dedent(case.manifest))
        env = _env(home)
        # What `pip install` does for a wheel: cachectl's and the case's bytecode, written once
        # before any timed process (a source checkout otherwise compiles it in the first one).
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", str(REPO / "cachectl"), str(home)],
            env=env,
            check=True,
            capture_output=True,
            timeout=600,
        )
        warm = subprocess.run(
            [sys.executable, "-m", "cachectl", "warm", str(manifest), "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
            cwd=home,
        )
        if warm.returncode != 0:
            raise RuntimeError(warm.stderr[-3000:])
        prepared = home / "prepared.pkl"
        off = {**env, "JAX_ENABLE_COMPILATION_CACHE": "false"}
        fmt = {"dir": str(home), "manifest": str(manifest), "out": str(prepared)}
        _py(PREPARE.format(**fmt), off, home)
        samples: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
        for _ in range(rounds):
            for mode in MODES:
                code = SERVICE.format(
                    dir=str(home),
                    manifest=str(manifest),
                    prepared=str(prepared),
                    mode=mode,
                    steady_calls=STEADY_CALLS,
                )
                if os.environ.get("BENCH_FIELD_KEEP"):
                    (home.parent / f"field-{mode}.py").write_text(code)
                samples[mode].append(_py(code, off if mode in ("none", "floor") else env, home))
    result: dict[str, Any] = {"labels": samples["serving"][0]["labels"]}
    for mode, rows in samples.items():
        result[mode] = {
            k: stats([r[k] for r in rows]) for k in ("ready", "loaded", "load", "loads", "overhead")
        }
        # per bucket: the first request over its steady-state latency, each round's own
        result[mode]["first_over_steady"] = [
            stats([r["first"][i] / r["steady"][i] for r in rows])
            for i in range(len(result["labels"]))
        ]
        result[mode]["first_ms"] = [
            stats([r["first"][i] * 1000 for r in rows]) for i in range(len(result["labels"]))
        ]
        result[mode]["steady_ms"] = [
            stats([r["steady"][i] * 1000 for r in rows]) for i in range(len(result["labels"]))
        ]
    for a, b in (("none", "serving"), ("activate", "serving"), ("serving", "floor")):
        pairs = list(zip(samples[a], samples[b], strict=True))
        result[f"{a}/{b}"] = {
            k: stats([x[k] / y[k] for x, y in pairs]) for k in ("overhead", "ready", "loaded")
        }
    return result


def run(quick: bool = False) -> dict[str, Any]:
    rounds = 2 if quick else 3
    cases = _cases()
    return {"rounds": rounds, **{name: _one_case(case, rounds) for name, case in cases.items()}}


def _ms(s: dict[str, float]) -> str:
    return f"{s['median'] * 1000:.0f} ms ({s['min'] * 1000:.0f}–{s['max'] * 1000:.0f})"


def _x(s: dict[str, float]) -> str:
    return f"{s['median']:.2f}x ({s['min']:.2f}–{s['max']:.2f})"


LABELS = {
    "none": "(a) no cache, `jax.jit`",
    "activate": "(b) `activate()` + `jax.jit`",
    "serving": "(c) `cachectl.serving`",
    "serving_warmup": "(c+w) `cachectl.serving(warmup=True)`",
    "floor": "(d) `serialize` / `deserialize_and_load`, 2 threads",
}


def markdown(r: dict[str, Any]) -> str:
    lines = [
        SECTION,
        "",
        f"`python -m bench --only field`. {machine_line()} Fresh processes, {r['rounds']} rounds, "
        "the five kinds alternating; every bucket of the field suite's Brax/MJX and Flax NNX "
        "manifests (tests/support/field_cases.py) called once on zeros of its shape, in turn, "
        f"then {STEADY_CALLS} rounds more of the same calls in the same order (steady state: each "
        "bucket's median; rounds, not one bucket's calls back to back, so that a steady call "
        "follows another bucket's as a first call does). Every timed call gets fresh copies of "
        "its inputs, made just before it and not timed, as a request's arrive freshly decoded "
        "(until this stop the same arrays were reused: each function's first call then read "
        "them cold from memory, about 40 us more on the Flax NNX case, with or without "
        "warm-up). *Overhead*: first calls minus "
        "steady-state calls, plus for (c) building the runtime (activate, find, check and load "
        "the executables; with `warmup=True` also its warm-up calls on zeros) and for (d) the "
        "pool's loads. *Setup*: `cachectl.serving(...)` for (c) (importing cachectl's serving "
        "modules, reading the manifest, activate, then the executables), the pool for (d); *loading executables*: for (c) the "
        "runtime's own `ready_seconds` (find, check, load), for (d) the pool. *Loaded*: process "
        "start (before `import jax`) to the runtime built (for (c+w) warmed up too), or (d)'s "
        "pool done. *Ready*: process start to every bucket's first result, imports of the "
        "libraries and the input copies included. *(d) steady*: the floor's steady call, its "
        "executable called directly; (c+w)'s steady call over it is cachectl's dispatch (pick "
        "the bucket, pad, convert; a pytree with `leaf_axes` flattened once per call).",
        "",
    ]
    goals = []
    for name in CASES:
        c = r[name]
        lines += [
            f"**{name}** ({len(c['labels'])} buckets: {', '.join(c['labels'])})",
            "",
            "| service | loaded | ready | overhead | of which setup | of which loading executables |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for mode in MODES:
            s = c[mode]
            loaded = _ms(s["loaded"]) if mode in ("serving", "serving_warmup", "floor") else "–"
            lines.append(
                f"| {LABELS[mode]} | {loaded} | {_ms(s['ready'])} | {_ms(s['overhead'])} | "
                f"{_ms(s['load'])} | {_ms(s['loads'])} |"
            )
        lines += [
            "",
            "| bucket | (c) first / steady | (c+w) first / steady | (c+w) first | steady | "
            "(d) steady |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for i, label in enumerate(c["labels"]):
            lines.append(
                f"| {label} | {_x(c['serving']['first_over_steady'][i])} | "
                f"{_x(c['serving_warmup']['first_over_steady'][i])} | "
                f"{c['serving_warmup']['first_ms'][i]['median']:.2f} ms | "
                f"{c['serving_warmup']['steady_ms'][i]['median']:.2f} ms | "
                f"{c['floor']['steady_ms'][i]['median']:.2f} ms |"
            )
        lines += [
            "",
            f"Overhead (a)/(c) **{_x(c['none/serving']['overhead'])}**, (b)/(c) "
            f"{_x(c['activate/serving']['overhead'])}, (c)/(d) **{_x(c['serving/floor']['overhead'])}**; "
            f"ready (a)/(c) {_x(c['none/serving']['ready'])}, (c)/(d) {_x(c['serving/floor']['ready'])}; "
            f"loaded (c)/(d) **{_x(c['serving/floor']['loaded'])}**. "
            f"Readiness with `warmup=True`: {_ms(c['serving_warmup']['load'])} to build the runtime "
            f"against {_ms(c['serving']['load'])} without.",
            "",
        ]
        worst = max(s["median"] for s in c["serving_warmup"]["first_over_steady"])
        if name == "brax-mjx":
            got = c["none/serving"]["overhead"]["median"]
            goals.append(
                f"- (a)/(c) ≥ 15x on Brax/MJX: {got:.1f}x, **{'met' if got >= 15 else 'not met'}**."
            )
        loaded = c["serving/floor"]["loaded"]["median"]
        goals.append(
            f"- {name} ({len(c['labels'])} buckets), loaded (process start to every bucket loaded) "
            f"within 1.15x of (d): {loaded:.2f}x, **{'met' if loaded <= 1.15 else 'not met'}**."
        )
        if name == "flax-nnx":
            got = c["serving/floor"]["overhead"]["median"]
            goals.append(
                f"- (c) within 1.1x of (d) on the Flax NNX decoder: (c)/(d) {got:.2f}x, "
                f"**{'met' if got <= 1.1 else 'not met'}**."
            )
        goals.append(
            f"- {name}, `warmup=True`: the first request of every bucket within 1.2x of its "
            f"steady state: worst bucket {worst:.2f}x, **{'met' if worst <= 1.2 else 'not met'}**."
        )
    lines += [
        "Seen on the way:",
        "",
        "- (d) as written first segfaulted at the first call of a Brax/MJX executable: a "
        "process that never lowers has LAPACK's kernels registered but not initialized (MJX "
        "solves with them). It now calls `jax._src.lax.linalg.initialize_lapack()` first, as "
        "cachectl.core.jax_seam does before loading a stored executable.",
        "- Brax's built-in `inverted_pendulum` (brax 0.14.2, backend mjx) returns `reward`, "
        "`done` and `info['time_out']` not weakly typed from `reset` and weakly typed from "
        "`step`, so `jax.jit(step)` compiles twice, once per State (its `_cache_size()` is 2 "
        "after reset, step, step). The field case's env makes them arrays in both.",
        "- (c)'s setup over its executables' own loading is importing cachectl's serving modules, "
        "reading the manifest and `activate()` (neither SQLAlchemy nor pydantic: a valid manifest "
        "is built without pydantic, `manifest/schema.py` `build`); (d) does none of it.",
        "",
        "Goals:",
        "",
        *goals,
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    out = run(quick="--quick" in sys.argv)
    text = markdown(out)
    print(text)
    if "--json" in sys.argv:
        print(json.dumps(out))
    if "--no-write" not in sys.argv:
        write_section(SECTION, text)
