"""The gate (cachectl/trust/gate.py): a co-tenant's program planted at a service's key never runs.

Issue 67's cases 1, 2 and 8, each reproduced with real processes. The service's program is
``f = jax.jit(lambda x: x + 1)``; a co-tenant (a second uid, ``cotenant``, where the tests run as
root; the same uid otherwise: the bytes, not the uid, make the attack) learns its key by compiling
it in a cache of its own, and plants the entry of ``x + 1006`` at that key. Every service must
compute ``f(1) = 2`` (or compile), never 1007.

- case 2: the compile lease's ``written`` recorded the sha256 of the file read back at the key (the
  plant, which JAX's put skips), so a later service of another owner loaded it;
- case 1: the node upload sent the file found at the key in the node tier (the plant) to the
  server, which indexed it for every other node;
- case 8: ``warm`` rewrote entries a service had written; the service's own record outranked the
  index row, so every later process refused the warmed entries.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import infra

REPO = Path(__file__).resolve().parent.parent
COTENANT = "cotenant"

# A service: f = jit(x + ADD), called at 1.0; prints f(1), JAX's cache hits and compiles.
SERVICE = r"""
import json, os
import numpy as np
import jax
from jax import monitoring
seen = {"hits": 0, "requests": 0}
def on_event(event, **kw):
    if event == "/jax/compilation_cache/cache_hits":
        seen["hits"] += 1
    elif event == "/jax/compilation_cache/compile_requests_use_cache":
        seen["requests"] += 1
monitoring.register_event_listener(on_event)
import cachectl
cachectl.activate(telemetry=False)
scope = {}
exec("def f(x):\n    return x + " + os.environ.get("ADD", "1") + "\n", scope)
out = float(jax.jit(scope["f"])(np.float32(1.0)))
print(json.dumps({"out": out, **seen}))
"""


def _base_env(home: Path, **extra: str) -> dict[str, str]:
    """A process of one owner: its own HOME and XDG dirs (its state: pins, written records)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHECTL_", "JAX_", "XDG_"))}
    env.update(HOME=str(home), PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    for var, sub in (
        ("XDG_DATA_HOME", "data"),
        ("XDG_CACHE_HOME", "cache"),
        ("XDG_CONFIG_HOME", "config"),
        ("XDG_STATE_HOME", "state"),
    ):
        (home / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(home / sub)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env.update(extra)
    return env


def _run(argv: list[str], env: dict[str, str], timeout: float = 300) -> str:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert done.returncode == 0, (argv, done.stdout[-2000:], done.stderr[-4000:])
    return done.stderr


def service(env: dict[str, str], **extra: str) -> tuple[dict[str, Any], str]:
    done = subprocess.run(
        [sys.executable, "-c", SERVICE],
        env={**env, **extra},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def cachectl(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "cachectl", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-4000:])
    return done.stdout


def as_cotenant() -> list[str]:
    """The argv prefix that runs a command as the second uid (created if missing), or [] where
    the tests do not run as root (the plant is then made by this uid: the same bytes)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return []
    try:
        user = pwd.getpwnam(COTENANT)
    except KeyError:
        if shutil.which("useradd") is None:
            return []
        subprocess.run(["useradd", "-m", COTENANT], check=False, capture_output=True)
        user = pwd.getpwnam(COTENANT)
    return [
        "setpriv",
        f"--reuid={user.pw_uid}",
        f"--regid={user.pw_gid}",
        "--clear-groups",
    ]


def plant(data: bytes, target: Path, staging: Path) -> None:
    """The co-tenant writes ``data`` at ``target`` (its directories made first, by it)."""
    staging.write_bytes(data)
    staging.chmod(0o644)
    script = 'mkdir -p "$(dirname "$1")" && cp "$2" "$1"'
    subprocess.run(
        [*as_cotenant(), "sh", "-c", script, "plant", str(target), str(staging)], check=True
    )


@contextlib.contextmanager
def shared_dir() -> Iterator[Path]:
    """A directory both uids reach (pytest's tmp_path is this uid's alone), sticky like /tmp."""
    path = Path(tempfile.mkdtemp(prefix="cachectl-gate-", dir="/tmp"))
    path.chmod(0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def learned(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, bytes]:
    """What the co-tenant learns in caches of its own: f's entry path relative to the cache root
    (the namespace is the environment's, the same on every machine like this one) and the bytes
    of ``x + 1006`` compiled under the same name (once for the module's tests)."""
    home = tmp_path_factory.mktemp("cotenant-own")
    found: dict[str, tuple[str, bytes]] = {}
    for add in ("1", "1006"):
        own = home / f"own-{add}"
        env = _base_env(own, CACHECTL_ROOT=str(own / "root"))
        out, _ = service(env, ADD=add)
        assert out["out"] == 1.0 + int(add)
        (entry,) = sorted((own / "root").rglob("jit_f-*-cache"))
        found[add] = (str(entry.relative_to(own / "root")), entry.read_bytes())
    return found["1"][0], found["1006"][1]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", ["sqlite", "postgresql"])
def test_a_lease_never_vouches_for_a_planted_entry(
    tmp_path: Path, request, index: str, learned: tuple[str, bytes]
) -> None:
    """Case 2. The co-tenant plants ``x + 1006`` at f's key in the shared cache before any
    compile. Owner A's service misses, takes the compile lease, compiles (2); JAX's put skips the
    taken key, and the lease is marked written with the sha256 of the bytes A handed put, not of
    the plant. Owner B's service on the same cache and index waits on that row, finds the plant's
    sha256 differs, and compiles: 2, never 1007."""
    rel, evil = learned
    with shared_dir() as shared:
        db = (
            f"sqlite:///{shared}/index.db"
            if index == "sqlite"
            else request.getfixturevalue("pg_url")
        )
        root = shared / "root"
        root.mkdir()
        root.chmod(0o1777)  # a cache both tenants write
        owners = {
            name: _base_env(tmp_path / name, CACHECTL_DB=db, CACHECTL_ROOT=str(root))
            for name in ("a", "b")
        }
        cachectl(owners["a"], "db", "upgrade")
        cachectl(owners["a"], "path")  # the default cache, registered on the shared index
        plant(evil, root / rel, shared / "staged")
        first, err_a = service(owners["a"])
        assert first["out"] == 2.0, err_a[-3000:]
        assert (root / rel).read_bytes() == evil  # JAX's put left the plant in place
        later, err_b = service(owners["b"])
        assert later["out"] == 2.0, err_b[-3000:]
        assert later["hits"] == 0


needs_unshare = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a machine without the cache root is a mount namespace: needs root and unshare",
)


def _elsewhere(hidden: Path, argv: list[str]) -> list[str]:
    """``argv`` on a machine where ``hidden`` (the server's cache root) is an empty directory."""
    script = f'mount --make-rprivate / && mount -t tmpfs tmpfs {hidden} && exec "$@"'
    return ["unshare", "-m", "bash", "-c", script, "elsewhere", *argv]


def node_service(hidden: Path, env: dict[str, str]) -> tuple[dict[str, Any], str]:
    done = subprocess.run(
        _elsewhere(hidden, [sys.executable, "-c", SERVICE]),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@needs_unshare
@pytest.mark.timeout(600)
def test_a_node_upload_sends_the_bytes_put_was_handed(
    isolated_home, tmp_path: Path, learned: tuple[str, bytes]
) -> None:
    """Case 1. Server mode, the cache root on the server's machine only. The co-tenant makes
    the writer node's tier directory first (a shared node cache) and plants ``x + 1006`` at f's
    key. The writer service compiles f (2); JAX's put skips the taken key; what the service
    uploads is the bytes it handed put, never the file found at the key, so the server indexes
    f's own program and a second node computes 2, never 1007."""
    from support.warming import invoke

    from cachectl.storage.node_tier import source_dir

    rel, evil = learned
    invoke("path")  # the server's machine: the default cache, empty
    token = invoke("token", "create", "--name", "nodes", "--role", "writer").stdout.split()[-1]
    server = infra.start_server(
        "cachectl-serve",
        lambda port: [sys.executable, "-m", "cachectl", "serve", "--port", str(port)],
        tmp_path / "logs",
    )
    try:
        with shared_dir() as shared:
            node_root = shared / "node"
            node_root.mkdir()
            node_root.chmod(0o1777)  # a node cache every tenant of the machine shares
            plant(evil, Path(source_dir(str(node_root), server.url, "default")) / rel, shared / "s")
            on_node = {"CACHECTL_SERVER": server.url, "CACHECTL_TOKEN": token}
            writer = _base_env(tmp_path / "a", **on_node, CACHECTL_NODE_CACHE=str(node_root))
            first, err = node_service(isolated_home, writer)
            assert first["out"] == 2.0, err[-3000:]
            assert "could not upload" not in err, err[-3000:]
            other, err = node_service(isolated_home, _base_env(tmp_path / "b", **on_node))
            assert other["out"] == 2.0, err[-3000:]
            assert other["hits"] == 1, err[-3000:]  # f's own program, from the server
    finally:
        server.stop()


MLP_SERVICE = r"""
import json
import numpy as np
import jax
from jax import monitoring
seen = {"hits": 0}
def on_event(event, **kw):
    if event == "/jax/compilation_cache/cache_hits":
        seen["hits"] += 1
monitoring.register_event_listener(on_event)
import cachectl
cachectl.activate(telemetry=False)
from examples import mlp
f = jax.jit(mlp.forward)
for b in (1, 8, 32):
    f(mlp.init_params(), np.ones((b, 16), np.float32))
print(json.dumps(seen))
"""


@pytest.mark.timeout(600)
def test_an_entry_warm_rewrote_is_the_one_later_services_load(tmp_path: Path) -> None:
    """Case 8, the README's MLP. A first deploy's service writes its 3 programs (and records
    their sha256s in its owner's state); ``warm`` then rewrites those files and indexes them.
    The owner's next service loads the warmed entries (3 hits, none refused): the index row is
    the fact, the owner's own record counts only where the index has no row. verify is clean."""
    env = _base_env(tmp_path / "owner")
    first = subprocess.run(
        [sys.executable, "-c", MLP_SERVICE], env=env, capture_output=True, text=True, cwd=REPO
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert list((Path(env["XDG_STATE_HOME"]) / "cachectl" / "written").iterdir())
    warmed = json.loads(cachectl(env, "warm", "examples/mlp.yaml", "--json"))
    assert warmed["summary"]["compiled"] == 3
    again = subprocess.run(
        [sys.executable, "-c", MLP_SERVICE], env=env, capture_output=True, text=True, cwd=REPO
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "refused JAX entry" not in again.stderr, again.stderr[-3000:]
    assert json.loads(again.stdout.strip().splitlines()[-1])["hits"] == 3
    assert json.loads(cachectl(env, "verify", "--json"))["plan"]["findings"] == []
