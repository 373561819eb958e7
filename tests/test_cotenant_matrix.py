"""The co-tenant matrix (issue 67 item 3): in every cell a second uid on the node (the user
``cotenant``, tests/support/cotenant.py) plants ``jax.jit(lambda x: x + 1006)``'s entry at the
key of the service's ``jax.jit(lambda x: x + 1)`` (the key learned by compiling that program in a
cache of one's own), and every read path computes f(1) = 2 or compiles, never 1007.

A cell's test id reads ``path-mode-moment-db``.

- **mode**: ``local`` (a local-disk cache group-shared with the co-tenant: ``cache add --group``,
  ``--writers root``), ``s3`` (a bucket on moto; the co-tenant writes it with a bucket credential of
  its own: in a bucket there is no uid), ``server`` (a real ``cachectl serve``, its root hidden
  from the node by a mount namespace: every read goes through the node tier, which the co-tenant
  made first, case 1 of the issue), ``down`` (the same node after that server stopped: the node
  tier offline, its kept record, case 3).
- **moment** of the plant: ``before`` the writer service's compile; ``between`` the bytes JAX's
  put wrote and the records cachectl keeps of them (the writer's script runs the co-tenant's
  plant the moment JAX's ``LRUCache.put`` returns: test code in the victim's process, no knob in
  cachectl); ``after`` the records (in the direct modes the writer service, then ``cachectl warm``
  of f: its index row and stored executable; the indexed file, and the node tiers, rewritten); ``down``:
  while the server is down (the node's kept record edited and the entry swapped).
- **db**: the index on SQLite or PostgreSQL (the server's, in the server modes).
- **path**: ``activate`` (activate()'s reads of JAX's cache; through the node tier in the server
  modes, online and offline), ``serving`` (``cachectl.serving`` of a manifest holding f),
  ``lease`` (the same service with the compile lease on: a waiter reads what the lease row
  vouches for), ``exec`` (``cachectl exec`` of plain JAX), ``warm-check`` (and its children: a
  hit on the planted bytes is a load of them), ``pull`` (the mirror JAX reads unchecked: the
  planted bytes copied there are a service computing 1007), ``bundle`` (``bundle create`` of the
  cache, then ``bundle install`` into another cache: the planted bytes installed likewise).

Cells left out, because the moment or path does not exist there: the ``down`` moment outside the
``down`` mode, and the ``before``/``between``/``after`` moments in it (the server is up then:
that is the ``server`` mode); ``lease``, ``warm-check`` and ``pull`` in the ``down`` mode (the
lease, warm-check's coverage and pull need the server). ``bundle`` only in the ``after`` moment of the direct
modes: ``bundle create`` bundles indexed entries, and only there does a warm index f's entry (a
service's writes are recorded in its owner's state, not the index; the server's machine holds the
root in the server modes).

On PostgreSQL only ``activate``, ``serving`` and ``lease`` run (the paths whose answer is the
index's own rows and lease rows), at the moments where a record of the index decides: local and
server ``before`` (the lease row and the server's index must not vouch for a plant) and ``down``;
``exec``, ``warm-check`` and ``pull``, the other moments and the bucket read the same records and
run on SQLite (CI's time: each (mode, moment, db) is a writer service and its readers).

Size: 7 paths x 4 modes x 4 moments x 2 databases is 224 combinations, of which 67 cells run
(SQLite 59: local 19, s3 19, server 18, down 3; PostgreSQL 8: local 3, server 3, down 2);
``test_the_matrix_size`` holds that count.

Cost: one writer service and a few reader processes per (mode, moment, db); moto is shared, one
server per database for ``server``, one per cell for ``down``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import cotenant, infra
from support.cotenant import F_ANSWER, PLANTED_ANSWER

from cachectl.storage import node_tier

WHY_NOT = cotenant.can_act()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")

CACHECTL = [sys.executable, "-m", "cachectl"]
CACHE = "shared"

PATHS = {
    "local": ("activate", "serving", "lease", "exec", "warm-check", "pull"),
    "s3": ("activate", "serving", "lease", "exec", "warm-check", "pull"),
    "server": ("activate", "serving", "lease", "exec", "warm-check", "pull"),
    "down": ("activate", "serving", "exec"),
}
MOMENTS = {
    "local": ("before", "between", "after"),
    "s3": ("before", "between", "after"),
    "server": ("before", "between", "after"),
    "down": ("down",),
}
DBS = ("sqlite", "postgresql")
# On PostgreSQL, the paths whose answer is the index's own (its rows, the lease's rows); exec,
# warm-check and pull read through the same records, so they run once per moment, on SQLite.
PG_PATHS = ("activate", "serving", "lease")
# ... and at the moments where a record of the index's decides (the plant before the compile,
# which the lease's row and the server's index must not vouch for, and the node's record with the
# server down), on the local disk and through the server: CI's time (each is a writer service
# and its readers); the other moments and the bucket read the same rows as on SQLite.
PG_MOMENTS = {("local", "before"), ("server", "before"), ("down", "down")}


# bundle create bundles indexed entries: only after a warm's record, in the direct modes.
BUNDLED = {("local", "after"), ("s3", "after")}


def _paths(mode: str, moment: str, db: str) -> tuple[str, ...]:
    if db != "sqlite":
        if (mode, moment) not in PG_MOMENTS:
            return ()
        return tuple(p for p in PATHS[mode] if p in PG_PATHS)
    return PATHS[mode] + (("bundle",) if (mode, moment) in BUNDLED else ())


CELLS = [
    pytest.param(path, mode, moment, db, id=f"{path}-{mode}-{moment}-{db}")
    for mode in PATHS
    for moment in MOMENTS[mode]
    for db in DBS
    for path in _paths(mode, moment, db)
]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Learned:
    """What the co-tenant learned in a cache of its own: f's key, g's bytes, the namespace."""

    key: str
    planted: Path  # g's entry, readable by the co-tenant
    planted_sha: str
    namespace: str  # jax-<v>/<backend>/<digest16>


@dataclass
class Seen:
    """One path's answer in a cell: f(1), or None where the path computes nothing itself."""

    value: float | None
    detail: str


@dataclass
class World:
    """The module's shared parts: its directory (reachable by the co-tenant), what it learned,
    moto, PostgreSQL's admin URL, one server per database, and every cell's outcome."""

    base: Path
    learned: Learned
    pg_admin: str | None
    moto: Any = None
    servers: dict[str, Any] = field(default_factory=dict)
    outcomes: dict[tuple[str, str, str], dict[str, Seen] | str] = field(default_factory=dict)
    dbs: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def world(request: pytest.FixtureRequest) -> Iterator[World]:
    cotenant.user()
    base = Path(tempfile.mkdtemp(prefix="cachectl-cotenant-"))
    base.chmod(0o755)  # the co-tenant reaches what the cells share with it
    (base / "cotenant_f.py").write_text(cotenant.MODULE)
    (base / "f.yaml").write_text(cotenant.MANIFEST)
    (base / "exec_f.py").write_text(cotenant.EXEC)
    own = cotenant.clean_env(
        **cotenant.home(base / "own"),
        CACHECTL_DB=f"sqlite:///{base / 'own' / 'index.db'}",
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    found = cotenant.last_json(
        cotenant.run([sys.executable, "-c", cotenant.LEARN], own, base, timeout=240)
    )
    (f,), (g,) = found["f"], found["g"]
    planted = base / "planted"
    planted.write_bytes((Path(str(found["path"])) / g).read_bytes())
    planted.chmod(0o644)
    learned = Learned(
        key=f.removesuffix("-cache"),
        planted=planted,
        planted_sha=_sha(planted.read_bytes()),
        namespace="/".join(str(found["path"]).split("/")[-3:]),
    )
    pg_admin = None
    with contextlib.suppress(pytest.skip.Exception):
        pg_admin = request.getfixturevalue("pg_admin_url")
    w = World(base, learned, pg_admin)
    try:
        yield w
    finally:
        for server in w.servers.values():
            server.stop()
        if w.moto is not None:
            w.moto.stop()
        if pg_admin is not None:
            for name in w.dbs:
                infra.pg_drop_database(pg_admin, name)
        shutil.rmtree(base, ignore_errors=True)


def _index(w: World, db: str, where: Path) -> str:
    if db == "sqlite":
        return f"sqlite:///{where / 'index.db'}"
    if w.pg_admin is None:
        pytest.skip("PostgreSQL tests skipped: CACHECTL_TEST_NO_PG=1")
    name = infra.unique_name("cachectl_t").replace("-", "_")
    w.dbs.append(name)
    return infra.pg_create_database(w.pg_admin, name)


def _cachectl(env: dict[str, str], cwd: Path, *args: str) -> Any:
    done = cotenant.run([*CACHECTL, *args], env, cwd)
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-3000:])
    return done


def _service(
    env: dict[str, str], cwd: Path, plant: list[str] | None = None, manifest: str = ""
) -> dict[str, Any]:
    argv = [sys.executable, "-c", cotenant.SERVICE, json.dumps(plant) if plant else "", manifest]
    return cotenant.last_json(cotenant.run(argv, env, cwd))


def _value(found: dict[str, Any], name: str) -> Seen:
    return Seen(float(found[name]), json.dumps(found))


def _bytes_verdict(data: bytes | None, what: str, w: World) -> Seen:
    """A path that hands bytes on to a loader that reads them unchecked (a mirror, an installed
    bundle): the co-tenant's bytes there are a service computing 1007."""
    if data is None:
        return Seen(F_ANSWER, f"{what}: nothing at f's key (a service compiles)")
    if _sha(data) == w.learned.planted_sha:
        return Seen(PLANTED_ANSWER, f"{what}: the co-tenant's bytes at f's key")
    return Seen(F_ANSWER, f"{what}: other bytes than the co-tenant's at f's key")


def _find(root: Path, name: str) -> bytes | None:
    found = sorted(root.rglob(name))
    return found[0].read_bytes() if found else None


def _warm_check(env: dict[str, str], cwd: Path, at_key: bytes | None, w: World) -> Seen:
    done = cotenant.run([*CACHECTL, "warm-check", "f.yaml", "--json", "--path", str(cwd)], env, cwd)
    try:
        report = json.loads(done.stdout)
    except ValueError:
        return Seen(None, f"warm-check exited {done.returncode}: {done.stderr[-1500:]}")
    hits = report["summary"]["hits"]
    planted = at_key is not None and _sha(at_key) == w.learned.planted_sha
    if hits and planted:
        return Seen(PLANTED_ANSWER, f"warm-check hit f's key holding the co-tenant's bytes: {hits}")
    return Seen(F_ANSWER, f"warm-check hits {hits}, planted bytes at the key: {planted}")


# -- the direct modes: local disk, and a bucket --------------------------------------------------


def _direct(w: World, mode: str, moment: str, db: str) -> dict[str, Seen]:
    cell = w.base / f"{mode}-{moment}-{db}"
    cell.mkdir()
    cell.chmod(0o755)
    for name in ("cotenant_f.py", "f.yaml", "exec_f.py"):
        shutil.copy(w.base / name, cell / name)
    index = _index(w, db, cell)
    extra: dict[str, str] = {}
    if mode == "s3":
        if w.moto is None:
            w.moto = infra.start_moto(w.base / "moto-logs")
        extra = dict(w.moto.env)
        bucket = infra.unique_name()
        infra.create_s3_bucket(w.moto.url, bucket)
        root = f"s3://{bucket}/jax"
        add = ["--service-writes", "allow"]
    else:
        root = str(cell / "root")
        add = ["--group", cotenant.USER, "--writers", "root", "--service-writes", "allow"]
    owner = dict(CACHECTL_DB=index, CACHECTL_CACHE=CACHE, **extra)
    writer = cotenant.clean_env(
        **cotenant.home(cell / "a"), **owner, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0"
    )
    reader = cotenant.clean_env(**cotenant.home(cell / "b"), **owner)
    if db == "postgresql":
        _cachectl(writer, cell, "db", "upgrade")
    _cachectl(writer, cell, "cache", "add", CACHE, root, *add)
    target = f"{root}/{w.learned.namespace}/{w.learned.key}-cache"
    if mode == "s3":
        plant = cotenant.bucket_plant(w.moto.url, w.learned.planted, target)
    else:
        plant = cotenant.file_plant(w.learned.planted, Path(target))

    if moment == "before":
        cotenant.plant(plant)
    wrote = _service(writer, cell, plant if moment == "between" else None)
    if moment == "after":  # the record: also a warm's index row for f, and its stored executable
        _cachectl(writer, cell, "warm", "f.yaml", "--path", str(cell))
        cotenant.plant(plant)

    def at_key() -> bytes | None:
        if mode == "s3":
            got = httpx.get(f"{w.moto.url}/{target.removeprefix('s3://')}")
            return got.content if got.status_code == 200 else None
        return Path(target).read_bytes() if Path(target).exists() else None

    seen: dict[str, Seen] = {}
    off = {**reader, "CACHECTL_COMPILE_LEASE": "0"}
    served = _service(off, cell, manifest=str(cell / "f.yaml"))
    seen["serving"] = _value(served, "serving")
    seen["activate"] = _value(served, "activate")
    seen["lease"] = _value(_service(reader, cell), "activate")
    if db == "sqlite":  # the paths that read through those same records once per moment
        ran = cotenant.run([*CACHECTL, "exec", "--", sys.executable, "exec_f.py"], reader, cell)
        seen["exec"] = _value(cotenant.last_json(ran), "exec")
        seen["warm-check"] = _warm_check(reader, cell, at_key(), w)
        argv = [*CACHECTL, "pull", "--to", str(cell / "mirror"), "--json"]
        pulled = cotenant.run(argv, reader, cell)
        mirror = _find(cell / "mirror", f"{w.learned.key}-cache")
        seen["pull"] = _bytes_verdict(mirror, f"pull (exit {pulled.returncode})", w)
    if (mode, moment) in BUNDLED and db == "sqlite":
        seen["bundle"] = _bundle(reader, cell, w)
    for s in seen.values():
        s.detail += f" | writer saw {json.dumps(wrote)}"
    return seen


def _bundle(reader: dict[str, str], cell: Path, w: World) -> Seen:
    """bundle create of the cache, then bundle install into a cache of the reader's own."""
    bundle = cell / "f.tar.zst"
    argv = [*CACHECTL, "bundle", "create", "-o", str(bundle), "--manifest", "f.yaml"]
    made = cotenant.run(argv, reader, cell)
    if made.returncode != 0 and "differs from the index" in made.stderr:
        return Seen(F_ANSWER, f"bundle create refused the rewritten file: {made.stderr[-300:]}")
    if made.returncode != 0:
        return Seen(None, f"bundle create exited {made.returncode}: {made.stderr[-1500:]}")
    _cachectl(reader, cell, "cache", "add", "other", str(cell / "other"))
    argv = [*CACHECTL, "bundle", "install", str(bundle), "--cache", "other"]
    done = cotenant.run(argv, reader, cell)
    installed = _find(cell / "other", f"{w.learned.key}-cache")
    said = f"bundle install (exit {done.returncode}: {done.stderr.strip()[-300:]})"
    return _bytes_verdict(installed, said, w)


# -- the server modes: a node without the root, through its node tier ----------------------------


def _serve(w: World, env: dict[str, str], logs: Path) -> Any:
    pairs = [f"{k}={v}" for k, v in env.items()]
    return infra.start_server(
        "cachectl-serve",
        lambda port: ["env", "-i", *pairs, *CACHECTL, "serve", "--port", str(port)],
        logs,
    )


def _node(home: Path, hidden: Path, env: dict[str, str], argv: list[str], cwd: Path) -> Any:
    """``argv`` as a process of a node: the server's machine's directory hidden under a tmpfs."""
    script = (
        f"mount --make-rprivate / && mount -t tmpfs tmpfs {hidden} && "
        f'test -z "$(ls -A {hidden})" && exec "$@"'
    )
    return cotenant.run(["unshare", "-m", "bash", "-c", script, "node", *argv], env, cwd)


def _through_server(w: World, mode: str, moment: str, db: str) -> dict[str, Seen]:
    cell = w.base / f"{mode}-{moment}-{db}"
    cell.mkdir()
    cell.chmod(0o755)
    for name in ("cotenant_f.py", "f.yaml", "exec_f.py"):
        shutil.copy(w.base / name, cell / name)
    key = f"{w.learned.key}-cache"
    # The server's machine: its own directory, hidden from the node's processes.
    machine = w.base / f"server-{db}" if mode == "server" else cell / "server"
    fresh = not machine.exists()
    machine.mkdir(exist_ok=True)
    index = _index(w, db, machine) if fresh else (machine / "index-url").read_text()
    (machine / "index-url").write_text(index)
    host = cotenant.clean_env(**cotenant.home(machine / "home"), CACHECTL_DB=index)
    if fresh and db == "postgresql":
        _cachectl(host, machine, "db", "upgrade")
    if mode == "down":  # the default cache: a node finds its root without the index
        cache = "default"
        _cachectl(host, machine, "path")
        _cachectl(host, machine, "cache", "set", cache, "--service-writes", "allow")
    else:
        cache = f"c{len(w.outcomes)}"
        root = str(machine / cache)
        _cachectl(host, machine, "cache", "add", cache, root, "--service-writes", "allow")
    if fresh:
        token = _cachectl(host, machine, "token", "create", "--name", "n", "--role", "writer")
        (machine / "token").write_text(token.stdout.strip().splitlines()[-1])
    token = (machine / "token").read_text()
    server = w.servers.get(db) if mode == "server" else None
    if server is None:
        server = _serve(w, host, machine / "logs")
        if mode == "server":
            w.servers[db] = server

    def node_env(name: str) -> dict[str, str]:
        return cotenant.clean_env(
            **cotenant.home(cell / name),
            CACHECTL_SERVER=server.url,
            CACHECTL_TOKEN=token,
            CACHECTL_CACHE=cache,
            CACHECTL_NODE_CACHE=str(cell / "tmp" / f"node-{name}"),
            PYTHONPATH=str(cotenant.REPO),
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        )

    writer, reader = node_env("a"), node_env("b")

    def in_tier(name: str) -> Path:
        src = node_tier.source_dir(str(cell / "tmp" / f"node-{name}"), server.url, cache)
        return Path(src) / w.learned.namespace

    # The co-tenant makes both nodes' tiers first, as its own, in a directory like /tmp.
    (cell / "tmp").mkdir()
    (cell / "tmp").chmod(0o1777)
    cotenant.make_dirs(in_tier("a"), in_tier("b"))
    plant_a = cotenant.file_plant(w.learned.planted, in_tier("a") / key)
    plant_b = cotenant.file_plant(w.learned.planted, in_tier("b") / key)

    def service(env: dict[str, str], plant: list[str] | None = None, manifest: str = "") -> Any:
        argv = [
            sys.executable,
            "-c",
            cotenant.SERVICE,
            json.dumps(plant) if plant else "",
            manifest,
        ]
        return cotenant.last_json(_node(cell, machine, env, argv, cell))

    if moment == "before":
        cotenant.plant(plant_a)
    wrote = service(writer, plant_a if moment == "between" else None)
    if moment == "after":
        cotenant.plant(plant_a)
        cotenant.plant(plant_b)

    def served_bytes() -> bytes | None:
        got = httpx.get(
            f"{server.url}/api/v1/caches/{cache}/environments/{w.learned.namespace.split('/')[-1]}"
            f"/entries/{w.learned.key}",
            headers={"authorization": f"Bearer {token}"},
        )
        return got.content if got.status_code == 200 else None

    seen: dict[str, Seen] = {}
    off = {**reader, "CACHECTL_COMPILE_LEASE": "0"}
    if mode == "down":
        first = service(off, manifest=str(cell / "f.yaml"))  # the node fetches and keeps a record
        server.stop()
        record = in_tier("b") / node_tier.RECORD
        kept = json.loads(record.read_text()) if record.exists() else {}
        kept[w.learned.key] = [w.learned.planted_sha, None]
        edited = cell / "record"
        edited.write_text(json.dumps(kept))
        edited.chmod(0o644)
        cotenant.plant(cotenant.file_plant(edited, record))
        cotenant.plant(plant_b)
        served = service(off, manifest=str(cell / "f.yaml"))
        seen["serving"] = _value(served, "serving")
        seen["activate"] = _value(served, "activate")
        if db == "sqlite":
            argv = [*CACHECTL, "exec", "--", sys.executable, "exec_f.py"]
            ran = _node(cell, machine, reader, argv, cell)
            seen["exec"] = _value(cotenant.last_json(ran), "exec")
        for s in seen.values():
            s.detail += f" | online first {json.dumps(first)}"
    else:
        served = service(off, manifest=str(cell / "f.yaml"))
        seen["serving"] = _value(served, "serving")
        seen["activate"] = _value(served, "activate")
        seen["lease"] = _value(service(reader), "activate")
        at_server = served_bytes()
        if at_server is not None and _sha(at_server) == w.learned.planted_sha:
            for s in seen.values():
                s.detail += " | the server indexed the co-tenant's bytes"
    if mode == "server" and db == "sqlite":
        argv = [*CACHECTL, "exec", "--", sys.executable, "exec_f.py"]
        seen["exec"] = _value(cotenant.last_json(_node(cell, machine, reader, argv, cell)), "exec")
        argv = [*CACHECTL, "warm-check", "f.yaml", "--json", "--path", str(cell)]
        done = _node(cell, machine, reader, argv, cell)
        try:
            hits = json.loads(done.stdout)["summary"]["hits"]
        except (ValueError, KeyError):
            hits = None
        planted = at_server is not None and _sha(at_server) == w.learned.planted_sha
        seen["warm-check"] = (
            Seen(
                PLANTED_ANSWER, f"warm-check hit f's key, the server holds the co-tenant's: {hits}"
            )
            if hits and planted
            else Seen(
                F_ANSWER, f"warm-check hits {hits} (exit {done.returncode}), planted {planted}"
            )
        )
        argv = [*CACHECTL, "pull", "--to", str(cell / "mirror"), "--json"]
        pulled = _node(cell, machine, reader, argv, cell)
        mirror = _find(cell / "mirror", key)
        seen["pull"] = _bytes_verdict(mirror, f"pull (exit {pulled.returncode})", w)
    for s in seen.values():
        s.detail += f" | writer saw {json.dumps(wrote)}"
    return seen


def _outcome(w: World, mode: str, moment: str, db: str) -> dict[str, Seen]:
    """One service setup per (mode, moment, db), run at its first cell; its paths answer the rest."""
    found = w.outcomes.get((mode, moment, db))
    if found is None:
        run = _through_server if mode in ("server", "down") else _direct
        try:
            found = run(w, mode, moment, db)
        except Exception as exc:  # every cell of the setup says why, without running it again
            found = f"the cell's setup failed: {type(exc).__name__}: {exc}"
        w.outcomes[(mode, moment, db)] = found
    if isinstance(found, str):
        pytest.fail(found[:4000], pytrace=False)
    return found


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("path", "mode", "moment", "db"), CELLS)
def test_a_cotenants_plant_never_computes(
    world: World, path: str, mode: str, moment: str, db: str
) -> None:
    seen = _outcome(world, mode, moment, db)[path]
    assert seen.value != PLANTED_ANSWER, f"f(1) = {seen.value}: {seen.detail}"
    assert seen.value == F_ANSWER, f"f(1) = {seen.value}: {seen.detail}"


def test_the_matrix_size() -> None:
    """The closing line's size: paths x modes x moments x databases, less the cells left out."""
    sizes = [len(_paths(m, t, d)) for m in PATHS for t in MOMENTS[m] for d in DBS]
    assert len(CELLS) == sum(sizes) == 67
