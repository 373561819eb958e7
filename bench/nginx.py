"""The server against nginx on the same files: CPU per request and 1 MiB GET latency, and workers.

    python bench/nginx.py [--quick] [--no-write]

Three servers over one cache root, all started here and pinned to CPU 0 (``taskset``), with the
load generator pinned to CPU 1: wrk (C, one thread; scripts/test installs it beside nginx) for
GETs, bench/loadgen.py (Python, raw HTTP/1.1 keep-alive) for HEAD (Debian's wrk 4.1 waits for a
body after a HEAD) and for everything where wrk is missing; the table says which.

- ``cachectl serve`` (one worker), which checks the token and sends the file itself (``sendfile``);
- the recipe of server/accel.py: nginx in front of ``cachectl serve --accel-redirect``, with the
  configuration ``cachectl serve --print-nginx-config`` prints (one nginx worker); cachectl
  checks the token (nginx keeps its answer for as long as cachectl says), nginx sends the bytes;
- nginx alone (one worker) serving the same files from an ``alias``: no token, no index, and no
  check for links below the root (the recipe's ``disable_symlinks``: an ``openat`` per level), as
  a user would serve a directory (the peer). sendfile, tcp_nopush and keep-alive are the same.

Figures, each measured on every server in each round, the servers in a new order each round:
1 MiB GET on one keep-alive connection (median latency, and CPU per request), HEAD and 4 KiB GET
from 16 keep-alive connections (server CPU per request: /proc utime + stime of the server's
processes over the window, divided by the requests answered). CPU of the recipe is nginx's and
cachectl's together.

Then workers: 4 KiB GET from 32 connections against ``cachectl serve --workers 2`` and against one
worker, alternating. A machine with two cores cannot give two workers two whole cores and the
load generator one more, so each window also records where the CPU went (/proc): each worker's
CPU seconds, the load generator's, and the rest of the machine's (other users). Quoted: req/s,
and requests per server CPU second (does a second worker make each request dearer?), with the
cores the servers and the load generator used. Medians over rounds with min-max; ratios of medians.
Needs nginx (scripts/test installs it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
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

from bench.common import machine, machine_line, stats, tree_cpu, write_section  # noqa: E402
from bench.server import _free_port, _pinned  # noqa: E402
from bench.server import _seed as _server_seed  # noqa: E402

SECTION = "## Server against nginx"
API = "/api/v1"
SERVER_CPU, CLIENT_CPU = "0", "1"
PREFIX = "/_cachectl_files/"
_TICK = os.sysconf("SC_CLK_TCK")


def _nginx() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/sbin/nginx") if os.access(p, os.X_OK)), None
    )


def _seed(tmp: Path) -> dict[str, Any]:
    """One cache on local disk with a 1 MiB and a 4 KiB entry, and a reader token (the server
    bench's seed, cut to those two)."""
    seed = _server_seed(tmp, entries=1, small=4096)
    (small_key, small_size, _), (big_key, big_size, _) = seed["keys"][0], seed["big"]
    return {
        **seed,
        "namespace": seed["env"].namespace,
        "files": {"big": (big_key, big_size), "small": (small_key, small_size)},
    }


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    import httpx

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: exited: {log.read_text()[-2000:]}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{url}: did not start")


def _start(argv: list[str], log: Path, url: str, env: dict[str, str] | None = None) -> Any:
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
    _wait_http(url, proc, log)
    return proc


def _serve(seed: dict[str, Any], port: int, log: Path, *extra: str, cpu: str | None) -> Any:
    argv = [*_pinned(cpu), sys.executable, "-m", "cachectl", "serve", "--db", seed["db"]]
    argv += ["--port", str(port), "--log-level", "warning", *extra]
    return _start(argv, log, f"http://127.0.0.1:{port}/healthz")


def _direct_config(root: str, port: int) -> str:
    """nginx alone: the cache root's files under /files/, one worker, as the recipe's nginx runs."""
    user = "user root;" if os.geteuid() == 0 else ""
    return f"""daemon off;
{user}
worker_processes 1;
pid nginx-direct.pid;
error_log stderr warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 100000;
    client_body_temp_path tmp/client_body;
    proxy_temp_path tmp/proxy;
    fastcgi_temp_path tmp/fastcgi;
    uwsgi_temp_path tmp/uwsgi;
    scgi_temp_path tmp/scgi;
    server {{
        listen 127.0.0.1:{port};
        location /files/ {{
            alias {root}/;
            types {{ }}
            default_type application/octet-stream;
        }}
    }}
}}
"""


def _nginx_proc(nginx: str, prefix: Path, name: str, text: str, port: int) -> Any:
    conf = prefix / f"{name}.conf"
    conf.write_text(text)
    argv = [*_pinned(SERVER_CPU), nginx, "-p", str(prefix), "-c", str(conf), "-e", "stderr"]
    return _start(argv, prefix / f"{name}.log", f"http://127.0.0.1:{port}/")


_WRK_SCRIPT = """
wrk.method = os.getenv("BENCH_METHOD")
if os.getenv("BENCH_AUTH") ~= "" then wrk.headers["Authorization"] = os.getenv("BENCH_AUTH") end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, "errors": %d}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect + e.read + e.write + e.status + e.timeout))
end
"""


def _wrk() -> str | None:
    return shutil.which("wrk")


def _load(
    port: int, path: str, method: str, headers: dict[str, str], length: int, conc: int, secs: float
) -> dict[str, Any]:
    """One window of load from CLIENT_CPU: wrk where installed, else bench/loadgen.py, which also
    sends every HEAD (Debian's wrk 4.1 waits for a body after a HEAD's headers). Adds the load
    generator's own CPU seconds (``client_cpu_s``)."""
    wrk = _wrk()
    if wrk is not None and method != "HEAD":
        return _wrk_load(wrk, port, path, method, headers, conc, secs)
    spec = {
        "host": "127.0.0.1",
        "port": port,
        "concurrency": conc,
        "seconds": secs,
        "requests_mix": [[method, 1, method, path, headers, None, 200, length]],
    }
    loadgen = Path(__file__).resolve().parent / "loadgen.py"
    out, cpu = _child([*_pinned(CLIENT_CPU), sys.executable, str(loadgen), json.dumps(spec)], None)
    return {**json.loads(out), "client_cpu_s": cpu}


def _child(argv: list[str], env: dict[str, str] | None) -> tuple[str, float]:
    """A child's stdout and CPU seconds (its rusage: it and its own children)."""
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.PIPE, env=env)
        _pid, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        err = proc.stderr.read().decode() if proc.stderr else ""
        if proc.returncode != 0:
            raise RuntimeError(f"{argv[0]}: exit {proc.returncode}: {err[-2000:]}")
        out.seek(0)
        return out.read().decode(), usage.ru_utime + usage.ru_stime


def _wrk_load(
    wrk: str, port: int, path: str, method: str, headers: dict[str, str], conc: int, secs: float
) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as fh:
        fh.write(_WRK_SCRIPT)
    try:
        env = {**os.environ, "BENCH_METHOD": method}
        env["BENCH_AUTH"] = headers.get("Authorization", "")
        argv = [*_pinned(CLIENT_CPU), wrk, "-t1", f"-c{conc}", f"-d{max(1, round(secs))}s"]
        argv += ["--timeout", "10s", "-s", fh.name, f"http://127.0.0.1:{port}{path}"]
        out, cpu = _child(argv, env)
    finally:
        os.unlink(fh.name)
    got = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    seconds = got["duration_us"] / 1e6
    return {
        "requests": got["requests"],
        "req_per_s": got["requests"] / seconds,
        "p50_ms": got["p50_us"] / 1000,
        "p99_ms": got["p99_us"] / 1000,
        "errors": got["errors"],
        "error_samples": [] if not got["errors"] else [f"{got['errors']} errors (wrk)"],
        "client_cpu_s": cpu,
    }


def run(quick: bool = False) -> dict[str, Any]:
    nginx = _nginx()
    if nginx is None:
        return {"skipped": "nginx is not installed (scripts/test installs it)"}
    rounds, secs = (3, 1.0) if quick else (5, 2.0)
    tmp = Path(tempfile.mkdtemp(prefix="cachectl-bench-nginx-"))
    procs: list[Any] = []
    try:
        seed = _seed(tmp)
        (tmp / "nginx" / "tmp").mkdir(parents=True)
        auth = {"Authorization": f"Bearer {seed['reader']}"}
        p_plain, p_accel, p_recipe, p_direct = (_free_port() for _ in range(4))
        plain = _serve(seed, p_plain, tmp / "plain.log", cpu=SERVER_CPU)
        accel = _serve(seed, p_accel, tmp / "accel.log", "--accel-redirect", PREFIX, cpu=SERVER_CPU)
        procs += [plain, accel]
        printed = subprocess.run(
            [sys.executable, "-m", "cachectl", "serve", "--db", seed["db"], "--port", str(p_accel)]
            + ["--accel-redirect", PREFIX, "--print-nginx-config"]
            + ["--nginx-listen", f"127.0.0.1:{p_recipe}"]
            + (["--nginx-user", "root"] if os.geteuid() == 0 else []),
            capture_output=True,
            text=True,
            check=True,
        ).stdout.replace("worker_processes auto;", "worker_processes 1;")
        recipe = _nginx_proc(nginx, tmp / "nginx", "recipe", printed, p_recipe)
        direct = _nginx_proc(
            nginx, tmp / "nginx", "direct", _direct_config(seed["root"], p_direct), p_direct
        )
        procs += [recipe, direct]
        servers = {
            "cachectl": (p_plain, [plain], True),
            "recipe": (p_recipe, [recipe, accel], True),
            "nginx": (p_direct, [direct], False),
        }

        def path_of(name: str, with_api: bool) -> str:
            key = seed["files"][name][0]
            if with_api:
                return f"{API}/caches/bench/environments/{seed['digest']}/entries/{key}"
            return f"/files/{seed['namespace']}/{key}-cache"

        figures = {  # name: (file, method, connections)
            "get_1mib": ("big", "GET", 1),
            "head": ("small", "HEAD", 16),
            "get_4kib": ("small", "GET", 16),
        }
        samples: dict[str, dict[str, dict[str, list[float]]]] = {
            f: {s: {"cpu_ms": [], "p50_ms": [], "req_per_s": []} for s in servers} for f in figures
        }
        order = [(f, s) for f in figures for s in servers]
        for _ in range(rounds):
            random.shuffle(order)
            for fig, server in order:
                port, pids, with_api = servers[server]
                name, method, conc = figures[fig]
                headers = auth if with_api else {}
                before = sum(tree_cpu(p.pid) for p in pids)
                got = _load(
                    port,
                    path_of(name, with_api),
                    method,
                    headers,
                    seed["files"][name][1],
                    conc,
                    secs,
                )
                used = sum(tree_cpu(p.pid) for p in pids) - before
                if got["errors"]:
                    raise RuntimeError(f"{server} {fig}: {got['error_samples']}")
                cell = samples[fig][server]
                cell["cpu_ms"].append(used / got["requests"] * 1000)
                cell["p50_ms"].append(float(got["p50_ms"]))
                cell["req_per_s"].append(float(got["req_per_s"]))
        for p in procs:
            p.terminate()
            p.wait(20)
        procs.clear()
        workers = _workers(seed, tmp, rounds, secs, auth, path_of("small", True))
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    result: dict[str, Any] = {"rounds": rounds, "seconds": secs, "machine": machine()}
    result["load_generator"] = (
        "wrk, one thread; HEAD from bench/loadgen.py, raw HTTP/1.1 keep-alive"
        if _wrk()
        else "bench/loadgen.py, raw HTTP/1.1 keep-alive"
    )
    for fig, cells in samples.items():
        result[fig] = {s: {k: stats(v) for k, v in cell.items()} for s, cell in cells.items()}
        for s in ("cachectl", "recipe"):
            for k in ("cpu_ms", "p50_ms"):
                result[fig][f"{s}_over_nginx_{k}"] = statistics.median(
                    cells[s][k]
                ) / statistics.median(cells["nginx"][k])
    result["workers"] = workers
    return result


def _machine_busy() -> float:
    """CPU seconds the whole machine has spent busy (/proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / _TICK


def _worker_pids(master: int) -> list[int]:
    """The server processes under ``master`` (uvicorn's workers), or the master itself."""
    kids = []
    for task in Path(f"/proc/{master}/task").iterdir():
        kids += [int(c) for c in (task / "children").read_text().split()]
    return kids or [master]


def _workers(
    seed: dict[str, Any], tmp: Path, rounds: int, secs: float, auth: dict[str, str], path: str
) -> dict[str, Any]:
    """4 KiB GET from 32 connections: `--workers 2` against one worker, alternating, each window
    with where the machine's CPU went (server processes one by one, the load generator, the rest).
    A GET, so that wrk (C) sends it where installed: it takes least from the workers' cores."""
    size = seed["files"]["small"][1]
    keys = ("req_per_s", "req_per_server_cpu_s", "server_cores", "client_cores", "other_cores")
    samples: dict[str, dict[str, list[float]]] = {n: {k: [] for k in keys} for n in ("1", "2")}
    shares: dict[str, list[list[float]]] = {"1": [], "2": []}
    for _ in range(rounds):
        for n in random.sample(["1", "2"], 2):
            port = _free_port()
            # One worker on CPU 0 (the load generator has CPU 1); two may use both cores.
            cpu = SERVER_CPU if n == "1" else f"{SERVER_CPU},{CLIENT_CPU}"
            proc = _serve(seed, port, tmp / f"workers-{n}.log", "--workers", n, cpu=cpu)
            try:
                _load(port, path, "GET", auth, size, 32, 1.0)  # every worker's caches filled
                pids = [proc.pid] if n == "1" else _worker_pids(proc.pid)
                before = [tree_cpu(p) for p in pids]
                busy, started = _machine_busy(), time.monotonic()
                got = _load(port, path, "GET", auth, size, 32, secs)
                wall = time.monotonic() - started
                used = [tree_cpu(p) - b for p, b in zip(pids, before, strict=True)]
                busy = _machine_busy() - busy
                if got["errors"]:
                    raise RuntimeError(f"--workers {n}: {got['error_samples']}")
            finally:
                proc.terminate()
                proc.wait(30)
            cell = samples[n]
            cell["req_per_s"].append(float(got["req_per_s"]))
            cell["req_per_server_cpu_s"].append(got["requests"] / sum(used))
            cell["server_cores"].append(sum(used) / wall)
            cell["client_cores"].append(got["client_cpu_s"] / wall)
            cell["other_cores"].append(max(0.0, busy - sum(used) - got["client_cpu_s"]) / wall)
            shares[n].append(sorted((u / sum(used) for u in used), reverse=True))
    one, two = samples["1"], samples["2"]
    return {
        "one": {k: stats(v) for k, v in one.items()},
        "two": {k: stats(v) for k, v in two.items()},
        "two_worker_cpu_shares": shares["2"],
        "ratio": statistics.median(two["req_per_s"]) / statistics.median(one["req_per_s"]),
        "per_cpu_ratio": statistics.median(two["req_per_server_cpu_s"])
        / statistics.median(one["req_per_server_cpu_s"]),
    }


def _r(s: dict[str, float], digits: int = 3) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def markdown(result: dict[str, Any]) -> str:
    if "skipped" in result:
        return f"{SECTION}\n\nSkipped: {result['skipped']}.\n"
    lines = [
        SECTION,
        "",
        "`python bench/nginx.py` (bench/nginx.py): `cachectl serve`, nginx in front of "
        "`cachectl serve --accel-redirect` (the recipe, server/accel.py, with the configuration "
        "`cachectl serve --print-nginx-config` prints) and nginx alone on the same files, each "
        "one process (one nginx worker) pinned to CPU 0, the load generator "
        f"({result.get('load_generator', 'bench/loadgen.py')}) on CPU 1; "
        f"{result['rounds']} rounds of {result['seconds']:g} s per figure and server, in a new "
        f"order each round. {machine_line(result['machine'])} Medians (min–max); ratios of medians.",
        "",
        "| figure | cachectl serve | recipe (nginx + cachectl) | nginx alone | cachectl / nginx | recipe / nginx |",
        "|---|---|---|---|---|---|",
    ]
    names = {
        "get_1mib": ("1 MiB GET, one keep-alive connection: latency, ms", "p50_ms"),
        "get_1mib_cpu": ("1 MiB GET: server CPU per request, ms", "cpu_ms"),
        "head": ("HEAD, 16 connections: server CPU per request, ms", "cpu_ms"),
        "get_4kib": ("4 KiB GET, 16 connections: server CPU per request, ms", "cpu_ms"),
    }
    for label, (title, key) in names.items():
        fig = result["get_1mib" if label == "get_1mib_cpu" else label]
        lines.append(
            f"| {title} | {_r(fig['cachectl'][key])} | {_r(fig['recipe'][key])} | "
            f"{_r(fig['nginx'][key])} | {fig[f'cachectl_over_nginx_{key}']:.2f}x | "
            f"{fig[f'recipe_over_nginx_{key}']:.2f}x |"
        )
    w = result["workers"]
    busiest = [max(x) for x in w["two_worker_cpu_shares"]]
    lines += [
        "",
        "4 KiB GET from 32 keep-alive connections, `cachectl serve --workers 2` against one worker, "
        f"alternating, {result['rounds']} rounds. One worker is pinned to CPU 0 with the load "
        "generator on CPU 1; two workers may use both CPUs, which the load generator shares with "
        "them (this machine has two cores, and other users). Cores used are CPU seconds per "
        "second of the window, from /proc: the server's processes, the load generator's, and the "
        "rest of the machine's.",
        "",
        "| workers | 4 KiB GET req/s | requests per server CPU second | server cores | load generator cores | other cores |",
        "|---|---|---|---|---|---|",
    ]
    for label, cell in (("1", w["one"]), ("2", w["two"])):
        lines.append(
            f"| {label} | {_r(cell['req_per_s'], 0)} | {_r(cell['req_per_server_cpu_s'], 0)} | "
            f"{_r(cell['server_cores'], 2)} | {_r(cell['client_cores'], 2)} | "
            f"{_r(cell['other_cores'], 2)} |"
        )
    lines += [
        f"| 2 / 1 | {w['ratio']:.2f}x | {w['per_cpu_ratio']:.2f}x | | | |",
        "",
        f"With two workers, the busier worker did {min(busiest):.0%}–{max(busiest):.0%} of the "
        "servers' CPU work.",
        "",
        "What two cores can and cannot show. Two workers cannot each have a whole core while the "
        "load generator has one of its own: what it uses (load generator cores) comes out of the "
        "workers'. On a shared machine the req/s ratio also depends on how much of the two cores "
        "the other users left each configuration (other cores), and two processes get a larger "
        "share of a contended machine than one. So here the req/s ratio is not a measure of "
        "scaling, in either direction. What the machine can show is requests per server CPU "
        "second: if it is the same for one and two workers, a second worker does not make each "
        "request dearer. It can also show how the work was split between the two workers "
        "(connections stay with the worker that accepted them).",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    result = run(quick=args.quick)
    print(json.dumps(result, indent=2, default=str))
    text = markdown(result)
    print(text)
    if not args.no_write:
        write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
