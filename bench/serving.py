"""Serving: how long a fresh service takes until every bucket of the example LM has answered.

Three kinds of fresh process, alternating in one run, each timing from process
start (``time.perf_counter`` at the top of the script, before ``import jax``)
until every bucket of examples/manifest.yaml has returned its first result:

  (a) plain ``jax.jit``, no cache: every bucket compiles;
  (b) ``cachectl.activate()`` + ``jax.jit``: every bucket hits the persistent cache;
  (c) ``cachectl.serving``: every bucket dispatches to its stored executable.

"Overhead" is the first-call time of all buckets minus their steady-state time
(the same calls again), plus, for (c), constructing the runtime (loading the
executables). Also measured in one process: the runtime's per-call dispatch
cost (pick a bucket, pad, convert) against calling the loaded executable
directly, and readiness with ``preload=True`` (parallel loads) vs ``False``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, compile_bytecode, machine, machine_line, stats, write_section

SECTION = "## Serving"
MANIFEST = REPO / "examples" / "manifest.yaml"

# Once, after `cachectl warm`, for (d): every bucket compiled with the persistent cache off and
# serialized with jax.experimental.serialize_executable, keyed by function and bucket values.
PREPARE = r"""
import json, pickle, sys
sys.path.insert(0, {repo!r})
from jax.experimental.serialize_executable import serialize
from cachectl.manifest import build_call, expand, jit_function, load_manifest
manifest = load_manifest({manifest!r})
specs = {{s.name: s for s in manifest.functions}}
floor = []
for bucket in expand(manifest):
    spec = specs[bucket.function]
    args, kwargs = build_call(spec, bucket, [{repo!r}])
    compiled = jit_function(spec, [{repo!r}]).lower(*args, **kwargs).compile()
    floor.append(((spec.name, tuple(bucket.values.values())), serialize(compiled)))
with open({out!r}, "wb") as f:
    pickle.dump(floor, f)
print(json.dumps({{"buckets": len(floor)}}))
"""

SERVICE = r"""
import time
t0 = time.perf_counter()
import json, sys
sys.path.insert(0, {repo!r})
import numpy as np
import jax
mode = {mode!r}
from examples import lm
build = load = 0.0
loaded = None
if mode == "activate":
    t_build = time.perf_counter()
    import cachectl
    cachectl.activate(readonly=True, telemetry=False)
    build = time.perf_counter() - t_build
buckets_prefill = [(b, s) for b in (1, 4, 8) for s in (32, 64, 128) if (b, s) != (8, 128)]
buckets_decode = [1, 4, 8]
def run_all(prefill, decode, params):
    for b, s in buckets_prefill:
        np.asarray(prefill(params, np.zeros((b, s), np.int32))[0])
    for b in buckets_decode:
        kv = np.zeros(lm.kv_cache_shape(b), lm.KV_DTYPE)
        np.asarray(decode(params, kv, np.zeros((b, 1), np.int32), np.int32(3), np.zeros(2, np.uint32),
                          sampling="greedy")[0])
if mode == "serving":
    import cachectl
    t_build = time.perf_counter()
    rt = cachectl.serving({manifest!r}, telemetry=False, preload={preload!r})
    rt.wait_loaded()  # the loads run behind serving(): what this table compares is all of them
    build = time.perf_counter() - t_build
    loaded = time.perf_counter() - t0
    report = rt.report()
    # finding, checking and loading the executables
    load = report.loaded_seconds if report.loaded_seconds is not None else report.ready_seconds
    prefill, decode = rt["prefill"], rt["decode_step"]
elif mode == "floor":
    # What a team writes by hand: read the serialized executables, load them in the pool
    # cachectl.serving uses (min(8, buckets) threads), dispatch on the shape.
    import pickle
    from concurrent.futures import ThreadPoolExecutor
    from jax.experimental.serialize_executable import deserialize_and_load
    t_build = time.perf_counter()
    with open({prepared!r}, "rb") as f:
        floor = pickle.load(f)
    with ThreadPoolExecutor(min(8, len(floor))) as pool:
        exes = dict(zip([k for k, _ in floor], pool.map(lambda s: deserialize_and_load(*s[1]), floor)))
    build = load = time.perf_counter() - t_build
    loaded = time.perf_counter() - t0
    prefill = lambda params, tokens: exes["prefill", tokens.shape](params, tokens)
    decode = lambda params, kv, tok, pos, key, sampling: exes["decode_step", (tok.shape[0],)](
        params, kv, tok, pos, key)
else:
    prefill = jax.jit(lm.prefill)
    decode = jax.jit(lm.decode_step, static_argnames=["sampling"], donate_argnums=[1])
params = jax.device_put(lm.init_params(jax.random.key(0)))
jax.block_until_ready(params)
t1 = time.perf_counter()
run_all(prefill, decode, params)
first = time.perf_counter() - t1
ready = time.perf_counter() - t0
t2 = time.perf_counter()
run_all(prefill, decode, params)
steady = time.perf_counter() - t2
if mode == "serving":
    load += sum(s.load_seconds for f in rt._functions.values() for s in f._slots
                if s.load_seconds and not {preload!r})  # lazy loads happened inside the first calls
print(json.dumps({{"ready": ready, "first": first, "steady": steady, "build": build, "load": load,
                  "loaded": loaded if loaded is not None else ready,
                  "overhead": first - steady + (load if {preload!r} else 0.0)}}))
"""

DISPATCH = r"""
import json, sys, time
sys.path.insert(0, {repo!r})
import numpy as np, jax
import cachectl
from examples import lm
rt = cachectl.serving({manifest!r}, telemetry=False)
params = jax.device_put(lm.init_params(jax.random.key(0)))
f = rt["prefill"]
slot = f._slots[0]
exe = slot.compiled
tokens = np.zeros((1, 32), np.int32)
jax.block_until_ready(f(params, tokens))
n = {n}
def timed(call):
    out = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            r = call()
        jax.block_until_ready(r)
        out.append((time.perf_counter() - t) / n)
    return out
pairs = []
for _ in range(5):
    direct = min(timed(lambda: exe(params, tokens)))
    runtime = min(timed(lambda: f(params, tokens)))
    pairs.append((direct, runtime))
# A request that needs padding and cutting: [1, 20] -> bucket [1, 32], logits cut back on the host.
short = np.zeros((1, 20), np.int32)
padded = [min(timed(lambda: f(params, short))) for _ in range(5)]
print(json.dumps({{"pairs": pairs, "padded": padded}}))
"""


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHECTL_", "JAX_"))}
    env.update(
        XDG_DATA_HOME=str(home / "data"),
        XDG_CACHE_HOME=str(home / "cache"),
        XDG_CONFIG_HOME=str(home / "config"),
    )
    return env


def _py(code: str, env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900, cwd=REPO
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _manifest_here(home: Path) -> Path:
    """The example's manifest with its target set to this machine's backend (it names cpu)."""
    backend = machine()["backend"]
    path = home / "manifest.yaml"
    path.write_text(MANIFEST.read_text().replace("  backend: cpu\n", f"  backend: {backend}\n"))
    return path


def run(quick: bool = False, rounds: int | None = None) -> dict[str, Any]:
    """``rounds``: of the five kinds each (default 3 quick, else 5); a TPU pays ~10 s per process."""
    rounds = rounds or (3 if quick else 5)
    bytecode = compile_bytecode()
    with tempfile.TemporaryDirectory(prefix="cachectl-bench-serving-") as tmp:
        home = Path(tmp)
        env = _env(home)
        manifest = _manifest_here(home)
        warm = subprocess.run(
            [sys.executable, "-m", "cachectl", "warm", str(manifest), "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
            cwd=REPO,
        )
        if warm.returncode != 0:
            raise RuntimeError(warm.stderr[-2000:])
        report = json.loads(warm.stdout)
        prepared = home / "floor.pickle"
        off = dict(env, JAX_ENABLE_COMPILATION_CACHE="false")
        _py(PREPARE.format(repo=str(REPO), manifest=str(manifest), out=str(prepared)), off)
        aot_bytes = sum(b["aot_bytes"] or 0 for b in report["buckets"])
        entry_bytes = sum(b["bytes"] or 0 for b in report["buckets"])
        modes = {
            "none": ("plain", True),
            "activate": ("activate", True),
            "serving": ("serving", True),
            "serving_lazy": ("serving", False),
            "floor": ("floor", True),
        }
        samples: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        for _ in range(rounds):
            for name, (mode, preload) in modes.items():
                code = SERVICE.format(
                    repo=str(REPO),
                    manifest=str(manifest),
                    mode=mode,
                    preload=preload,
                    prepared=str(prepared),
                )
                run_env = dict(env)
                if mode in ("plain", "floor"):
                    run_env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
                samples[name].append(_py(code, run_env))
        dispatch = _py(
            DISPATCH.format(repo=str(REPO), manifest=str(manifest), n=200 if quick else 1000), env
        )
    result: dict[str, Any] = {
        "rounds": rounds,
        "aot_bytes": aot_bytes,
        "entry_bytes": entry_bytes,
        "buckets": len(report["buckets"]),
        "bytecode": bytecode,
    }
    for name, rows in samples.items():
        result[name] = {
            k: stats([r[k] for r in rows])
            for k in ("ready", "loaded", "first", "steady", "build", "load", "overhead")
        }
    pairs = list(zip(samples["serving"], samples["floor"], strict=True))
    result["serving/floor"] = {
        k: stats([x[k] / y[k] for x, y in pairs]) for k in ("loaded", "ready", "overhead")
    }
    for a in ("none", "activate"):
        pairs = list(zip(samples[a], samples["serving"], strict=True))
        result[f"{a}/serving"] = {
            "overhead": stats([x["overhead"] / y["overhead"] for x, y in pairs]),
            "ready": stats([x["ready"] / y["ready"] for x, y in pairs]),
        }
    result["preload"] = {
        "true_build": result["serving"]["build"],
        "false_build": result["serving_lazy"]["build"],
        "false_first": result["serving_lazy"]["first"],
        "true_first": result["serving"]["first"],
    }
    timings = dispatch["pairs"]
    result["dispatch_us"] = stats([(r - d) * 1e6 for d, r in timings])
    result["direct_us"] = stats([d * 1e6 for d, _ in timings])
    result["padded_us"] = stats([p * 1e6 for p in dispatch["padded"]])
    return result


def _ms(s: dict[str, float]) -> str:
    return f"{s['median'] * 1000:.0f} ms ({s['min'] * 1000:.0f}–{s['max'] * 1000:.0f})"


def _x(s: dict[str, float]) -> str:
    return f"{s['median']:.1f}x ({s['min']:.1f}–{s['max']:.1f})"


def _x2(s: dict[str, float]) -> str:
    return f"{s['median']:.2f}x ({s['min']:.2f}–{s['max']:.2f})"


def markdown(r: dict[str, Any]) -> str:
    rows = [
        ("(a) no cache, `jax.jit`", r["none"]),
        ("(b) `activate()` + `jax.jit`, persistent cache", r["activate"]),
        ("(c) `cachectl.serving` (preload)", r["serving"]),
        ("(c') `cachectl.serving`, `preload=False`", r["serving_lazy"]),
        ("(d) the floor: `deserialize_and_load` in the same pool", r["floor"]),
    ]
    lines = [
        SECTION,
        "",
        f"`python -m bench --only serving`. {machine_line()} Fresh processes, {r['rounds']} rounds, the four "
        "kinds alternating; every bucket of `examples/manifest.yaml` "
        f"({r['buckets']}: 8 prefill, 3 decode) called once. *Ready*: process start to every bucket's first "
        "result. *Overhead* (the issue's measure): first calls minus the same calls again, plus for (c) "
        "finding, checking and loading its executables (with `preload=False` the loads happen inside the "
        "first calls). *Setup*: `import cachectl` + `activate()` for (b), `import cachectl` + building the "
        "runtime (which activates too and reads the manifest) for (c); neither imports SQLAlchemy or "
        "pydantic.",
        "",
        "| service | loaded | ready | overhead | setup | of which loading executables |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, s in rows:
        loaded = _ms(s["loaded"]) if label.startswith(("(c)", "(d)")) else "–"
        lines.append(
            f"| {label} | {loaded} | {_ms(s['ready'])} | {_ms(s['overhead'])} | {_ms(s['build'])} | "
            f"{_ms(s['load'])} |"
        )
    fl = r["serving/floor"]
    lines += [
        "",
        f"- Overhead ratio (a)/(c): **{_x(r['none/serving']['overhead'])}** (goal ≥ 20x); "
        f"(b)/(c): **{_x(r['activate/serving']['overhead'])}** (goal ≥ 2.5x). "
        f"Ready ratio (a)/(c) {_x(r['none/serving']['ready'])}, (b)/(c) **{_x2(r['activate/serving']['ready'])}** "
        "(goal: above 1, (c) ready before (b)).",
        f"- Against the floor (d): loaded (process start to every executable loaded) (c)/(d) "
        f"**{_x2(fl['loaded'])}** (goal ≤ 1.15x); ready (c)/(d) {_x2(fl['ready'])}; overhead (c)/(d) "
        f"{_x2(fl['overhead'])}. (d) reads the pickled `serialize` output of every bucket (compiled with the "
        "persistent cache off), loads it in a pool of min(8, buckets) threads and picks the executable by "
        "shape; it checks nothing. cachectl's bytecode: "
        + r.get("bytecode", "?")
        + " before timing.",
        f"- Dispatch cost per call (pick the bucket, pad, convert; `prefill` at [1, 32] with the params tree) "
        f"over calling the loaded executable directly: **{r['dispatch_us']['median']:.1f} µs** "
        f"({r['dispatch_us']['min']:.1f}–{r['dispatch_us']['max']:.1f}; goal ≤ 50 µs); the direct call "
        f"itself {r['direct_us']['median']:.0f} µs. A request that is padded ([1, 20] -> [1, 32]) and whose "
        f"logits are cut back on the host (a device-to-host copy) takes {r['padded_us']['median']:.0f} µs "
        "per call in all.",
        f"- Readiness: `preload=True` builds in {_ms(r['preload']['true_build'])} (loads in parallel threads), "
        f"`preload=False` in {_ms(r['preload']['false_build'])} and pays each load at its bucket's first call "
        f"(first calls {_ms(r['preload']['false_first'])} vs {_ms(r['preload']['true_first'])}).",
        f"- Bytes: the {r['buckets']} stored executables add {r['aot_bytes'] / 1024:.1f} KiB to "
        f"{r['entry_bytes'] / 1024:.1f} KiB of JAX entries ({100 * r['aot_bytes'] / r['entry_bytes']:.1f}%): "
        "they reference the entry's executable instead of holding a second copy.",
        "- On a real accelerator the compile (a) grows most; the loads in (b) and (c) read the same entry "
        "bytes, so (b)/(c) is what tracing and lowering cost there.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    out = run(quick="--quick" in sys.argv)
    text = markdown(out)
    print(text)
    if "--no-write" not in sys.argv:
        write_section(SECTION, text)
