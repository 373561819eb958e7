"""CLI startup: whole `cachectl` processes against `python3 -c pass`, alternating.

`python bench/cli.py [-n N]` (or `python -m bench --only cli` once listed in MODULES).
Every command runs on an empty embedded default in a temp HOME (XDG dirs under it,
CACHECTL_*/JAX_* variables dropped), with this tree first on PYTHONPATH. Each round
runs every command once, the plain interpreter between them, so load on a shared
machine falls on both sides alike. Prints the medians and each command's ratio to
the interpreter alone; goals: `--help` and `CMD --help` <= 0.15 s, the index
commands <= 0.35 s; `exec` (remembered and --fresh) has none: it is measured side by side.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, stats

SECTION = "## CLI startup"

# (label, cachectl arguments, goal in seconds or None)
COMMANDS: tuple[tuple[str, tuple[str, ...], float | None], ...] = (
    ("cachectl --help", ("--help",), 0.15),
    ("cachectl warm --help", ("warm", "--help"), 0.15),
    ("cachectl ls --help", ("ls", "--help"), 0.15),
    ("cachectl token create --help", ("token", "create", "--help"), 0.15),
    ("cachectl ls", ("ls",), 0.35),
    ("cachectl stats", ("stats",), 0.35),
    ("cachectl cache list", ("cache", "list"), 0.35),
    (
        "cachectl prune --older-than 30d --dry-run",
        ("prune", "--older-than", "30d", "--dry-run"),
        0.35,
    ),
    # exec reads the environment in a child (a TPU opened here would stay held across the
    # exec) and remembers it; --fresh reads it again. The service here is `true`.
    ("cachectl exec -- true", ("exec", "--", "true"), None),
    ("cachectl exec --fresh -- true", ("exec", "--fresh", "--", "true"), None),
)
BASELINE = "python3 -c pass"


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHECTL_", "JAX_"))}
    env["HOME"] = str(home)
    for var, sub in (
        ("DATA", "data"),
        ("CACHE", "cache"),
        ("CONFIG", "config"),
        ("STATE", "state"),
    ):
        (home / sub).mkdir(exist_ok=True)
        env[f"XDG_{var}_HOME"] = str(home / sub)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return env


def _timed(argv: list[str], env: dict[str, str], cwd: Path) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{argv}: exit {proc.returncode}\n{proc.stderr}")
    return elapsed


def run(quick: bool = False, n: int | None = None) -> dict[str, Any]:
    n = n or (5 if quick else 15)
    python = sys.executable
    with tempfile.TemporaryDirectory(prefix="cachectl-bench-cli-") as tmp:
        home = Path(tmp)
        env = _env(home)
        cachectl = [python, "-m", "cachectl"]
        # One untimed pass: creates the embedded default's index and warms the page cache.
        for _, args, _ in COMMANDS:
            _timed([*cachectl, *args], env, home)
        times: dict[str, list[float]] = {label: [] for label, _, _ in COMMANDS}
        times[BASELINE] = []
        for _ in range(n):
            for label, args, _ in COMMANDS:
                times[BASELINE].append(_timed([python, "-c", "pass"], env, home))
                times[label].append(_timed([*cachectl, *args], env, home))
    base = stats(times[BASELINE])
    rows = []
    for label, _, goal in COMMANDS:
        s = stats(times[label])
        rows.append(
            {
                "command": label,
                **s,
                "ratio": s["median"] / base["median"],
                "goal": goal,
                "met": None if goal is None else s["median"] <= goal,
            }
        )
    return {"n": n, "baseline": base, "rows": rows}


def markdown(r: dict[str, Any]) -> str:
    base = r["baseline"]
    lines = [
        f"Whole processes on an empty embedded default, {r['n']} runs each, alternating"
        f" with `{BASELINE}` (median {base['median']:.3f} s).",
        "",
        "| command | median s | min-max s | / python | goal s | met |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for row in r["rows"]:
        goal = "–" if row["goal"] is None else f"{row['goal']:.2f}"
        met = "–" if row["met"] is None else "yes" if row["met"] else "no"
        lines.append(
            f"| `{row['command']}` | {row['median']:.3f} | {row['min']:.3f}-{row['max']:.3f}"
            f" | {row['ratio']:.1f}x | {goal} | {met} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=15, help="runs per command (default 15)")
    args = parser.parse_args(argv)
    print(markdown(run(n=args.n)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
