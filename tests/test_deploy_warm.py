"""A cold fleet through the real `cachectl serve` ends trace-free (issue 68, items 1 and 2).

Machine A holds the root of a named cache (`--service-writes allow`), a writer token and the
server. Replicas and the deploy are machines of their own (tests/test_node_tier.py's MachineB: a
HOME each, A's home hidden in a mount namespace, CACHECTL_NODE_CACHE): the replicas start
together on the empty cache and upload what JAX wrote; the deploy's `cachectl warm` then finds
every entry on the server, compiles none of them, and stores each bucket's executable bound to the
server's entry bytes (warm/settle.py). A later replica on `cachectl.serving` falls back for none.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from support import infra
from support.machines import CACHECTL, MachineB, fleet, needs_unshare
from support.warming import TINY_SERVICE, invoke, tiny

CACHE = "fleet"
BUCKETS = 5  # the tiny manifest: affine x 4, layer x 1

# A replica on cachectl.serving: every bucket of the tiny manifest called once; its report.
TINY_SERVING = """
import json, sys
import numpy as np
import cachectl
sys.path.insert(0, {dir!r})
rt = cachectl.serving({manifest!r}, readonly={readonly})
w = np.ones((8, 8), np.float32)
p = {{"w": w, "b": np.zeros((8,), np.float32)}}
for batch in (1, 2):
    for mode in ("relu", "tanh"):
        rt["affine"](np.ones((batch, 8), np.float32), w, mode=mode)
rt["layer"](np.ones((3, 8), np.float32), p)
functions = rt.report().to_dict()["functions"]
print(json.dumps({{n: {{"fallback": f["fallback"], "loaded": f["loaded"]}}
                  for n, f in functions.items()}}))
"""


ALL_LOADED = {"affine": {"fallback": 0, "loaded": 4}, "layer": {"fallback": 0, "loaded": 1}}


def _fleet(
    isolated_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[infra.Server, str, Path, list[MachineB]]:
    """Machine A (the root of an empty named cache, a writer token, the real server) and five
    other machines: three replicas, the deploy and one more, each with its own node tier."""
    root = isolated_home / "root"
    invoke("cache", "add", CACHE, str(root), "--service-writes", "allow")
    token = (
        invoke("token", "create", "--name", "fleet", "--role", "writer")
        .stdout.strip()
        .splitlines()[-1]
    )
    manifest = tiny(tmp_path)
    monkeypatch.setenv("CACHECTL_SERVER_TOKEN_CACHE", "0")  # a policy set on A holds at once
    server = infra.start_server(
        "cachectl-serve",
        lambda port: [sys.executable, "-m", "cachectl", "serve", "--port", str(port)],
        tmp_path / "logs",
    )
    names = ("r0", "r1", "r2", "deploy", "fresh")
    machines = fleet(names, tmp_path, isolated_home, server.url, token, CACHE)
    return server, token, manifest, list(machines.values())


def _serving(machine: MachineB, manifest: Path, readonly: bool) -> dict[str, dict[str, int]]:
    code = TINY_SERVING.format(dir=str(manifest.parent), manifest=str(manifest), readonly=readonly)
    proc = machine.run(sys.executable, "-c", code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_unshare
@pytest.mark.timeout(600)
def test_a_cold_fleet_then_the_deploy_warm_ends_trace_free(
    isolated_home, tmp_path, monkeypatch
) -> None:
    server, _token, manifest, machines = _fleet(isolated_home, tmp_path, monkeypatch)
    replicas, deploy = machines[:3], machines[3]
    try:
        code = TINY_SERVICE.format(dir=str(manifest.parent), cache=repr(CACHE))
        # JAX writes a program that compiles in under its 1 s minimum only when told to
        fast = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
        procs = [r.start(sys.executable, "-c", code, env=fast) for r in replicas]
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0 and "could not upload" not in err, err[-3000:]

        # A deploy whose executables the server refuses (the cache's quota, which the server
        # checks after the executable's entry sha256): each bucket fails, warm exits 1. Through
        # worker processes, which compile what the server holds (nothing is asked before), so each
        # executable is bound to the server's entry, not to this compile's (else: 422, "other
        # entry bytes").
        invoke("cache", "set", CACHE, "--max-size", "1KiB")
        proc = deploy.run(
            *CACHECTL, "warm", str(manifest), "--json", "--executor", "process", "--jobs", "2"
        )
        assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
        report = json.loads(proc.stdout)
        assert report["summary"]["failed"] == BUCKETS, proc.stdout[-3000:]
        errors = [b["error"] for b in report["buckets"]]
        assert all("could not upload it to the server" in e and "quota" in e for e in errors), (
            errors
        )
        invoke("cache", "set", CACHE, "--max-size", "1GiB")

        # The deploy warm: every entry is the server's; none compiled, each executable stored.
        proc = deploy.run(*CACHECTL, "warm", str(manifest), "--json")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        report = json.loads(proc.stdout)
        s = report["summary"]
        assert (s["compiled"], s["cached"], s["failed"]) == (0, BUCKETS, 0), proc.stdout[-3000:]
        assert sum(b["aot_bytes"] is not None for b in report["buckets"]) == BUCKETS

        check = deploy.run(*CACHECTL, "warm-check", str(manifest), "--json")
        assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]
        summary = json.loads(check.stdout)["summary"]
        assert (summary["hits"], summary["aot_loaded"], summary["aot_ran"]) == (BUCKETS,) * 3

        # A later replica: every bucket from a stored executable.
        served = _serving(replicas[0], manifest, readonly=True)
        assert served == ALL_LOADED, served
    finally:
        server.stop()


@needs_unshare
@pytest.mark.timeout(600)
def test_writer_replicas_on_serving_store_what_they_compiled(
    isolated_home, tmp_path, monkeypatch
) -> None:
    """Write-back (cachectl/dispatch/write_back.py): three writer replicas on cachectl.serving
    start together on the empty cache; each bucket they compile is stored with its executable
    and uploaded, so a later replica is trace-free with no warm in between."""
    server, _token, manifest, machines = _fleet(isolated_home, tmp_path, monkeypatch)
    replicas = machines[:3]
    fast = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    try:
        code = TINY_SERVING.format(dir=str(manifest.parent), manifest=str(manifest), readonly=False)
        procs = [r.start(sys.executable, "-c", code, env=fast) for r in replicas]
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0 and "could not" not in err, err[-3000:]
        served = _serving(machines[3], manifest, readonly=True)
        assert served == ALL_LOADED, served

        # A warm through worker processes afterwards, on a node that read nothing yet, compiles
        # every bucket (they ask nothing first), binds each executable to the server's entry (its
        # own compile's bytes differ), and the server takes them all.
        proc = machines[4].run(
            *CACHECTL, "warm", str(manifest), "--json", "--executor", "process", "--jobs", "2"
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        s = json.loads(proc.stdout)["summary"]
        assert (s["compiled"], s["failed"]) == (BUCKETS, 0), (
            proc.stdout[-3000:] + proc.stderr[-3000:]
        )
    finally:
        server.stop()
