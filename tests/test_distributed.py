"""`cachectl warm` inside a jax.distributed job: 2 CPU processes on loopback, then a 2-process
service and the serving runtime in 2 processes; refusals and failures end every process, bounded."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.infra import free_port  # noqa: E402

MODULE = """
import jax.numpy as jnp

def step(x, w):
    return jnp.tanh(x @ w).sum(axis=1)
"""

MANIFEST = """
version: 1
target: {backend: cpu, device_count: 2}
functions:
  - fn: dist_mod:step
    mesh: {axes: {data: 2}}
    args:
      - {shape: [batch, 4], dtype: float32, sharding: [data, null]}
      - {shape: [4, 4], dtype: float32}
    buckets: {batch: [2, 4, 8]}
"""

SERVICE = """
import json, sys
import numpy as np
import os
import jax
jax.distributed.initialize(num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                           process_id=int(os.environ["JAX_PROCESS_ID"]))
import cachectl
activation = cachectl.activate(readonly=True)
sys.path.insert(0, {dir!r})
import dist_mod
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("data",))  # as the manifest builds it (Auto axes)
rows, rep = NamedSharding(mesh, P("data", None)), NamedSharding(mesh, P())
step = jax.jit(dist_mod.step)
counts = {{}}
jax.monitoring.register_event_listener(lambda e, **kw: counts.__setitem__(e, counts.get(e, 0) + 1))
REQUESTS, HITS = "/jax/compilation_cache/compile_requests_use_cache", "/jax/compilation_cache/cache_hits"
w = jax.make_array_from_callback((4, 4), rep, lambda idx: np.full((4, 4), 0.5, np.float32)[idx])
inputs = {{}}
for batch in (2, 4, 8):
    host = np.arange(batch * 4, dtype=np.float32).reshape(batch, 4) / 10
    inputs[batch] = (host, jax.make_array_from_callback((batch, 4), rows, lambda idx, h=host: h[idx]))
    step(inputs[batch][1], w).block_until_ready()
jit = dict(counts)

# The serving runtime in the same 2 processes: both load the executables process 0 stored.
rt = cachectl.serving({manifest!r})
correct = []
for batch, (host, x) in inputs.items():
    out = rt["step"](x, w)
    want = np.tanh(host @ np.full((4, 4), 0.5, np.float32)).sum(axis=1)
    rows_here = [i for s in out.addressable_shards for i in range(batch)[s.index[0]]]
    got = np.concatenate([np.asarray(s.data) for s in out.addressable_shards])
    correct.append(bool(np.allclose(got, want[rows_here], atol=1e-5)))
served = rt.report().to_dict()
print(json.dumps({{"process": jax.process_index(), "digest": activation.digest,
                  "requests": jit.get(REQUESTS, 0), "hits": jit.get(HITS, 0),
                  "serving_compile_requests": counts.get(REQUESTS, 0) - jit.get(REQUESTS, 0),
                  "served": served["functions"]["step"], "warnings": served["warnings"], "correct": correct}}))
"""

# Per job: far above a healthy one (seconds), far below pytest's patience. The product's own
# waits are bounded tighter (CACHECTL_DISTRIBUTED_TIMEOUT), so a stuck step ends as its
# one-line error rather than as this timeout.
CHILD_TIMEOUT_S = 120
PRODUCT_TIMEOUT_S = 45


def job_env(port: int, rank: int, count: int, timeout_s: int) -> dict[str, str]:
    return dict(
        os.environ,
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES=str(count),
        JAX_PROCESS_ID=str(rank),
        JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
        JAX_PLATFORMS="cpu",
        CACHECTL_DISTRIBUTED_TIMEOUT=str(timeout_s),
        PYTHONFAULTHANDLER="1",
    )


def run_job(
    argvs: list[list[str]],
    logs: Path,
    *,
    count: int | None = None,
    timeout_s: int = PRODUCT_TIMEOUT_S,
) -> list[subprocess.CompletedProcess]:
    """Run one process per argv as the ranks of one job, all of them within CHILD_TIMEOUT_S.

    Output goes to files (a full pipe cannot block a child). On a timeout every child's
    process group gets SIGABRT (faulthandler prints where each Python thread waits), then
    SIGKILL, and the test fails with every process's stderr.
    """
    port = free_port()
    logs.mkdir(parents=True)
    files = [
        ((logs / f"{rank}.out").open("w+"), (logs / f"{rank}.err").open("w+"))
        for rank in range(len(argvs))
    ]
    procs = [
        subprocess.Popen(
            argv,
            env=job_env(port, rank, count or len(argvs), timeout_s),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            text=True,
            start_new_session=True,
        )
        for rank, (argv, (out, err)) in enumerate(zip(argvs, files, strict=True))
    ]
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    timed_out = False
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    if timed_out:
        for sig in (signal.SIGABRT, signal.SIGKILL):
            for p in procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, sig)
            for p in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5)
    done = []
    for p, (out, err) in zip(procs, files, strict=True):
        out.seek(0)
        err.seek(0)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()))
        out.close()
        err.close()
    if timed_out:
        pytest.fail(
            f"the job ran past {CHILD_TIMEOUT_S} s and was killed\n"
            + "\n".join(
                f"--- process {rank} (exit {c.returncode}) stderr:\n{c.stderr[-4000:]}"
                for rank, c in enumerate(done)
            )
        )
    return done


def cachectl_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "cachectl", *args]


def errors(proc: subprocess.CompletedProcess) -> list[str]:
    """cachectl's own error lines (JAX logs its warnings to stderr too)."""
    return [line for line in proc.stderr.splitlines() if line.startswith("cachectl: error:")]


@pytest.fixture
def manifest(tmp_path: Path) -> Path:
    (tmp_path / "dist_mod.py").write_text(MODULE)
    path = tmp_path / "manifest.yaml"
    path.write_text(MANIFEST)
    return path


def test_two_process_warm_then_two_process_service_hits(tmp_path: Path, manifest: Path) -> None:
    args = ["warm", str(manifest), "--json", "--jobs", "1"]
    done = run_job([cachectl_argv(*args), cachectl_argv(*args)], tmp_path / "warm")
    for proc in done:
        assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads(p.stdout) for p in done]
    assert [r["process"] for r in reports] == [
        {"index": 0, "count": 2, "writer": 0},
        {"index": 1, "count": 2, "writer": 0},
    ]
    assert (
        reports[0]["environment"]["process_count"] == 2
        and reports[0]["environment"]["device_count"] == 2
    )
    assert reports[0]["namespace"] == reports[1]["namespace"]
    assert [b["status"] for b in reports[0]["buckets"]] == ["compiled"] * 3
    assert [b["status"] for b in reports[1]["buckets"]] == ["compiled"] * 3
    # Every key either process looked up is in the namespace, written by process 0. (On CPU the
    # topology fingerprint in JAX's key differs per process, so process 1's keys are its own.)
    keys = {b["key"] for r in reports for b in r["buckets"]}
    assert (
        len(keys) == 6
    )  # pinned: on CPU each process's key is its own (see cachectl/warm/distributed.py)
    ns = Path(reports[0]["namespace"])
    assert {p.name[: -len("-cache")] for p in ns.glob("*-cache")} == keys

    # Recorded once: one warm run, one row per entry.
    db = Path(os.environ["XDG_DATA_HOME"]) / "cachectl" / "index.db"
    with sqlite3.connect(db) as conn:
        runs = conn.execute("SELECT status, buckets, compiled FROM warm_runs").fetchall()
        rows = conn.execute("SELECT key, origin, function FROM entries").fetchall()
    assert runs == [("succeeded", 3, 3)]
    assert len(rows) == len(keys) and {r[0] for r in rows} == keys
    assert {(r[1], r[2]) for r in rows} == {("warm", "step")}

    # A 2-process service over the same job shape hits everything, in both processes; then the
    # serving runtime in the same processes answers every bucket from a stored executable.
    code = SERVICE.format(dir=str(tmp_path), manifest=str(manifest))
    served = run_job(
        [[sys.executable, "-c", code], [sys.executable, "-c", code]], tmp_path / "service"
    )
    for proc in served:
        assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(p.stdout.strip().splitlines()[-1]) for p in served]
    assert [r["process"] for r in results] == [0, 1]
    assert {r["digest"] for r in results} == {reports[0]["environment"]["digest"]}
    for r in results:
        assert r["requests"] == 3 and r["hits"] == 3, results  # 100% hits in each process
        assert (
            r["served"]["loaded"] == 3 and r["served"]["aot"] == 3 and r["served"]["fallback"] == 0
        ), r
        assert r["serving_compile_requests"] == 0 and r["warnings"] == [], r
        assert r["correct"] == [True, True, True], r

    # Run again: every process reports every bucket cached.
    again = [
        json.loads(p.stdout)
        for p in run_job([cachectl_argv(*args), cachectl_argv(*args)], tmp_path / "again")
    ]
    assert [b["status"] for b in again[0]["buckets"]] == ["cached"] * 3
    assert [b["status"] for b in again[1]["buckets"]] == ["cached"] * 3


def test_processes_with_different_manifests_all_refuse(tmp_path: Path, manifest: Path) -> None:
    other = tmp_path / "other.yaml"
    other.write_text(MANIFEST.replace("[2, 4, 8]", "[2, 4]"))
    done = run_job(
        [cachectl_argv("warm", str(manifest)), cachectl_argv("warm", str(other))], tmp_path / "job"
    )
    for proc in done:
        assert proc.returncode == 3, proc.stderr[-3000:]
        assert (
            len(errors(proc)) == 1
            and "the processes of this JAX job differ in manifest digest" in proc.stderr
        )
        assert "Traceback" not in proc.stderr
    assert not list((Path(os.environ["XDG_CACHE_HOME"]) / "cachectl").rglob("*-cache"))


def test_a_target_mismatch_on_any_process_refuses_everywhere(
    tmp_path: Path, manifest: Path
) -> None:
    manifest.write_text(MANIFEST.replace("device_count: 2", "device_count: 4"))
    done = run_job(
        [cachectl_argv("warm", str(manifest)), cachectl_argv("warm", str(manifest))],
        tmp_path / "job",
    )
    for proc in done:
        assert proc.returncode == 3, proc.stderr[-3000:]
        assert len(errors(proc)) == 1 and "does not match the manifest's target" in proc.stderr


def test_a_process_that_fails_before_planning_ends_every_process(
    tmp_path: Path, manifest: Path
) -> None:
    """Process 1 cannot read its manifest: it must not leave process 0 waiting for its view."""
    missing = tmp_path / "missing.yaml"
    done = run_job(
        [cachectl_argv("warm", str(manifest)), cachectl_argv("warm", str(missing))],
        tmp_path / "job",
    )
    assert [p.returncode for p in done] == [2, 2], [p.stderr[-2000:] for p in done]
    assert len(errors(done[0])) == 1 and "process 1 of 2 failed:" in errors(done[0])[0]
    assert "missing.yaml" in errors(done[1])[0] and "Traceback" not in done[1].stderr
    assert not list((Path(os.environ["XDG_CACHE_HOME"]) / "cachectl").rglob("*-cache"))


def test_a_peer_that_never_joins_is_a_bounded_one_line_error(
    tmp_path: Path, manifest: Path
) -> None:
    started = time.monotonic()
    [proc] = run_job([cachectl_argv("warm", str(manifest))], tmp_path / "job", count=2, timeout_s=3)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert errors(proc) == [
        "cachectl: error: --distributed: the JAX job's other processes did not join within "
        "3 s (CACHECTL_DISTRIBUTED_TIMEOUT); did one of them fail before joining?"
    ]
    assert time.monotonic() - started < 60
    assert not (Path(os.environ["XDG_DATA_HOME"]) / "cachectl" / "index.db").exists()


def test_distributed_and_shard_do_not_combine(tmp_path: Path, manifest: Path) -> None:
    """Decided: a JAX job compiles every bucket with all of its processes, so it is never sharded."""
    env = job_env(free_port(), 0, 2, PRODUCT_TIMEOUT_S)
    for extra in (
        ["--shard", "1/2"],
        ["--shard", "auto", "--shards", "2"],
        ["--no-distributed", "--distributed", "--shard", "2/2"],
    ):
        proc = subprocess.run(
            cachectl_argv("warm", str(manifest), *extra),
            env={**env, "JOB_COMPLETION_INDEX": "0"},
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
        )
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines() == [
            "cachectl: error: --distributed and --shard do not combine: every process of a JAX job compiles "
            "every bucket together; to split a manifest across jobs, give each job its own manifest"
        ]
    assert not (Path(os.environ["XDG_DATA_HOME"]) / "cachectl" / "index.db").exists()


STALLED_PEER = """
import os, time
import jax
jax.distributed.initialize(num_processes=2, process_id=1)
jax.devices()  # the backend: every process's devices exchanged
time.sleep({seconds})  # joined, then never takes part in the warm
"""


def test_a_peer_that_joins_and_stalls_is_a_bounded_one_line_error(
    tmp_path: Path, manifest: Path
) -> None:
    started = time.monotonic()
    done = run_job(
        [
            cachectl_argv("warm", str(manifest)),
            [sys.executable, "-c", STALLED_PEER.format(seconds=6)],
        ],
        tmp_path / "job",
        timeout_s=3,
    )
    assert done[0].returncode == 2, done[0].stderr[-3000:]
    [line] = errors(done[0])
    assert line.startswith(
        "cachectl: error: --distributed: process 1 of 2 did not reach the 'open' step within "
        "3 s (CACHECTL_DISTRIBUTED_TIMEOUT): DEADLINE_EXCEEDED"
    ), line
    assert "Traceback" not in done[0].stderr
    assert time.monotonic() - started < 60


def test_a_signed_cache_two_process_warm_signs_once_and_refuses_without_a_key(
    tmp_path: Path, manifest: Path
) -> None:
    """The key check runs in every process (each refuses, exit 4); process 0 signs after storing
    process 1's entries too, so the signed content list covers all six entries."""

    def cachectl(*args: str, code: int = 0) -> subprocess.CompletedProcess:
        done = subprocess.run(
            cachectl_argv(*args),
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        assert done.returncode == code, done.stderr
        return done

    key = tmp_path / "ci.key"
    pub = json.loads(cachectl("key", "generate", str(key), "--json").stdout)["public_path"]
    cachectl("cache", "set", "default", "--trust", pub)
    refused = run_job([cachectl_argv("warm", str(manifest))] * 2, tmp_path / "unsigned")
    for proc in refused:
        assert proc.returncode == 4, proc.stderr[-3000:]
        assert len(errors(proc)) == 1 and "accepts only signed content" in errors(proc)[0]
    signed = run_job(
        [cachectl_argv("warm", str(manifest), "--sign-key", str(key), "--json")] * 2,
        tmp_path / "signed",
    )
    for proc in signed:
        assert proc.returncode == 0, proc.stderr[-3000:]
    digest = json.loads(signed[0].stdout)["environment"]["digest"]

    from cachectl.index import open_index
    from cachectl.trust import signing

    index = open_index(f"sqlite:///{Path(os.environ['XDG_DATA_HOME']) / 'cachectl' / 'index.db'}")
    try:
        cache, env_info = index.get_cache("default"), index.get_environment("default", digest)
        # What pull and serving check: every indexed file is in the signed list.
        assert signing.unsigned_files(index, cache, env_info) == []
        files = signing.trusted_files(index, cache, env_info)
    finally:
        index.close()
    assert files is not None
    assert (
        sum(name.endswith("-cache") for name in files) == 6
        and sum(name.endswith("-aot") for name in files) == 3
    )


NOISY_MODULE = (
    MODULE
    + """
import jax

def noisy(x, w):
    jax.debug.callback(lambda v: None, x)  # a host callback: JAX writes this program nowhere
    return jnp.tanh(x @ w).sum(axis=1)
"""
)

NOISY_MANIFEST = (
    MANIFEST.replace("[2, 4, 8]", "[2, 4]")
    + """  - fn: dist_mod:noisy
    mesh: {axes: {data: 2}}
    args:
      - {shape: [batch, 4], dtype: float32, sharding: [data, null]}
      - {shape: [4, 4], dtype: float32}
    buckets: {batch: [2]}
"""
)


def test_every_process_settles_its_buckets_as_warm_does(tmp_path: Path) -> None:
    """Process 1 compiles through warm's executors (--jobs threads) and judges each bucket as
    warm's settle does: a program with host callbacks, which JAX writes from no process, is
    its own failure with the way out, and is never handed to process 0 to store."""
    (tmp_path / "dist_mod.py").write_text(NOISY_MODULE)
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(NOISY_MANIFEST)
    args = ["warm", str(manifest), "--json", "--jobs", "2"]
    done = run_job([cachectl_argv(*args), cachectl_argv(*args)], tmp_path / "warm")
    assert [p.returncode for p in done] == [1, 1], [p.stderr[-2000:] for p in done]
    reports = [json.loads(p.stdout) for p in done]
    for report in reports:
        assert [(b["function"], b["status"]) for b in report["buckets"]] == [
            ("step", "compiled"),
            ("step", "compiled"),
            ("noisy", "failed"),
        ], report["buckets"]
        assert "uses host callbacks" in report["buckets"][2]["error"], report["buckets"][2]
    follower = reports[1]
    assert not follower["buckets"][2]["error"].startswith("process 0"), follower["buckets"][2]
    assert follower["summary"]["jobs"] == 2 and follower["summary"]["executor"] == "thread"
    # Stored: the plain function's entries of both processes (keys differ per process on CPU),
    # nothing of the program with host callbacks.
    stored = {b["key"] for r in reports for b in r["buckets"] if b["status"] == "compiled"}
    assert len(stored) == 4
    ns = Path(reports[0]["namespace"])
    assert {p.name[: -len("-cache")] for p in ns.glob("*-cache")} == stored


# The job: 2 processes of 2 CPU devices each, a global mesh of 4.
MESH4 = (
    MANIFEST.replace("device_count: 2", "device_count: 4")
    .replace("data: 2", "data: 4")
    .replace("[2, 4, 8]", "[4, 8]")
)


def test_warm_check_inside_the_job_checks_the_jobs_namespace_from_every_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """warm-check (and warm --check) in a jax.distributed job: each child joins the job before
    activate(), so the job's 4-device mesh and namespace are checked from both processes (it
    exited 3 there: "needs a mesh of 4 devices; this machine has 2"). Process 0 records."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    (tmp_path / "dist_mod.py").write_text(MODULE)
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(MESH4)
    warm = ["warm", str(manifest), "--json", "--jobs", "1"]
    for proc in run_job([cachectl_argv(*warm), cachectl_argv(*warm)], tmp_path / "warm"):
        assert proc.returncode == 0, proc.stderr[-3000:]
    # Process 0 through `warm --check`, process 1 through `warm-check`: the same check.
    done = run_job(
        [
            cachectl_argv("warm", str(manifest), "--check", "--json"),
            cachectl_argv("warm-check", str(manifest), "--json"),
        ],
        tmp_path / "check",
    )
    for proc in done:
        assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads(p.stdout) for p in done]
    for r in reports:
        assert r["environment"]["device_count"] == 4 and r["environment"]["process_count"] == 2
        assert [b["status"] for b in r["buckets"]] == ["hit", "hit"], r["buckets"]
        assert [b["aot"] for b in r["buckets"]] == ["loaded", "loaded"], r["buckets"]
    assert reports[0]["namespace"] == reports[1]["namespace"]
    assert reports[0]["proof"] is not None and reports[0]["proof"]["buckets"] == 2
    assert reports[1]["proof"] is None and "process 0" in reports[1]["proof_error"]

    # misses in the job lowers the job's mesh too: no "does not lower ... fix the manifest".
    misses = ["misses", "--manifest", str(manifest), "--json"]
    done = run_job([cachectl_argv(*misses), cachectl_argv(*misses)], tmp_path / "misses")
    for proc in done:
        assert proc.returncode == 0, proc.stderr[-3000:]
        found = json.loads(proc.stdout)["findings"]
        assert not [f for f in found if f["kind"] == "lowering"], found
