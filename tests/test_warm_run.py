"""`cachectl warm-run`: a library's private jit, warmed by running the user's command.

The library here jits a closure made inside its own function, as Keras's ``model.predict`` and
NumPyro's ``MCMC.run`` do: no manifest can name it, and its sub-second compiles are never
written by a service under JAX's default minimum compile time. Every process is a real one.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.infra import held, run_cachectl  # noqa: E402

LIBRARY = """
import jax, jax.numpy as jnp

def predict(x):
    def _predict_step(v):  # private: made anew inside the library on every call
        return jnp.tanh(v @ v.T).sum(axis=-1)
    return jax.jit(_predict_step)(x)

def other(x):  # what another writer warms into the same namespace meanwhile
    return jnp.sin(x) + 1
"""

# The warm-up, held after its first program is written until the test says go.
HELD = """
import os, pathlib, time
import numpy as np
import lib_internal
gate = pathlib.Path(os.environ["WR_GATE"])
lib_internal.predict(np.ones((2, 4), np.float32))
(gate / "wrote").touch()
deadline = time.monotonic() + 300
while not (gate / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
lib_internal.predict(np.ones((8, 4), np.float32))
"""

OTHER = """
version: 1
target: {backend: cpu}
functions:
  - fn: lib_internal:other
    args:
      - {shape: [batch, 4], dtype: float32}
    buckets: {batch: [3]}
"""

WARMUP = """
import numpy as np
import lib_internal
for n in (2, 8):
    print("warmup", n, np.asarray(lib_internal.predict(np.ones((n, 4), np.float32))).shape)
"""

# A service that calls the library under plain activate() (read-only, as a service is by
# default here), counting JAX's own persistent-cache hits and misses.
SERVICE = """
import json, numpy as np, jax
counts = {"hits": 0, "misses": 0}
def on(event, **kw):  # JAX's own counters (cachectl.core.jax_seam names them)
    if event == "/jax/compilation_cache/compile_requests_use_cache":
        counts["misses"] += 1
    if event == "/jax/compilation_cache/cache_hits":
        counts["hits"] += 1
        counts["misses"] -= 1
jax.monitoring.register_event_listener(on)
import cachectl
cachectl.activate(readonly=True)
import lib_internal
for n in (2, 8):
    lib_internal.predict(np.ones((n, 4), np.float32))
print(json.dumps(counts))
"""


def _cachectl(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(p for p in (str(cwd), os.environ.get("PYTHONPATH")) if p)
    return run_cachectl(cwd, *args, env={"PYTHONPATH": path})  # then this checkout's cachectl


def _setup(tmp_path: Path) -> None:
    (tmp_path / "lib_internal.py").write_text(textwrap.dedent(LIBRARY))
    (tmp_path / "warmup.py").write_text(textwrap.dedent(WARMUP))
    (tmp_path / "service.py").write_text(textwrap.dedent(SERVICE))
    (tmp_path / "held.py").write_text(textwrap.dedent(HELD))
    (tmp_path / "other.yaml").write_text(textwrap.dedent(OTHER))


def test_warm_run_writes_and_indexes_a_private_jit_that_a_service_then_hits(
    tmp_path: Path,
) -> None:
    _setup(tmp_path)
    service = subprocess.run(
        [sys.executable, "service.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert service.returncode == 0, service.stderr
    assert json.loads(service.stdout.splitlines()[-1]) == {"hits": 0, "misses": 2}  # cold

    first = _cachectl(tmp_path, "warm-run", "--json", "--", sys.executable, "warmup.py")
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)  # the command's own prints went to stderr
    assert "warmup 2" in first.stderr and "warmup 8" in first.stderr
    assert report["exit_code"] == 0 and report["known_before"] == 0
    written = [e for e in report["entries"] if e["status"] == "written"]
    assert [e["module"] for e in written] == ["jit__predict_step"] * 2, report
    namespace = Path(report["namespace"].removeprefix("file://"))
    assert {p.name for p in namespace.glob("*-cache")} == {f"{e['key']}-cache" for e in written}

    db = Path(os.environ["XDG_DATA_HOME"]) / "cachectl" / "index.db"
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT key, origin, warm_run_id FROM entries").fetchall()
        runs = conn.execute("SELECT id, status, compiled FROM warm_runs").fetchall()
    assert sorted(r[0] for r in rows) == sorted(e["key"] for e in written)
    assert {(r[1], r[2]) for r in rows} == {("warm", report["run_id"])}
    assert runs == [(report["run_id"], "succeeded", 2)]

    service = subprocess.run(
        [sys.executable, "service.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert service.returncode == 0, service.stderr
    assert json.loads(service.stdout.splitlines()[-1]) == {"hits": 2, "misses": 0}

    again = _cachectl(tmp_path, "warm-run", "--", sys.executable, "warmup.py")
    assert again.returncode == 0, again.stderr
    assert "0 program(s) written and indexed (2 already in the namespace)" in again.stdout


def test_a_failing_command_fails_the_warm_run_and_a_missing_one_is_bad_input(
    tmp_path: Path,
) -> None:
    _setup(tmp_path)
    failed = _cachectl(tmp_path, "warm-run", "--", sys.executable, "-c", "raise SystemExit(3)")
    assert failed.returncode == 1, failed.stderr
    assert "the command exited 3" in failed.stderr and "Traceback" not in failed.stderr

    missing = _cachectl(tmp_path, "warm-run", "--", "no-such-command-here")
    assert missing.returncode == 2, missing.stderr
    assert "command not found: no-such-command-here" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_warm_check_replays_the_warm_run_read_only_and_counts_jax_hits(tmp_path: Path) -> None:
    _setup(tmp_path)
    nothing = _cachectl(tmp_path, "warm-check", "--replay")
    assert nothing.returncode != 0 and "no warm-run into cache" in nothing.stderr, nothing.stderr

    run = json.loads(
        _cachectl(tmp_path, "warm-run", "--json", "--", sys.executable, "warmup.py").stdout
    )
    replay = _cachectl(tmp_path, "warm-check", "--replay", "--json")
    assert replay.returncode == 0, replay.stderr
    report = json.loads(replay.stdout)  # the command's own prints went to stderr
    assert "warmup 8" in replay.stderr
    assert report["run_id"] == run["run_id"] and report["command"] == [sys.executable, "warmup.py"]
    assert report["exit_code"] == 0 and report["processes"] == 1
    assert report["requests"] == report["hits"] == 2 and report["ok"], report

    # Without the entries the same replay misses every program, and writes none (read-only).
    namespace = Path(run["namespace"].removeprefix("file://"))
    for entry in namespace.glob("*-cache"):
        entry.unlink()
    cold = _cachectl(tmp_path, "warm-check", "--replay", str(run["run_id"]))
    assert cold.returncode == 1, cold.stdout + cold.stderr
    assert "cache hits: 0/2 compile requests (0.0%) in 1 JAX process(es)" in cold.stdout
    assert "2 of 2 compile requests missed the cache" in cold.stderr
    assert list(namespace.glob("*-cache")) == []


@pytest.mark.parametrize("shell", [False, True], ids=["python", "sh-c"])
def test_warm_run_claims_only_what_its_command_wrote_while_others_write_there(
    tmp_path: Path, shell: bool
) -> None:
    """While the command is held between its two programs, a manifest warm writes and indexes
    its own program into the same namespace, and a writer without cachectl drops a file there:
    warm-run indexes, under its run, exactly the command's two programs (written by Python run
    directly, or below a shell); the warm's entry stays the warm's, and the stray file is
    reported unclaimed and left for verify."""
    _setup(tmp_path)
    gate = tmp_path / "gate"
    gate.mkdir()
    out, err = tmp_path / "run.out", tmp_path / "run.err"
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "WR_GATE": str(gate)}
    argv = [sys.executable, "-m", "cachectl", "warm-run", "--json", "--"]
    command = ["sh", "-c", f"'{sys.executable}' held.py"] if shell else [sys.executable, "held.py"]
    with out.open("w") as stdout, err.open("w") as stderr:
        run = subprocess.Popen(
            [*argv, *command], cwd=tmp_path, env=env, stdout=stdout, stderr=stderr
        )
    # Once its first program is written, it waits.
    with held(run, (gate / "wrote").exists, gate / "go", err):
        other = _cachectl(tmp_path, "warm", "other.yaml", "--json")
        assert other.returncode == 0, other.stdout + other.stderr
        theirs = json.loads(other.stdout)
        namespace = Path(theirs["namespace"].removeprefix("file://"))
        stray = f"jit_stray-{'0' * 64}-cache"
        (namespace / stray).write_bytes(b"not an entry cachectl wrote")
    assert run.returncode == 0, out.read_text() + err.read_text()
    ours = json.loads(out.read_text())
    assert Path(ours["namespace"].removeprefix("file://")) == namespace  # one shared namespace
    assert [(e["module"], e["status"]) for e in ours["entries"]] == [
        ("jit__predict_step", "written")
    ] * 2, ours
    assert ours["unclaimed"] == [stray], ours
    assert (namespace / stray).is_file()  # not ours to index, nor to remove

    db = Path(os.environ["XDG_DATA_HOME"]) / "cachectl" / "index.db"
    with sqlite3.connect(db) as conn:
        rows = dict(conn.execute("SELECT key, warm_run_id FROM entries").fetchall())
        runs = dict(conn.execute("SELECT id, status FROM warm_runs").fetchall())
    their_keys = {b["key"] for b in theirs["buckets"]}
    assert len(their_keys) == 1 and their_keys <= set(rows), theirs
    assert {rows[k] for k in their_keys} != {ours["run_id"]}
    assert {k for k, r in rows.items() if r == ours["run_id"]} == {
        e["key"] for e in ours["entries"]
    }
    assert runs[ours["run_id"]] == "succeeded"
    verify = _cachectl(tmp_path, "verify", "--json")  # every other file indexed by its writer
    assert verify.returncode == 1, verify.stdout + verify.stderr
    findings = json.loads(verify.stdout)["plan"]["findings"]
    assert [(f["kind"], Path(f["path"]).name) for f in findings] == [("unknown-writer", stray)]


def test_a_command_whose_processes_cannot_report_fails_and_claims_nothing(tmp_path: Path) -> None:
    """Python run with -I ignores PYTHONPATH, so cachectl's hook never starts in it: its JAX still
    writes into the namespace (the settings are JAX's own variables), but no process says so.
    warm-run claims nothing, names the file unclaimed and fails; verify names it unknown-writer."""
    _setup(tmp_path)
    code = "import jax; jax.jit(lambda x: x * 3 + 1)(1.0)"
    run = _cachectl(tmp_path, "warm-run", "--json", "--", sys.executable, "-I", "-c", code)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "no process of the command reported to cachectl" in run.stderr
    assert "Traceback" not in run.stderr
    report = json.loads(run.stdout)
    assert report["entries"] == [] and report["processes"] == 0, report
    assert len(report["unclaimed"]) == 1 and report["unclaimed"][0].startswith("jit_")
    namespace = Path(report["namespace"].removeprefix("file://"))
    assert (namespace / report["unclaimed"][0]).is_file()
    db = Path(os.environ["XDG_DATA_HOME"]) / "cachectl" / "index.db"
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM entries").fetchone() == (0,)
        assert conn.execute("SELECT status FROM warm_runs").fetchall() == [("failed",)]


# -- issue 62: a co-tenant who can write the namespace (not the index) plants another program -----

PLANT_LIB = """
def g(x):  # the co-tenant's program: its entry is what gets planted at f's key
    return x + 1006

def fb(x):  # planted before JAX writes it
    return x + 1

def fa(x):  # planted after JAX wrote it
    return x + 2
"""

PLANT_MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: plant_lib:fb
    args:
      - {shape: [batch], dtype: float32}
    buckets: {batch: [1]}
"""

# The command warm-run runs; it plays the co-tenant too, around its own writes.
PLANTING = """
import json, os, pathlib, sys
import numpy as np, jax
import plant_lib
from cachectl.core import jax_seam
ns = pathlib.Path(os.environ["JAX_COMPILATION_CACHE_DIR"].removeprefix("file://"))
x = np.ones((1,), np.float32)
def key(f):
    return jax_seam.persistent_cache_key(jax.jit(f).lower(x))
jax.jit(plant_lib.g)(x)
planted = (ns / f"{key(plant_lib.g)}-cache").read_bytes()
(ns / f"{key(plant_lib.fb)}-cache").write_bytes(planted)  # before fb's write
jax.jit(plant_lib.fb)(x)
jax.jit(plant_lib.fa)(x)
(ns / f"{key(plant_lib.fa)}-cache").write_bytes(planted)  # after fa's write
print(json.dumps({"g": key(plant_lib.g), "fb": key(plant_lib.fb), "fa": key(plant_lib.fa)}))
"""

# f's answers in a fresh process: a plain activate() service, then cachectl.serving.
ANSWERS = """
import json, sys
import numpy as np, jax
import cachectl
import plant_lib
x = np.ones((1,), np.float32)
if sys.argv[1] == "activate":
    cachectl.activate(readonly=True)
    out = {n: float(jax.jit(getattr(plant_lib, n))(x)[0]) for n in ("fb", "fa")}
else:
    rt = cachectl.serving("plant.yaml")
    out = {"fb": float(np.asarray(rt["fb"](x))[0])}
    out["aot"] = sum(f.loaded for f in rt.report().functions.values())
print(json.dumps(out))
"""


def test_a_planted_entry_is_never_claimed_by_warm_run_or_warm_and_never_runs(
    tmp_path: Path,
) -> None:
    """Issue 62 finding 1. JAX logs "Writing" and then writes nothing where a file is already at
    the key: warm-run claims a key only when the file's sha256 is that of the bytes its own
    process handed JAX, so a program planted at fb's key before its write, or at fa's after, is
    refused and never indexed. A manifest warm over the unindexed plant compiles fb and replaces
    it. Services then compute fb and fa, not the planted ``x + 1006``."""
    (tmp_path / "plant_lib.py").write_text(textwrap.dedent(PLANT_LIB))
    (tmp_path / "plant.yaml").write_text(textwrap.dedent(PLANT_MANIFEST))
    (tmp_path / "planting.py").write_text(textwrap.dedent(PLANTING))
    (tmp_path / "answers.py").write_text(textwrap.dedent(ANSWERS))
    run = _cachectl(tmp_path, "warm-run", "--json", "--", sys.executable, "planting.py")
    assert run.returncode == 1, run.stdout + run.stderr
    line = next(x for x in run.stderr.splitlines() if x.startswith('{"g"'))
    keys = json.loads(line)  # the command's stdout goes to stderr
    assert "hold other bytes than it wrote" in run.stderr, run.stderr
    report = json.loads(run.stdout)
    status = {e["key"]: (e["status"], e["error"]) for e in report["entries"]}
    assert status[keys["g"]] == ("written", None), report
    for name in ("fb", "fa"):
        assert status[keys[name]][0] == "foreign", report
        assert "not what the command wrote" in status[keys[name]][1], report
    db = Path(os.environ["XDG_DATA_HOME"]) / "cachectl" / "index.db"
    with sqlite3.connect(db) as conn:
        indexed = dict(conn.execute("SELECT key, origin FROM entries").fetchall())
    assert indexed == {keys["g"]: "warm"}

    warm = _cachectl(tmp_path, "warm", "plant.yaml", "--json")
    assert warm.returncode == 0, warm.stdout + warm.stderr
    bucket = json.loads(warm.stdout)["buckets"][0]
    assert bucket["key"] == keys["fb"] and bucket["status"] == "compiled", bucket
    assert "not indexed (another writer's file): removed" in warm.stderr
    with sqlite3.connect(db) as conn:
        indexed = dict(conn.execute("SELECT key, origin FROM entries").fetchall())
    assert indexed == {keys["g"]: "warm", keys["fb"]: "warm"}

    def answers(how: str) -> dict[str, float]:
        done = subprocess.run(
            [sys.executable, "answers.py", how],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "PYTHONPATH": str(tmp_path)},
        )
        assert done.returncode == 0, done.stderr
        return dict(json.loads(done.stdout.splitlines()[-1]))

    assert answers("activate") == {"fb": 2.0, "fa": 3.0}
    assert answers("serving") == {"fb": 2.0, "aot": 1}

    # fb's indexed entry rewritten, its executable gone: a re-warm loads the rewritten file and
    # stores no executable built from it.
    namespace = Path(json.loads(warm.stdout)["namespace"].removeprefix("file://"))
    planted = (namespace / f"{keys['g']}-cache").read_bytes()
    (namespace / f"{keys['fb']}-cache").write_bytes(planted)
    (namespace / f"{keys['fb']}-aot").unlink()
    again = _cachectl(tmp_path, "warm", "plant.yaml", "--json")
    assert again.returncode == 1, again.stdout + again.stderr
    assert "differ from its index row" in json.loads(again.stdout)["buckets"][0]["error"]
    assert not (namespace / f"{keys['fb']}-aot").exists()
    assert answers("serving") == {"fb": 2.0, "aot": 0}
