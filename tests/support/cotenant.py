"""A co-tenant: a second uid on the same node, with write access to the shared cache's directories
(the cache's group, or a node directory it made first) and none to the index. What it plants is
``jax.jit(lambda x: x + 1006)``'s entry at the key of a service's ``jax.jit(lambda x: x + 1)``;
for tests/test_cotenant_matrix.py.

The co-tenant is the real user ``cotenant`` (made with ``useradd -m`` where missing); its file
plants run as that uid and gid (``setpriv --reuid --regid --clear-groups``). In a bucket there is
no uid: there it plants with a credential of its own (a bucket writer that is not an index writer).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
USER = "cotenant"
F_ANSWER, PLANTED_ANSWER = 2.0, 1007.0

# The program a service runs, and what the co-tenant compiles in a cache of its own to learn f's
# key and to get g's bytes (the same JAX settings give the same key in any cache).
LEARN = """
import json, os
import numpy as np, jax, cachectl
where = cachectl.activate(telemetry=False).path
x = np.ones((1,), np.float32)
seen = set(os.listdir(where))
jax.jit(lambda x: x + 1)(x).block_until_ready()
f = sorted(set(os.listdir(where)) - seen)
seen |= set(f)
jax.jit(lambda x: x + 1006)(x).block_until_ready()
g = sorted(set(os.listdir(where)) - seen)
print(json.dumps({"f": f, "g": g, "path": where}))
"""

# f for a manifest (cachectl.serving, warm-check): a lambda, so its key is the service's.
MODULE = "f = lambda x: x + 1\n"
MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: cotenant_f:f
    args:
      - {shape: [batch], dtype: float32}
    buckets: {batch: [1]}
"""

# A service: argv[1] a JSON command run right after JAX's put returns (the co-tenant, between
# the bytes JAX wrote and the records cachectl keeps of them), or ""; argv[2] a manifest that
# cachectl.serving serves first, or "". It prints what f(1) computed, per read path.
SERVICE = """
import json, subprocess, sys
import numpy as np
plant, manifest = sys.argv[1], sys.argv[2]
if plant:  # JAX's own file cache: the moment its put returned
    from jax._src import lru_cache
    original = lru_cache.LRUCache.put
    def put(self, key, value):
        original(self, key, value)
        subprocess.run(json.loads(plant), check=True, timeout=60)
    lru_cache.LRUCache.put = put
import jax, cachectl
counts = {}
jax.monitoring.register_event_listener(lambda e, **kw: counts.__setitem__(e, counts.get(e, 0) + 1))
x = np.ones((1,), np.float32)
seen = {}
if manifest:
    rt = cachectl.serving(manifest)
    seen["serving"] = float(np.asarray(rt["f"](x)).ravel()[0])
else:
    cachectl.activate(telemetry=False)
seen["activate"] = float(np.asarray(jax.jit(lambda x: x + 1)(x)).ravel()[0])
seen["hits"] = counts.get("/jax/compilation_cache/cache_hits", 0)
print(json.dumps(seen))
"""

# What `cachectl exec` runs: plain JAX, no activate().
EXEC = """
import json
import numpy as np, jax
print(json.dumps({"exec": float(np.asarray(jax.jit(lambda x: x + 1)(np.ones((1,), np.float32))).ravel()[0])}))
"""

# The co-tenant's file plant: its bytes written beside the target, then renamed over it.
_PLANT_SH = 'mkdir -p "$(dirname "$2")" && cat "$1" > "$2.planting" && mv -f "$2.planting" "$2"'


def user() -> tuple[int, int]:
    """The co-tenant's (uid, gid): the user ``cotenant``, made where missing."""
    try:
        found = pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "-m", USER], check=True, capture_output=True)
        found = pwd.getpwnam(USER)
    return found.pw_uid, found.pw_gid


def can_act() -> str | None:
    """Why this machine cannot run a second uid's plants, or None."""
    if os.geteuid() != 0:
        return "needs root to act as a second uid"
    for tool in ("setpriv", "useradd", "unshare"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    return None


def as_cotenant(*argv: str) -> list[str]:
    uid, gid = user()
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *argv]


def file_plant(source: Path, target: Path) -> list[str]:
    """The command by which the co-tenant puts ``source``'s bytes at ``target`` (its uid)."""
    return as_cotenant("sh", "-c", _PLANT_SH, "plant", str(source), str(target))


def bucket_plant(endpoint: str, source: Path, url: str) -> list[str]:
    """The command by which the co-tenant puts ``source``'s bytes at ``url`` (s3://) with its own
    bucket credential."""
    code = (
        "import sys, s3fs\n"
        "fs = s3fs.S3FileSystem(key='COTENANT', secret='cotenant', "
        "client_kwargs={'endpoint_url': sys.argv[1]}, skip_instance_cache=True)\n"
        "fs.pipe(sys.argv[2], open(sys.argv[3], 'rb').read())\n"
    )
    return [sys.executable, "-c", code, endpoint, url, str(source)]


def plant(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (command, done.stderr)


def make_dirs(*paths: Path) -> None:
    """Directories the co-tenant made first (its own, 0755): it may plant in them at any time."""
    for path in paths:
        plant(as_cotenant("mkdir", "-p", str(path)))


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without cachectl's, XDG's or JAX's variables (a module's processes say theirs)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CACHECTL_", "XDG_", "JAX_"))}
    return {**base, "JAX_PLATFORMS": "cpu", **extra}


def home(path: Path) -> dict[str, str]:
    """An owner's own HOME and XDG directories (its state: the records of what it wrote)."""
    env = {"HOME": str(path)}
    for var, sub in (
        ("XDG_DATA_HOME", "data"),
        ("XDG_CACHE_HOME", "cache"),
        ("XDG_CONFIG_HOME", "config"),
        ("XDG_STATE_HOME", "state"),
    ):
        (path / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(path / sub)
    return env


def run(
    argv: list[str], env: Mapping[str, str], cwd: Path, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, env=dict(env), cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def last_json(done: subprocess.CompletedProcess[str]) -> dict[str, object]:
    lines = [x for x in done.stdout.strip().splitlines() if x.startswith("{")]
    assert done.returncode == 0 and lines, (
        done.returncode,
        done.stdout[-2000:],
        done.stderr[-3000:],
    )
    found = json.loads(lines[-1])
    assert isinstance(found, dict)
    said = [x[:300] for x in done.stderr.splitlines() if x.startswith("cachectl")]
    return {**found, "said": said[-4:]}
