"""Benchmark `cachectl warm` on the example LM (examples/manifest.yaml, 11 buckets).

Measures, each in fresh processes with a fresh embedded default cache:

* service compile phase: a fresh process compiling every bucket with no cache
  vs after warm (activate(), all hits) -> ratio;
* cold warm wall time with --jobs 1 vs the default (the cores) -> parallel speed-up;
* the same cold warm with --executor thread vs process (both at the default jobs);
* re-warm of a fully warmed manifest as a fraction of the cold warm;
* warm's parallel efficiency (sum of per-bucket compile seconds / (wall x jobs)) for
  the example and for a 40-bucket manifest, and where the time of a parallel warm goes:
  per bucket ``.lower()`` vs ``.compile()`` wall time, the calling thread's CPU time,
  and the process's CPU time per thread (``/proc/self/task``).

Sides are alternated within each repetition; results are median and min-max.
Run: ``python bench/warm.py [--quick] [--reps N] [--no-write]``; importable as
``bench.warm.run(quick)`` by a suite. Writes the ``## Warm`` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from bench.common import write_section  # noqa: E402

MANIFEST = REPO / "examples" / "manifest.yaml"
BENCHMARKS = REPO / "BENCHMARKS.md"
SECTION = "## Warm"
BUDGET_SECONDS = 300.0

# A service's compile phase: arguments built first (not timed), then every bucket
# compiled one after another, as first requests would.
_SERVICE = """
import json, sys, time
import jax
activate = sys.argv[1] == "warm"
if activate:
    import cachectl
    cachectl.activate(telemetry=False)
else:
    jax.config.update("jax_enable_compilation_cache", False)
from cachectl.manifest import build_call, check_imports, expand, jit_function, load_manifest
m = load_manifest(sys.argv[2])
check_imports(m)
calls = [(jit_function(m.function(b.function)), build_call(m.function(b.function), b)) for b in expand(m)]
counts = {}
jax.monitoring.register_event_listener(lambda e, **kw: counts.__setitem__(e, counts.get(e, 0) + 1))
lower = compile = 0.0
for fn, (args, kwargs) in calls:
    t0 = time.perf_counter()
    lowered = fn.lower(*args, **kwargs)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    lower, compile = lower + t1 - t0, compile + t2 - t1
print(json.dumps({"seconds": lower + compile, "compile_seconds": compile, "buckets": len(calls),
                  "hits": counts.get("/jax/compilation_cache/cache_hits", 0)}))
"""


# 40 buckets of a small MLP: enough buckets that a pool of --jobs threads stays busy.
_MANY_MODULE = """
import jax.numpy as jnp

def mlp(x, w1, w2, w3):
    h = jnp.tanh(x @ w1)
    h = h / (1.0 + jnp.abs(h).mean(axis=-1, keepdims=True))
    h = jnp.tanh(h @ w2)
    return jnp.tanh(h @ w3).sum(axis=-1)
"""
_MANY_MANIFEST = (
    """
version: 1
target: {backend: cpu}
functions:
  - fn: bench_many:mlp
    args:
      - {shape: [batch, 64], dtype: float32}
      - {shape: [64, 256], dtype: float32}
      - {shape: [256, 256], dtype: float32}
      - {shape: [256, 32], dtype: float32}
    buckets: {batch: ["""
    + ", ".join(str(b) for b in range(1, 41))
    + "]}\n"
)

# Where a parallel warm's time goes, in one process without any cache: per bucket the
# wall and calling-thread CPU of .lower() and of .compile(); the process's CPU per thread.
_PARALLEL = """
import json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
import jax
jax.config.update("jax_enable_compilation_cache", False)
from cachectl.manifest import build_call, check_imports, expand, jit_function, load_manifest
m = load_manifest(sys.argv[1])
check_imports(m)
jobs = int(sys.argv[2])
calls = [(jit_function(m.function(b.function)), build_call(m.function(b.function), b)) for b in expand(m)]
def threads():
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir("/proc/self/task"):
        try:
            f = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[tid] = (int(f[11]) + int(f[12])) / tick
    return out
def one(i):
    fn, (args, kwargs) = calls[i]
    t0, c0 = time.perf_counter(), time.thread_time()
    lowered = fn.lower(*args, **kwargs)
    t1, c1 = time.perf_counter(), time.thread_time()
    lowered.compile()
    return t1 - t0, c1 - c0, time.perf_counter() - t1, time.thread_time() - c1
before, cpu0, wall0 = threads(), time.process_time(), time.perf_counter()
if jobs == 1:
    per = [one(i) for i in range(len(calls))]
else:
    with ThreadPoolExecutor(jobs) as pool:
        per = list(pool.map(one, range(len(calls))))
wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
busy = sorted((c - before.get(t, 0.0) for t, c in threads().items()), reverse=True)
sums = [sum(p[k] for p in per) for k in range(4)]
print(json.dumps({"jobs": jobs, "buckets": len(per), "wall": wall, "cpu": cpu, "lower_wall": sums[0],
                  "lower_thread_cpu": sums[1], "compile_wall": sums[2], "compile_thread_cpu": sums[3],
                  "efficiency": sums[2] / (wall * jobs), "threads_busy": sum(b > 0.05 for b in busy),
                  "thread_cpu_top": busy[:4]}))
"""


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHECTL_", "JAX_", "XDG_"))}
    for var, sub in (
        ("XDG_DATA_HOME", "data"),
        ("XDG_CACHE_HOME", "cache"),
        ("XDG_CONFIG_HOME", "config"),
    ):
        (home / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(home / sub)
    return env


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed(
    cmd: list[str], home: Path
) -> tuple[subprocess.CompletedProcess[str], float, float, float]:
    """Run one process: (result, wall s, CPU s of it and its children, 1-min load at start)."""
    load = os.getloadavg()[0]
    cpu0, start = _children_cpu(), time.perf_counter()
    proc = subprocess.run(
        cmd, env=_env(home), capture_output=True, text=True, cwd=REPO, timeout=900
    )
    return proc, time.perf_counter() - start, _children_cpu() - cpu0, load


def _warm(home: Path, *args: str, manifest: Path = MANIFEST) -> dict[str, Any]:
    """One `cachectl warm --json` process: wall time as a user sees it, CPU time, and its report."""
    proc, wall, cpu, load = _timed(
        [sys.executable, "-m", "cachectl", "warm", str(manifest), "--json", *args], home
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"warm {' '.join(args)} failed ({proc.returncode}): {proc.stderr[-2000:]}"
        )
    report = json.loads(proc.stdout)
    return {"process_seconds": wall, "cpu_seconds": cpu, "load": load, **report["summary"]}


def _service(home: Path, mode: str) -> dict[str, Any]:
    proc, _, _, load = _timed(
        [sys.executable, "-c", textwrap.dedent(_SERVICE), mode, str(MANIFEST)], home
    )
    if proc.returncode != 0:
        raise RuntimeError(f"service ({mode}) failed: {proc.stderr[-2000:]}")
    return {"load": load, **json.loads(proc.stdout.strip().splitlines()[-1])}


def _parallel(home: Path, manifest: Path, jobs: int) -> dict[str, Any]:
    proc, _, _, load = _timed(
        [sys.executable, "-c", textwrap.dedent(_PARALLEL), str(manifest), str(jobs)], home
    )
    if proc.returncode != 0:
        raise RuntimeError(f"parallel probe (jobs {jobs}) failed: {proc.stderr[-2000:]}")
    return {"load": load, **json.loads(proc.stdout.strip().splitlines()[-1])}


def _many(tmp: Path, jobs: int, samples: dict[str, list[float]], checks: list[str]) -> None:
    """Cold warms of the 40-bucket manifest, --jobs 1 and --jobs N threads, alternating."""
    (tmp / "bench_many.py").write_text(_MANY_MODULE)
    manifest = tmp / "many.yaml"
    manifest.write_text(_MANY_MANIFEST)
    order = [(1, "jobs1"), (jobs, "thread")]
    for n, side in order if len(samples["many_jobs1"]) % 2 == 0 else order[::-1]:
        r = _warm(
            tmp / f"many-{side}-{len(samples[f'many_{side}'])}", "--jobs", str(n), manifest=manifest
        )
        samples[f"many_{side}"].append(r["process_seconds"])
        samples[f"cpu_many_{side}"].append(r["cpu_seconds"])
        samples[f"eff_many_{side}"].append(r["parallel_efficiency"])
        samples["load"].append(r["load"])
        if r["compiled"] != 40:
            checks.append(f"40-bucket {side}: compiled {r['compiled']} of {r['buckets']}")


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


_SAMPLES = (
    "warm_jobs1",
    "warm_default_thread",
    "warm_default_process",
    "rewarm",
    "cpu_jobs1",
    "cpu_default_thread",
    "cpu_default_process",
    "cpu_rewarm",
    "cold_in_process",
    "rewarm_in_process",
    "service_nocache",
    "service_warm",
    "service_nocache_compile",
    "service_warm_compile",
    "load",
    "eff_jobs1",
    "eff_thread",
    "lower_thread",
    "compile_thread",
    "many_jobs1",
    "many_thread",
    "cpu_many_jobs1",
    "cpu_many_thread",
    "eff_many_jobs1",
    "eff_many_thread",
)


def run(
    quick: bool = False, reps: int | None = None, budget_s: float = BUDGET_SECONDS
) -> dict[str, Any]:
    """Run the benchmark; returns every sample and the summary numbers.

    Up to 3 repetitions (``quick``: 2); another starts only if the one before
    suggests it fits in ``budget_s``, since the machine is shared. Every sample
    records wall time, CPU time and the load average when it started.
    """
    from cachectl.warm import default_jobs

    max_reps = reps or (2 if quick else 3)
    jobs = default_jobs()
    samples: dict[str, list[float]] = {k: [] for k in _SAMPLES}
    checks: list[str] = []
    done_reps = 0
    load_before = _load()
    started = time.perf_counter()
    sides = {
        "jobs1": ("warm_jobs1", "cpu_jobs1", ["--jobs", "1"]),
        "thread": (
            "warm_default_thread",
            "cpu_default_thread",
            ["--jobs", str(jobs), "--executor", "thread"],
        ),
        "process": (
            "warm_default_process",
            "cpu_default_process",
            ["--jobs", str(jobs), "--executor", "process"],
        ),
    }
    parallel: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="cachectl-bench-warm-") as tmp:
        for rep in range(max_reps):
            rep_started = time.perf_counter()
            # Alternate which side goes first, so drift in machine load spreads over all sides.
            order = (
                ["jobs1", "thread", "process"] if rep % 2 == 0 else ["process", "thread", "jobs1"]
            )
            homes = {}
            for side in order:
                homes[side] = home = Path(tmp) / f"r{rep}-{side}"
                wall_key, cpu_key, args = sides[side]
                r = _warm(home, *args)
                samples[wall_key].append(r["process_seconds"])
                samples[cpu_key].append(r["cpu_seconds"])
                samples["load"].append(r["load"])
                if side == "thread":
                    samples["cold_in_process"].append(r["wall_seconds"])
                    samples["eff_thread"].append(r["parallel_efficiency"])
                    samples["lower_thread"].append(r["lower_seconds"])
                    samples["compile_thread"].append(r["compile_seconds"])
                if side == "jobs1":
                    samples["eff_jobs1"].append(r["parallel_efficiency"])
                if r["compiled"] != r["buckets"]:
                    checks.append(f"rep {rep} {side}: compiled {r['compiled']} of {r['buckets']}")
            again = _warm(homes["thread"], "--jobs", str(jobs))
            samples["rewarm"].append(again["process_seconds"])
            samples["cpu_rewarm"].append(again["cpu_seconds"])
            samples["rewarm_in_process"].append(again["wall_seconds"])
            if again["cached"] != again["buckets"]:
                checks.append(f"rep {rep} rewarm: cached {again['cached']} of {again['buckets']}")
            for mode in ("nocache", "warm") if rep % 2 == 0 else ("warm", "nocache"):
                s = _service(homes["thread"], mode)
                samples[f"service_{mode}"].append(s["seconds"])
                samples[f"service_{mode}_compile"].append(s["compile_seconds"])
                samples["load"].append(s["load"])
                if mode == "warm" and s["hits"] != s["buckets"]:
                    checks.append(
                        f"rep {rep} service after warm: {s['hits']} hits of {s['buckets']}"
                    )
            _many(Path(tmp), jobs, samples, checks)
            if rep == 0:
                parallel = [_parallel(Path(tmp) / "parallel", MANIFEST, n) for n in (1, jobs)]
            done_reps = rep + 1
            elapsed, last = time.perf_counter() - started, time.perf_counter() - rep_started
            if elapsed + last > budget_s:
                break
    stats = {k: _stats(v) for k, v in samples.items()}
    med = {k: v["median"] for k, v in stats.items()}
    return {
        "command": "python bench/warm.py"
        + (" --quick" if quick else "")
        + (f" --reps {max_reps}" if reps else ""),
        "reps": done_reps,
        "jobs_default": jobs,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "jax": _jax_version(),
        "load_before": load_before,
        "load_after": _load(),
        "total_seconds": time.perf_counter() - started,
        "stats": stats,
        "samples": samples,
        "ratios": {
            "service_nocache_over_warm": med["service_nocache"] / med["service_warm"],
            "service_compile_only_nocache_over_warm": med["service_nocache_compile"]
            / med["service_warm_compile"],
            "warm_speedup_default_threads": med["warm_jobs1"] / med["warm_default_thread"],
            "warm_speedup_default_processes": med["warm_jobs1"] / med["warm_default_process"],
            "process_over_thread": med["warm_default_process"] / med["warm_default_thread"],
            "process_over_thread_cpu": med["cpu_default_process"] / med["cpu_default_thread"],
            "rewarm_fraction_of_cold": med["rewarm"] / med["warm_default_thread"],
            "rewarm_fraction_of_cold_in_process": med["rewarm_in_process"] / med["cold_in_process"],
            "many_speedup_threads": med["many_jobs1"] / med["many_thread"],
            "many_cpu_thread_over_jobs1": med["cpu_many_thread"] / med["cpu_many_jobs1"],
        },
        "parallel": parallel,
        "problems": checks,
    }


def _jax_version() -> str:
    import jax

    return jax.__version__


def _row(name: str, s: dict[str, float]) -> str:
    return f"| {name} | {s['median']:.2f} | {s['min']:.2f} – {s['max']:.2f} | {s['n']} |"


def markdown(result: dict[str, Any]) -> str:
    s, r = result["stats"], result["ratios"]
    j = result["jobs_default"]
    threads_win = r["process_over_thread"] > 1 and r["process_over_thread_cpu"] > 1
    verdict = (
        "threads win on both wall time and CPU time, which is why `DEFAULT_EXECUTOR` in "
        "`cachectl/warm/reports.py` is `thread`"
        if threads_win
        else "this run does NOT show threads winning on both wall and CPU time: revisit `DEFAULT_EXECUTOR` "
        "in `cachectl/warm/reports.py` (set to `thread`) if that holds on a quiet machine"
    )
    lines = [
        SECTION,
        "",
        "Example manifest (`examples/manifest.yaml`: the small transformer LM, 8 prefill + 3 decode "
        "buckets), CPU JAX. Produced by:",
        "",
        "```",
        result["command"],
        "```",
        "",
        f"Machine: {result['cpus']} cores shared with other engineers' test suites and benchmarks "
        f"(1/5/15-min load average {result['load_before']} before, {result['load_after']} after; "
        f"1-min load at the start of the samples: median {s['load']['median']:.1f}, "
        f"{s['load']['min']:.1f} – {s['load']['max']:.1f}). Wall times on a loaded 2-core machine are "
        "noisy, parallel speed-ups most of all; CPU seconds (the process and its children) are the "
        f"steadier number. Python {result['python']}, jax {result['jax']}. {result['reps']} "
        f"repetition(s) (up to 3; another only if it fits in {BUDGET_SECONDS:.0f} s), sides alternated "
        "within each; every warm is a fresh `cachectl warm --json` process into a fresh embedded "
        "default cache, timed from process start to exit (JAX import included). Total "
        f"{result['total_seconds']:.0f} s.",
        "",
        "| measurement | median s | min – max s | n |",
        "|---|---|---|---|",
        _row(
            "service compile phase (lower + compile), no cache: 11 compiles", s["service_nocache"]
        ),
        _row("service compile phase (lower + compile), after warm: 11 hits", s["service_warm"]),
        _row("  of which `.compile()`, no cache", s["service_nocache_compile"]),
        _row("  of which `.compile()`, after warm", s["service_warm_compile"]),
        _row("cold warm, `--jobs 1`: wall", s["warm_jobs1"]),
        _row(f"cold warm, `--jobs {j}` threads (default): wall", s["warm_default_thread"]),
        _row(f"cold warm, `--jobs {j} --executor process`: wall", s["warm_default_process"]),
        _row("cold warm, `--jobs 1`: CPU", s["cpu_jobs1"]),
        _row(f"cold warm, `--jobs {j}` threads: CPU", s["cpu_default_thread"]),
        _row(f"cold warm, `--jobs {j} --executor process`: CPU", s["cpu_default_process"]),
        _row(f"re-warm of the warmed manifest, `--jobs {j}`: wall", s["rewarm"]),
        _row(
            "cold warm, default, inside the process (report `wall_seconds`)", s["cold_in_process"]
        ),
        _row("re-warm, inside the process (report `wall_seconds`)", s["rewarm_in_process"]),
        "",
        f"- Service compile phase, no cache / after warm: **{r['service_nocache_over_warm']:.1f}x** "
        f"(`.compile()` alone: {r['service_compile_only_nocache_over_warm']:.0f}x; what remains after "
        "warm is mostly tracing and lowering, which a cache cannot skip).",
        f"- Warm parallel speed-up, `--jobs 1` / `--jobs {j}` wall (threads): "
        f"**{r['warm_speedup_default_threads']:.2f}x** (processes: {r['warm_speedup_default_processes']:.2f}x).",
        f"- Processes / threads at `--jobs {j}`: wall **{r['process_over_thread']:.2f}**, CPU "
        f"**{r['process_over_thread_cpu']:.2f}** (above 1: threads win). Each worker process pays its "
        "own JAX import, manifest import and argument building; XLA's CPU compiler releases the GIL, so "
        f"threads in one process compile concurrently without that. Verdict of this run: {verdict}. "
        "The default `--jobs` is the number of cores this process may use.",
        f"- Re-warm / cold warm: **{r['rewarm_fraction_of_cold']:.2f}** as processes (JAX import and "
        f"lowering included), {r['rewarm_fraction_of_cold_in_process']:.2f} inside the process; "
        "every bucket reported `cached`.",
    ]
    lines += [
        "",
        f"Parallel efficiency (report's `parallel_efficiency`: sum of per-bucket compile seconds / "
        f"(wall x jobs)) and a 40-bucket manifest (a small MLP, `batch` 1..40), cold, `--jobs 1` vs "
        f"`--jobs {j}` threads:",
        "",
        "| measurement | median | min – max | n |",
        "|---|---|---|---|",
        _row("example, parallel efficiency, `--jobs 1`", s["eff_jobs1"]),
        _row(f"example, parallel efficiency, `--jobs {j}` threads", s["eff_thread"]),
        _row(
            f"example, `--jobs {j}`: sum of `.lower()` s (report `lower_seconds`)",
            s["lower_thread"],
        ),
        _row(
            f"example, `--jobs {j}`: sum of `.compile()` s (report `compile_seconds`)",
            s["compile_thread"],
        ),
        _row("40 buckets, `--jobs 1`: wall s", s["many_jobs1"]),
        _row(f"40 buckets, `--jobs {j}` threads: wall s", s["many_thread"]),
        _row("40 buckets, `--jobs 1`: CPU s", s["cpu_many_jobs1"]),
        _row(f"40 buckets, `--jobs {j}` threads: CPU s", s["cpu_many_thread"]),
        _row("40 buckets, parallel efficiency, `--jobs 1`", s["eff_many_jobs1"]),
        _row(f"40 buckets, parallel efficiency, `--jobs {j}` threads", s["eff_many_thread"]),
        "",
        f"- 40 buckets, speed-up `--jobs 1` / `--jobs {j}` threads: **{r['many_speedup_threads']:.2f}x** "
        f"wall; CPU seconds {r['many_cpu_thread_over_jobs1']:.2f} of `--jobs 1`'s.",
    ]
    if result["parallel"]:
        lines += [
            "",
            "Where a cold warm's time goes (the example, one process, no cache, one sample each; "
            "`thread CPU` is the CPU time of the thread that called `.lower()`/`.compile()`, the "
            "process's CPU is read per thread from `/proc/self/task`):",
            "",
            "| jobs | wall s | process CPU s | `.lower()` wall s | `.lower()` thread CPU s | "
            "`.compile()` wall s | `.compile()` thread CPU s | efficiency | threads busy | CPU s of the busiest 4 |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for p in result["parallel"]:
            lines.append(
                f"| {p['jobs']} | {p['wall']:.2f} | {p['cpu']:.2f} | {p['lower_wall']:.2f} | "
                f"{p['lower_thread_cpu']:.2f} | {p['compile_wall']:.2f} | {p['compile_thread_cpu']:.2f} | "
                f"{p['efficiency']:.2f} | {p['threads_busy']} | "
                + ", ".join(f"{c:.2f}" for c in p["thread_cpu_top"])
                + " |"
            )
        one = result["parallel"][0]
        waiting = one["compile_thread_cpu"] / max(one["compile_wall"], 1e-9)
        compile_cpu = one["cpu"] - one["lower_thread_cpu"]
        lines += [
            "",
            f"- With `--jobs 1` the calling thread used {waiting:.0%} of a core while `.compile()` ran: "
            "XLA compiles on its own threads and the caller waits (with the GIL released), so the GIL "
            f"is not what limits threads. Those threads burned {compile_cpu:.2f} CPU s in "
            f"{one['compile_wall']:.2f} s of `.compile()` wall time "
            f"({compile_cpu / max(one['compile_wall'], 1e-9):.2f} cores on average, on a machine whose "
            "load leaves this process a fraction of its 2 cores). `.lower()` is Python under the GIL: "
            f"{one['lower_thread_cpu']:.2f} CPU s, "
            f"{one['lower_thread_cpu'] / max(one['cpu'], 1e-9):.0%} of the process's CPU.",
        ]
        if len(result["parallel"]) > 1:
            two = result["parallel"][1]
            lines += [
                f"- With `--jobs {two['jobs']}` both threads kept compiling (efficiency "
                f"{two['efficiency']:.2f}), but each `.compile()` took longer: "
                f"{two['compile_wall']:.2f} s summed over the buckets against {one['compile_wall']:.2f} s "
                f"one at a time ({two['compile_wall'] / max(one['compile_wall'], 1e-9):.1f}x), while the "
                f"process's CPU went from {one['cpu'] / max(one['wall'], 1e-9):.2f} to "
                f"{two['cpu'] / max(two['wall'], 1e-9):.2f} cores. The compile is CPU-bound and runs on "
                f"XLA's own threads ({one['threads_busy']} threads busy with `--jobs 1`), so a second "
                "job gains only the cores the machine has free; on this loaded machine there were few.",
            ]
    lines += [
        f"- Defaults chosen from this: `--jobs` = the cores, executor `thread`. In CPU seconds, "
        f"`--jobs {j}` threads cost {s['cpu_default_thread']['median'] / s['cpu_jobs1']['median']:.2f}x "
        f"of `--jobs 1` on the example and {r['many_cpu_thread_over_jobs1']:.2f}x on 40 buckets "
        f"(nothing wasted), processes {r['process_over_thread_cpu']:.2f}x of threads; in wall time "
        f"threads gained {r['warm_speedup_default_threads']:.2f}x (11 buckets of uneven size) and "
        f"{r['many_speedup_threads']:.2f}x (40 buckets).",
    ]
    if result["problems"]:
        lines += ["", "Problems seen: " + "; ".join(result["problems"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two repetitions")
    parser.add_argument("--reps", type=int, help="repetitions (default 3, --quick 2)")
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    args = parser.parse_args(argv)
    result = run(quick=args.quick, reps=args.reps)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))
    if not args.no_write:
        write_section(SECTION, markdown(result))
        print(f"wrote the {SECTION!r} section of {BENCHMARKS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
