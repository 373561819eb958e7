"""CLI startup: whole `cachectl` processes against `python3 -c pass`, alternating.

`python bench/cli.py [-n N]` (or `python -m bench --only cli` once listed in MODULES).
Every command runs on an empty embedded default in a temp HOME (XDG dirs under it,
CACHECTL_*/JAX_* variables dropped), with this tree first on PYTHONPATH. Each round
runs every command once, the plain interpreter between them, so load on a shared
machine falls on both sides alike. Prints the medians and each command's ratio to
the interpreter alone; goals: `--help` and `CMD --help` <= 0.15 s, the index
commands <= 0.35 s; `exec` (remembered and --fresh) has none: it is measured side by side.

`python bench/cli.py --nothing-compiled [-n N] [--before REF] [--write]`: the commands that
compile nothing (`path`, `env`, `ls`, `doctor`, `fingerprint`, `token create`, a manifest
error), goal <= 0.5 s each, once this machine's environment is remembered (an untimed pass
remembers it and records it in the index). ``--before REF`` measures the same commands on
that commit of this clone too (extracted to a temp dir, first on PYTHONPATH), in the same
rounds; ``--write`` replaces BENCHMARKS.md's section. Both trees' bytecode is written first,
as an install does (this machine sets PYTHONDONTWRITEBYTECODE).
"""

from __future__ import annotations

import argparse
import compileall
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, machine_line, stats, write_section

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


NOTHING_SECTION = "## Commands that compile nothing"
NOTHING_GOAL = 0.5
# (label, cachectl arguments ("{i}": the run's number), the exit code it answers with)
NOTHING_COMPILED: tuple[tuple[str, tuple[str, ...], int], ...] = (
    ("cachectl path", ("path",), 0),
    ("cachectl env", ("env",), 0),
    ("cachectl ls", ("ls",), 0),
    ("cachectl doctor", ("doctor",), 0),
    ("cachectl fingerprint", ("fingerprint",), 0),
    ("cachectl token create", ("token", "create", "--name", "t{i}", "--role", "reader"), 0),
    ("cachectl warm missing.yaml", ("warm", "missing.yaml"), 2),
)


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


def _timed(argv: list[str], env: dict[str, str], cwd: Path, code: int = 0) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - t0
    if proc.returncode != code:
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


def _tree_at(ref: str, into: Path) -> Path:
    """This clone's files at ``ref``, extracted (never checked out here), bytecode written."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", ref],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    compileall.compile_dir(str(into / "cachectl"), quiet=1)
    return into


def run_nothing_compiled(n: int = 9, before: str | None = None) -> dict[str, Any]:
    """The commands that compile nothing, each side's environment remembered first."""
    python = sys.executable
    compileall.compile_dir(str(REPO / "cachectl"), quiet=1)
    with tempfile.TemporaryDirectory(prefix="cachectl-bench-nothing-") as tmp:
        root = Path(tmp)
        trees = {"now": REPO}
        if before is not None:
            (root / "before").mkdir()
            trees[before] = _tree_at(before, root / "before")
        envs: dict[str, tuple[dict[str, str], Path]] = {}
        for side, tree in trees.items():
            home = root / f"home-{len(envs)}"
            home.mkdir()
            env = _env(home)
            env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [str(tree), os.environ.get("PYTHONPATH")])
            )
            envs[side] = (env, home)
            # Untimed: the index made, this environment recorded and remembered, pages cached.
            for _, args, code in NOTHING_COMPILED:
                argv = [python, "-m", "cachectl", *(a.format(i="warm") for a in args)]
                _timed(argv, env, home, code)
        times: dict[tuple[str, str], list[float]] = {}
        base: list[float] = []
        for i in range(n):
            for label, args, code in NOTHING_COMPILED:
                for side, (env, home) in envs.items():
                    base.append(_timed([python, "-c", "pass"], env, home))
                    argv = [python, "-m", "cachectl", *(a.format(i=f"{side}{i}") for a in args)]
                    times.setdefault((label, side), []).append(_timed(argv, env, home, code))
    b = stats(base)
    rows = []
    for label, _, _ in NOTHING_COMPILED:
        s = stats(times[(label, "now")])
        row: dict[str, Any] = {"command": label, **s, "ratio": s["median"] / b["median"]}
        if before is not None:
            row["before"] = stats(times[(label, before)])["median"]
        row["met"] = s["median"] <= NOTHING_GOAL
        rows.append(row)
    return {"n": n, "baseline": b, "rows": rows, "before": before, "machine": machine_line()}


def markdown_nothing_compiled(r: dict[str, Any]) -> str:
    base, before = r["baseline"], r["before"]
    lines = [
        f"{NOTHING_SECTION}",
        "",
        f"`python bench/cli.py --nothing-compiled -n {r['n']}"
        + (f" --before {before}" if before else "")
        + "`: whole processes once this machine's environment is remembered (an untimed pass"
        " remembers it and records it in a temp HOME's embedded index), alternating with"
        f" `python3 -c pass` (median {base['median']:.3f} s)"
        + (
            f" and with the same commands on {before} (the tree before these changes)"
            if before
            else ""
        )
        + f", {r['n']} runs each, bytecode written as installed. {r['machine']} Goal (issue 61):"
        f" each <= {NOTHING_GOAL} s.",
        "",
        "| command | median s | min-max s | / python |"
        + (f" before ({before}) median s |" if before else "")
        + " goal s | met |",
        "|---|---:|---:|---:|" + ("---:|" if before else "") + "---:|---|",
    ]
    for row in r["rows"]:
        lines.append(
            f"| `{row['command']}` | {row['median']:.3f} | {row['min']:.3f}-{row['max']:.3f}"
            f" | {row['ratio']:.1f}x |"
            + (f" {row['before']:.3f} |" if before else "")
            + f" {NOTHING_GOAL:.2f} | {'yes' if row['met'] else 'no'} |"
        )
    lines += [
        "",
        "What the commands no longer do: import JAX to read this machine's environment (they",
        "take the one `cachectl exec` remembers, `Context.environment`, checked against the index",
        "before anything registers it), import JAX for doctor's config checks (a process that has",
        "not imported JAX has configured nothing: the `JAX_*` variables say it all), or import the",
        "warm stack before the manifest is read, or import SQLAlchemy and the index models for",
        "`token create` (on a plain SQLite index the stdlib driver writes the token row and its",
        "audit row in one sqlite3 transaction, by the rules of `cachectl/trust/token_rules.py`).",
        "On a machine this loaded, compare the ratios to `python3 -c pass`, not the seconds.",
    ]
    return "\n".join(lines) + "\n"


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
    parser.add_argument(
        "--nothing-compiled", action="store_true", help="the commands that compile nothing"
    )
    parser.add_argument("--before", metavar="REF", help="also time this commit of the clone")
    parser.add_argument("--write", action="store_true", help="replace BENCHMARKS.md's section")
    args = parser.parse_args(argv)
    if not args.nothing_compiled:
        print(markdown(run(n=args.n)))
        return 0
    text = markdown_nothing_compiled(run_nothing_compiled(n=args.n, before=args.before))
    print(text)
    if args.write:
        write_section(NOTHING_SECTION, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
