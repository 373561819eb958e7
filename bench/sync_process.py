"""`cachectl sync` as a whole process against `sha256sum` over the same 20,000 entries.

    python bench/sync_process.py [--quick] [--no-write]

bench/lifecycle.py times ``sync()`` inside its own process; a user runs ``cachectl sync``, whose
process also starts Python and imports what it needs. Here both sides are whole processes, run
alternately for a few rounds on one namespace of fake but valid entries (``make_entry``, 256 B -
2 KiB payloads): ``cachectl --db ... sync --min-age 0`` on a fresh SQLite index each round (every
entry new: read, hashed, checked, indexed), and ``find ROOT -type f -print0 | xargs -0 sha256sum``.
Wall time and CPU time (the children's user + system) per run; medians with min-max.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, machine, machine_line, stats, write_section  # noqa: E402

SECTION = "## sync as a whole process"


def _entries(root: Path, n: int) -> None:
    from cachectl.core.fingerprint import Environment
    from cachectl.storage.entries import make_entry, sha256
    from cachectl.storage.namespace import ensure_namespace
    from cachectl.storage.store import Store

    env = Environment(
        "0.10.2", "0.10.2", "cpu", "cpu", "cpu", 1, 1, "kinds:cpu", (), "zstandard", "none", False
    )
    store = Store(str(root))
    ensure_namespace(store, env)
    ns = root / env.namespace
    rng = random.Random(0)
    blobs = [make_entry(os.urandom(rng.randint(256, 2048))) for _ in range(64)]
    for i in range(n):
        (ns / f"jit_f{i % 50}-{sha256(str(i).encode())}-cache").write_bytes(blobs[i % 64])


def _timed(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def run(quick: bool = False) -> dict[str, Any]:
    from cachectl.index import open_index

    n, rounds = 20_000, (3 if quick else 5)
    work = Path(tempfile.mkdtemp(prefix="cachectl-bench-sync-"))
    try:
        root = work / "cache"
        root.mkdir()
        _entries(root, n)
        # cachectl's bytecode read as an installed package has it (pip compiles it at install): an
        # inherited PYTHONDONTWRITEBYTECODE=1 made every run compile the checkout's sources again.
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("CACHECTL_") and k != "PYTHONDONTWRITEBYTECODE"
        }
        env["CACHECTL_CACHE"] = "default"
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", str(REPO / "cachectl")],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        samples: dict[str, dict[str, list[float]]] = {
            s: {"wall": [], "cpu": []} for s in ("sync", "sha256sum")
        }
        for r in range(rounds):
            db = f"sqlite:///{work}/index-{r}.db"
            index = open_index(db)
            index.add_cache("default", str(root))
            index.close()
            sides = {
                "sync": [sys.executable, "-m", "cachectl", "--db", db, "sync", "--min-age", "0"],
                "sha256sum": [
                    "bash",
                    "-c",
                    f"find {root} -type f -print0 | xargs -0 sha256sum >/dev/null",
                ],
            }
            for side in random.sample(list(sides), 2):
                wall, cpu = _timed(sides[side], env)
                samples[side]["wall"].append(wall)
                samples[side]["cpu"].append(cpu)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out: dict[str, Any] = {"entries": n, "rounds": rounds, "machine": machine()}
    for side, cell in samples.items():
        out[side] = {k: stats(v) for k, v in cell.items()}
    for k in ("wall", "cpu"):
        out[f"ratio_{k}"] = statistics.median(samples["sync"][k]) / statistics.median(
            samples["sha256sum"][k]
        )
    return out


def _r(s: dict[str, float]) -> str:
    return f"{s['median']:.2f} s ({s['min']:.2f}–{s['max']:.2f})"


def markdown(result: dict[str, Any]) -> str:
    return "\n".join(
        [
            SECTION,
            "",
            f"`python bench/sync_process.py` (bench/sync_process.py): {result['entries']:,} entries "
            f"in one namespace, {result['rounds']} rounds alternating, each `cachectl sync` on a "
            f"fresh SQLite index. {machine_line(result['machine'])} Medians (min–max).",
            "",
            "| | `cachectl sync --min-age 0` | `find … \\| xargs -0 sha256sum` | ratio |",
            "|---|---|---|---|",
            f"| wall | {_r(result['sync']['wall'])} | {_r(result['sha256sum']['wall'])} | "
            f"**{result['ratio_wall']:.2f}x** |",
            f"| CPU (user + system) | {_r(result['sync']['cpu'])} | "
            f"{_r(result['sha256sum']['cpu'])} | **{result['ratio_cpu']:.2f}x** |",
            "",
        ]
    )


if __name__ == "__main__":
    res = run(quick="--quick" in sys.argv)
    print(json.dumps(res, default=str))
    text = markdown(res)
    print(text)
    if "--no-write" not in sys.argv:
        write_section(SECTION, text)
