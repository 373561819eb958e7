"""Lease at scale: hundreds of simulated replicas on the compile lease of one ``cachectl serve``.

    python bench/lease_scale.py [--replicas 256] [--keys 50] [--die 0.1] [--nodes 64]
                                [--per-node 4] [--json] [--no-write]
    python -m bench --only lease_scale [--quick]   (--quick: 64 x 20, 16 nodes)

No JAX. The server is a real ``cachectl serve --workers 2`` on PostgreSQL (a fresh database on
the server CACHECTL_TEST_PG_URL names; SQLite where it is unset, said in the output), with a
local-disk cache, one environment and a few writer tokens (a replica uses token ``i % tokens``).

**The lease.** ``--replicas`` simulated replicas (asyncio tasks on raw HTTP/1.1 keep-alive connections, bench/loadgen.py, spread
over ``--client-procs`` processes) start together, and each misses every one of ``--keys`` keys
in its own random order, one at a time, as a JAX process compiles. Each miss does what
cachectl/service/compile_lease.py ``CompileLeases.missed`` does, over the real routes
(server/lease_routes.py): take the key's lease; holding it, compile (sleep the key's compile
time, drawn once per key from a lognormal distribution, median ``--median`` s, seeded), renew it
every ttl/3 meanwhile, upload the entry (PUT, real bytes) and finish it ``written`` with its
sha256; held by another, poll the row with CompileLeases' backoff (0.1 s + waited/20, at most
0.5 s), and on ``written`` GET the entry and check its sha256, on ``unwritten`` compile, on an
expired lease take it over, past the hedge bound (2x the key's recorded compile time, else 60 s)
claim the hedge and compile too. A request that fails turns the lease off for that replica, as
CompileLeases does: it then compiles whatever it misses.

Two rounds on fresh keys: everyone healthy, then with ``--die`` of the holders killed (a holder
that takes a lease dies with that chance at a random point of its compile: it stops
heartbeating, never finishes and misses nothing more). Reported: compiles per key (begun, and
written), takeovers (a holder's compile of a key an earlier holder began: its lease expired) and
how long after each death the next holder began, waits (a miss another replica compiled: from
the miss to the entry read) as p50/p99 against the key's compile time, lease requests per second and the server's CPU (its process tree in /proc).

**The node tier.** ``--nodes`` simulated nodes x ``--per-node`` processes read the first round's
entries (one manifest's) through the server into their node tiers with the real code
(cachectl/storage/node_tier.py, cachectl/service/node_source.py ``read_entry`` over
cachectl.client's ServerClient): each simulated process is a thread with its own NodeTier, as
separate processes on a node have (the tier's per-file lock is an flock on its own open file, so
threads contend as processes do), nodes spread over ``--tier-procs`` processes. GETs of the
entry route are counted per node and entry from the requests the clients sent (httpx's request
hook); expected at most 1.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import multiprocessing
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_line, tree_cpu, write_section  # noqa: E402
from bench.loadgen import KeepAliveClient  # noqa: E402

SECTION = "## Lease at scale"
API = "/api/v1"
CACHE = "bench"
POLL_S, MAX_POLL_S = 0.1, 0.5  # CompileLeases' backoff
DEFAULT_HEDGE_S = 60.0


# -- the server ---------------------------------------------------------------------------------


def _database(tmp: Path) -> tuple[str, str]:
    """A fresh database: on CACHECTL_TEST_PG_URL's server, else an SQLite file."""
    pg = os.environ.get("CACHECTL_TEST_PG_URL")
    if not pg:
        return f"sqlite:///{tmp / 'index.db'}", "sqlite"
    import psycopg

    name = "cachectl_lease_scale_" + uuid.uuid4().hex[:8]
    with psycopg.connect(
        pg.replace("postgresql+psycopg://", "postgresql://"), autocommit=True
    ) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    return pg.rsplit("/", 1)[0] + "/" + name, "postgresql"


def _drop(db: str) -> None:
    if not db.startswith("postgresql"):
        return
    import psycopg

    admin = os.environ["CACHECTL_TEST_PG_URL"].replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{db.rsplit("/", 1)[1]}" WITH (FORCE)')


def _pg_sessions(db: str) -> int | None:
    """Sessions PostgreSQL has opened on ``db`` so far (pg_stat_database; PostgreSQL 14+): how
    many connections the server made, a pool that keeps its connections makes few."""
    if not db.startswith("postgresql"):
        return None
    import psycopg

    admin = os.environ["CACHECTL_TEST_PG_URL"].replace("postgresql+psycopg://", "postgresql://")
    try:
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute("SELECT pg_stat_clear_snapshot()")
            row = c.execute(
                "SELECT sessions FROM pg_stat_database WHERE datname = %s", (db.rsplit("/", 1)[1],)
            ).fetchone()
    except psycopg.Error:
        return None
    return int(row[0]) if row and row[0] is not None else None


def _env(tmp: Path, db: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHECTL_", "JAX_"))}
    for var in ("XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_STATE_HOME"):
        env[var] = str(tmp / "home" / var.lower())
    env["CACHECTL_DB"] = db
    return env


def _upgrade(tmp: Path, db: str) -> dict[str, str]:
    """``cachectl --db URL db upgrade``: the schema, as a user makes it. The servers' env."""
    env = _env(tmp, db)
    subprocess.run(
        [sys.executable, "-m", "cachectl", "--db", db, "db", "upgrade"],
        env=env,
        check=True,
        capture_output=True,
    )
    return env


def _seed(tmp: Path, db: str, env: dict[str, str], writers: int) -> dict[str, Any]:
    """One cache, one environment, writer tokens and a reader (while the server starts)."""
    from cachectl.core.fingerprint import Environment
    from cachectl.index import open_index
    from cachectl.storage.namespace import ensure_namespace
    from cachectl.storage.store import Store
    from cachectl.trust import tokens

    root = tmp / "cache"
    index = open_index(db)
    try:
        index.add_cache(CACHE, str(root))
        environment = Environment(
            "0.10.2",
            "0.10.2",
            "cpu",
            "cpu",
            "cpu",
            1,
            1,
            "kinds:cpu",
            (),
            "zstandard",
            "none",
            False,
        )
        ensure_namespace(Store(str(root)), environment)
        index.ensure_environment(CACHE, environment)
        made = [tokens.create_token(index, f"w{i}", "writer").token for i in range(writers)]
        reader = tokens.create_token(index, "reader", "reader").token
    finally:
        index.close()
    return {
        "env": env,
        "digest": environment.digest,
        "namespace": environment.namespace,
        "writers": made,
        "reader": reader,
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(tmp: Path, env: dict[str, str], workers: int) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    log = open(tmp / "server.log", "wb")  # noqa: SIM115 - the server's for its lifetime
    proc = subprocess.Popen(
        [
            *[sys.executable, "-m", "cachectl", "serve", "--port", str(port)],
            *["--workers", str(workers), "--log-level", "warning"],
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    return proc, f"http://127.0.0.1:{port}"


def _wait_up(tmp: Path, proc: subprocess.Popen[bytes], url: str) -> None:
    import httpx

    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {(tmp / 'server.log').read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the server did not start within 90 s")


# -- the lease: simulated replicas ----------------------------------------------------------------


@dataclass
class Part:
    """What one client process simulates."""

    url: str
    digest: str
    writers: list[str]
    replicas: list[int]
    keys: list[str]
    compile_s: dict[str, float]
    seed: int
    ttl_s: float
    die: float
    entry_bytes: int
    start_at: float


@dataclass
class Record:
    """What a client process saw: per miss, per request, per death and takeover."""

    misses: list[dict[str, Any]] = field(default_factory=list)
    requests: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    latency: dict[str, list[float]] = field(default_factory=dict)
    deaths: list[dict[str, Any]] = field(default_factory=list)
    starts: list[dict[str, Any]] = field(default_factory=list)
    lease_off: int = 0
    cpu_s: float = 0.0  # this client process's CPU (user + system) for the round


def entry_bytes(key: str, size: int, took: float) -> bytes:
    """The entry a holder of ``key`` uploads: the same bytes from every holder (a hedge's too).
    Its header says the key's compile time (whole seconds, rounded up), as JAX's does: the
    index records it, and a waiter's hedge bound is twice it."""
    from cachectl.storage.entries import make_entry

    seed = hashlib.sha256(key.encode()).digest()
    body = (seed * (size // len(seed) + 1))[:size]
    return make_entry(body, compile_seconds=max(1, math.ceil(took)), compression="zlib")


class LeaseOff(Exception):
    """A lease request failed: the replica turns the lease off, as CompileLeases does."""


class Replica:
    def __init__(self, part: Part, i: int, client: Any, rec: Record) -> None:
        self.part, self.i, self.client, self.rec = part, i, client, rec
        self.rng = random.Random(part.seed * 1_000_003 + i)
        self.tag = f"node{i}/sim:{1000 + i}:{uuid.uuid4().hex[:8]}"
        self.headers = {"authorization": f"Bearer {part.writers[i % len(part.writers)]}"}
        self.base = f"{API}/caches/{CACHE}/environments/{part.digest}"
        self.off = False
        self.dead = False

    async def _lease(self, action: str, **body: Any) -> Any:
        path = self.base + "/compile-lease" + ("/read" if action in ("look", "recorded") else "")
        t0 = time.perf_counter()
        try:
            r = await self.client.post(path, json={**body, "action": action}, headers=self.headers)
        except Exception as exc:
            self.rec.errors[f"{action}: {type(exc).__name__}"] += 1
            raise LeaseOff from exc
        self.rec.latency.setdefault(action, []).append(time.perf_counter() - t0)
        self.rec.requests[action] += 1
        if r.status_code == 403 and action in ("finish", "release"):
            # RemoteLessor's: taken over meanwhile, no longer ours to end (the lease stays on)
            self.rec.errors[f"{action}: 403 (taken over meanwhile)"] += 1
            return False
        if r.status_code != 200:
            self.rec.errors[f"{action}: {r.status_code}"] += 1
            raise LeaseOff(r.text[:200])
        return r.json()["result"]

    async def take(self, key: str, stale: str | None = None) -> dict[str, Any] | None:
        for _ in range(3):
            seen = await self._lease(
                "take", key=key, holder=self.tag, ttl_s=self.part.ttl_s, module=key, stale=stale
            )
            if seen is not None:
                return dict(seen)
        return None

    async def run(self) -> None:
        keys = list(self.part.keys)
        self.rng.shuffle(keys)
        await asyncio.sleep(max(0.0, self.part.start_at - time.time()))
        for key in keys:
            t0 = time.time()
            try:
                how = "compiled (lease off)" if self.off else await self.missed(key)
            except LeaseOff:
                self.off = True
                self.rec.lease_off += 1
                how = "compiled (lease off)"
            if how == "compiled (lease off)":
                await asyncio.sleep(self.part.compile_s[key])
            if self.dead:
                return
            self.rec.misses.append(
                {"replica": self.i, "key": key, "how": how, "start": t0, "end": time.time()}
            )

    async def missed(self, key: str) -> str:
        """CompileLeases.missed and _wait for one key: how the miss ended."""
        seen = await self.take(key)
        started = time.monotonic()
        hedge_after: float | None = None
        while True:
            if seen is None or seen["mine"]:
                return await self.compile(key, hedge=False)
            if seen["state"] == "written":
                if await self.read(key, seen["sha256"]):
                    return "read"
                seen = await self.take(key, stale=seen["sha256"])
                continue
            if seen["state"] != "compiling":
                return await self.compile(key, hedge=False, leased=False)  # unwritten
            if seen["left_s"] <= 0:  # the holder's heartbeat stopped: one waiter takes over
                seen = await self.take(key)
                continue
            if hedge_after is None:  # the row's compile_ms, else the "recorded" call
                ms = seen.get("compile_ms")
                ms = await self._lease("recorded", key=key) if ms is None else ms
                took = ms / 1000.0 if ms is not None else None
                hedge_after = DEFAULT_HEDGE_S if took is None else max(2.0 * took, took + 1.0)
            due = seen["age_s"] > hedge_after and seen["hedger"] is None
            if due and await self._lease("hedge", key=key, holder=self.tag):
                return await self.compile(key, hedge=True)
            waited = time.monotonic() - started
            await asyncio.sleep(min(MAX_POLL_S, POLL_S + waited / 20.0))
            looked = await self._lease("look", key=key)
            seen = dict(looked) if looked is not None else await self.take(key)

    async def read(self, key: str, sha: str | None) -> bool:
        """The entry the holder wrote, through the entry route, checked against its sha256."""
        r = await self.client.get(f"{self.base}/entries/{key}", headers=self.headers)
        self.rec.requests["GET entry"] += 1
        return r.status_code == 200 and hashlib.sha256(r.content).hexdigest() == sha

    async def compile(self, key: str, *, hedge: bool, leased: bool = True) -> str:
        took = self.part.compile_s[key]
        self.rec.starts.append(
            {"key": key, "at": time.time(), "replica": self.i, "holder": leased and not hedge}
        )
        if leased and not hedge and self.rng.random() < self.part.die:
            at = self.rng.random() * took  # killed mid-compile: no more beats, never finishes
            await asyncio.sleep(at)
            self.dead = True
            self.rec.deaths.append({"key": key, "at": time.time(), "replica": self.i})
            return "died"
        beat = asyncio.create_task(self.heartbeat(key)) if leased and not hedge else None
        t0 = time.monotonic()
        try:
            await asyncio.sleep(took)
        finally:
            if beat is not None:
                beat.cancel()
        data = entry_bytes(key, self.part.entry_bytes, took)
        sha = hashlib.sha256(data).hexdigest()
        r = await self.client.put(
            f"{self.base}/entries/{key}",
            content=data,
            headers={
                **self.headers,
                "content-type": "application/octet-stream",
                "x-cachectl-sha256": sha,
            },
        )
        self.rec.requests["PUT entry"] += 1
        if r.status_code not in (200, 201):
            self.rec.errors[f"PUT entry: {r.status_code}"] += 1
            sha = None  # stored nothing: the lease ends unwritten
        if leased:
            ms = int((time.monotonic() - t0) * 1000)
            if sha is not None or not hedge:
                await self._lease("finish", key=key, holder=self.tag, sha256=sha, compile_ms=ms)
        return "hedged" if hedge else ("compiled" if leased else "compiled (unwritten)")

    async def heartbeat(self, key: str) -> None:
        while True:
            await asyncio.sleep(self.part.ttl_s / 3)
            try:
                await self._lease("renew", key=key, holder=self.tag, ttl_s=self.part.ttl_s)
            except LeaseOff:
                continue  # an index hiccup: the next beat tries again


async def _replicas(part: Part) -> Record:
    """This process's replicas, on one raw keep-alive client (bench/loadgen.py): httpx's CPU per
    request, times hundreds of replicas on this machine, starved the server it measured."""
    rec = Record()
    client = KeepAliveClient(part.url, timeout=60.0)
    try:
        await asyncio.gather(*(Replica(part, i, client, rec).run() for i in part.replicas))
    finally:
        await client.aclose()
    return rec


def _run_part(part: Part) -> Record:
    cpu0 = time.process_time()
    rec = asyncio.run(_replicas(part))
    rec.cpu_s = time.process_time() - cpu0
    return rec


def _postgres_cpu() -> float:
    """CPU seconds of the PostgreSQL processes alive now (its backends, by their name)."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        name, rest = stat.split("(", 1)[1].rsplit(")", 1)
        if name == "postgres":
            fields = rest.split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def lease_round(
    url: str, seed: dict[str, Any], args: argparse.Namespace, name: str, die: float, pid: int
) -> dict[str, Any]:
    """One round of every replica missing every key (``name`` keeps its keys apart)."""
    rng = random.Random(args.seed)
    keys = [
        f"jit_{name}_{n}-{hashlib.sha256(f'{name}{n}'.encode()).hexdigest()}"
        for n in range(args.keys)
    ]
    sigma = args.sigma
    compile_s = {k: args.median * rng.lognormvariate(0.0, sigma) for k in keys}
    procs = max(1, min(args.client_procs, args.replicas))
    start_at = time.time() + 0.5 + args.replicas / 200  # the client processes forked by then
    parts = [
        Part(
            url,
            seed["digest"],
            seed["writers"],
            list(range(p, args.replicas, procs)),
            keys,
            compile_s,
            args.seed + (1 if die else 0),
            args.ttl,
            die,
            args.entry_kib * 1024,
            start_at,
        )
        for p in range(procs)
    ]
    db = seed["env"]["CACHECTL_DB"]
    sessions0 = _pg_sessions(db)
    cpu0, pg0 = tree_cpu(pid), _postgres_cpu()
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        recs = pool.map(_run_part, parts)
    wall = time.time() - start_at
    cpu, pg_cpu = tree_cpu(pid) - cpu0, _postgres_cpu() - pg0
    misses = [m for r in recs for m in r.misses]
    requests: Counter[str] = sum((r.requests for r in recs), Counter())
    errors: Counter[str] = sum((r.errors for r in recs), Counter())
    deaths = [d for r in recs for d in r.deaths]
    # A takeover: a holder's compile begun on a key an earlier holder began (the lease expired:
    # its holder killed, or its renew or finish answered later than the ttl).
    holders: dict[str, list[dict[str, Any]]] = {}
    for st in sorted((x for r in recs for x in r.starts if x["holder"]), key=lambda x: x["at"]):
        holders.setdefault(st["key"], []).append(st)
    takeovers = [st for starts in holders.values() for st in starts[1:]]
    after = []  # from each death to the next holder's compile of that key
    for d in deaths:
        later = [st["at"] - d["at"] for st in holders.get(d["key"], []) if st["at"] > d["at"]]
        if later:
            after.append(min(later))
    by_action: dict[str, list[float]] = {}
    for r in recs:
        for action, xs in r.latency.items():
            by_action.setdefault(action, []).extend(xs)
    latency = [x for xs in by_action.values() for x in xs]
    started = Counter(m["key"] for m in misses if m["how"] != "read")
    started.update(d["key"] for d in deaths)
    written = Counter(m["key"] for m in misses if m["how"] in ("compiled", "hedged"))
    waits = [m["end"] - m["start"] for m in misses if m["how"] == "read"]
    ratio = [(m["end"] - m["start"]) / compile_s[m["key"]] for m in misses if m["how"] == "read"]
    lease_requests = sum(v for k, v in requests.items() if "entry" not in k)
    return {
        "name": name,
        "replicas": args.replicas,
        "keys": args.keys,
        "die": die,
        "wall_s": wall,
        "compile_s": {"p50": statistics.median(compile_s.values()), "max": max(compile_s.values())},
        "misses": len(misses),
        "outcomes": dict(Counter(m["how"] for m in misses)),
        "compiles_per_key": {
            "max": max(started.values(), default=0),
            "total": sum(started.values()),
        },
        "written_per_key": {
            "min": min((written[k] for k in keys), default=0),
            "max": max((written[k] for k in keys), default=0),
        },
        "deaths": len(deaths),
        "takeovers": len(takeovers),
        "deaths_taken_over": len(after),
        "takeover_after_death_s": {"max": max(after, default=0.0), "p50": _pct(after, 0.5)},
        "ttl_s": args.ttl,
        "waits_s": {"p50": _pct(waits, 0.5), "p99": _pct(waits, 0.99), "n": len(waits)},
        "wait_over_compile": {"p50": _pct(ratio, 0.5), "p99": _pct(ratio, 0.99)},
        "requests": dict(requests),
        "errors": dict(errors),
        "lease_off_replicas": sum(r.lease_off for r in recs),
        "lease_requests_per_s": lease_requests / wall,
        "lease_request_ms": {"p50": _pct(latency, 0.5) * 1000, "p99": _pct(latency, 0.99) * 1000},
        "lease_request_ms_by_action": {
            a: {"p50": _pct(xs, 0.5) * 1000, "p99": _pct(xs, 0.99) * 1000, "max": max(xs) * 1000}
            for a, xs in sorted(by_action.items())
        },
        "pg_sessions_opened": None if sessions0 is None else (_pg_sessions(db) or 0) - sessions0,
        "server_cpu_s": cpu,
        "server_cores": cpu / wall,
        # Where the machine's cores went: the simulated replicas' processes, and PostgreSQL's
        # backends alive at the end (every replica shares this machine with them here).
        "clients_cores": sum(r.cpu_s for r in recs) / wall,
        "postgres_cores": pg_cpu / wall,
        "keys_list": keys,
    }


# -- the node tier ---------------------------------------------------------------------------------


@dataclass
class TierPart:
    url: str
    reader: str
    digest: str
    namespace: str
    base: str
    nodes: list[int]
    per_node: int
    entries: dict[str, str]  # key -> sha256
    seed: int
    start_at: float


def _tier_process(part: TierPart) -> dict[str, Any]:
    """One process's nodes: per node ``per_node`` threads, each a process's own NodeTier."""
    from cachectl.client.server_client import ServerClient
    from cachectl.service.node_source import RemoteFiles, _server_fetch, read_entry
    from cachectl.storage.node_tier import NodeTier

    gets: Counter[tuple[int, str]] = Counter()
    other: Counter[str] = Counter()
    bad: list[str] = []
    lock = threading.Lock()

    def one(node: int, proc: int) -> None:
        client = ServerClient(part.url, part.reader)
        entry_path = f"/caches/{CACHE}/environments/{part.digest}/entries/"

        def hook(request: Any) -> None:
            path = request.url.path
            with lock:
                if request.method == "GET" and entry_path in path:
                    gets[(node, path.rsplit("/", 1)[1])] += 1
                else:
                    other[f"{request.method} {path.rsplit('/', 1)[1]}"] += 1

        client._http.event_hooks["request"].append(hook)
        tier = NodeTier(str(Path(part.base) / f"node{node}"), warn=lambda m: bad.append(m))
        files = tier.files(part.url, CACHE, part.namespace)
        remote = RemoteFiles(
            files, part.url, CACHE, _server_fetch(client, CACHE, part.digest), True
        )
        keys = list(part.entries)
        random.Random(part.seed * 7919 + node * 31 + proc).shuffle(keys)
        time.sleep(max(0.0, part.start_at - time.time()))
        for key in keys:
            data = read_entry(remote, key, part.entries[key], lambda k, why: bad.append(why))
            if data is None or hashlib.sha256(data).hexdigest() != part.entries[key]:
                bad.append(f"node{node}/{proc}: {key} not read")
        client.close()

    threads = [
        threading.Thread(target=one, args=(n, p)) for n in part.nodes for p in range(part.per_node)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"gets": [[n, k, c] for (n, k), c in gets.items()], "other": dict(other), "bad": bad}


def tier_round(
    url: str, seed: dict[str, Any], args: argparse.Namespace, keys: list[str], tmp: Path, pid: int
) -> dict[str, Any]:
    from cachectl.index import open_index

    index = open_index(seed["env"]["CACHECTL_DB"])
    try:
        env = index.find_environment(CACHE, seed["digest"])
        rows = {e.key: e.sha256 for e in index.list_entries(env.id)}
    finally:
        index.close()
    entries = {k: rows[k] for k in keys if k in rows}
    procs = max(1, min(args.tier_procs, args.nodes))
    start_at = time.time() + 0.5 + args.nodes * args.per_node / 200
    parts = [
        TierPart(
            url,
            seed["reader"],
            seed["digest"],
            seed["namespace"],
            str(tmp / "nodes"),
            list(range(p, args.nodes, procs)),
            args.per_node,
            entries,
            args.seed,
            start_at,
        )
        for p in range(procs)
    ]
    cpu0 = tree_cpu(pid)
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        outs = pool.map(_tier_process, parts)
    wall = time.time() - start_at
    cpu = tree_cpu(pid) - cpu0
    gets: Counter[tuple[int, str]] = Counter()
    other: Counter[str] = Counter()
    bad: list[str] = []
    for o in outs:
        for n, k, c in o["gets"]:
            gets[(n, k)] += c
        other.update(o["other"])
        bad.extend(o["bad"])
    return {
        "nodes": args.nodes,
        "per_node": args.per_node,
        "entries": len(entries),
        "entry_bytes": args.entry_kib * 1024,
        "gets": sum(gets.values()),
        "gets_per_entry_per_node": {
            "max": max(gets.values(), default=0),
            "mean": sum(gets.values()) / max(1, args.nodes * len(entries)),
        },
        "pairs_fetched": len(gets),
        "other_requests": sum(other.values()),
        "problems": bad[:5],
        "problem_count": len(bad),
        "wall_s": wall,
        "server_cpu_s": cpu,
    }


# -- the run ---------------------------------------------------------------------------------------


def _say(text: str) -> None:
    print(f"lease_scale: {text}", file=sys.stderr, flush=True)


QUICK = ["--replicas", "64", "--keys", "20", "--nodes", "16"]


def run(quick: bool = False) -> dict[str, Any]:
    """The suite's entry (bench/__main__.py): the default sizes, or ``QUICK``'s."""
    flags = QUICK if quick else []
    return measure(
        parser().parse_args(flags),
        "python -m bench --only lease_scale" + (" --quick" if quick else ""),
    )


def measure(args: argparse.Namespace, command: str) -> dict[str, Any]:
    load = os.getloadavg()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cachectl-bench-lease-scale-") as t:
        tmp = Path(t)
        db, kind = _database(tmp)
        try:
            env = _upgrade(tmp, db)
            _say(f"{kind} database ready ({time.monotonic() - t0:.0f} s)")
            proc, url = _serve(tmp, env, args.workers)
            try:
                seed = _seed(tmp, db, env, args.tokens)
                _wait_up(tmp, proc, url)
                _say(f"server up ({time.monotonic() - t0:.0f} s)")
                rounds = [lease_round(url, seed, args, "healthy", 0.0, proc.pid)]
                _say(f"healthy round done ({time.monotonic() - t0:.0f} s)")
                if args.die > 0:
                    rounds.append(lease_round(url, seed, args, "die", args.die, proc.pid))
                    _say(f"round with holders killed done ({time.monotonic() - t0:.0f} s)")
                tier = (
                    tier_round(url, seed, args, rounds[0]["keys_list"], tmp, proc.pid)
                    if args.nodes > 0
                    else None
                )
                _say(f"node tier done ({time.monotonic() - t0:.0f} s)")
            finally:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
            log = (tmp / "server.log").read_text(errors="replace")
        finally:
            _drop(db)
    for r in rounds:
        r.pop("keys_list")
    return {
        "command": command,
        "machine": {
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "jax": "not imported",
            "backend": "none",
            "load_average": " ".join(f"{x:.2f}" for x in load),
        },
        "total_s": time.monotonic() - t0,
        "index": kind,
        "workers": args.workers,
        "tokens": args.tokens,
        "rounds": rounds,
        "tier": tier,
        "server_tracebacks": log.count("Traceback"),
    }


def _after(x: dict[str, Any]) -> str:
    if not x["deaths"]:
        return "-"
    return (
        f"{x.get('deaths_taken_over', 0)} of {x['deaths']} killed taken over, at most "
        f"{x['takeover_after_death_s']['max']:.1f} s after the death"
    )


def _round_name(die: float) -> str:
    return "everyone healthy" if not die else f"{die:.0%} of holders killed"


def markdown(r: dict[str, Any]) -> str:
    command = r["command"]
    lines = [
        SECTION,
        "",
        f"`{command}` ({r['total_s'] / 60:.1f} minutes). {machine_line(r['machine'])}",
        "",
        f"`cachectl serve --workers {r['workers']}` on {r['index']} (a fresh database), "
        f"{r['tokens']} writer tokens; simulated replicas (asyncio, raw HTTP/1.1 keep-alive: bench/loadgen.py) on the real lease "
        "routes, each doing what `CompileLeases` does on a miss; no JAX: a compile is a sleep "
        "of the key's compile time (lognormal, seeded), then a real upload of the entry.",
        "",
        "| round | replicas x keys | compiles per key (most) | entries written per key | "
        "holders killed | takeovers | wait p50 / p99 | "
        "wait / compile time p50 / p99 | lease requests/s | server CPU |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in r["rounds"]:
        lines.append(
            f"| {_round_name(x['die'])} "
            f"| {x['replicas']} x {x['keys']} | {x['compiles_per_key']['max']} "
            f"| {x['written_per_key']['min']}–{x['written_per_key']['max']} | {x['deaths']} "
            f"| {x['takeovers']} ({_after(x)}; ttl {x['ttl_s']:.0f} s) "
            f"| {x['waits_s']['p50']:.2f} / {x['waits_s']['p99']:.2f} s "
            f"| {x['wait_over_compile']['p50']:.2f} / {x['wait_over_compile']['p99']:.2f} "
            f"| {x['lease_requests_per_s']:.0f} | {x['server_cores']:.2f} cores "
            f"({x['server_cpu_s'] / max(1, sum(x['requests'].values())) * 1000:.1f} ms/request) |"
        )
    first = r["rounds"][0]
    lines += [
        "",
        f"- Compile times: median {first['compile_s']['p50']:.2f} s, longest "
        f"{first['compile_s']['max']:.2f} s. A wait is a miss another replica compiled, from "
        "the miss to the entry read and checked; its ratio is to that key's compile time (a "
        "waiter that missed the key late waits less than the compile). Compiles per key count "
        "every compile begun: a holder's (a killed one's too), a hedge's, and a replica's "
        "with its lease off.",
    ]
    for x in r["rounds"]:
        lat = x.get("lease_request_ms_by_action", {})
        spurious = x["takeovers"] - x["deaths"]
        lines.append(
            f"- {_round_name(x['die']).capitalize()}: {x['wall_s']:.0f} s; misses ended "
            + ", ".join(f"{k} {v}" for k, v in sorted(x["outcomes"].items()))
            + "; lease requests p50 / p99 / most: "
            + ", ".join(
                f"{a} {v['p50']:.0f} / {v['p99']:.0f} / {v.get('max', 0):.0f} ms"
                for a, v in lat.items()
            )
            + (
                f"; {x['pg_sessions_opened']} PostgreSQL sessions opened"
                if x.get("pg_sessions_opened") is not None
                else ""
            )
            + (
                f"; the machine's cores went to the simulated replicas "
                f"{x['clients_cores']:.2f}, the server {x['server_cores']:.2f}, PostgreSQL "
                f"{x['postgres_cores']:.2f}"
                if "clients_cores" in x
                else ""
            )
            + (
                f"; **{spurious} takeovers more than holders killed**: leases that expired while "
                "their holder lived (its take answered, or its renew came, later than the ttl)"
                if spurious > 0
                else ""
            )
            + (
                f"; {x['lease_off_replicas']} replicas turned their lease off (a request failed) "
                "and compiled what they missed after it"
                if x["lease_off_replicas"]
                else ""
            )
            + "."
        )
    lines.append(
        "- Requests per round: "
        + "; ".join(
            f"{x['name']}: "
            + ", ".join(f"{k} {v}" for k, v in sorted(x["requests"].items()))
            + (f" (errors: {x['errors']})" if x["errors"] else ", no errors")
            for x in r["rounds"]
        )
        + f". Server tracebacks logged: {r['server_tracebacks']}."
    )
    t = r["tier"]
    if t:
        lines += [
            f"- **The node tier**: {t['nodes']} nodes x {t['per_node']} processes read the "
            f"healthy round's {t['entries']} entries ({t['entry_bytes'] // 1024} KiB each) "
            "through the server into their node tiers (the real NodeTier and read_entry, a "
            "thread per process with its own tier): "
            f"**{t['gets_per_entry_per_node']['max']} GET at most per entry per node** "
            f"({t['gets']} entry GETs for {t['nodes'] * t['entries']} (node, entry) pairs), "
            f"{t['other_requests']} other requests (the client's listing of the index's record "
            f"per key), {t['problem_count']} reads failed, {t['wall_s']:.1f} s, server CPU "
            f"{t['server_cpu_s']:.1f} s.",
        ]
    lines += [
        "- What this does not show: real compiles (a sleep stands in, so JAX's and the "
        "processes' own CPU is absent and the clients, 2 processes of asyncio on raw HTTP/1.1, share this "
        "machine's cores with the server and PostgreSQL); holders on one host seen gone at "
        "once (every simulated replica is its own host here, so a dead holder is found only "
        "by its expiry); a network between nodes and the server (loopback here)"
        + (
            "; the hedge (no key's compile reaches the 60 s bound of a key with no recorded time)."
            if not any(x["outcomes"].get("hedged") for x in r["rounds"])
            else "."
        ),
        "",
    ]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=256, help="simulated replicas (256)")
    p.add_argument("--keys", type=int, default=50, help="keys every replica misses (50)")
    p.add_argument(
        "--die", type=float, default=0.1, help="chance a holder is killed (0.1; 0: no such round)"
    )
    p.add_argument("--median", type=float, default=1.0, help="median compile time, s (1)")
    p.add_argument(
        "--sigma", type=float, default=0.5, help="lognormal sigma of compile times (0.5)"
    )
    p.add_argument("--ttl", type=float, default=10.0, help="the lease ttl replicas ask, s (10)")
    p.add_argument("--seed", type=int, default=68)
    p.add_argument("--tokens", type=int, default=8, help="writer tokens (8)")
    p.add_argument("--workers", type=int, default=2, help="server workers (2)")
    p.add_argument("--client-procs", type=int, default=2, help="client processes (2)")
    p.add_argument("--entry-kib", type=int, default=64, help="entry size, KiB (64)")
    p.add_argument("--nodes", type=int, default=64, help="node-tier nodes (64; 0: skip)")
    p.add_argument("--per-node", type=int, default=4, help="processes per node (4)")
    p.add_argument("--tier-procs", type=int, default=4, help="processes the nodes run in (4)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    for name in ("replicas", "keys", "tokens", "workers", "client_procs", "per_node", "tier_procs"):
        if getattr(args, name) < 1:
            parser().error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.die < 1:
        parser().error("--die is a chance: from 0 to below 1")
    command = "python bench/lease_scale.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out = measure(args, command.strip())
    if args.json:
        print(json.dumps(out, default=str))
    else:
        print(markdown(out))
    if not args.no_write:
        write_section(SECTION, markdown(out))
    ok = all(x["written_per_key"]["min"] >= 1 for x in out["rounds"]) and not (
        out["tier"] and out["tier"]["problem_count"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
