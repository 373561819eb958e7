"""Fleet start: replicas of the example service started together on a cold cache, with and without
the compile lease.

Each replica is ``examples/serve.py`` (``cachectl.serving`` over ``examples/manifest.yaml``:
prefill and decode) in a fresh process, serving 2 requests. A cold cache has no stored
executable, so each replica compiles the buckets its requests need through JAX's persistent
cache (jit): a replica is done when it has served them. 2 "nodes" x 3 processes: each node is its own HOME; all share one cache root and one
index (SQLite, or PostgreSQL where CACHECTL_TEST_PG_URL names a server). Compiles are counted
from JAX's own monitoring events in each replica (requests that use the cache, less hits),
and per program from JAX's miss log (its module names). In one run, alternating: one cold
replica alone, 6 together with the lease, 6 together with CACHECTL_COMPILE_LEASE=0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, machine_line, stats, write_section

SECTION = "## Fleet start"
NODES, PER_NODE = 2, 3

REPLICA = r"""
import time
t0 = time.perf_counter()
import contextlib, io, json, logging, re, sys
sys.path.insert(0, {repo!r})
from jax import monitoring
counts = {{"requests": 0, "hits": 0}}
def on_event(event, **kw):
    if event == "/jax/compilation_cache/compile_requests_use_cache":
        counts["requests"] += 1
    elif event == "/jax/compilation_cache/cache_hits":
        counts["hits"] += 1
monitoring.register_event_listener(on_event)
missed = []
class Misses(logging.Handler):
    def emit(self, record):
        if str(record.msg).startswith("PERSISTENT COMPILATION CACHE MISS for"):
            missed.append([str(record.args[0]), str(record.args[1])])
compiler = logging.getLogger("jax._src.compiler")
compiler.addHandler(Misses())
compiler.setLevel(logging.DEBUG)
compiler.propagate = False
from examples import serve
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    serve.main(["--requests", "2", "--writes"])
text = buf.getvalue()
rows = re.findall(r"first row (\[[^\]]*\])", text)
print(json.dumps({{"ready": time.perf_counter() - t0, "compiles": counts["requests"] - counts["hits"],
                  "requests": counts["requests"], "missed": missed, "rows": rows,
                  "wall": time.perf_counter() - t0}}))
"""


def _home(base: Path, name: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHECTL_", "JAX_"))}
    for var, sub in (
        ("XDG_DATA_HOME", "data"),
        ("XDG_CACHE_HOME", "cache"),
        ("XDG_CONFIG_HOME", "config"),
        ("XDG_STATE_HOME", "state"),
    ):
        (base / name / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(base / name / sub)
    env["JAX_PLATFORMS"] = os.environ.get("JAX_PLATFORMS", "cpu")
    return env


def _index(base: Path) -> tuple[str, str]:
    pg = os.environ.get("CACHECTL_TEST_PG_URL")
    if not pg:
        return f"sqlite:///{base / 'index.db'}", "sqlite"
    import psycopg

    name = "cachectl_fleet_" + uuid.uuid4().hex[:8]
    with psycopg.connect(
        pg.replace("postgresql+psycopg://", "postgresql://"), autocommit=True
    ) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    return pg.rsplit("/", 1)[0] + "/" + name, "postgresql"


def _start_fleet(base: Path, n: int, lease: bool, *, again: bool = False) -> dict[str, Any]:
    """``n`` replicas started together (spread over the nodes) on a fresh cache and index
    (``again``: on the cache and index the last fleet in ``base`` left, warm)."""
    if not again:
        base.mkdir(parents=True)
        (base / "db").write_text("|".join(_index(base)))
    db, kind = (base / "db").read_text().split("|")
    root = base / "root"
    envs = []
    for i in range(n):
        env = _home(base, f"node{i % NODES}")
        env.update(CACHECTL_DB=db, CACHECTL_ROOT=str(root), CACHECTL_READONLY="0")
        # The example's programs compile faster than JAX's default threshold for writing an
        # entry (1 s), so no replica would store any: a fleet that wants them cached lowers it.
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        if not lease:
            env["CACHECTL_COMPILE_LEASE"] = "0"
        envs.append(env)
    subprocess.run(
        [sys.executable, "-m", "cachectl", "db", "upgrade"],
        env=envs[0],
        check=True,
        capture_output=True,
    )
    code = REPLICA.format(repo=str(REPO))
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=e,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for e in envs
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(stderr[-3000:])
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    per_program = Counter(
        key
        for r in out
        for module, key in r["missed"]
        if module in ("jit_prefill", "jit_decode_step")
    )
    return {
        "index": kind,
        "replicas": n,
        "wall": time.perf_counter() - t0,
        "ready": [r["ready"] for r in out],
        "compiles": sum(r["compiles"] for r in out),
        "requests": sum(r["requests"] for r in out),
        "program_compiles": sum(per_program.values()),
        "programs": len(per_program),
        "max_per_program": max(per_program.values(), default=0),
        "rows": [r["rows"] for r in out],
    }


def run(quick: bool = False) -> dict[str, Any]:
    rounds = 1 if quick else 2
    res: dict[str, list[dict[str, Any]]] = {"alone": [], "lease": [], "off": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="cachectl-bench-fleet-start-") as t:
        tmp = Path(t)
        for r in range(rounds):
            res["alone"].append(_start_fleet(tmp / f"alone{r}", 1, True))
            res["lease"].append(_start_fleet(tmp / f"lease{r}", NODES * PER_NODE, True))
            res["warm"].append(_start_fleet(tmp / f"lease{r}", NODES * PER_NODE, True, again=True))
            res["off"].append(_start_fleet(tmp / f"off{r}", NODES * PER_NODE, False))
    programs = res["alone"][0]["programs"]
    same = all(
        rows == res["alone"][0]["rows"][0] for k in res for x in res[k] for rows in x["rows"]
    )
    return {"runs": res, "programs": programs, "outputs_equal": same}


def markdown(r: dict[str, Any]) -> str:
    runs, programs = r["runs"], r["programs"]
    alone = [x["ready"][0] for x in runs["alone"]]

    def row(name: str, label: str) -> str:
        xs = runs[name]
        slow = [max(x["ready"]) for x in xs]
        ratio = stats([s / a for s, a in zip(slow, alone, strict=True)])
        return (
            f"| {label} | {', '.join(str(x['program_compiles']) for x in xs)} "
            f"(at most {max(x['max_per_program'] for x in xs)} of one program) | "
            f"{', '.join(str(x['compiles']) for x in xs)} | "
            f"{stats(slow)['median']:.1f} s | **{ratio['median']:.2f}x** "
            f"({ratio['min']:.2f}–{ratio['max']:.2f}) |"
        )

    index = runs["lease"][0]["index"]
    return "\n".join(
        [
            SECTION,
            "",
            f"`python -m bench --only fleet_start`. {machine_line()}",
            "",
            f"`examples/serve.py` replicas (prefill and decode: {programs} programs of the manifest) started "
            f"together on a cold cache, {NODES} nodes x {PER_NODE} processes (each node its own HOME; one "
            f"cache root on local disk and one {index} index), {len(alone)} rounds alternating. Compiles are "
            "JAX's own: its monitoring events (requests that use the persistent cache, less hits) and, per "
            "program, its miss log for the manifest's modules.",
            "",
            "| start | compiles of the manifest's programs, each round | all compiles (with JAX's small eager "
            "programs), each round | slowest replica done | slowest / one cold replica alone |",
            "|---|---:|---:|---:|---:|",
            f"| one cold replica alone | {', '.join(str(x['program_compiles']) for x in runs['alone'])} | "
            f"{', '.join(str(x['compiles']) for x in runs['alone'])} | {stats(alone)['median']:.1f} s | 1.00x |",
            row("lease", f"{NODES * PER_NODE} replicas, compile lease on"),
            row("off", f"{NODES * PER_NODE} replicas, `CACHECTL_COMPILE_LEASE=0`"),
            row("warm", f"{NODES * PER_NODE} replicas again, on the cache the lease fleet left"),
            "",
            f"- Every replica's served tokens equal the lone replica's: {r['outputs_equal']}.",
            "- Each replica serves 2 requests with `examples/serve.py --writes` (serving is read-only by "
            "default: a read-only fleet writes nothing to share) and "
            "`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0` (its programs compile in less than JAX's 1 s "
            'threshold for writing an entry). "Done" is from the process\'s start to its last response.',
            "- With the lease one replica compiles each program and the others wait for its entry and read "
            "it; without it each replica compiles every program, all at once. The last row is the floor this "
            "machine sets: the same 6 replicas with nothing to compile, so the lease fleet's time over it is "
            "what waiting for the compiles cost. This machine is shared and has 2 cores: 6 replicas starting "
            "together compete for them (importing JAX, starting the backend), which a fleet of machines does "
            "not; the lone replica and the fleets are timed in the same run, alternating, and only the ratios "
            "are the result.",
            "- The compile counts are exact; the times are this machine's at the load average above (other "
            "work shares it), so the time columns are indications only: the issue's goal (slowest replica "
            "within 1.3x of a lone one) needs a run on a quiet machine with a core per replica.",
            "- Not measured yet (they need the node-local tier): entry fetches per key per node through the "
            "server or a bucket, and a restart's fetches.",
            "",
        ]
    )


if __name__ == "__main__":
    out = run(quick="--quick" in sys.argv)
    text = markdown(out)
    print(text)
    if "--no-write" not in sys.argv:
        write_section(SECTION, text)
