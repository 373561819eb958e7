"""ASGI servers side by side on cachectl's app: uvicorn (`cachectl serve`), hypercorn and granian.

    python bench/asgi.py [--quick] [--no-write]

Every server runs the same app over the same SQLite index and local root (bench/server.py's seed
plus a 64 MiB entry), one worker, pinned to CPU 0 (``taskset``); the clients are pinned to CPU 1.
uvicorn is the real `cachectl serve` process (downloads by ``sendfile``, server/zero_copy.py); the
others serve bench/asgi_app.py's ``app``: "uvicorn (no fast lane)" serves that app without
server/fast_lane.py, and "uvicorn (read and write)" without zero-copy sends, each under uvicorn
configured as `cachectl serve` configures it (the lane's and sendfile's gains, side by side).
granian is run twice: the product's download route (it reads and writes the bytes, as under
uvicorn), and bench/asgi_app.py's pathsend download (the same route and auth; the open file handed
to granian by the ``http.response.pathsend`` extension: a measurement, not shippable as it is, see
that module). Per server, in one run:

* HEAD of an entry at 16 keep-alive clients (bench/loadgen.py, raw HTTP/1.1) for 3 s, in rounds
  that alternate over the servers (3; --quick 1): req/s, p99, and the server's CPU per request
  (from /proc, summed over the server's processes), each the median over the rounds;
* GET of a 1 MiB and a 64 MiB entry over one keep-alive connection from bench/server.py's
  blocking client, against ``open().read()`` of the same file: rounds alternate over every server
  and the disk read, so other load on the machine hits each alike. Medians.

Writes the ``## ASGI servers`` section of BENCHMARKS.md. Needs ``pip install granian hypercorn``
(in no extra: `cachectl serve` runs uvicorn only), so it is not one of ``python -m bench``'s modules.
"""

from __future__ import annotations

import argparse
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

from bench.common import BENCHMARKS, REPO, machine, machine_line, tree_cpu, write_section  # noqa: E402
from bench.loadgen import _request  # noqa: E402
from bench.server import (  # noqa: E402
    API,
    CLIENT_CPU,
    SERVER_CPU,
    _free_port,
    _loadgen,
    _pinned,
    _RawClient,
    _routes,
    _seed,
    _start_server,
)

SECTION = "## ASGI servers"
BIG = 64 << 20
GOALS = {"ratio_1mib": 3.0, "head_rps": 3000.0, "head_p99_ms": 20.0, "head_cpu_ms": 0.3}


def _seed_big(seed: dict[str, Any]) -> tuple[str, int, str]:
    """A 64 MiB entry next to the seed's: (key, size, path)."""
    from cachectl.index import NewEntry, open_index
    from cachectl.storage.entries import make_entry, sha256
    from cachectl.storage.store import Store

    key = f"jit_bench_big-{sha256(b'big')}"
    data = make_entry(os.urandom(BIG), compile_seconds=1)
    Store(seed["root"]).write_bytes(f"{seed['env'].namespace}/{key}-cache", data)
    index = open_index(seed["db"])
    info = index.ensure_environment("bench", seed["env"])
    index.upsert_entries(
        info.id,
        [
            NewEntry(
                key=key, module="jit_bench_big", size=len(data), sha256=sha256(data), origin="warm"
            )
        ],
    )
    index.close()
    return key, len(data), str(Path(seed["root"]) / seed["env"].namespace / f"{key}-cache")


def _command(server: str, port: int) -> list[str]:
    py = sys.executable
    if server == "hypercorn":
        return [py, "-m", "hypercorn", "--bind", f"127.0.0.1:{port}", "--workers", "1"]
    if server.startswith("granian"):
        return [
            py,
            "-m",
            "granian",
            "--interface",
            "asgi",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--runtime-threads",
            "1",
            "--loop",
            "uvloop",
            "--no-log",
        ]
    if server in ("uvicorn (no fast lane)", "uvicorn (read and write)"):
        return [py, str(REPO / "bench" / "asgi_app.py"), str(port)]
    raise ValueError(server)


def _start(server: str, seed: dict[str, Any], tmp: Path) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    log = tmp / f"{server}.log"
    if server == "uvicorn":
        return _start_server(seed["db"], port, log, cpu=SERVER_CPU), port
    import httpx

    pythonpath = os.pathsep.join([str(REPO), str(REPO / ".pp"), os.environ.get("PYTHONPATH", "")])
    env = {
        **os.environ,
        "CACHECTL_DB": seed["db"],
        "PYTHONPATH": pythonpath,
        "CACHECTL_BENCH_PATHSEND": "1" if server == "granian (pathsend)" else "0",
        "CACHECTL_BENCH_NO_FAST_LANE": "1" if server == "uvicorn (no fast lane)" else "0",
        "CACHECTL_BENCH_NO_ZERO_COPY": "1" if server == "uvicorn (read and write)" else "0",
    }
    command = _command(server, port)
    if not server.startswith("uvicorn"):
        command.append("bench.asgi_app:app")
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [*_pinned(SERVER_CPU), *command],
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=REPO,
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{server} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{server} did not start")


def _head(port: int, pid: int, seed: dict[str, Any], seconds: float) -> dict[str, Any]:
    route = _routes(seed)["HEAD entry"]
    before = tree_cpu(pid)
    out = _loadgen(
        {
            "host": "127.0.0.1",
            "port": port,
            "concurrency": 16,
            "seconds": seconds,
            "requests_mix": [route],
        }
    )
    cpu = tree_cpu(pid) - before
    return {
        "req_per_s": out["req_per_s"],
        "p50_ms": out["p50_ms"],
        "p99_ms": out["p99_ms"],
        "errors": out["errors"],
        "error_samples": out["error_samples"],
        "cpu_ms": cpu / max(out["requests"], 1) * 1000,
    }


def _median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds; errors summed."""
    out: dict[str, Any] = {
        k: statistics.median(r[k] for r in rounds)
        for k in ("req_per_s", "p50_ms", "p99_ms", "cpu_ms")
    }
    out["errors"] = sum(r["errors"] for r in rounds)
    out["error_samples"] = [r["error_samples"] for r in rounds if r["errors"]]
    out["rounds"] = len(rounds)
    return out


def _same_bytes(ports: dict[str, int], url: str, headers: dict[str, str], path: str) -> None:
    """Every server sends the file's own bytes (timed with a client that counts them only)."""
    import hashlib

    import httpx

    want = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    for server, port in ports.items():
        got = httpx.get(f"http://127.0.0.1:{port}{url}", headers=headers, timeout=60)
        if got.status_code != 200 or hashlib.sha256(got.content).hexdigest() != want:
            raise RuntimeError(f"{server} sent other bytes for {url} ({got.status_code})")


def _downloads(
    ports: dict[str, int], seed: dict[str, Any], big: tuple[str, int, str], reps: dict[str, int]
) -> dict[str, dict[str, float]]:
    """Median ms of a GET per server and of open().read(), per size, alternating rounds."""
    base = f"{API}/caches/bench/environments/{seed['digest']}/entries"
    headers = {"Authorization": f"Bearer {seed['reader']}"}
    sizes = {
        "1 MiB": (seed["big"][0], seed["big"][1], seed["big_path"]),
        "64 MiB": big,
    }
    out: dict[str, dict[str, float]] = {}
    everywhere = os.sched_getaffinity(0)
    for label, (key, size, path) in sizes.items():
        clients = {
            server: _RawClient(
                port, _request("GET", f"{base}/{key}", f"127.0.0.1:{port}", headers, None), size
            )
            for server, port in ports.items()
        }
        times: dict[str, list[float]] = {name: [] for name in [*clients, "disk"]}
        _same_bytes(ports, f"{base}/{key}", headers, path)
        try:
            if _pinned(CLIENT_CPU):
                os.sched_setaffinity(0, {int(CLIENT_CPU)})
            for client in clients.values():
                client.get()  # warm: the connection, the server's first-request work
            per_round = 5 if reps[label] >= 10 else 1
            for _ in range(max(reps[label] // per_round, 1)):
                for name, client in clients.items():
                    times[name] += [client.get() for _ in range(per_round)]
                for _ in range(per_round):
                    started = time.perf_counter()
                    with open(path, "rb") as fh:
                        data = fh.read()
                    times["disk"].append(time.perf_counter() - started)
                    assert len(data) == size
                    del data
        finally:
            os.sched_setaffinity(0, everywhere)
            for client in clients.values():
                client.close()
        out[label] = {name: statistics.median(v) * 1000 for name, v in times.items()}
    return out


SERVERS = (
    "uvicorn",
    "uvicorn (no fast lane)",
    "uvicorn (read and write)",
    "hypercorn",
    "granian (no pathsend)",
    "granian (pathsend)",
)


def run(quick: bool = False) -> dict[str, Any]:
    info = machine()
    with tempfile.TemporaryDirectory(prefix="cachectl-bench-asgi-") as tmp_dir:
        tmp = Path(tmp_dir)
        os.environ.setdefault("XDG_DATA_HOME", str(tmp / "xdg-data"))
        os.environ.setdefault("XDG_CACHE_HOME", str(tmp / "xdg-cache"))
        seed = _seed(tmp)
        big = _seed_big(seed)
        procs: dict[str, tuple[subprocess.Popen, int]] = {}
        try:
            for server in SERVERS:
                procs[server] = _start(server, seed, tmp)
            rounds: dict[str, list[dict[str, Any]]] = {server: [] for server in procs}
            for _ in range(1 if quick else 3):  # rounds alternate over the servers
                for server, (proc, port) in procs.items():
                    rounds[server].append(_head(port, proc.pid, seed, seconds=3))
            heads = {server: _median_round(r) for server, r in rounds.items()}
            downloads = _downloads(
                {server: port for server, (_proc, port) in procs.items()},
                seed,
                big,
                {"1 MiB": 20 if quick else 100, "64 MiB": 5 if quick else 20},
            )
        finally:
            for proc, _port in procs.values():
                proc.terminate()
            for proc, _port in procs.values():
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
        logs = {s: (tmp / f"{s}.log").read_text(errors="replace") for s in SERVERS}
    return {
        "quick": quick,
        "machine": info,
        "pinned": bool(_pinned(SERVER_CPU)),
        "head": heads,
        "downloads": downloads,
        "server_errors_logged": {
            s: text.count("ERROR") + text.count("Traceback") for s, text in logs.items()
        },
        "versions": _versions(),
    }


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("uvicorn", "hypercorn", "granian", "starlette")}


def _mark(ok: bool) -> str:
    return "met" if ok else "**not met**"


def markdown(result: dict[str, Any]) -> str:
    v, dl = result["versions"], result["downloads"]
    head = result["head"]
    lines = [
        SECTION,
        "",
        f"`python bench/asgi.py{' --quick' if result['quick'] else ''}` — the same app (SQLite index, "
        f"local root) on each server, one worker, "
        + (
            "the server pinned to CPU 0 and every client to CPU 1 (`taskset`)"
            if result["pinned"]
            else "unpinned (fewer than 2 CPUs or no taskset)"
        )
        + f"; all servers up at once, measured in rounds that alternate over them. "
        f"uvicorn {v['uvicorn']} is `cachectl serve` itself (httptools, uvloop, the bounded head); "
        f"hypercorn {v['hypercorn']} (asyncio) and granian {v['granian']} (uvloop, 1 runtime thread) "
        'serve bench/asgi_app.py\'s app; "uvicorn (no fast lane)" serves it without server/fast_lane.py, '
        '"uvicorn (read and write)" without server/zero_copy.py (each download read in its thread hop '
        "and written, as before it), both under uvicorn configured as `cachectl serve` "
        "(bench/asgi_app.py's `__main__`); `cachectl serve` sends a file on local disk with "
        "`sendfile`. "
        '"granian (no pathsend)" runs the product\'s download route '
        "(it reads an entry up to 4 MiB whole and writes it, streams above, as under uvicorn); "
        '"granian (pathsend)" the same route and auth with bench/asgi_app.py\'s download, which hands '
        "granian the open file by ASGI `http.response.pathsend` (`/proc/self/fd/N`: the inode opened "
        f"with O_NOFOLLOW and checked). {machine_line(result['machine'])}",
        "",
        f"HEAD of an entry at 16 keep-alive clients (bench/loadgen.py), {head[SERVERS[0]]['rounds']} "
        "round(s) of 3 s alternating over the servers, medians; server CPU from /proc over the "
        "server's processes. GET: one keep-alive connection, blocking client, medians, vs "
        "`open().read()` of the same file in the same rounds.",
        "",
        "| server | HEAD req/s | HEAD p99 ms | CPU ms/HEAD | 1 MiB GET ms | vs read | 64 MiB GET ms | vs read | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in SERVERS:
        h = head[s]
        one, big = dl["1 MiB"], dl["64 MiB"]
        lines.append(
            f"| {s} | {h['req_per_s']:.0f} | {h['p99_ms']:.1f} | {h['cpu_ms']:.2f} | "
            f"{one[s]:.2f} | {one[s] / one['disk']:.1f}x | {big[s]:.1f} | {big[s] / big['disk']:.1f}x | "
            f"{h['errors']} |"
        )
    lines += [
        f"| `open().read()` | | | | {dl['1 MiB']['disk']:.2f} | 1x | {dl['64 MiB']['disk']:.1f} | 1x | |",
        "",
        "Goals (1 MiB GET ≤ 3x `open().read()`; HEAD ≥ 3,000 req/s with p99 < 20 ms at 16 clients; "
        "≤ 0.3 ms server CPU per HEAD):",
        "",
    ]
    for s in SERVERS:
        h = head[s]
        ratio = dl["1 MiB"][s] / dl["1 MiB"]["disk"]
        lines.append(
            f"- {s}: 1 MiB {ratio:.1f}x {_mark(ratio <= GOALS['ratio_1mib'])}; "
            f"HEAD {h['req_per_s']:.0f} req/s, p99 {h['p99_ms']:.1f} ms "
            f"{_mark(h['req_per_s'] >= GOALS['head_rps'] and h['p99_ms'] < GOALS['head_p99_ms'])}; "
            f"CPU {h['cpu_ms']:.2f} ms/HEAD {_mark(h['cpu_ms'] <= GOALS['head_cpu_ms'])}."
        )
    uv, nl, gr = head["uvicorn"], head["uvicorn (no fast lane)"], head["granian (no pathsend)"]
    rw = "uvicorn (read and write)"
    one, big = dl["1 MiB"], dl["64 MiB"]
    others = [s for s in SERVERS if not s.startswith("uvicorn")]
    best = max(others, key=lambda s: head[s]["req_per_s"] / head[s]["cpu_ms"])
    better = (
        head[best]["req_per_s"] > 1.15 * uv["req_per_s"]
        and head[best]["cpu_ms"] < 0.87 * uv["cpu_ms"]
    )
    lines += [
        "",
        "The fast lane (server/fast_lane.py: GET and HEAD of stored bytes answered before FastAPI "
        "routes them, by the routes' own functions) side by side with FastAPI's routing under the "
        f"same uvicorn: HEAD at {uv['req_per_s'] / nl['req_per_s']:.2f}x the rate for "
        f"{uv['cpu_ms'] / nl['cpu_ms']:.2f}x the CPU per request (p99 {uv['p99_ms']:.1f} ms against "
        f"{nl['p99_ms']:.1f} ms); the 1 MiB GET in {one['uvicorn'] / one['uvicorn (no fast lane)']:.2f}x "
        f"the time, the 64 MiB GET in {big['uvicorn'] / big['uvicorn (no fast lane)']:.2f}x. "
        "server/zero_copy.py's `sendfile` side by side with reading each download in its thread hop "
        f"and writing it: the 1 MiB GET in {one['uvicorn'] / one[rw]:.2f}x the time, the 64 MiB GET "
        f"in {big['uvicorn'] / big[rw]:.2f}x. "
        'hypercorn and granian serve the same app, lane included, except "granian (pathsend)", '
        "whose download replaces the route's and so runs without it. Side by side with `cachectl "
        f"serve`: granian answers HEAD at {gr['req_per_s'] / uv['req_per_s']:.2f}x uvicorn's rate "
        f"for {gr['cpu_ms'] / uv['cpu_ms']:.2f}x its CPU per request, hypercorn at "
        f"{head['hypercorn']['req_per_s'] / uv['req_per_s']:.2f}x; the 1 MiB GET is "
        f"{one['granian (no pathsend)'] / one['uvicorn']:.2f}x uvicorn's time on granian and "
        f"{one['granian (pathsend)'] / one['uvicorn']:.2f}x with pathsend, the 64 MiB GET "
        f"{big['granian (no pathsend)'] / big['uvicorn']:.2f}x and "
        f"{big['granian (pathsend)'] / big['uvicorn']:.2f}x (two shared cores: compare the ratios, "
        "not the absolute figures).",
        "",
        "The 1 MiB goal is below what HTTP over loopback costs on this machine: the `## Server` "
        "section's floors, a minimal server that only opens, reads and writes the file, and one that "
        "sends it with `loop.sendfile`, are each several times `open().read()`, and `GET /healthz` "
        "alone, through `cachectl serve`, takes longer than the goal allows a whole download. "
        "granian's pathsend opens "
        "`/proc/self/fd/N` and `read`s it in 128 KiB chunks into `writev` (strace: no `sendfile`, "
        "`splice` or `copy_file_range`), so at 1 MiB it is no faster than reading the file and "
        "writing it in one write; "
        "and, as granian implements it, it cannot be shipped "
        "safely: granian opens the path after `send` has returned and signals nothing when it has, so "
        "the descriptor behind `/proc/self/fd/N` has no bounded lifetime (closed early and reused, it "
        "would send another file), and a plain name would be opened following symlinks, against "
        "server/entry_routes.py's rule. "
        + (
            f"{best} is better than uvicorn on these figures (more than 1.15x the HEAD rate for less "
            "than 0.87x the CPU): a candidate for `cachectl serve`."
            if better
            else f"No other server is better than uvicorn on these figures by more than this machine's "
            f"noise (the best, {best}, more than 1.15x the HEAD rate for less than 0.87x the CPU would "
            "be): `cachectl serve` stays on uvicorn alone, no `--server` option, no new package in "
            "the `server` extra."
        ),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 s of HEAD, fewer GETs")
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    args = parser.parse_args(argv)
    result = run(quick=args.quick)
    print(json.dumps(result, indent=2))
    if not args.no_write:
        write_section(SECTION, markdown(result))
        print(f"wrote the {SECTION!r} section of {BENCHMARKS}", file=sys.stderr)
    errors = sum(h["errors"] for h in result["head"].values())
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
