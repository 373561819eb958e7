"""The server against nginx on the same files: CPU per request and 1 MiB GET latency, and workers.

    python bench/nginx.py [--quick] [--no-write]

Three servers over one cache root, all started here and pinned to CPU 0 (``taskset``), with the
load generator (bench/loadgen.py: raw HTTP/1.1 keep-alive) pinned to CPU 1:

- ``cachectl serve`` (one worker), which checks the token and sends the file itself (``sendfile``);
- the recipe of server/accel.py: nginx in front of ``cachectl serve --accel-redirect``, with the
  configuration ``cachectl serve --print-nginx-config`` prints (one nginx worker); cachectl
  checks the token, nginx sends the bytes;
- nginx alone (one worker) serving the same files from an ``alias``: no token, no index (the peer).

Figures, each measured on every server in each round, the servers in a new order each round:
1 MiB GET on one keep-alive connection (median latency, and CPU per request), HEAD and 4 KiB GET
from 16 keep-alive connections (server CPU per request: /proc utime + stime of the server's
processes over the window, divided by the requests answered). CPU of the recipe is nginx's and
cachectl's together. Then HEAD throughput of ``cachectl serve --workers 2`` against one worker,
alternating, both allowed both cores (the load generator shares them: this machine has two).
Medians over rounds with min-max; ratios of medians. Needs nginx (scripts/test installs it).
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

from bench.common import machine, machine_line, stats, write_section  # noqa: E402
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


def _tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process and all its descendants, alive now."""
    total = 0.0
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / _TICK
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, IndexError, ValueError):
            continue
    return total


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


def _load(
    port: int, path: str, method: str, headers: dict[str, str], length: int, conc: int, secs: float
) -> dict[str, Any]:
    spec = {
        "host": "127.0.0.1",
        "port": port,
        "concurrency": conc,
        "seconds": secs,
        "requests_mix": [[method, 1, method, path, headers, None, 200, length]],
    }
    loadgen = Path(__file__).resolve().parent / "loadgen.py"
    out = subprocess.run(
        [*_pinned(CLIENT_CPU), sys.executable, str(loadgen), json.dumps(spec)],
        capture_output=True,
        text=True,
        check=True,
        timeout=secs + 60,
    )
    return dict(json.loads(out.stdout))


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
                before = sum(_tree_cpu(p.pid) for p in pids)
                got = _load(
                    port,
                    path_of(name, with_api),
                    method,
                    headers,
                    seed["files"][name][1],
                    conc,
                    secs,
                )
                used = sum(_tree_cpu(p.pid) for p in pids) - before
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
    for fig, cells in samples.items():
        result[fig] = {s: {k: stats(v) for k, v in cell.items()} for s, cell in cells.items()}
        for s in ("cachectl", "recipe"):
            for k in ("cpu_ms", "p50_ms"):
                result[fig][f"{s}_over_nginx_{k}"] = statistics.median(
                    cells[s][k]
                ) / statistics.median(cells["nginx"][k])
    result["workers"] = workers
    return result


def _workers(
    seed: dict[str, Any], tmp: Path, rounds: int, secs: float, auth: dict[str, str], path: str
) -> dict[str, Any]:
    """HEAD req/s from 32 connections: `--workers 2` against one worker, alternating."""
    rates: dict[str, list[float]] = {"1": [], "2": []}
    size = seed["files"]["small"][1]
    for _ in range(rounds):
        for n in random.sample(["1", "2"], 2):
            port = _free_port()
            proc = _serve(seed, port, tmp / f"workers-{n}.log", "--workers", n, cpu="0,1")
            try:
                _load(port, path, "HEAD", auth, size, 32, 0.5)  # every worker's caches filled
                got = _load(port, path, "HEAD", auth, size, 32, secs)
                rates[n].append(float(got["req_per_s"]))
            finally:
                proc.terminate()
                proc.wait(30)
    return {
        "one": stats(rates["1"]),
        "two": stats(rates["2"]),
        "ratio": statistics.median(rates["2"]) / statistics.median(rates["1"]),
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
        "one process (one nginx worker) pinned to CPU 0, the load generator (bench/loadgen.py, "
        "raw HTTP/1.1 keep-alive) on CPU 1; "
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
    lines += [
        "",
        "HEAD from 32 keep-alive connections, `cachectl serve --workers 2` against one worker "
        "(both servers allowed CPUs 0-1, the load generator on CPU 1: it shares a core with a "
        "worker), alternating:",
        "",
        "| workers | HEAD req/s | ratio |",
        "|---|---|---|",
        f"| 1 | {_r(w['one'], 0)} | 1.00 |",
        f"| 2 | {_r(w['two'], 0)} | {w['ratio']:.2f}x |",
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
