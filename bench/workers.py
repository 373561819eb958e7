"""Does `cachectl serve --workers N` scale with cores? req/s of 1, 2 (and 4) workers on a unix socket.

    python bench/workers.py [--quick] [--out result.json] [--rounds R] [--seconds S]
        [--generators G] [--max-workers 2|4] [--only head,get_4k,api_cache]

Needs nothing but the installed cachectl (with its server extra): no nginx, no wrk, no TCP (the
server listens with ``--uds``, the load speaks HTTP/1.1 keep-alive over the socket), so it runs
where only unix sockets are let through. A cache is seeded with a 4 KiB entry (bench/server.py's
seed); then, in each round and in a new order each round, ``cachectl serve --uds --workers N``
is started pinned to N cores (``sched_setaffinity`` on the server process: uvicorn's workers
inherit it) and driven by one bench/loadgen.py process per remaining core (at most
``--generators``), each pinned to its core with many connections. Three loads, each in its own
window: HEAD and GET of the entry (the fast lane: tens of microseconds of server CPU each, so the
load generators or the machine's socket layer can be the limit before the workers are) and
``api_cache``, GET /caches/NAME through the whole FastAPI stack (auth, an index read, JSON: a
millisecond or more each, so the workers are the limit). Per window: req/s (all generators
together), the server's CPU seconds per request and the cores it kept busy (/proc utime + stime
of the server's process tree). Quoted: medians over rounds with min-max, and the ratio of medians
N workers / 1 worker. ``--out`` is rewritten after each worker count, so a run stopped early
keeps what it measured.

Scaling is only measured where every worker gets a core of its own and the load generators two
more: with fewer than workers + 2 cores the figures are still taken (unpinned, shared cores),
but no ratio is reported and ``refused`` says why. Four workers are measured where 6 cores are
available (unless ``--max-workers 2``). Three rounds take a few minutes (``--quick``: seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine, stats, tree_cpu  # noqa: E402
from bench.server import _seed  # noqa: E402

API = "/api/v1"
CONNECTIONS = 16  # per load generator
LOADGEN = Path(__file__).with_name("loadgen.py")


def plan(cpus: list[int], generators: int | None = None, top: int = 4) -> dict[str, Any]:
    """Which worker counts to measure, on which cores, and whether a scaling figure is honest."""
    if len(cpus) < 2 + 2:
        return {
            "counts": [1, 2],
            "server_cpus": {1: cpus, 2: cpus},
            "client_cpus": [None],
            "refused": f"scaling needs at least 4 cores (2 workers + 2 load generators) and this "
            f"process may use {len(cpus)}: the servers and the load share cores, so req/s here "
            "says nothing about scaling",
        }
    counts = [1, 2, 4] if len(cpus) >= 4 + 2 and top >= 4 else [1, 2]
    top = counts[-1]
    return {
        "counts": counts,
        "server_cpus": {n: cpus[:n] for n in counts},
        "client_cpus": cpus[top:][:generators],
        "refused": None,
    }


def _pin(cpus: list[int] | None) -> Any:
    if cpus is None:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def _healthy(path: str) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            s.connect(path)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            return s.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def _serve(db: str, uds: str, workers: int, cpus: list[int] | None, log: Path) -> Any:
    argv = [sys.executable, "-m", "cachectl", "serve", "--db", db, "--uds", uds]
    argv += ["--workers", str(workers), "--log-level", "warning"]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            argv,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_pin(cpus),  # noqa: PLW1509 - before exec; workers inherit the mask
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"--workers {workers}: exited: {log.read_text()[-2000:]}")
        if _healthy(uds):
            return proc
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"--workers {workers}: not ready in 60 s")


def _load(uds: str, mix: list[Any], clients: list[int | None], seconds: float) -> dict[str, Any]:
    """One load generator per client core, all at once, each sending ``mix``; requests summed."""
    spec = {"uds": uds, "concurrency": CONNECTIONS, "seconds": seconds, "requests_mix": mix}
    procs = [
        subprocess.Popen(
            [sys.executable, str(LOADGEN)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=_pin([c] if c is not None else None),  # noqa: PLW1509
        )
        for c in clients
    ]
    outs = [p.communicate(json.dumps(spec), timeout=seconds + 60)[0] for p in procs]
    results = [json.loads(o) for o in outs]
    errors = sum(r["errors"] for r in results)
    if errors:
        raise RuntimeError(
            f"{[r[0] for r in mix]}: {errors} errors: {[r['error_samples'] for r in results]}"
        )
    return {
        "requests": sum(r["requests"] for r in results),
        "req_per_s": sum(r["req_per_s"] for r in results),
        "load_wall_s": max(r["wall_s"] for r in results),
    }


def _progress(started: float, line: str) -> None:
    """One line per step on stderr, at once: a run that stalls shows where."""
    print(f"[{time.monotonic() - started:6.1f}s] {line}", file=sys.stderr, flush=True)


ROUTES = ("head", "get_4k", "api_cache")


def run(
    quick: bool = False,
    rounds: int | None = None,
    seconds: float | None = None,
    generators: int | None = None,
    max_workers: int = 4,
    only: tuple[str, ...] = ROUTES,
    out: Path | None = None,
) -> dict[str, Any]:
    """Seed, then in each round start each worker count in a new order and load it; stop all.

    Three loads: the fast lane's HEAD and 4 KiB GET (microseconds of server CPU each, where a
    sandbox's socket layer or the load generators can be the limit before the workers are), and
    ``api_cache``, GET /caches/NAME through the whole FastAPI stack (auth, an index read, JSON),
    whose server CPU per request is large enough that the workers are the limit. Each window also
    records how many cores the server kept busy (its CPU seconds over the window's): a count
    that does not scale while its cores are idle is limited by something else, and says so.
    """
    rounds = rounds or (1 if quick else 3)
    seconds = seconds or (0.5 if quick else 3.0)
    started = time.monotonic()
    # Serving bytes needs no accelerator; on a TPU host only one process may hold the chip, and the
    # servers and load generators started here must never wait for it.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    cpus = sorted(os.sched_getaffinity(0))
    p = plan(cpus, generators, max_workers)
    info = machine()
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="cachectl-bench-workers-") as tmp_dir:
        tmp = Path(tmp_dir)
        os.environ.setdefault("XDG_DATA_HOME", str(tmp / "xdg-data"))
        os.environ.setdefault("XDG_CACHE_HOME", str(tmp / "xdg-cache"))
        _progress(started, f"{len(cpus)} cores: seeding the cache")
        seed = _seed(tmp, entries=1, small=4096)
        key, size, _ = seed["keys"][0]
        path = f"{API}/caches/bench/environments/{seed['digest']}/entries/{key}"
        auth = {"Authorization": f"Bearer {seed['reader']}"}
        every = {
            "head": ["head", 1, "HEAD", path, auth, None, 200, size],
            "get_4k": ["get_4k", 1, "GET", path, auth, None, 200, size],
            "api_cache": ["api_cache", 1, "GET", f"{API}/caches/bench", auth, None, 200, None],
        }
        routes = {name: every[name] for name in only}
        cells: dict[int, dict[str, dict[str, list[float]]]] = {
            n: {
                r: {"req_per_s": [], "server_cpu_ms_per_request": [], "server_cores_busy": []}
                for r in routes
            }
            for n in p["counts"]
        }
        for r in range(rounds):
            for n in random.sample(p["counts"], len(p["counts"])):
                uds = str(tmp / f"w{n}-{r}.sock")
                pinned = p["server_cpus"][n] if p["refused"] is None else None
                _progress(started, f"round {r + 1}/{rounds}: starting --workers {n}")
                proc = _serve(seed["db"], uds, n, pinned, tmp / f"server-{n}.log")
                try:
                    # Every worker's caches filled: one window mixing every load.
                    _load(uds, list(routes.values()), p["client_cpus"], min(0.5, seconds))
                    for name, route in routes.items():
                        before, t0 = tree_cpu(proc.pid), time.monotonic()
                        got = _load(uds, [route], p["client_cpus"], seconds)
                        used = tree_cpu(proc.pid) - before
                        window = time.monotonic() - t0
                        cell = cells[n][name]
                        cell["req_per_s"].append(got["req_per_s"])
                        cell["server_cpu_ms_per_request"].append(used / got["requests"] * 1000)
                        # Over the load's own seconds: starting the generators is no server work.
                        cell["server_cores_busy"].append(used / got["load_wall_s"])
                        _progress(
                            started,
                            f"--workers {n} {name}: {got['req_per_s']:.0f} req/s, "
                            f"{cell['server_cpu_ms_per_request'][-1]:.3f} ms CPU/request "
                            f"(load {got['load_wall_s']:.1f} s of a {window:.1f} s window)",
                        )
                finally:
                    proc.terminate()
                    proc.wait(30)
                result = _result(p, cells, routes, info, cpus, rounds, seconds, size, started)
                if out:  # what a run stopped early had measured is kept
                    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _result(
    p: dict[str, Any],
    cells: dict[int, dict[str, dict[str, list[float]]]],
    routes: dict[str, Any],
    info: dict[str, Any],
    cpus: list[int],
    rounds: int,
    seconds: float,
    size: int,
    started: float,
) -> dict[str, Any]:
    workers = {
        str(n): {r: {k: stats(v) for k, v in c.items() if v} for r, c in cell.items()}
        for n, cell in cells.items()
    }
    scaling = None
    if p["refused"] is None:
        scaling = {
            str(n): {
                r: statistics.median(cells[n][r]["req_per_s"])
                / statistics.median(cells[1][r]["req_per_s"])
                for r in routes
                if cells[n][r]["req_per_s"] and cells[1][r]["req_per_s"]
            }
            for n in p["counts"][1:]
        }
    return {
        "machine": info,
        "cpus": len(cpus),
        "pinned": p["refused"] is None,
        "server_cpus": {str(n): c for n, c in p["server_cpus"].items()},
        "load_generators": len(p["client_cpus"]),
        "connections_per_generator": CONNECTIONS,
        "rounds": rounds,
        "seconds": seconds,
        "entry_bytes": size,
        "workers": workers,
        "scaling": scaling,
        "refused": p["refused"],
        "elapsed_s": time.monotonic() - started,
    }


def summary(result: dict[str, Any]) -> str:
    lines = [f"{result['cpus']} cores, {result['load_generators']} load generator(s)"]
    for n, cell in result["workers"].items():
        for route, s in cell.items():
            if not s:
                continue
            rps, cpu = s["req_per_s"], s["server_cpu_ms_per_request"]
            busy = s["server_cores_busy"]["median"]
            ratio = (result["scaling"] or {}).get(n, {}).get(route)
            lines.append(
                f"--workers {n} {route}: {rps['median']:.0f} req/s ({rps['min']:.0f}-{rps['max']:.0f}), "
                f"{cpu['median']:.3f} ms server CPU/request, {busy:.2f} cores busy"
                + (f", {ratio:.2f}x one worker" if ratio else "")
            )
    if result["refused"]:
        lines.append(f"no scaling figure: {result['refused']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--seconds", type=float)
    parser.add_argument("--generators", type=int, help="at most this many load generators")
    parser.add_argument("--max-workers", type=int, default=4, choices=(2, 4))
    parser.add_argument("--only", default=",".join(ROUTES), help=f"loads, of {','.join(ROUTES)}")
    parser.add_argument("--out", type=Path, help="write the result as JSON here (after each count)")
    args = parser.parse_args(argv)
    only = tuple(r for r in args.only.split(",") if r)
    if not only or set(only) - set(ROUTES):
        parser.error(f"--only: name loads of {', '.join(ROUTES)}")
    result = run(
        args.quick, args.rounds, args.seconds, args.generators, args.max_workers, only, args.out
    )
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
