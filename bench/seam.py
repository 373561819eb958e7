"""The JAX seam and the telemetry split: does the service path pay for them?

    python bench/seam.py [--quick] [--json] [--base COMMIT]

Both sides run in the same run, alternating, each in fresh processes: the tree at
``--base`` (default: the commit before the seam, extracted with ``git archive``) and
this working tree, each put first on ``PYTHONPATH``. Measured: ``import cachectl``
alone, ``import cachectl`` + ``activate()`` (a root and read-only mode given, so no
index is opened at start; JAX import, the fingerprint and the collector's install included), and the collector's
compiler-log tap on one hit call (the only code on the compile path the seam touched).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, machine, stats

SECTION = "## JAX seam and telemetry split"
BASE = "83f1114"

IMPORT = "import time; t0 = time.perf_counter(); import cachectl; print(time.perf_counter() - t0)"
ACTIVATE = (
    "import time; t0 = time.perf_counter(); import cachectl; cachectl.activate(); "
    "print(time.perf_counter() - t0)"
)
# One hit log call through the installed tap (the logger stays at WARNING: no record is built).
TAP = """
import logging, time
from cachectl import telemetry
c = telemetry.Collector(cache="c", environment_digest="d", sink=None)
logger = logging.getLogger("bench.seam.compiler")
tap = telemetry.LogTap(c, logger)
tap.install()
msg = "Persistent compilation cache hit for '%s' with key %r"
n = {n}
t0 = time.perf_counter()
for i in range(n):
    logger.debug(msg, "jit_f", "jit_f-" + "0" * 64)
print((time.perf_counter() - t0) / n * 1e6)
"""


def _base_tree(commit: str, into: Path) -> Path:
    """The project at ``commit``, as files (no checkout, no change to this repository)."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit, "cachectl"], check=True, capture_output=True
    ).stdout
    into.mkdir()
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _run(tree: Path, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Python with ``tree`` first on the path, started in the tree's parent (``-c`` puts the
    working directory first: not this repository)."""
    return subprocess.run(
        [sys.executable, *args],
        env={**env, "PYTHONPATH": str(tree)},
        cwd=env["BENCH_CWD"],
        check=True,
        capture_output=True,
        text=True,
    )


def _timed(tree: Path, code: str, env: dict[str, str]) -> float:
    out = _run(tree, ["-c", code], env).stdout
    return float(out.strip().splitlines()[-1])


def _import_time_us(tree: Path, env: dict[str, str]) -> int:
    """``-X importtime``'s cumulative microseconds for the cachectl package."""
    err = _run(tree, ["-X", "importtime", "-c", "import cachectl"], env).stderr
    line = [x for x in err.splitlines() if x.rstrip().endswith("| cachectl")][-1]
    return int(line.split("|")[1])


def run(quick: bool = False, base: str = BASE) -> dict[str, Any]:
    reps = 6 if quick else 20
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"base": _base_tree(base, Path(tmp) / "base"), "seam": REPO}
        env = {
            **os.environ,
            "CACHECTL_ROOT": str(Path(tmp) / "root"),
            "CACHECTL_READONLY": "1",
            "CACHECTL_DB": f"sqlite:///{tmp}/index.db",
            "XDG_CONFIG_HOME": str(Path(tmp) / "xdg"),
            "XDG_DATA_HOME": str(Path(tmp) / "xdg-data"),
            "JAX_PLATFORMS": "cpu",
            "BENCH_CWD": tmp,
        }
        for name, tree in trees.items():  # both sides import what they import from these trees
            where = _run(
                tree, ["-c", "import cachectl; print(cachectl.__file__)"], env
            ).stdout.strip()
            assert where.startswith(str(tree)), (name, where)
        samples: dict[str, dict[str, list[float]]] = {
            k: {"import_s": [], "activate_s": [], "importtime_us": [], "tap_us": []} for k in trees
        }
        for rep in range(reps):
            order = (
                list(trees.items()) if rep % 2 == 0 else list(trees.items())[::-1]
            )  # neither always first
            for name, tree in order:
                s = samples[name]
                s["import_s"].append(_timed(tree, IMPORT, env))
                s["activate_s"].append(_timed(tree, ACTIVATE, env))
                s["importtime_us"].append(_import_time_us(tree, env))
                s["tap_us"].append(_timed(tree, TAP.format(n=100_000), env))
    out: dict[str, Any] = {
        "base_commit": base,
        "reps": reps,
        "load_average": load,
        "machine": machine(),
        "seconds": time.perf_counter() - started,
    }
    for name, s in samples.items():
        out[name] = {k: stats(v) for k, v in s.items()}
    out["ratios"] = {
        k: statistics.median(samples["seam"][k]) / statistics.median(samples["base"][k])
        for k in samples["seam"]
    }
    # Each repetition's two sides ran back to back: their ratio sees the same machine load.
    out["paired"] = {
        k: statistics.median(
            a / b for a, b in zip(samples["seam"][k], samples["base"][k], strict=True)
        )
        for k in samples["seam"]
    }
    return out


def markdown(r: dict[str, Any]) -> str:
    rows = [
        ("`import cachectl`, process-internal, ms", "import_s", 1e3),
        ("`-X importtime` cumulative for `cachectl`, ms", "importtime_us", 1e-3),
        (
            "`import cachectl` + `activate()` (root + read-only given, JAX import included), s",
            "activate_s",
            1.0,
        ),
        ("collector's compiler-log tap, one hit call, µs", "tap_us", 1.0),
    ]
    lines = [
        SECTION,
        "",
        f"`python -m bench --only seam{' --quick' if r['reps'] < 20 else ''}` (or `python bench/seam.py`; "
        f"{r['seconds']:.0f} s; load average "
        f"{r['load_average']} at the start; Python {r['machine']['python']}, jax {r['machine']['jax']}). "
        f"Base: the tree at `{r['base_commit']}` (before `cachectl/core/jax_seam.py` and the telemetry split); seam: "
        f"this tree. The machine's load moves medians by more than the change does; the minimums are "
        f"the least-disturbed runs. Fresh processes, sides alternated (each first in every other repetition), {r['reps']} repetitions, medians (min – max).",
        "",
        "| measurement | base | seam | seam / base: medians | adjacent pairs, median | minimums |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, key, scale in rows:
        b, s = r["base"][key], r["seam"][key]
        lines.append(
            f"| {label} | {b['median'] * scale:.2f} ({b['min'] * scale:.2f} – {b['max'] * scale:.2f}) | "
            f"{s['median'] * scale:.2f} ({s['min'] * scale:.2f} – {s['max'] * scale:.2f}) | "
            f"{r['ratios'][key]:.3f} | {r['paired'][key]:.3f} | {s['min'] / b['min']:.3f} |"
        )
    tap = r["seam"]["tap_us"]["min"] - r["base"]["tap_us"]["min"]
    lines += [
        "",
        "The service path loads three more small modules than before (`jax_seam`, `telemetry/collector`, "
        "`taps`, `sinks`, less `jax_signatures`); none imports JAX or anything new at module level. "
        f"`import cachectl` + `activate()`: {r['paired']['activate_s']:.3f}x in adjacent pairs. The tap reads "
        f"each call with one function the seam builds (`jax_seam.compiler_call_reader`): {tap:+.2f} µs per "
        "compiler log call between the least-disturbed runs (two per compile), beside the ~9 µs the collector costs per hit (section Services).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    base = sys.argv[sys.argv.index("--base") + 1] if "--base" in sys.argv else BASE
    result = run(quick="--quick" in sys.argv, base=base)
    print(json.dumps(result, indent=2) if "--json" in sys.argv else markdown(result))
