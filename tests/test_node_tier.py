"""Machines that do not hold the cache root read it through the server, or a bucket, into a
node-local tier (cachectl/storage/node_tier.py, cachectl/service/node_source.py).

Machine A warms examples/manifest.yaml into a local-disk cache and runs the real `cachectl serve`
on loopback. Machine B is its own HOME in its own mount namespace, A's whole home hidden under a
tmpfs (`unshare -m`), with only CACHECTL_SERVER and a token. For the bucket, two "nodes" (each its
own node directory and credentials) start three processes each on a warm S3 cache (moto, its
request recorder counting the GETs).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from support import infra
from support.compiles import CHILD
from support.machines import CACHECTL, MachineB, needs_unshare
from support.warming import TINY_SERVICE, invoke, tiny

from cachectl.storage import node_tier

# Read at import: isolated_home clears CACHECTL_* before each test.
NO_AZURITE = os.environ.get("CACHECTL_TEST_NO_AZURITE") == "1"
AZURITE = infra.azurite_command()

REPO = Path(__file__).resolve().parent.parent
MANIFEST = str(REPO / "examples" / "manifest.yaml")
ENTRY_ROUTES = (
    'route="/api/v1/caches/{cache}/environments/{digest}/entries/{key}"',
    'route="/api/v1/caches/{cache}/environments/{digest}/entries/{key}/aot"',
)


def _entry_requests(url: str, token: str) -> int:
    text = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {token}"}).text
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("cachectl_http_requests_total{")
            and any(r in line for r in ENTRY_ROUTES)
        )
    )


ALL_SERVED = {"prefill": (0, 8), "decode_step": (0, 3)}


@needs_unshare
@pytest.mark.timeout(600)  # eight real processes, each importing JAX, on a shared runner
def test_machine_b_reads_the_server_into_its_node_tier(isolated_home, tmp_path) -> None:
    # Machine A: the test process's HOME; warm the example, a writer token, the real server.
    warmed = invoke("warm", MANIFEST, "--json")
    assert json.loads(warmed.stdout)["summary"]["compiled"] == 11
    token = (
        invoke("token", "create", "--name", "b", "--role", "writer").stdout.strip().splitlines()[-1]
    )
    server = infra.start_server(
        "cachectl-serve",
        lambda port: [sys.executable, "-m", "cachectl", "serve", "--port", str(port)],
        tmp_path / "logs",
    )
    try:
        b = MachineB(tmp_path / "b", isolated_home, server.url, token)

        # warm-check: 11/11 hits, 11/11 stored executables called, all over the server.
        proc = b.run(*CACHECTL, "warm-check", MANIFEST, "--json")
        summary = json.loads(proc.stdout)["summary"]
        assert (summary["hits"], summary["aot_loaded"], summary["aot_ran"]) == (11, 11, 11), (
            proc.stderr
        )
        assert _entry_requests(server.url, token) == 22  # 11 entries + 11 executables, once each

        # every command says what is true on a node (no root here, the server holds it): no
        # drift, no advice to sync, no traceback
        doctor = b.run(*CACHECTL, "doctor", "--json")
        said = json.loads(doctor.stdout)["findings"]
        assert not [f for f in said if f["severity"] != "info"], said
        assert any("is on the server's machine" in f["message"] for f in said), said
        synced = b.run(*CACHECTL, "sync", "--dry-run")
        assert synced.returncode == 2 and "Run `cachectl sync` on that machine" in synced.stderr
        assert "Traceback" not in synced.stderr and synced.stdout == ""
        listed = b.run(*CACHECTL, "ls")
        assert "on the server's machine: read here through" in listed.stdout, listed.stdout
        missed = b.run(*CACHECTL, "misses", "--manifest", MANIFEST)
        assert missed.returncode == 0 and "nothing missed" in missed.stdout, missed.stderr

        # the service: every bucket from a stored executable, JAX compiled nothing; a node-tier
        # file damaged meanwhile is detected by its sha256 and fetched again (one request)
        damaged = next(b.node.rglob("jit_decode_step-*-aot"))
        damaged.write_bytes(b"not what the server holds")
        served, stderr = b.serve()
        assert served == ALL_SERVED and "Compiling" not in stderr, stderr[-2000:]
        assert "run `cachectl" not in stderr and "is damaged" in stderr
        assert _entry_requests(server.url, token) == 23

        # pull copies every entry; warm from B finds all 11 held by the server and exits 0
        pulled = json.loads(
            b.run(*CACHECTL, "pull", "--to", str(tmp_path / "pulled"), "--json").stdout
        )
        assert (pulled["copied"], pulled["executables_copied"], pulled["missing"]) == (11, 11, [])
        proc = b.run(*CACHECTL, "warm", MANIFEST, "--json")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(proc.stdout)["summary"]["cached"] == 11

        # a full node disk: a warning, and the service is served from the remote all the same
        small = tmp_path / "small-node"
        served, stderr = b.serve(small_tmpfs=small, env={"CACHECTL_NODE_CACHE": str(small)})
        assert served == ALL_SERVED and "is full" in stderr, stderr[-2000:]

        # a restart on the node: nothing asked of the server
        before = _entry_requests(server.url, token)
        served, _ = b.serve()
        assert served == ALL_SERVED and _entry_requests(server.url, token) == before
    finally:
        server.stop()
    # the server gone: the service starts from the node tier alone
    served, stderr = b.serve()
    assert served == ALL_SERVED and "Compiling" not in stderr, stderr[-2000:]
    assert "entries this node fetched and verified before" in stderr


def _serve_uds(sock: Path, log: Path) -> subprocess.Popen[bytes]:
    """`cachectl serve --uds` on machine A, once it answers /healthz on the socket."""
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [*CACHECTL, "serve", "--uds", str(sock)], stdout=fh, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as probe:
            probe.connect(str(sock))
            probe.sendall(b"GET /healthz HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
            if probe.recv(64).startswith(b"HTTP/1.1 200"):
                return proc
        time.sleep(0.05)


@needs_unshare
@pytest.mark.timeout(600)
def test_machine_b_reaches_a_unix_socket_server(isolated_home, tmp_path) -> None:
    """CACHECTL_SERVER=unix:///PATH: machine B (its own mount namespace) reads the cache over
    A's `cachectl serve --uds`, the CLI, the node tier's fetch and the lease's routes alike."""
    warmed = invoke("warm", MANIFEST, "--json")
    assert json.loads(warmed.stdout)["summary"]["compiled"] == 11
    token = invoke("token", "create", "--name", "u", "--role", "writer").stdout.split()[-1]
    run = tmp_path / "run"
    run.mkdir()
    sock = run / "cachectl.sock"
    server = _serve_uds(sock, tmp_path / "serve.log")
    try:
        b = MachineB(tmp_path / "b", isolated_home, f"unix://{sock}", token)
        banner = (tmp_path / "serve.log").read_text()
        assert f"clients on this host: CACHECTL_SERVER=unix://{sock}" in banner, banner
        proc = b.run(*CACHECTL, "warm-check", MANIFEST, "--json")
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = json.loads(proc.stdout)["summary"]
        print("warm-check over the unix socket:", {k: summary[k] for k in ("hits", "aot_loaded")})
        assert (summary["hits"], summary["aot_loaded"], summary["aot_ran"]) == (11, 11, 11), (
            proc.stderr
        )
        assert len(list(b.node.rglob("*-aot"))) == 11  # fetched into B's node tier
        # the lease's routes over the same socket (what a writer service on B asks)
        from cachectl.client import ServerClient

        client = ServerClient(f"unix://{sock}", token)
        try:
            digest = client.get("/api/v1/caches/default/environments")[0]["digest"]
            assert client.compile_lease("default", digest, "look", {"key": "jit_f-0"}) is None
        finally:
            client.close()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
    assert not sock.exists()


@needs_unshare
@pytest.mark.timeout(400)
@pytest.mark.parametrize("index", ["sqlite", "postgresql"])
def test_a_cold_fleet_across_nodes_compiles_each_program_once(
    isolated_home, tmp_path, monkeypatch, request, index: str
) -> None:
    """2 nodes x 2 writer processes started together on an empty cache through the real server
    (its index SQLite or PostgreSQL): one takes the compile lease and compiles; it uploads the
    entry JAX wrote into its node tier (cachectl/service/node_upload.py) before the lease says
    written, so the other node's waiters read it from the server. Nothing records a compile time
    yet (no hedge): one compile in all; without the upload, the other node compiles it again (2)."""
    if index == "postgresql":  # machine A's index, and so the server's
        monkeypatch.setenv("CACHECTL_DB", request.getfixturevalue("pg_url"))
        invoke("db", "upgrade")
    invoke("path")  # machine A: the default cache registered, empty
    token = (
        invoke("token", "create", "--name", "fleet", "--role", "writer")
        .stdout.strip()
        .splitlines()[-1]
    )
    job = {
        "JAX_PLATFORMS": "cpu",
        "N": "1500",
        "SALT": "0.25",
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    plain = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        env={**os.environ, **job, "PLAIN": "1", "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    server = infra.start_server(
        "cachectl-serve",
        lambda port: [sys.executable, "-m", "cachectl", "serve", "--port", str(port)],
        tmp_path / "logs",
    )
    try:
        nodes = [MachineB(tmp_path / f"node{i}", isolated_home, server.url, token) for i in (0, 1)]
        procs = [(n, nodes[n].start(sys.executable, "-c", CHILD, env=job)) for n in (0, 0, 1, 1)]
        done = [(n, p.communicate(timeout=300)) for n, p in procs]
    finally:
        server.stop()
    expected = json.loads(plain.communicate(timeout=300)[0].strip().splitlines()[-1])["out"]
    for (n, (_out, err)), (_, p) in zip(done, procs, strict=True):
        assert p.returncode == 0 and "could not upload" not in err, (n, err[-3000:])
    results = [(n, json.loads(out.strip().splitlines()[-1])) for n, (out, _) in done]
    assert all(r["out"] == expected and r["requests"] == 1 for _, r in results), results
    assert sum(r["compiles"] for _, r in results) == 1, results


@needs_unshare
@pytest.mark.timeout(400)
def test_a_named_cache_serves_from_the_node_tier_with_the_server_down(
    isolated_home, tmp_path
) -> None:
    """A node picks a named cache with CACHECTL_CACHE. Its root comes from the index; with the
    server down the node still knows it (service/server_roots.py) and serves from its node tier,
    as the default cache does. Before: `cache 'team' not activated: index unavailable`, every
    call through jit."""
    invoke("cache", "add", "team", str(isolated_home / "team-root"))
    manifest = tiny(tmp_path)
    warm = infra.run_cachectl(tmp_path, "warm", str(manifest), "--cache", "team", "--json")
    assert warm.returncode == 0 and json.loads(warm.stdout)["summary"]["compiled"] == 5, warm.stderr
    token = invoke("token", "create", "--name", "n", "--role", "reader").stdout.split()[-1]
    server = infra.start_server(
        "cachectl-serve",
        lambda port: [sys.executable, "-m", "cachectl", "serve", "--port", str(port)],
        tmp_path / "logs",
    )
    b = MachineB(tmp_path / "b", isolated_home, server.url, token)
    code = TINY_SERVICE.format(dir=str(tmp_path), cache="")
    try:
        up = b.run(sys.executable, "-c", code, env={"CACHECTL_CACHE": "team"})
    finally:
        server.stop()
    down = b.run(sys.executable, "-c", code, env={"CACHECTL_CACHE": "team"})
    for proc in (up, down):
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(proc.stdout.strip().splitlines()[-1])["hits"] == 5, proc.stderr[-2000:]
    assert "entries this node fetched and verified before" in down.stderr, down.stderr

    # serving's reason for each function names the real cause, not "run `cachectl warm`"
    serving = (
        f"import json, sys; sys.path.insert(0, {str(tmp_path)!r}); import cachectl; "
        f"r = cachectl.serving({str(manifest)!r}).report().to_dict()['functions']; "
        "print(json.dumps(sorted({f['fallback_reason'] for f in r.values()})))"
    )
    server = infra.start_server(
        "cachectl-serve",
        lambda port: [sys.executable, "-m", "cachectl", "serve", "--port", str(port)],
        tmp_path / "logs",
    )
    causes = {
        "refused the token": {
            "CACHECTL_CACHE": "team",
            "CACHECTL_TOKEN": "cct_wrong",
            "CACHECTL_SERVER": server.url,
        },
        "no cache named 'nosuch'": {"CACHECTL_CACHE": "nosuch", "CACHECTL_SERVER": server.url},
        "is unreachable": {"CACHECTL_CACHE": "default", "CACHECTL_SERVER": "http://127.0.0.1:9"},
    }
    try:
        said = {
            cause: b.run(sys.executable, "-c", serving, env={**env, "CACHECTL_NODE_CACHE": "off"})
            for cause, env in causes.items()
        }
    finally:
        server.stop()
    for cause, proc in said.items():
        assert proc.returncode == 0, proc.stderr[-2000:]
        reasons = json.loads(proc.stdout.strip().splitlines()[-1])
        assert len(reasons) == 1 and cause in reasons[0], (cause, reasons)
        assert "run `cachectl warm`" not in reasons[0]


def test_two_nodes_read_each_entry_from_the_bucket_once(tmp_path, monkeypatch) -> None:
    # Our own moto, recording every request it answers.
    monkeypatch.setenv("MOTO_RECORDER_FILEPATH", str(tmp_path / "recording"))
    moto = infra.start_moto(tmp_path / "moto")
    try:
        for key, value in moto.env.items():
            monkeypatch.setenv(key, value)
        infra.clear_fsspec_instance_caches()
        bucket = f"s3://{infra.unique_name()}"
        infra.create_s3_bucket(moto.url, bucket[5:])
        invoke("cache", "add", "objects", f"{bucket}/jax")
        manifest = tiny(tmp_path)
        # In a process of its own: JAX's persistent cache and its object-store client are
        # process-wide, and an earlier test of this worker may have pointed them at another S3.
        warm = infra.run_cachectl(tmp_path, "warm", str(manifest), "--cache", "objects", "--json")
        assert warm.returncode == 0, warm.stderr
        assert json.loads(warm.stdout)["summary"]["compiled"] == 5
        httpx.post(f"{moto.url}/moto-api/recorder/start-recording")

        code = TINY_SERVICE.format(dir=str(tmp_path), cache=repr("objects"))
        procs = []
        for node in ("node0", "node1"):  # a node: its own tier, its own credentials
            env = {
                **os.environ,
                "CACHECTL_NODE_CACHE": str(tmp_path / node),
                "AWS_ACCESS_KEY_ID": node.upper(),
            }
            procs += [
                subprocess.Popen(
                    [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True
                )
                for _ in range(3)
            ]
        results = [
            json.loads(p.communicate(timeout=240)[0].strip().splitlines()[-1]) for p in procs
        ]
        httpx.post(f"{moto.url}/moto-api/recorder/stop-recording")
        recording = httpx.get(f"{moto.url}/moto-api/recorder/download-recording").text
    finally:
        moto.stop()
    assert all(r["hits"] == 5 for r in results), results
    gets: Counter[tuple[str, str]] = Counter()
    for line in recording.splitlines():
        request = json.loads(line)
        path = request["url"].split("?", 1)[0]
        if request["method"] == "GET" and path.endswith("-cache"):
            auth = request["headers"].get("Authorization", "")
            node = "node0" if "Credential=NODE0/" in auth else "node1"
            gets[(node, path.rsplit("/", 1)[1])] += 1
    assert len(gets) == 10 and max(gets.values()) == 1, gets  # 5 entries x 2 nodes, once each


def test_two_nodes_read_each_entry_from_an_azure_container_once(tmp_path, monkeypatch) -> None:
    """The same through az:// (Azurite): 6 processes on 2 nodes, each entry fetched once per node,
    so twice in all (moto tells nodes apart by credentials; Azurite's log does not: 2 GETs of
    each entry with every process hitting means one per node)."""
    if NO_AZURITE:
        pytest.skip("Azure Blob tests skipped: CACHECTL_TEST_NO_AZURITE=1")
    command = AZURITE
    assert command is not None, "Azurite is not installed: run the tests through scripts/test"
    log = tmp_path / "azurite-debug.log"
    azurite = infra.start_azurite(command, tmp_path / "azurite", debug_log=log)
    try:
        for key, value in azurite.env.items():
            monkeypatch.setenv(key, value)
        infra.clear_fsspec_instance_caches()
        container = infra.unique_name()
        infra.create_az_container(azurite.env["AZURE_STORAGE_CONNECTION_STRING"], container)
        invoke("cache", "add", "objects", f"az://{container}/jax")
        manifest = tiny(tmp_path)
        warm = infra.run_cachectl(tmp_path, "warm", str(manifest), "--cache", "objects", "--json")
        assert warm.returncode == 0, warm.stderr
        assert json.loads(warm.stdout)["summary"]["compiled"] == 5
        start = log.stat().st_size
        code = TINY_SERVICE.format(dir=str(tmp_path), cache=repr("objects"))
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code],
                env={**os.environ, "CACHECTL_NODE_CACHE": str(tmp_path / node)},
                stdout=subprocess.PIPE,
                text=True,
            )
            for node in ("node0", "node1")
            for _ in range(3)
        ]
        results = [
            json.loads(p.communicate(timeout=240)[0].strip().splitlines()[-1]) for p in procs
        ]
        with log.open("rb") as f:
            f.seek(start)
            lines = f.read().decode(errors="replace").splitlines()
    finally:
        azurite.stop()
    assert all(r["hits"] == 5 for r in results), results
    gets: Counter[str] = Counter()
    for line in lines:
        if "RequestMethod=GET " not in line:
            continue
        url = line.split("RequestURL=", 1)[1].split(" ", 1)[0].split("?", 1)[0]
        if url.endswith("-cache"):
            gets[url.rsplit("/", 1)[1]] += 1
    assert len(gets) == 5 and set(gets.values()) == {2}, gets  # 5 entries, once per node


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_the_tier_evicts_the_least_recently_read_and_bounds_its_wait(tmp_path, monkeypatch) -> None:
    """In one process, on real files: the size limit evicts by last read; a lock held by another
    process past the bounded wait makes this one fetch on its own, with one warning."""
    warnings: list[str] = []
    tier = node_tier.NodeTier(str(tmp_path / "node"), limit=2500, warn=warnings.append)
    files = tier.files("s3://bucket/root", "main", "jax-x/cpu/abc")
    blobs = {f"k{i}-cache": bytes([i]) * 1000 for i in range(3)}
    fetched: list[str] = []

    def read(name: str) -> bytes:
        return files.read(name, _sha(blobs[name]), lambda: fetched.append(name) or blobs[name])

    read("k0-cache")
    read("k1-cache")
    os.utime(files.path("k0-cache"), (1, 1))  # k0 read long ago, k1 just now
    os.utime(files.path("k1-cache"), (2, 2))
    read("k1-cache")  # a hit: k1 is now the most recent
    read("k2-cache")  # past 2500 bytes: the least recently read goes
    assert fetched == ["k0-cache", "k1-cache", "k2-cache"]
    assert not os.path.exists(files.path("k0-cache"))
    assert os.path.exists(files.path("k1-cache")) and os.path.exists(files.path("k2-cache"))
    assert tier.counts.evicted == 1

    # another process holds k0's lock: past the (shortened) wait, this one fetches itself
    monkeypatch.setattr(node_tier, "WAIT_S", 0.3)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time\n"
            "from cachectl.storage import node_tier\n"
            f"files = node_tier.NodeTier({str(tmp_path / 'node')!r}).files("
            "'s3://bucket/root', 'main', 'jax-x/cpu/abc')\n"
            "fh = files._lock_file('k0-cache')\n"
            "fcntl.flock(fh.fileno(), fcntl.LOCK_EX)\n"
            "print('held', flush=True)\n"
            "time.sleep(30)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert read("k0-cache") == blobs["k0-cache"]
    finally:
        holder.kill()
        holder.communicate()
    assert fetched[-1] == "k0-cache"
    assert any("fetching on our own" in w for w in warnings), warnings


def test_a_writer_services_upload_is_quiet_on_a_conflict_and_warns_once(
    tmp_path, sqlite_url
) -> None:
    """service/node_upload.py against a live server: an entry JAX wrote into the node tier is
    uploaded and served; the same key with other bytes (another node's compile, a hedge) is
    left to the server's first, with no warning; a reader token costs one warning, then no more
    uploads."""
    from support.server_kit import MAIN, entry_key, seed, served

    from cachectl.client.server_client import ServerClient
    from cachectl.service.node_upload import ServiceUploads
    from cachectl.storage.entries import make_entry

    s = seed(sqlite_url, str(tmp_path / "root"), str(tmp_path / "other"), entries=1)
    node = tmp_path / "node"
    node.mkdir()
    keys = [entry_key("jit_fleet", n) for n in range(3)]
    with served(sqlite_url) as (live, client):
        warned: list[str] = []
        clients: list[ServerClient] = []

        def uploads(token: str) -> ServiceUploads:
            def client() -> ServerClient:
                clients.append(ServerClient(live.url, s.tokens[token]))
                return clients[-1]

            return ServiceUploads(
                client,
                MAIN,
                s.digest,
                str(node),
                warned.append,
            )

        writer = uploads("writer")
        first = make_entry(b"first compile" * 100, compile_seconds=1)
        writer.wrote(keys[0], first)
        path = f"/api/v1/caches/{MAIN}/environments/{s.digest}/entries/{keys[0]}"
        got = client.get(path, headers={"authorization": f"Bearer {s.tokens['reader']}"})
        assert got.status_code == 200 and got.content == first

        writer.wrote(
            keys[0], make_entry(b"a hedge" * 100, compile_seconds=2)
        )  # 409 from the server: its first bytes stay
        assert writer.sent == 1 and warned == []

        reader = uploads("reader")
        for key in keys[1:]:
            reader.wrote(key, make_entry(key.encode() * 50, compile_seconds=1))
        assert reader.sent == 0 and len(warned) == 1, warned
        assert "could not upload entry" in warned[0] and "other nodes compile" in warned[0]
        for made in clients:
            made.close()
