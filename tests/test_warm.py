"""`cachectl warm`: real JAX compiles into real caches, proven by fresh service processes.

Every "service" here is a fresh Python process (infra.run_py) that calls
cachectl.activate() and then jax.jit on the real functions with real arrays;
jax.monitoring counts its compile requests and persistent-cache hits around
those calls, so "requests - hits = 0" means nothing was compiled.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest
from support.infra import run_py  # noqa: E402
from support.manifests import IMPORT_ERRORS, MALFORMED  # noqa: E402
from support.warming import TINY_MANIFEST, TINY_MODULE, invoke, service, tiny, warm_json  # noqa: E402,F401

from cachectl.storage.entries import sha256

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "manifest.yaml"


def entry_files(namespace: str) -> dict[str, bytes]:
    return {p.name[: -len("-cache")]: p.read_bytes() for p in Path(namespace).glob("*-cache")}


def index_db() -> Path:
    return Path(os.environ["XDG_DATA_HOME"]) / "cachectl" / "index.db"


# --------------------------------------------------------------------------- end to end


def test_warm_then_a_fresh_service_compiles_nothing(tmp_path: Path) -> None:
    manifest = tiny(tmp_path)
    report = warm_json(str(manifest), "--jobs", "2")

    assert set(report) == {"environment", "namespace", "summary", "buckets", "side_programs"}
    assert report["side_programs"] == []  # the functions run nothing eagerly while traced
    assert report["summary"]["buckets"] == 5 and report["summary"]["compiled"] == 5
    assert report["summary"]["cached"] == 0 and report["summary"]["failed"] == 0
    assert {b["status"] for b in report["buckets"]} == {"compiled"}
    assert set(report["buckets"][0]) == {
        "function",
        "bucket",
        "status",
        "key",
        "compile_seconds",
        "bytes",
        "error",
        "aot_bytes",
        "aot_error",
    }
    assert report["buckets"][0]["function"] == "affine"
    assert report["buckets"][0]["bucket"] == {"batch": 1, "mode": "relu"}
    assert report["environment"]["namespace"] in report["namespace"]

    # Exactly the buckets were written: nothing user code compiled on the way (weights()).
    files = entry_files(report["namespace"])
    assert set(files) == {b["key"] for b in report["buckets"]}
    assert {b["bytes"] for b in report["buckets"]} == {
        len(files[b["key"]]) for b in report["buckets"]
    }

    result = service(tmp_path)
    assert result["path"] == report["namespace"]
    assert result["requests"] == 5 and result["hits"] == 5, result


def test_index_records_every_written_entry_and_the_run(tmp_path: Path) -> None:
    manifest = tiny(tmp_path)
    report = warm_json(str(manifest), "--jobs", "1")
    files = entry_files(report["namespace"])
    with sqlite3.connect(index_db()) as db:
        rows = db.execute(
            "SELECT key, module, size_bytes, sha256, origin, function, bucket, "
            "compile_time_ms, warm_run_id FROM entries"
        ).fetchall()
        runs = db.execute(
            "SELECT id, status, buckets, compiled, cached, failed, manifest_digest, "
            "manifest_path, host, user, finished_at, heartbeat_at FROM warm_runs"
        ).fetchall()
        audit = db.execute(
            "SELECT operation, entries FROM audit_log WHERE operation = 'warm'"
        ).fetchall()
    assert len(runs) == 1
    run_id, status, buckets, compiled, cached, failed, digest, path, host, user, finished, beat = (
        runs[0]
    )
    assert (status, buckets, compiled, cached, failed) == ("succeeded", 5, 5, 0, 0)
    assert digest == sha256(manifest.read_bytes()) and path == str(manifest.resolve())
    assert host and user and finished and beat
    assert audit == [("warm", 5)]

    by_key = {r[0]: r for r in rows}
    assert set(by_key) == set(files)
    for b in report["buckets"]:
        key, module, size, digest, origin, function, bucket, ms, run = by_key[b["key"]]
        assert (origin, function, json.loads(bucket), run) == (
            "warm",
            b["function"],
            b["bucket"],
            run_id,
        )
        assert module == "jit_" + b["function"]
        assert size == len(files[key]) == b["bytes"] and digest == sha256(files[key])
        assert ms is not None and abs(ms - b["compile_seconds"] * 1000) <= 1


def test_rewarm_reports_every_bucket_cached(tmp_path: Path) -> None:
    manifest = tiny(tmp_path)
    first = warm_json(str(manifest))
    # Same process: the programs are in JAX's in-memory cache too, and must still
    # be found (and keyed) through the persistent one.
    again = warm_json(str(manifest))
    assert again["summary"]["cached"] == 5 and again["summary"]["compiled"] == 0
    assert [b["status"] for b in again["buckets"]] == ["cached"] * 5
    assert [b["key"] for b in again["buckets"]] == [b["key"] for b in first["buckets"]]
    assert again["summary"]["compile_seconds"] == 0
    with sqlite3.connect(index_db()) as db:
        runs = db.execute(
            "SELECT id, status, compiled, cached FROM warm_runs ORDER BY id"
        ).fetchall()
        newest = db.execute("SELECT DISTINCT warm_run_id, origin FROM entries").fetchall()
    assert runs == [(1, "succeeded", 5, 0), (2, "succeeded", 0, 5)]
    # The re-warm claims its buckets (lifecycle protects the newest run's entries); provenance stays.
    assert newest == [(2, "warm")]


def test_rewarm_says_why_it_still_lowers_every_bucket(tmp_path: Path) -> None:
    manifest = tiny(tmp_path)
    first = invoke("warm", str(manifest)).stdout
    assert "5 bucket(s): 5 compiled, 0 cached" in first and "cached already" not in first
    again = " ".join(invoke("warm", str(manifest)).stdout.split())
    assert "5 bucket(s): 0 compiled, 5 cached" in again
    assert (
        "every bucket was cached already: none was compiled or loaded, but each was lowered"
        in again
    )


def test_rewarm_of_stored_buckets_neither_compiles_nor_loads(tmp_path: Path) -> None:
    """A bucket whose entry and stored executable are there is known from its key alone."""
    import jax

    counting: list[str] = []
    jax.monitoring.register_event_listener(lambda event, **kw: counting and counting.append(event))
    manifest = tiny(tmp_path)
    first = warm_json(str(manifest))
    counting.append("start")
    again = warm_json(str(manifest))
    assert [b["status"] for b in again["buckets"]] == ["cached"] * 5
    assert [b["key"] for b in again["buckets"]] == [b["key"] for b in first["buckets"]]
    assert [b["aot_bytes"] for b in again["buckets"]] == [b["aot_bytes"] for b in first["buckets"]]
    from cachectl.core import jax_seam

    shortcut = jax_seam.persistent_cache_key(jax.jit(lambda v: v + 1).lower(1.0)) is not None
    if shortcut:
        assert "/jax/compilation_cache/compile_requests_use_cache" not in counting
    else:  # a JAX whose key the seam cannot compute (tests/test_jax_seam.py): each bucket is a hit
        assert counting.count("/jax/compilation_cache/cache_hits") == 5
    # Without its stored executable a bucket goes through JAX again (a hit) and is stored anew.
    gone = first["buckets"][1]["key"]
    (Path(first["namespace"]) / f"{gone}-aot").unlink()
    counting[:] = ["start"]
    third = warm_json(str(manifest))
    assert [b["status"] for b in third["buckets"]] == [
        "cached",
        "compiled",
        "cached",
        "cached",
        "cached",
    ]
    assert (Path(first["namespace"]) / f"{gone}-aot").exists()
    assert counting.count("/jax/compilation_cache/cache_hits") == (1 if shortcut else 5)
    counting.clear()


def test_warm_through_a_pipe_logs_one_line_per_bucket(tmp_path: Path) -> None:
    """Not a terminal (a CI log): a line per finished bucket on stderr; the JSON on stdout as ever."""
    import re
    import subprocess

    manifest = tiny(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "cachectl", "warm", str(manifest), "--json", "--jobs", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("warm ")]
    assert len(lines) == 5, proc.stderr
    pattern = re.compile(
        r"warm (\d)/5 (\w+)\[(\S*)\] (compiled|cached|failed) (\d+\.\d\d)s \(key (\w{12}), .*\)"
    )
    seen = []
    for line in lines:
        match = pattern.fullmatch(line)
        assert match is not None, line
        seen.append((match[2], match[3], match[4]))
    assert [int(pattern.fullmatch(line)[1]) for line in lines] == [1, 2, 3, 4, 5]  # type: ignore[index]
    expected = [
        (b["function"], ",".join(f"{k}={v}" for k, v in b["bucket"].items()), b["status"])
        for b in report["buckets"]
    ]
    assert sorted(seen) == sorted(expected) and {s for _, _, s in seen} == {"compiled"}


def test_warm_check_proves_coverage_in_a_fresh_process(tmp_path: Path) -> None:
    manifest = tiny(tmp_path)
    half = json.loads(invoke("warm", str(manifest), "--shard", "1/2", "--json").stdout)
    assert half["summary"]["buckets"] == 3

    partial = invoke("warm-check", str(manifest), "--json", code=1)
    data = json.loads(partial.stdout)
    assert data["summary"]["buckets"] == 5 and data["summary"]["hits"] == 3
    assert data["summary"]["coverage"] == 60.0
    assert [b["status"] for b in data["buckets"]] == ["hit", "miss", "hit", "miss", "hit"]
    assert "below 100%" in partial.stderr

    invoke("warm", str(manifest), "--shard", "2/2")
    full = json.loads(invoke("warm", str(manifest), "--check", "--json").stdout)
    assert full["summary"]["coverage"] == 100.0 and full["summary"]["hits"] == 5
    assert "coverage: 5/5 buckets hit (100.0%)" in invoke("warm-check", str(manifest)).stdout


def test_example_manifest_shard_hits_in_the_real_model(tmp_path: Path) -> None:
    """The README's job, one shard of it: the example LM served with jax.jit finds its programs."""
    report = warm_json(str(EXAMPLE), "--shard", "1/4")
    assert [(b["function"], b["bucket"], b["status"]) for b in report["buckets"]] == [
        ("prefill", {"batch": 1, "seq": 32}, "compiled"),
        ("prefill", {"batch": 4, "seq": 64}, "compiled"),
        ("decode_step", {"batch": 1}, "compiled"),
    ]
    serve = """
        import json, jax, jax.numpy as jnp
        import cachectl
        cachectl.activate()
        from examples import lm
        params = lm.init_params(jax.random.key(0))
        prefill = jax.jit(lm.prefill)
        decode = jax.jit(lm.decode_step, static_argnames=["sampling"], donate_argnums=[1])
        inputs = [jnp.zeros((1, 32), jnp.int32), jnp.zeros((4, 64), jnp.int32)]
        cache, token, pos, key = lm.init_kv_cache(1), jnp.zeros((1, 1), jnp.int32), jnp.int32(3), jax.random.PRNGKey(0)
        jax.block_until_ready((params, inputs, cache, token, pos, key))
        counts = {}
        jax.monitoring.register_event_listener(lambda e, **kw: counts.__setitem__(e, counts.get(e, 0) + 1))
        for tokens in inputs:
            prefill(params, tokens)[0].block_until_ready()
        decode(params, cache, token, pos, key)[0].block_until_ready()
        print(json.dumps(counts))
    """
    counts = json.loads(run_py(serve, cwd=REPO, check=True).stdout.strip().splitlines()[-1])
    requests = counts["/jax/compilation_cache/compile_requests_use_cache"]
    assert requests == 3 and requests - counts.get("/jax/compilation_cache/cache_hits", 0) == 0, (
        counts
    )


@pytest.mark.parametrize("store", ["s3", "az"])
def test_object_store_cache(tmp_path: Path, store: str, request: pytest.FixtureRequest) -> None:
    """warm into an object store (moto, Azurite), a service hits it, a second warm finds it."""
    bucket = request.getfixturevalue({"s3": "s3_bucket", "az": "az_container"}[store])
    # An option of the cache's that JAX's own filesystem must carry too, or the service is refused.
    options = ["--storage-option", "assume_container_exists=true"] if store == "az" else []
    invoke("cache", "add", "objects", f"{bucket}/jax", *options)
    manifest = tiny(tmp_path)
    report = warm_json(str(manifest), "--cache", "objects")
    assert report["summary"]["compiled"] == 5
    assert report["namespace"].startswith(f"{bucket}/jax/")

    import fsspec

    fs = fsspec.filesystem(store, skip_instance_cache=True)
    stored = {
        p.rsplit("/", 1)[1][: -len("-cache")]: fs.cat_file(p)
        for p in fs.find(report["namespace"].split("://", 1)[1])
        if p.endswith("-cache")
    }
    assert set(stored) == {b["key"] for b in report["buckets"]}
    with sqlite3.connect(index_db()) as db:
        shas = dict(db.execute("SELECT key, sha256 FROM entries").fetchall())
    assert shas == {k: sha256(v) for k, v in stored.items()}

    result = service(tmp_path, cache="objects")
    assert result["path"] == report["namespace"] and result["warning"] is None
    assert result["requests"] == 5 and result["hits"] == 5, result
    again = warm_json(str(manifest), "--cache", "objects")
    assert again["summary"]["cached"] == 5
    if store == "az":  # what `cachectl env` hands a child's JAX (FSSPEC_AZ) carries it
        variables = json.loads(invoke("--cache", "objects", "env", "--json").stdout)
        handed = json.loads(variables["FSSPEC_AZ"])
        assert handed["assume_container_exists"] is True, handed


def test_process_executor_writes_the_same_keys(tmp_path: Path) -> None:
    manifest = tiny(tmp_path)
    report = warm_json(str(manifest), "--executor", "process", "--jobs", "2")
    assert report["summary"]["compiled"] == 5
    assert set(entry_files(report["namespace"])) == {b["key"] for b in report["buckets"]}
    assert service(tmp_path)["hits"] == 5


# --------------------------------------------------------------------------- several devices

MESH_MODULE = """
import jax, jax.numpy as jnp

def weights():
    return {"w": jax.ShapeDtypeStruct((16, 16), jnp.float32)}

def step(x, p):
    return jnp.tanh(x @ p["w"]).sum(axis=-1)
"""

MESH_MANIFEST = """
version: 1
target: {backend: cpu, device_count: 4}
functions:
  - fn: wm_mesh:step
    mesh: {axes: {data: 4}, axis_types: explicit}  # the service calls jax.make_mesh
    args:
      - {shape: [batch, 16], dtype: float32, sharding: [data, null]}
      - {pytree: wm_mesh:weights}
    buckets: {batch: [4, 8]}
  - name: step_2x2
    fn: wm_mesh:step
    mesh: {axes: {data: 2, model: 2}, axis_types: explicit}
    args:
      - {shape: [8, 16], dtype: float32, sharding: [data, null]}
      - {pytree: wm_mesh:weights, sharding: [null, model]}
"""

MESH_SERVICE = """
import json, sys
import numpy as np
import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import cachectl
sys.path.insert(0, {dir!r})
import wm_mesh
cachectl.activate()
step = jax.jit(wm_mesh.step)
mesh = jax.make_mesh((4,), ("data",))
grid = jax.make_mesh((2, 2), ("data", "model"))
w = np.ones((16, 16), np.float32)
inputs = [
    (jax.device_put(np.ones((4, 16), np.float32), NamedSharding(mesh, P("data", None))),
     {{"w": jax.device_put(w, NamedSharding(mesh, P()))}}),
    (jax.device_put(np.ones((8, 16), np.float32), NamedSharding(mesh, P("data", None))),
     {{"w": jax.device_put(w, NamedSharding(mesh, P()))}}),
    (jax.device_put(np.ones((8, 16), np.float32), NamedSharding(grid, P("data", None))),
     {{"w": jax.device_put(w, NamedSharding(grid, P(None, "model")))}}),
]
jax.block_until_ready(inputs)
counts = {{}}
jax.monitoring.register_event_listener(lambda e, **kw: counts.__setitem__(e, counts.get(e, 0) + 1))
for x, p in inputs:
    step(x, p).block_until_ready()
print(json.dumps({{"devices": jax.device_count(),
                  "requests": counts.get("/jax/compilation_cache/compile_requests_use_cache", 0),
                  "hits": counts.get("/jax/compilation_cache/cache_hits", 0)}}))
"""


def test_mesh_manifest_on_four_devices(tmp_path: Path) -> None:
    (tmp_path / "wm_mesh.py").write_text(MESH_MODULE)
    manifest = tmp_path / "mesh.yaml"
    manifest.write_text(MESH_MANIFEST)
    flags = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    warm = f"""
        import sys
        from cachectl.cli import main
        sys.argv = ["cachectl", "warm", {str(manifest)!r}, "--json"]
        main()
    """
    proc = run_py(warm, flags)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["environment"]["device_count"] == 4
    assert report["summary"]["compiled"] == 3, report
    assert "cpu-cpu-x4" in report["namespace"]

    result = json.loads(run_py(MESH_SERVICE.format(dir=str(tmp_path)), flags, check=True).stdout)
    assert result == {"devices": 4, "requests": 3, "hits": 3}

    # One device here: the target and the mesh do not fit; nothing is compiled.
    mismatch = invoke("warm", str(manifest), code=3)
    assert "device_count" in mismatch.stderr or "devices" in mismatch.stderr


# --------------------------------------------------------------------------- refusals


def test_target_mismatch_exits_3_and_compiles_nothing(tmp_path: Path) -> None:
    manifest = tiny(
        tmp_path,
        TINY_MANIFEST.replace(
            "target: {backend: cpu}",
            "target: {backend: gpu, device_kind: 'NVIDIA H100*', device_count: 8}",
        ),
    )
    result = invoke("warm", str(manifest), code=3)
    message = result.stderr.strip()
    assert message.startswith("cachectl: error: ") and "\n" not in message
    for field in (
        "backend is cpu, the manifest targets gpu",
        "device kind is 'cpu'",
        "1 devices, the manifest targets 8",
    ):
        assert field in message, message
    assert "nothing was compiled" in message
    cache_root = Path(os.environ["XDG_CACHE_HOME"]) / "cachectl"
    assert not list(cache_root.rglob("*-cache"))
    if index_db().exists():
        with sqlite3.connect(index_db()) as db:
            assert db.execute("SELECT COUNT(*) FROM warm_runs").fetchone() == (0,)

    dry = invoke("warm", str(manifest), "--dry-run", code=3)
    assert "does not match" in dry.stdout and "affine" in dry.stdout


@pytest.mark.parametrize(
    ("text", "line", "needle"),
    [pytest.param(t, ln, n, id=i) for i, t, ln, n in MALFORMED],
)
def test_malformed_manifest_exits_2_naming_file_and_line(
    tmp_path: Path, text: str, line: int, needle: str
) -> None:
    import textwrap

    path = tmp_path / "bad.yaml"
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    # The functions the manifests name import fine: each one's only problem is the malformed field.
    (tmp_path / "m.py").write_text(
        "def f(*args, **kwargs):\n    return args\ndef p():\n    return {}\n"
    )
    for module in ("a", "b"):
        (tmp_path / f"{module}.py").write_text("def step(*args, **kwargs):\n    return args\n")
    result = invoke("warm", str(path), code=2)
    assert result.stderr.startswith(f"cachectl: error: {path}:{line}: "), result.stderr
    assert needle in result.stderr and result.stderr.count("\n") == 1
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("files", "text", "line", "needle"),
    [pytest.param(f, t, ln, n, id=i) for i, f, t, ln, n in IMPORT_ERRORS],
)
def test_unimportable_functions_exit_2_before_compiling(
    tmp_path: Path, files: dict[str, str], text: str, line: int, needle: str
) -> None:
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    path = tmp_path / "manifest.yaml"
    path.write_text(text)
    result = invoke("warm", str(path), code=2)
    assert result.stderr.startswith(f"cachectl: error: {path}:{line}: "), result.stderr
    assert needle in result.stderr


def test_non_writer_is_refused_with_exit_4(tmp_path: Path) -> None:
    invoke(
        "cache",
        "add",
        "guarded",
        str(tmp_path / "guarded"),
        "--writers",
        "@nobody-here,someone-else",
    )
    result = invoke("warm", str(tiny(tmp_path)), "--cache", "guarded", code=4)
    assert "may not warm cache 'guarded'" in result.stderr
    assert not list((tmp_path / "guarded").rglob("*-cache"))


def test_dry_run_lists_buckets_and_compiles_nothing(tmp_path: Path) -> None:
    report = warm_json(str(tiny(tmp_path)), "--dry-run", "--shard", "2/2")
    assert [(b["function"], b["bucket"], b["status"]) for b in report["buckets"]] == [
        ("affine", {"batch": 1, "mode": "tanh"}, "planned"),
        ("affine", {"batch": 2, "mode": "tanh"}, "planned"),
    ]
    assert not list(Path(os.environ["XDG_CACHE_HOME"]).rglob("*-cache"))
    assert "target: matches this machine" in invoke("warm", str(tiny(tmp_path)), "--dry-run").stdout


def test_cache_comes_from_flag_then_manifest_then_global(tmp_path: Path) -> None:
    manifest = tiny(
        tmp_path, "version: 1\ncache: from-manifest\n" + TINY_MANIFEST.split("\n", 2)[2]
    )
    missing = invoke("warm", str(manifest), "--dry-run", code=2)
    assert "no cache named 'from-manifest'" in missing.stderr
    invoke("cache", "add", "from-manifest", str(tmp_path / "m"))
    invoke("cache", "add", "from-flag", str(tmp_path / "f"))
    assert str(tmp_path / "m") in warm_json(str(manifest), "--dry-run")["namespace"]
    assert (
        str(tmp_path / "f")
        in warm_json(str(manifest), "--dry-run", "--cache", "from-flag")["namespace"]
    )


# --------------------------------------------------------------------------- failures

FAILING_MODULE = """
import jax.numpy as jnp

def picky(x):
    if x.shape[0] == 3:
        raise ValueError("batch 3 is not supported")
    return jnp.cumsum(x, axis=0)

def broken_params():
    raise OSError("checkpoint not found")

def uses(x, p):
    return x + p
"""

FAILING_MANIFEST = """
version: 1
functions:
  - fn: wm_failing:picky
    args: [{shape: [batch, 4], dtype: float32}]
    buckets: {batch: [1, 3, 5]}
  - fn: wm_failing:uses
    args:
      - {shape: [4], dtype: float32}
      - {pytree: wm_failing:broken_params}
"""


def test_a_failing_bucket_does_not_stop_the_others(tmp_path: Path) -> None:
    (tmp_path / "wm_failing.py").write_text(FAILING_MODULE)
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(FAILING_MANIFEST.lstrip())
    result = invoke("warm", str(manifest), "--json", code=1)
    report = json.loads(result.stdout)
    statuses = [(b["function"], b["bucket"], b["status"]) for b in report["buckets"]]
    assert statuses == [
        ("picky", {"batch": 1}, "compiled"),
        ("picky", {"batch": 3}, "failed"),
        ("picky", {"batch": 5}, "compiled"),
        ("uses", {}, "failed"),
    ]
    errors = [b["error"] for b in report["buckets"]]
    assert errors[0] is None and "ValueError: batch 3 is not supported" in errors[1]
    assert (
        f"{manifest}:9:" in errors[3]
        and "broken_params() raised OSError: checkpoint not found" in errors[3]
    )
    assert report["summary"] == {**report["summary"], "buckets": 4, "compiled": 2, "failed": 2}
    assert "2 of 4 bucket(s) failed" in result.stderr
    with sqlite3.connect(index_db()) as db:
        assert db.execute("SELECT status, compiled, failed FROM warm_runs").fetchall() == [
            ("failed", 2, 2)
        ]
        assert db.execute("SELECT COUNT(*) FROM entries").fetchone() == (2,)

    # --fail-fast with one job goes in manifest order and stops at the first failure.
    fast = json.loads(
        invoke("warm", str(manifest), "--json", "--fail-fast", "--jobs", "1", code=1).stdout
    )
    assert [b["status"] for b in fast["buckets"]] == ["cached", "failed", "skipped", "skipped"]
    assert fast["summary"]["buckets"] == 4 and fast["summary"]["failed"] == 1


def test_entries_above_max_entry_size_are_removed_and_reported(tmp_path: Path) -> None:
    invoke("cache", "add", "small", str(tmp_path / "small"), "--max-entry-size", "1KB")
    result = invoke("warm", str(tiny(tmp_path)), "--cache", "small", "--json", code=1)
    report = json.loads(result.stdout)
    assert {b["status"] for b in report["buckets"]} == {"too-large"}
    assert all(
        b["bytes"] > 1000 and "above the max entry size of cache 'small' (1000 B)" in b["error"]
        for b in report["buckets"]
    )
    assert report["summary"]["failed"] == 5
    assert not list((tmp_path / "small").rglob("*-cache"))
    with sqlite3.connect(index_db()) as db:
        assert db.execute("SELECT COUNT(*) FROM entries").fetchone() == (0,)


# --------------------------------------------------------------------------- warm runs in the index


def test_warm_runs_rows_and_heartbeat(db_url: str) -> None:
    from datetime import timedelta

    from cachectl.core.fingerprint import current_environment
    from cachectl.index import open_index, warm_runs
    from cachectl.index.lifecycle_queries import warms_in_progress

    index = open_index(db_url, auto_migrate=True)
    try:
        index.ensure_cache("c", "/tmp/unused-root")
        env = index.ensure_environment("c", current_environment())
        run = warm_runs.start_run(
            index, env.id, manifest_digest="ab" * 32, manifest_path="/m.yaml", buckets=3
        )
        assert run.status == "running" and run.heartbeat_at is not None
        assert warms_in_progress(index, [env.id])[env.id].run_id == run.id
        warm_runs.heartbeat(index, run.id, compiled=2, cached=0, failed=0)
        beat = warm_runs.get_run(index, run.id)
        assert beat.compiled == 2 and beat.heartbeat_at >= run.heartbeat_at
        later = beat.heartbeat_at + timedelta(minutes=11)
        assert warms_in_progress(index, [env.id], now=later) == {}  # a dead warm stops protecting
        done = warm_runs.finish_run(index, run.id, "failed", compiled=2, cached=0, failed=1)
        assert done.status == "failed" and done.finished_at is not None
        assert warms_in_progress(index, [env.id]) == {}
        assert [r.id for r in warm_runs.list_runs(index, cache="c")] == [run.id]
        assert warm_runs.list_runs(index, cache="other") == []
        with pytest.raises(ValueError):
            warm_runs.finish_run(index, run.id, "running", compiled=0, cached=0, failed=0)
    finally:
        index.close()


def test_warm_into_postgres_index_and_lifecycle_sees_it_running(
    tmp_path: Path, pg_url: str
) -> None:
    """Library call against PostgreSQL: while buckets compile, the run counts as in progress."""
    from sqlalchemy import select

    from cachectl.context import Context
    from cachectl.core.config import load_settings
    from cachectl.index import open_index, warm_runs
    from cachectl.index.lifecycle_queries import warms_in_progress
    from cachectl.index.models import Entry
    from cachectl.warm import warm

    open_index(pg_url, auto_migrate=True).close()
    ctx = Context(load_settings(db=pg_url))
    seen: list[bool] = []

    def progress(result: Any, done: int, total: int) -> None:
        env_id = ctx.index.environment_stats("default")[0].id
        seen.append(env_id in warms_in_progress(ctx.index, [env_id]))

    try:
        report = warm(ctx, tiny(tmp_path), jobs=2, progress=progress)
        assert report.summary.compiled == 5 and seen == [True] * 5
        env = ctx.index.environment_stats("default")[0]
        entries = ctx.index.list_entries(env.id)
        assert {e.key for e in entries} == {b.key for b in report.buckets}
        assert {e.origin for e in entries} == {"warm"} and all(
            e.compile_time_ms is not None for e in entries
        )
        files = entry_files(report.namespace)
        assert all(
            e.sha256 == sha256(files[e.key]) and e.size == len(files[e.key]) for e in entries
        )
        (run,) = warm_runs.list_runs(ctx.index, cache="default")
        assert (run.status, run.buckets, run.compiled, run.failed) == ("succeeded", 5, 5, 0)
        with ctx.index.session() as session:
            assert set(session.scalars(select(Entry.warm_run_id))) == {run.id}
        assert warms_in_progress(ctx.index, [env.id]) == {}
    finally:
        ctx.close()


# --------------------------------------------------------------------------- threads and global state

# Process-global state a trace pushes and pops, as NumPyro's effect-handler stack is: two traces
# in threads at once see each other's site and fail, which no trace alone does.
RACY_MODULE = """
import time
import jax.numpy as jnp

_SITES = []

def model(x):
    _SITES.append("w")
    try:
        if _SITES.count("w") > 1:
            raise AssertionError("all sites must have unique names but got 'w' duplicated")
        time.sleep(1.0)  # a slow trace: the other threads' traces start meanwhile
        return jnp.tanh(x)
    finally:
        _SITES.remove("w")
"""

RACY_MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: wm_racy:model
    args: [{shape: [batch, 8], dtype: float32}]
    buckets: {batch: [1, 2, 4]}
"""


def test_buckets_failing_among_threads_are_retried_alone_before_they_count_as_failed(
    tmp_path: Path,
) -> None:
    (tmp_path / "wm_racy.py").write_text(RACY_MODULE)
    manifest = tmp_path / "racy.yaml"
    manifest.write_text(RACY_MANIFEST)
    report = warm_json(str(manifest), "--jobs", "3")
    summary = report["summary"]
    assert summary["compiled"] == 3 and summary["failed"] == 0, report
    assert summary["executor"] == "thread" and summary["jobs"] == 3
    assert summary["retried_alone"] >= 1, summary  # they raced, then passed alone
    # A re-warm of a warm manifest traces too (to learn each key): the same race, still exit 0.
    again = invoke("warm", str(manifest), "--jobs", "3")
    assert "3 cached, 0 failed" in again.stdout, again.stdout
    assert "3 thread job(s)" in again.stdout and "retried alone after failing among threads" in (
        again.stdout
    ), again.stdout
