"""First answer: a fresh service's time to its first answer through ``cachectl.serving``, with a
tiny program warmed at 10 and at 1,000 buckets.

One function (``x * 2 + 1`` over ``float32[batch, 4]``), its manifest listing ``batch`` at N
sizes, warmed once per N into its own cache; then fresh processes, the two sizes alternating,
each timing from process start (``time.perf_counter`` before ``import jax``) until the first
call (batch 1, the smallest bucket) has returned its result on the host. The goal: the 1,000
buckets' first answer within 1.2x of the 10 buckets'. Each process also reports what
``Serving.report()`` says: ``ready_seconds`` (construction to the first answer possible) and
``loaded_seconds`` (construction to every bucket loaded, waited for after the first answer).

    python bench/first_answer.py                  # 10 vs 1,000 buckets, 5 rounds
    python bench/first_answer.py --json           # the result as JSON on stdout
    python bench/first_answer.py --write          # and rewrite BENCHMARKS.md's section

``JAX_PLATFORMS`` is left as the caller has it: unset on a TPU host, the services run there.
"""

from __future__ import annotations

import argparse
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

SECTION = "## First answer"
SIZES = (10, 1000)

PROGRAM = "def double(x):\n    return x * 2.0 + 1.0\n"

MANIFEST = """version: 1
functions:
  - fn: tiny:double
    args:
      - {{shape: [batch, 4], dtype: float32}}
    outputs:
      - {{shape: [batch, 4]}}
    buckets:
      batch: [{sizes}]
"""

SERVICE = r"""
import time
t0 = time.perf_counter()
import json, sys
sys.path.insert(0, {repo!r})
import numpy as np
import cachectl
rt = cachectl.serving({manifest!r}, telemetry=False)
built = time.perf_counter() - t0
out = np.asarray(rt["double"](np.ones((1, 4), np.float32)))
first = time.perf_counter() - t0
assert out.tolist() == [[3.0] * 4], out
getattr(rt, "wait_loaded", lambda: True)()  # a --baseline checkout may load before returning
report = rt.report()
f = report.functions["double"]
print(json.dumps({{"first": first, "built": built, "ready": report.ready_seconds,
                  "loaded": getattr(report, "loaded_seconds", report.ready_seconds),
                  "aot": f.aot, "fallback": f.fallback,
                  "buckets": f.buckets, "loaded_buckets": f.loaded}}))
"""


def _env(home: Path) -> dict[str, str]:
    """A private cache per run; JAX_PLATFORMS as the caller has it (unset on a TPU host)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHECTL_")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as installed: bytecode (tests/test_bench_env.py)
    env.update(
        XDG_DATA_HOME=str(home / "data"),
        XDG_CACHE_HOME=str(home / "cache"),
        XDG_CONFIG_HOME=str(home / "config"),
    )
    return env


def _warm(home: Path, n: int) -> tuple[Path, dict[str, str]]:
    """The program's manifest at ``n`` buckets, warmed into a cache of its own (a warm of a
    kept ``--workdir`` finds every bucket cached)."""
    where = home / f"b{n}"
    where.mkdir(exist_ok=True)
    (where / "tiny.py").write_text(PROGRAM)
    manifest = where / "manifest.yaml"
    manifest.write_text(MANIFEST.format(sizes=", ".join(str(b) for b in range(1, n + 1))))
    env = _env(where)
    warm = subprocess.run(
        [sys.executable, "-m", "cachectl", "warm", str(manifest), "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
        cwd=REPO,
    )
    if warm.returncode != 0:
        raise RuntimeError(warm.stderr[-2000:])
    return manifest, env


def _service(manifest: Path, env: dict[str, str], repo: Path = REPO) -> dict[str, Any]:
    """One fresh service process; ``repo``: the checkout of cachectl it imports (first on its
    path)."""
    code = SERVICE.format(repo=str(repo), manifest=str(manifest))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=manifest.parent,
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def run(
    quick: bool = False,
    rounds: int | None = None,
    sizes: tuple[int, ...] = SIZES,
    workdir: Path | None = None,
    baseline: Path | None = None,
) -> Any:
    """``baseline``: another checkout of cachectl (main before a change), measured in the same
    rounds, alternating, on the same warmed caches."""
    rounds = rounds or (3 if quick else 5)
    bytecode = compile_bytecode()
    with tempfile.TemporaryDirectory(prefix="cachectl-bench-first-") as tmp:
        home = workdir or Path(tmp)
        warmed = {n: _warm(home, n) for n in sizes}
        samples: dict[int, list[dict[str, Any]]] = {n: [] for n in sizes}
        before: dict[int, list[dict[str, Any]]] = {n: [] for n in sizes}
        for _ in range(rounds):
            for n in sizes:
                samples[n].append(_service(*warmed[n]))
                if baseline is not None:
                    before[n].append(_service(*warmed[n], repo=baseline))
    result: dict[str, Any] = {"rounds": rounds, "sizes": list(sizes), "bytecode": bytecode}
    if baseline is not None:
        result["baseline"] = {
            "repo": str(baseline),
            **{str(n): {"first": stats([r["first"] for r in rows])} for n, rows in before.items()},
            "ratio": stats(
                [
                    b["first"] / a["first"]
                    for a, b in zip(before[sizes[0]], before[sizes[-1]], strict=True)
                ]
            ),
        }
    for n, rows in samples.items():
        result[str(n)] = {
            k: stats([r[k] for r in rows]) for k in ("first", "built", "ready", "loaded")
        }
        result[str(n)]["fallback"] = max(r["fallback"] for r in rows)
        result[str(n)]["buckets"] = rows[0]["buckets"]
        result[str(n)]["loaded_buckets"] = min(r["loaded_buckets"] for r in rows)
    small, large = str(sizes[0]), str(sizes[-1])
    result["ratio"] = stats(
        [
            b["first"] / a["first"]
            for a, b in zip(samples[sizes[0]], samples[sizes[-1]], strict=True)
        ]
    )
    result["ratio_of_medians"] = result[large]["first"]["median"] / result[small]["first"]["median"]
    return result


def _ms(s: dict[str, float]) -> str:
    return f"{s['median'] * 1000:.0f} ms ({s['min'] * 1000:.0f}–{s['max'] * 1000:.0f})"


def markdown(r: dict[str, Any]) -> str:
    sizes = r["sizes"]
    lines = [
        SECTION,
        "",
        f"`{r.get('command', 'python bench/first_answer.py --write')}`. "
        f"{machine_line(r.get('machine'))} One tiny function "
        "(`x * 2 + 1` on `float32[batch, 4]`) warmed with its `batch` axis at "
        + " and at ".join(f"{n:,}" for n in sizes)
        + f" sizes, each into a cache of its own; then {r['rounds']} rounds of fresh processes, the "
        "sizes alternating. *First answer*: process start (before `import jax`) to the first call "
        "(batch 1) returned on the host. *Built*: process start to `cachectl.serving` returned. "
        "*Ready* and *loaded*: what `report()` says, construction to the first answer possible "
        "(`ready_seconds`) and to every bucket loaded (`loaded_seconds`, waited for after the first "
        "answer). cachectl's bytecode: " + r.get("bytecode", "?") + ".",
        "",
        "| buckets | first answer | built | ready (report) | loaded (report) | buckets loaded |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for n in sizes:
        s = r[str(n)]
        lines.append(
            f"| {n:,} | {_ms(s['first'])} | {_ms(s['built'])} | {_ms(s['ready'])} | "
            f"{_ms(s['loaded'])} | {s['loaded_buckets']}/{s['buckets']} |"
        )
    ratio = r["ratio"]
    lines += [
        "",
        f"- First answer, {sizes[-1]:,} over {sizes[0]:,} buckets: **{ratio['median']:.2f}x** "
        f"({ratio['min']:.2f}–{ratio['max']:.2f}, per round; ratio of the medians "
        f"{r['ratio_of_medians']:.2f}x); goal ≤ 1.2x.",
    ]
    base = r.get("baseline")
    if base is not None:
        b = base["ratio"]
        lines.append(
            "- The same rounds through `--baseline` (every bucket loaded before `serving()` "
            "returned): first answer "
            + ", ".join(f"{n:,} buckets {_ms(base[str(n)]['first'])}" for n in sizes)
            + f"; {sizes[-1]:,} over {sizes[0]:,}: **{b['median']:.2f}x** "
            f"({b['min']:.2f}–{b['max']:.2f})."
        )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python bench/first_answer.py", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="fresh processes per size (default 5)"
    )
    parser.add_argument(
        "--buckets",
        default=",".join(str(n) for n in SIZES),
        help="the bucket counts compared, smallest first (default 10,1000)",
    )
    parser.add_argument(
        "--workdir", type=Path, help="keep the warmed caches here (and reuse them next time)"
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another checkout of cachectl (say main before a change), measured in the same rounds",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--write", action="store_true", help="rewrite BENCHMARKS.md's section")
    args = parser.parse_args(argv)
    sizes = tuple(int(n) for n in args.buckets.split(","))
    info = machine()  # the load average at the start
    print(machine_line(info), file=sys.stderr)
    result = run(rounds=args.rounds, sizes=sizes, workdir=args.workdir, baseline=args.baseline)
    result["machine"] = info
    shown = [
        a for a in (argv if argv is not None else sys.argv[1:]) if a not in ("--json", "--write")
    ]
    result["command"] = " ".join(["python bench/first_answer.py", *shown])
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(markdown(result))
    if args.write:
        write_section(SECTION, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
