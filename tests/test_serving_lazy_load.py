"""cachectl.serving answers its first call without waiting for the other buckets' loads.

The loads run in background threads, in manifest order; a call to a bucket not loaded yet loads
that one at once in its own thread; a bucket loads once (a call to a bucket a loader thread is
loading waits for that load); a load that raises in a loader thread sends its bucket to jit;
a forked child finds no slot locked by a thread it does not have.

One real warm, one fresh service process. To see the order, the service holds every load made in
a loader thread at a gate until it lets them go (the loads themselves are the real ones).
"""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from support.infra import run_py
from support.serving import last_json

from cachectl.cli import cli

MODULE = """
import jax.numpy as jnp

def affine(x, w):
    return jnp.tanh(x @ w)
"""

MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: ll_tiny:affine
    args:
      - {shape: [batch, 8], dtype: float32}
      - {shape: [8, 8], dtype: float32}
    outputs:
      - {shape: [batch, 8]}
    buckets: {batch: [1, 2, 4, 8]}
"""

SERVICE = """
import json, os, sys, threading, time
sys.path.insert(0, {dir!r})
import numpy as np
from cachectl.dispatch import loading

loads = []  # [in a loader thread, the bucket's batch] of every load, in order
gate = threading.Event()
real = loading.Executables.load

def load(self, slot):
    background = threading.current_thread().name.startswith("cachectl-load")
    if background:
        gate.wait(8)  # held until the service lets them go (at most 8 s each)
        if slot.values["batch"] == 4:
            raise RuntimeError("a load that raises")  # that bucket goes to jit, the rest load
    loads.append([background, slot.values["batch"]])
    real(self, slot)

loading.Executables.load = load
import cachectl
rt = cachectl.serving({manifest!r}, workers=1)
f = rt["affine"]
w = np.eye(8, dtype=np.float32)
x = np.linspace(0, 1, 7 * 8, dtype=np.float32).reshape(7, 8)
first = np.asarray(f(x, w))  # batch 7: bucket 8, the manifest's last
first_ok = bool(np.allclose(first, np.tanh(x), atol=1e-6)) and first.shape == (7, 8)
at_first = [list(l) for l in loads]
loaded_at_first = sum(s.compiled is not None for s in f._slots)
print(json.dumps(dict(first_ok=first_ok, at_first=at_first, loaded_at_first=loaded_at_first)),
      flush=True)

# The loader thread holds bucket 1 at the gate: a fork now must not inherit its lock.
pid = os.fork()
if pid == 0:
    free = f._slots[0].lock.acquire(timeout=2)
    os._exit(0 if free else 1)
child_free = os.waitpid(pid, 0)[1] == 0

# A call to bucket 1, which the loader thread is loading: it waits for that load.
answers = []
caller = threading.Thread(target=lambda: answers.append(np.asarray(f(x[:1], w)).tolist()))
caller.start()
time.sleep(0.5)
waiting = caller.is_alive()
gate.set()
caller.join(30)
done = rt.wait_loaded(30)
fallback = np.asarray(f(x[:3], w))  # bucket 4, whose load raised: jit, padded and cut
fallback_ok = bool(np.allclose(fallback, np.tanh(x[:3]), atol=1e-6))
report = rt.report().to_dict()
print(json.dumps(dict(child_free=child_free, waiting=waiting, answered=len(answers), done=done,
                      fallback_ok=fallback_ok, loads=loads, report=report)))
"""


def test_the_first_answer_waits_for_no_other_bucket_and_each_bucket_loads_once(
    tmp_path: Path,
) -> None:
    (tmp_path / "ll_tiny.py").write_text(MODULE)
    manifest = tmp_path / "ll.yaml"
    manifest.write_text(MANIFEST)
    warm = CliRunner().invoke(cli, ["warm", str(manifest), "--json"])
    assert warm.exit_code == 0, warm.output
    proc = run_py(SERVICE.format(dir=str(tmp_path), manifest=str(manifest)))
    first = json.loads(proc.stdout.splitlines()[0])
    # The first call's bucket (8) loaded at once in the caller's thread, alone: the loader
    # thread was still held at the manifest's first bucket.
    assert first["first_ok"] is True, first
    assert (first["at_first"], first["loaded_at_first"]) == ([[False, 8]], 1), first
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = last_json(proc)
    assert out["child_free"] is True, out
    # The call to the bucket being loaded waited for that load, and was answered by it.
    assert (out["waiting"], out["answered"], out["done"]) == (True, 1, True), out
    assert sorted(b for _, b in out["loads"]) == [1, 2, 8], out["loads"]  # each once
    assert [b for bg, b in out["loads"] if bg] == [1, 2], out["loads"]  # manifest order
    report = out["report"]
    fn = report["functions"]["affine"]
    # The load that raised in a loader thread: its bucket is served by jit, not loaded again.
    assert out["fallback_ok"] is True, out
    assert (fn["loaded"], fn["aot"], fn["fallback"]) == (3, 2, 1), fn
    assert "loading it raised RuntimeError: a load that raises" in fn["fallback_reason"], fn
    assert 0 < report["ready_seconds"] < report["loaded_seconds"], report
    print(json.dumps({k: report[k] for k in ("ready_seconds", "loaded_seconds")}))
