"""A cold fleet of a Flax NNX decoder through the real `cachectl serve` (issue 68's first case).

Machine A holds an empty named cache (`--service-writes allow`), a writer token and the server.
Three replicas, each a machine of its own (tests/support/machines.py: its own HOME, A's home
hidden in a mount namespace, a node tier), start together on `cachectl.activate()` and call the
model at its four buckets; the deploy then runs `cachectl warm` through the server. Counted from
JAX's own log (its persistent-cache miss lines name each program's key): every program is
compiled at most once plus one hedge across the three replicas. After the deploy's warm:
`warm-check` finds 4/4 hits and 4/4 stored executables, a later replica on `cachectl.serving`
falls back for no bucket, and `cachectl misses` on a replica answers without a traceback.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from collections import Counter
from typing import Any

import pytest
from support import infra
from support.field_cases import FLAX_NNX
from support.machines import CACHECTL, fleet, needs_unshare
from support.warming import invoke

pytestmark = [pytest.mark.slow, needs_unshare, pytest.mark.timeout(900)]

CACHE = "nnx"
BUCKETS = 4
# The field case's manifest at four buckets.
ALL_BUCKETS = "buckets: {batch: [1, 2, 4], seq: [8, 16, 32, 64]}"
assert FLAX_NNX.manifest is not None and ALL_BUCKETS in FLAX_NNX.manifest
MANIFEST = FLAX_NNX.manifest.replace(ALL_BUCKETS, "buckets: {batch: [1, 2], seq: [8, 16]}")

# A replica: the model built, then one call per bucket; JAX's log of what it compiled, by key.
REPLICA = """
import json, logging, sys
sys.path.insert(0, {dir!r})
import numpy as np
import jax
compiled = []
class Keep(logging.Handler):
    def emit(self, record):
        if str(record.msg).startswith("PERSISTENT COMPILATION CACHE MISS for"):
            compiled.append([str(record.args[0]), str(record.args[1])])
logging.getLogger("jax._src.compiler").addHandler(Keep())
jax.config.update("jax_log_compiles", True)
jax.config.update("jax_explain_cache_misses", True)
events = {{}}
jax.monitoring.register_event_listener(
    lambda e, **kw: events.__setitem__(e, events.get(e, 0) + 1))
import cachectl
cachectl.activate({cache!r})
from flax import nnx
import case
_, state = nnx.split(case.make_model())
forward = jax.jit(case.forward)
for batch in (1, 2):
    for seq in (8, 16):
        forward(state, np.zeros((batch, seq), np.int32)).block_until_ready()
misses = events.get("/jax/compilation_cache/compile_requests_use_cache", 0) - events.get(
    "/jax/compilation_cache/cache_hits", 0)
print(json.dumps({{"compiled": compiled, "misses": misses}}))
"""

# A later replica on stored executables: each bucket called once; its report.
SERVING = """
import json, sys
sys.path.insert(0, {dir!r})
import numpy as np
import cachectl
from flax import nnx
import case
rt = cachectl.serving({manifest!r}, readonly=True)
_, state = nnx.split(case.make_model())
for batch in (1, 2):
    for seq in (8, 16):
        rt["forward"](state, np.zeros((batch, seq), np.int32))
f = rt.report().to_dict()["functions"]["forward"]
print(json.dumps({{"fallback": f["fallback"], "loaded": f["loaded"], "calls": f["calls"]}}))
"""


def _json(proc: subprocess.CompletedProcess[str], whole: bool = False) -> dict[str, Any]:
    """A command's JSON (``whole``: all of stdout, as `--json` prints it; else its last line)."""
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout if whole else proc.stdout.strip().splitlines()[-1])


def test_a_cold_nnx_fleet_compiles_each_program_once_and_ends_trace_free(
    isolated_home, tmp_path, monkeypatch
) -> None:
    if importlib.util.find_spec("flax") is None:
        pytest.skip("flax is not installed: the field extra, pip install -e '.[field]'")
    (tmp_path / "case.py").write_text(textwrap.dedent(FLAX_NNX.module))
    manifest = tmp_path / "nnx.yaml"
    manifest.write_text(MANIFEST)
    root = isolated_home / "root"
    invoke("cache", "add", CACHE, str(root), "--service-writes", "allow")
    made = invoke("token", "create", "--name", "fleet", "--role", "writer")
    token = made.stdout.strip().splitlines()[-1]
    monkeypatch.setenv("CACHECTL_SERVER_TOKEN_CACHE", "0")
    server = infra.start_server(
        "cachectl-serve",
        lambda port: [sys.executable, "-m", "cachectl", "serve", "--port", str(port)],
        tmp_path / "logs",
    )
    names = ("r0", "r1", "r2", "deploy", "later")
    machines = fleet(names, tmp_path, isolated_home, server.url, token, CACHE)
    for m in machines.values():  # the case's module, for warm's and the services' imports
        m.env["PYTHONPATH"] = f"{tmp_path}:{m.env['PYTHONPATH']}"
    try:
        code = REPLICA.format(dir=str(tmp_path), cache=CACHE)
        procs = [machines[n].start(sys.executable, "-c", code) for n in ("r0", "r1", "r2")]
        replicas = []
        for p in procs:
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0 and "could not upload" not in err, err[-3000:]
            replicas.append(json.loads(out.strip().splitlines()[-1]))
        per_key = Counter(key for r in replicas for _name, key in r["compiled"])
        names = {key: name for r in replicas for name, key in r["compiled"]}
        print(
            f"cold fleet: {sum(per_key.values())} compiles of {len(per_key)} programs by 3 "
            f"replicas; most for one program: {max(per_key.values())}; per replica "
            f"{[len(r['compiled']) for r in replicas]}"
        )
        for r in replicas:  # JAX's log and its monitoring events agree
            assert len(r["compiled"]) == r["misses"], r
        assert all(per_key[key] <= 2 for key in per_key), {names[k]: n for k, n in per_key.items()}
        assert sum(1 for key in per_key if "forward" in names[key]) == BUCKETS, names

        deploy = machines["deploy"]
        proc = deploy.run(*CACHECTL, "warm", str(manifest), "--json")
        report = _json(proc, whole=True)
        s = report["summary"]
        assert (s["compiled"], s["cached"], s["failed"]) == (0, BUCKETS, 0), proc.stdout[-3000:]
        assert sum(b["aot_bytes"] is not None for b in report["buckets"]) == BUCKETS

        checked = deploy.run(*CACHECTL, "warm-check", str(manifest), "--json")
        check = _json(checked, whole=True)["summary"]
        print(f"warm-check after the deploy: {check}")
        assert (check["hits"], check["aot_loaded"]) == (BUCKETS, BUCKETS), check

        code = SERVING.format(dir=str(tmp_path), manifest=str(manifest))
        served = _json(machines["later"].run(sys.executable, "-c", code))
        print(f"a later replica on cachectl.serving: {served}")
        assert served == {"fallback": 0, "loaded": BUCKETS, "calls": BUCKETS}, served

        missed = machines["r0"].run(*CACHECTL, "misses")
        assert missed.returncode in (0, 1), missed.stderr[-3000:]
        assert "Traceback" not in missed.stderr, missed.stderr[-3000:]
    finally:
        server.stop()
