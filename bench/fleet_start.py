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

The node-local tier, once per run: machine A warms the manifest into a local-disk cache; 6
read-only replicas start on it reading the root (the reference), then through ``cachectl serve``
from nodes that do not hold A's home (each replica in a mount namespace with it under an empty
tmpfs: root and ``unshare``), first start and a restart on the same nodes (entry-route requests
from the server's /metrics, files from the node tiers). The same with the cache in an S3 bucket
(moto, its request log counting GETs per file per node) and CACHECTL_NODE_CACHE per node. And a
cold fleet of writers through the server, lease on and off (the holder uploads what it compiled).

``--uds``: the server rows over a unix socket (``cachectl serve --uds PATH``, the replicas with
``CACHECTL_SERVER=unix://PATH``), for a host with no TCP sockets: the moto rows (a TCP server) are
left out, and the index is SQLite unless CACHECTL_TEST_PG_URL names a server. A node that does
not hold A's home is a mount namespace: ``unshare -m`` as root, else ``unshare -r -m`` (a user
namespace, no root needed where the kernel allows unprivileged ones). ``--server-only``: only the
cold fleet through the server (one replica alone, 6 with the lease, 6 without), ``--server-rounds``
times alternating; the result states the slowest of 6 over one replica alone.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
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
WRITES = ["--requests", "2", "--writes"]
READS = ["--requests", "2"]
# A node that does not hold machine A's home (its cache root and index): "$0" under a tmpfs.
HIDE = 'mount --make-rprivate / && mount -t tmpfs tmpfs "$0" && exec "$@"'
ENTRY_ROUTES = (
    'route="/api/v1/caches/{cache}/environments/{digest}/entries/{key}"',
    'route="/api/v1/caches/{cache}/environments/{digest}/entries/{key}/aot"',
)

REPLICA = r"""
import time
t0 = time.perf_counter()
import contextlib, io, json, logging, re, sys
sys.path.insert(0, {repo!r})
import os
_away = os.environ.get("FLEET_BENCH_NOT_HERE")
if _away:  # a node without A's root on a host with no mount namespaces: told it is not here
    from cachectl.storage import node_tier
    _here = node_tier.root_here
    node_tier.root_here = lambda url: False if str(url).startswith(_away) else _here(url)
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
    serve.main({args!r})
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
    t0 = time.perf_counter()
    out = _launch(envs, WRITES)
    return _fleet(kind, n, time.perf_counter() - t0, out)


def _launch(
    envs: list[dict[str, str]], args: list[str], hide: Path | None = None
) -> list[dict[str, Any]]:
    """One replica per env, started together (``hide``: each in its own mount namespace with
    that directory under an empty tmpfs, a machine that does not hold it; where the host has no
    mount namespaces, each told that directory is not on its machine); their reports."""
    argv = [sys.executable, "-c", REPLICA.format(repo=str(REPO), args=args)]
    unshare = _unshare() if hide is not None else None
    if hide is not None and unshare is not None:
        argv = [*unshare, "bash", "-c", HIDE, str(hide), *argv]
    elif hide is not None:  # no mount namespaces (a sandbox): each replica is told A's is away
        envs = [dict(e, FLEET_BENCH_NOT_HERE=str(hide)) for e in envs]
    procs = [
        subprocess.Popen(
            argv, env=e, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for e in envs
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(stderr[-3000:])
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _fleet(kind: str, n: int, wall: float, out: list[dict[str, Any]]) -> dict[str, Any]:
    per_program = Counter(
        key
        for r in out
        for module, key in r["missed"]
        if module in ("jit_prefill", "jit_decode_step")
    )
    return {
        "index": kind,
        "replicas": n,
        "wall": wall,
        "ready": [r["ready"] for r in out],
        "compiles": sum(r["compiles"] for r in out),
        "requests": sum(r["requests"] for r in out),
        "program_compiles": sum(per_program.values()),
        "programs": len(per_program),
        "max_per_program": max(per_program.values(), default=0),
        "rows": [r["rows"] for r in out],
    }


# -- the node-local tier: a warm cache behind the server and behind moto -------------------------

MANIFEST = str(REPO / "examples" / "manifest.yaml")


@functools.cache
def _unshare() -> list[str] | None:
    """How a replica gets a mount namespace of its own (a node without machine A's root):
    ``unshare -m`` as root, else ``unshare -r -m`` (an unprivileged user namespace, where the
    kernel allows one); None where neither works."""
    if shutil.which("unshare") is None:
        return None
    argv = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-r", "-m"]
    with tempfile.TemporaryDirectory(prefix="cachectl-bench-unshare-") as t:
        done = subprocess.run(
            [*argv, "bash", "-c", HIDE, t, "true"], capture_output=True, timeout=30
        )
    return argv if done.returncode == 0 else None


def _can_hide() -> bool:
    """The server parts need a node without machine A's root: a mount namespace, else (a host
    that has none, such as a sandbox) each replica told that A's home is not on its machine
    (``FLEET_BENCH_NOT_HERE``: node_tier.root_here answers False for it in that process, so it
    takes a remote node's path: the server's routes into its node tier)."""
    return True


def node_mode() -> str:
    """How a node without A's root is made here, as the results say it."""
    unshare = _unshare()
    if unshare is not None:
        return (
            f"in its own mount namespace (`{' '.join(unshare)}`) with A's home under an empty tmpfs"
        )
    return (
        "without a mount namespace (this host has none), each replica told A's home is not on "
        "its machine (node_tier.root_here answers False for it; the files stay on the same disk)"
    )


def _infra() -> Any:
    sys.path.insert(0, str(REPO / "tests"))  # tests/support/infra.py: moto, free ports
    from support import infra

    return infra


def _cachectl(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "cachectl", *args], env=env, cwd=REPO, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"cachectl {' '.join(args)}: {done.stderr[-3000:]}")
    return done.stdout


def _machine_a(base: Path) -> dict[str, str]:
    """Machine A: its own HOME under ``base/a`` holding the cache root and the SQLite index."""
    env = _home(base, "a")
    env["CACHECTL_DB"] = f"sqlite:///{base / 'a' / 'index.db'}"
    return env


# Set by --uds: the server rows listen on a unix socket, never on TCP.
UDS = {"on": False}


class _UdsServer:
    """``cachectl serve --uds PATH`` (the socket outside A's home: the nodes reach it)."""

    def __init__(self, base: Path, env: dict[str, str]) -> None:
        import httpx

        (base / "sock").mkdir(parents=True, exist_ok=True)
        (base / "logs").mkdir(parents=True, exist_ok=True)
        self.path = str(base / "sock" / "cachectl.sock")
        self.url = f"unix://{self.path}"
        self.log = base / "logs" / "cachectl-serve-uds.log"
        with open(self.log, "wb") as fh:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "cachectl", "serve", "--uds", self.path],
                env=env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                with _http(self.url) as c:
                    if c.get("/healthz", timeout=2).status_code == 200:
                        return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"cachectl serve --uds did not start: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()


def _http(url: str) -> Any:
    """An httpx client of the server at ``url`` (``unix:///PATH`` or ``http://HOST:PORT``)."""
    import httpx

    if url.startswith("unix://"):
        return httpx.Client(
            base_url="http://cachectl", transport=httpx.HTTPTransport(uds=url[len("unix://") :])
        )
    return httpx.Client(base_url=url)


def _serve(base: Path, a: dict[str, str]) -> Any:
    if UDS["on"]:
        return _UdsServer(base, {**a, "JAX_PLATFORMS": "cpu"})
    infra = _infra()
    pinned = [f"{k}={v}" for k, v in a.items() if k.startswith(("XDG_", "CACHECTL_"))]
    return infra.start_server(
        "cachectl-serve",
        lambda port: [
            "env",
            *pinned,
            sys.executable,
            "-m",
            "cachectl",
            "serve",
            "--port",
            str(port),
        ],
        base / "logs",
    )


def _entry_requests(url: str, token: str) -> int:
    with _http(url) as c:
        text = c.get("/metrics", headers={"authorization": f"Bearer {token}"}).text
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("cachectl_http_requests_total{")
            and any(r in line for r in ENTRY_ROUTES)
        )
    )


def _node_files(base: Path) -> int:
    """Entries and stored executables held in the nodes' tiers (what they fetched)."""
    return sum(
        1
        for n in range(NODES)
        for p in (base / f"node{n}").rglob("*")
        if p.is_file() and p.name.endswith(("-cache", "-aot")) and "/.locks/" not in str(p)
    )


def _ready(out: list[dict[str, Any]]) -> dict[str, Any]:
    return {"ready": [r["ready"] for r in out], "rows": [r["rows"] for r in out]}


def _server_fleets(base: Path) -> dict[str, Any]:
    """A warm local-disk cache: 6 replicas reading the root here, then through the server from
    nodes without it (first start, restart on the same nodes); entry requests from /metrics."""
    a = _machine_a(base)
    _cachectl(a, "warm", MANIFEST)
    token = _cachectl(a, "token", "create", "--name", "bench", "--role", "reader").split()[-1]
    nodes = [_home(base, f"node{i % NODES}") for i in range(NODES * PER_NODE)]
    local = _launch([dict(e, CACHECTL_DB=a["CACHECTL_DB"]) for e in nodes], READS)
    res: dict[str, Any] = {"local": _ready(local)}
    server = _serve(base, a)
    try:
        remote = [dict(e, CACHECTL_SERVER=server.url, CACHECTL_TOKEN=token) for e in nodes]
        for name in ("server", "server_restart"):
            before = _entry_requests(server.url, token)
            out = _launch(remote, READS, hide=base / "a")
            res[name] = dict(_ready(out), fetches=_entry_requests(server.url, token) - before)
            res[name]["files"] = _node_files(base)
    finally:
        server.stop()
    return res


def _moto_fleets(base: Path) -> dict[str, Any]:
    """A warm cache in an S3 bucket (moto, recording its requests): 6 replicas with a node tier
    each node, first start and restart; GETs per file per node from moto's request log."""
    import httpx

    infra = _infra()
    os.environ["MOTO_RECORDER_FILEPATH"] = str(base / "recording")
    moto = infra.start_moto(base / "logs")
    try:
        a = {**_machine_a(base), **moto.env}
        bucket = infra.unique_name("fleet")
        infra.create_s3_bucket(moto.url, bucket)
        _cachectl(a, "cache", "add", "objects", f"s3://{bucket}/jax")
        _cachectl(a, "warm", MANIFEST, "--cache", "objects")
        envs = []
        for i in range(NODES * PER_NODE):
            node = f"node{i % NODES}"
            env = {**_home(base, node), **moto.env, "CACHECTL_DB": a["CACHECTL_DB"]}
            env.update(
                CACHECTL_CACHE="objects",
                CACHECTL_NODE_CACHE=str(base / node / "tier"),
                AWS_ACCESS_KEY_ID=node.upper(),  # which node asked, in moto's log
            )
            envs.append(env)
        res: dict[str, Any] = {}
        for name in ("moto", "moto_restart"):
            httpx.post(f"{moto.url}/moto-api/recorder/reset-recording")
            httpx.post(f"{moto.url}/moto-api/recorder/start-recording")
            out = _launch(envs, READS)
            httpx.post(f"{moto.url}/moto-api/recorder/stop-recording")
            log = httpx.get(f"{moto.url}/moto-api/recorder/download-recording").text
            gets: Counter[tuple[str, str]] = Counter()
            for line in log.splitlines():
                request = json.loads(line)
                path = request["url"].split("?", 1)[0]
                if request["method"] == "GET" and path.endswith(("-cache", "-aot")):
                    auth = request["headers"].get("Authorization", "")
                    node = "node0" if "Credential=NODE0/" in auth else "node1"
                    gets[(node, path.rsplit("/", 1)[1])] += 1
            res[name] = dict(
                _ready(out),
                fetches=sum(gets.values()),
                files=_node_files(base),
                max_per_file=max(gets.values(), default=0),
            )
    finally:
        moto.stop()
        os.environ.pop("MOTO_RECORDER_FILEPATH", None)
    return res


def _cold_server(base: Path, lease: bool, n: int = NODES * PER_NODE) -> dict[str, Any]:
    """``n`` writer replicas on nodes without the root, started together on an empty cache
    through the server: the lease's holder uploads each entry it compiled, the other node reads
    it (``n`` 1: one cold replica alone, the floor the fleet is compared with)."""
    base.mkdir(parents=True)
    a = _machine_a(base)
    _cachectl(a, "path")  # the default cache registered, empty
    token = _cachectl(a, "token", "create", "--name", "bench", "--role", "writer").split()[-1]
    server = _serve(base, a)
    try:
        envs = []
        for i in range(n):
            env = _home(base, f"node{i % NODES}")
            env.update(CACHECTL_SERVER=server.url, CACHECTL_TOKEN=token)
            env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
            if not lease:
                env["CACHECTL_COMPILE_LEASE"] = "0"
            envs.append(env)
        t0 = time.perf_counter()
        out = _launch(envs, WRITES, hide=base / "a")
        return _fleet("server", len(envs), time.perf_counter() - t0, out)
    finally:
        server.stop()


def run(
    quick: bool = False,
    local_only: bool = False,
    rounds: int | None = None,
    tier_only: bool = False,
    *,
    uds: bool = False,
    server_only: bool = False,
    server_rounds: int = 1,
) -> dict[str, Any]:
    """``local_only``: the local-disk fleets alone (a machine with no loopback sockets or root);
    ``tier_only``: the node-tier parts and the cold fleet through the server alone; ``uds``: the
    server over a unix socket (no moto rows: moto is a TCP server); ``server_only``: the cold
    fleet through the server alone, ``server_rounds`` times."""
    UDS["on"] = uds
    rounds = 0 if (tier_only or server_only) else (rounds or (1 if quick else 2))
    res: dict[str, list[dict[str, Any]]] = {"alone": [], "lease": [], "off": [], "warm": []}
    tier: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="cachectl-bench-fleet-start-") as t:
        tmp = Path(t)
        for r in range(rounds):
            res["alone"].append(_start_fleet(tmp / f"alone{r}", 1, True))
            res["lease"].append(_start_fleet(tmp / f"lease{r}", NODES * PER_NODE, True))
            res["warm"].append(_start_fleet(tmp / f"lease{r}", NODES * PER_NODE, True, again=True))
            res["off"].append(_start_fleet(tmp / f"off{r}", NODES * PER_NODE, False))
        hide = _can_hide() and not local_only
        if server_only and not hide:
            raise RuntimeError(
                "--server-only needs a node without A's root: a mount namespace (unshare as "
                "root, or unprivileged user namespaces), and neither works here"
            )
        if hide:
            for name in ("server_alone", "server_lease", "server_off"):
                res[name] = []
            for r in range(server_rounds):  # alternating, so the ratios share the machine's load
                res["server_alone"].append(_cold_server(tmp / f"cold-server-alone{r}", True, 1))
                res["server_lease"].append(_cold_server(tmp / f"cold-server-lease{r}", True))
                res["server_off"].append(_cold_server(tmp / f"cold-server-off{r}", False))
        if hide and not server_only:
            tier.update(_server_fleets(tmp / "warm-server"))
        if not local_only and not server_only and not uds:
            tier.update(_moto_fleets(tmp / "warm-moto"))
    programs = res["alone"][0]["programs"] if res["alone"] else None
    same = (
        all(rows == res["alone"][0]["rows"][0] for k in res for x in res[k] for rows in x["rows"])
        if res["alone"]
        else None
    )
    served = [rows for t in tier.values() for rows in t["rows"]]
    return {
        "runs": res,
        "programs": programs,
        "outputs_equal": same,
        "tier": tier,
        "tier_outputs_equal": all(rows == served[0] for rows in served),
        "hidden": hide,
        "uds": uds,
        "nodes": node_mode() if hide else None,
        "server_ratio": _server_ratio(res),
    }


def _server_ratio(res: dict[str, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """Slowest of the 6 through the server / one replica alone through it, each round."""
    if not res.get("server_alone"):
        return None
    alone = [max(x["ready"]) for x in res["server_alone"]]
    out: dict[str, Any] = {"alone_s": alone}
    for name in ("server_lease", "server_off"):
        slow = [max(x["ready"]) for x in res[name]]
        out[name] = {
            "slowest_s": slow,
            "ratio": [s / a for s, a in zip(slow, alone, strict=True)],
            "program_compiles": [x["program_compiles"] for x in res[name]],
            "max_per_program": max(x["max_per_program"] for x in res[name]),
        }
    return out


def markdown(r: dict[str, Any], section: str = SECTION, flags: str = "") -> str:
    runs, programs = r["runs"], r["programs"]
    if not runs["alone"]:  # --tier-only, --server-only
        command = f"`python bench/fleet_start.py {flags}`. " if flags else ""
        return "\n".join([section, "", f"{command}{machine_line()}", "", *_tier_markdown(r)])
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
            "what waiting for the compiles cost. Where the machine has fewer cores than replicas, 6 replicas "
            "starting together compete for them (importing JAX, starting the backend), which a fleet of "
            "machines does not; the lone replica and the fleets are timed in the same run, alternating, and "
            "only the ratios are the result.",
            "- The compile counts are exact; the times are this machine's at the load average above, so "
            "compare ratios only, and only on a machine with a core per replica (the goal: the slowest "
            "replica within 1.3x of a lone one).",
            "",
            *_tier_markdown(r),
        ]
    )


def _tier_markdown(r: dict[str, Any]) -> list[str]:
    tier = r["tier"]
    local = tier.get("local")
    base = max(local["ready"]) if local else None

    def row(name: str, label: str) -> str:
        t = tier[name]
        slow = max(t["ready"])
        per = (
            f"{t['max_per_file']} (most of one file)"
            if "max_per_file" in t
            else (f"{t['fetches'] / t['files']:.2f} (mean)" if t["files"] else "-")
        )
        ratio = f"**{slow / base:.2f}x**" if base else "-"
        return f"| {label} | {t['fetches']} | {t['files']} | {per} | {slow:.1f} s | {ratio} |"

    lines = (
        []
        if not tier
        else [
            f"**A warm cache read through the node-local tier.** `examples/manifest.yaml` warmed on machine "
            f"A (11 buckets: 11 entries and 11 stored executables), then {NODES} nodes x {PER_NODE} "
            "replicas of `examples/serve.py` (read-only, 2 requests) started together on it; then again on "
            "the same nodes (a restart: their node tiers kept). Server: `cachectl serve` on A with a "
            "local-disk cache, each node its own HOME in its own mount namespace with A's home (root and "
            "index) under an empty tmpfs, `CACHECTL_SERVER` and a reader token; fetches are the server's "
            "entry-route requests (`/metrics`), files what the node tiers hold after the run. Bucket: moto "
            "S3 with `CACHECTL_NODE_CACHE` per node; fetches are GETs of entries and executables in moto's "
            "request log, per node by its credentials.",
            "",
            "| start | entry fetches | files (per node, summed) | fetches per file per node | "
            "slowest replica done | slowest / local disk |",
            "|---|---:|---:|---:|---:|---:|",
        ]
    )
    if local:
        lines.append(
            f"| local disk (the root on each node), for reference | - | - | - | {base:.1f} s | 1.00x |"
        )
    for name, label in (
        ("server", "through the server, first start"),
        ("server_restart", "through the server, restart on the same nodes"),
        ("moto", "through S3 (moto), first start"),
        ("moto_restart", "through S3 (moto), restart on the same nodes"),
    ):
        if name in tier:
            lines.append(row(name, label))
    lines.append("")
    if tier:
        lines.append(
            f"- Every replica's served tokens are equal across these starts: {r['tier_outputs_equal']}."
        )
    if not r["hidden"]:
        lines.append(
            "- The server rows and the cold fleet through the server: not run (--local-only)."
        )
    elif tier:
        lines.append(f"- Each node, here: {r.get('nodes')}.")
    runs = r["runs"]
    if "server_lease" in runs:
        on, off = runs["server_lease"][0], runs["server_off"][0]
        alone = max(runs["server_alone"][0]["ready"]) if runs.get("server_alone") else None
        lines.append(
            f"- **A cold fleet through the server** ({NODES} nodes x {PER_NODE} writer replicas, "
            f"`--writes`, a writer token, each node {r.get('nodes') or 'as above'}, an empty cache): "
            "the manifest's "
            f"programs compiled {on['program_compiles']} times with the lease (at most "
            f"{on['max_per_program']} of one program; the holder uploads each entry before its lease "
            f"says written, so the other node reads it), {off['program_compiles']} times with "
            f"`CACHECTL_COMPILE_LEASE=0` (at most {off['max_per_program']}); slowest replica "
            f"{max(on['ready']):.1f} s against {max(off['ready']):.1f} s"
            + (f"; one cold replica alone through the server {alone:.1f} s." if alone else ".")
        )
    ratio = r.get("server_ratio")
    if ratio:
        via = "a unix socket (`cachectl serve --uds`)" if r.get("uds") else "TCP loopback"
        lease, off = ratio["server_lease"], ratio["server_off"]

        def said(xs: list[float]) -> str:
            m = stats(xs)
            return f"{m['median']:.2f}x" + (
                f" (median of {len(xs)} rounds, {m['min']:.2f}–{m['max']:.2f})"
                if len(xs) > 1
                else ""
            )

        lines.append(
            f"- **Slowest of {NODES * PER_NODE} / one replica alone, through the server over {via}, "
            f"on {os.cpu_count()} cores: {said(lease['ratio'])} with the lease, "
            f"{said(off['ratio'])} with `CACHECTL_COMPILE_LEASE=0`** (goal: within 1.3x with a "
            f"core per replica). One replica alone: {', '.join(f'{a:.1f} s' for a in ratio['alone_s'])}; "
            f"slowest of {NODES * PER_NODE} with the lease "
            f"{', '.join(f'{a:.1f} s' for a in lease['slowest_s'])}, without "
            f"{', '.join(f'{a:.1f} s' for a in off['slowest_s'])}."
        )
    lines.append("")
    return lines


SERVER_SECTION = "## Fleet start through the server"


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--quick", action="store_true", help="one round of the local fleets")
    p.add_argument("--rounds", type=int, help="rounds of the local fleets (2)")
    p.add_argument("--local-only", action="store_true", help="the local-disk fleets alone")
    p.add_argument("--tier-only", action="store_true", help="the node-tier parts alone")
    p.add_argument(
        "--uds", action="store_true", help="the server over a unix socket (a host with no TCP)"
    )
    p.add_argument(
        "--server-only",
        action="store_true",
        help=f"only the cold fleet through the server (its own section, {SERVER_SECTION!r})",
    )
    p.add_argument("--server-rounds", type=int, default=1, help="rounds of the server rows (1)")
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    if args.server_rounds < 1 or (args.rounds is not None and args.rounds < 1):
        p.error("--rounds and --server-rounds must be at least 1")
    out = run(
        quick=args.quick,
        local_only=args.local_only,
        rounds=args.rounds,
        tier_only=args.tier_only,
        uds=args.uds,
        server_only=args.server_only,
        server_rounds=args.server_rounds,
    )
    if args.json:
        print(json.dumps(out, default=str))
    section = SERVER_SECTION if args.server_only else SECTION
    text = markdown(out, section, " ".join(argv if argv is not None else sys.argv[1:]))
    print(text)
    if not args.no_write:
        write_section(section, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
