"""cachectl.serving: warm stores executables; a fresh service dispatches to them with zero compiles.

Every service here is a fresh Python process (infra.run_py). "Zero compiles" is
counted with jax.monitoring duration events: /jax/core/compile/jaxpr_trace_duration
(tracing) and /jax/core/compile/backend_compile_duration (XLA compiles), around
the calls only.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from support.infra import run_py  # noqa: E402
from support.serving import COUNT_EVENTS, last_json  # noqa: E402

from cachectl.cli import cli

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "manifest.yaml"


def warm(*args: str) -> dict[str, Any]:
    result = CliRunner().invoke(cli, ["warm", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# --------------------------------------------------------------------------- the example LM


@pytest.fixture(scope="module")
def warmed_example(tmp_path_factory):
    """The example manifest warmed once into its own home; tests point XDG dirs at it."""
    home = tmp_path_factory.mktemp("example-home")
    env = {
        "XDG_DATA_HOME": str(home / "data"),
        "XDG_CACHE_HOME": str(home / "cache"),
        "XDG_CONFIG_HOME": str(home / "config"),
    }
    code = f"""
        import sys
        from cachectl.cli import main
        sys.argv = ["cachectl", "warm", {str(EXAMPLE)!r}, "--json"]
        main()
    """
    proc = run_py(code, env, check=True, timeout=600)
    report = json.loads(proc.stdout)
    assert report["summary"]["failed"] == 0
    return env, report


def test_warm_stores_an_executable_per_bucket(warmed_example) -> None:
    env, report = warmed_example
    namespace = Path(report["namespace"])
    aot_files = sorted(namespace.glob("*-aot"))
    assert len(aot_files) == report["summary"]["buckets"] == 11
    for b in report["buckets"]:
        assert b["aot_bytes"] == (namespace / f"{b['key']}-aot").stat().st_size
        # Metadata only: the executable itself stays in the JAX entry.
        assert b["aot_bytes"] < b["bytes"] / 2
    db = Path(env["XDG_DATA_HOME"]) / "cachectl" / "index.db"
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT count(*) FROM entries WHERE aot_sha256 IS NOT NULL").fetchone()
    assert rows[0] == 11


SERVE_EXAMPLE = (
    COUNT_EVENTS
    + """
import numpy as np
sys.path.insert(0, {repo!r})
import cachectl
from examples import lm
rt = cachectl.serving({manifest!r})
prefill, decode = rt["prefill"], rt["decode_step"]
params = jax.device_put(lm.init_params(jax.random.key(0)))
key = np.asarray(jax.random.PRNGKey(0))
rng = np.random.default_rng(0)
jax.block_until_ready(params)
before = compiles()
served = []
for length in range(1, 129):
    batch = int(rng.integers(1, 5)) if length <= 64 else 1
    tokens = rng.integers(0, lm.CONFIG.vocab, size=(batch, length), dtype=np.int32)
    logits, kv = prefill(params, tokens)
    served.append((tokens, np.asarray(logits), kv))
rows = served[40][2].shape[2]
token = np.zeros((rows, 1), np.int32)
kv = served[40][2]
for step in range(3):
    token, kv = decode(params, kv, token, np.int32(41 + step), key, sampling="greedy")
np.asarray(token)
during = compiles()
report = rt.report().to_dict()
# References, after the counting: jax.jit on the same padded inputs, and the unpadded call.
ref = jax.jit(lm.prefill)
worst_padded = worst_valid = 0.0
for tokens, logits, kv in served[::9] + [served[-1]]:
    b, s = tokens.shape
    bucket_b = kv.shape[2]
    bucket_s = min(x for x in (32, 64, 128) if x >= s)
    padded = np.zeros((bucket_b, bucket_s), np.int32)
    padded[:b, :s] = tokens
    full_logits, full_kv = ref(params, padded)
    worst_padded = max(worst_padded, float(np.max(np.abs(np.asarray(full_logits)[:b, :s] - logits))))
    exact_logits, exact_kv = ref(params, tokens)
    exact = np.asarray(exact_logits)
    worst_valid = max(worst_valid, float(np.max(np.abs(exact - logits)) / np.max(np.abs(exact))))
print(json.dumps({{"before": before, "during": during, "report": report, "calls": len(served),
                  "text": rt.report().to_json(),
                  "shapes": [list(l.shape) for _, l, _ in served[:3]],
                  "worst_padded": worst_padded, "worst_valid": worst_valid}}))
"""
)


def test_fresh_service_serves_every_length_with_zero_compiles(warmed_example) -> None:
    env, _ = warmed_example
    proc = run_py(
        SERVE_EXAMPLE.format(repo=str(REPO), manifest=str(EXAMPLE)), env, check=True, timeout=600
    )
    out = last_json(proc)
    assert out["during"] == out["before"], (
        out["before"],
        out["during"],
    )  # nothing traced or compiled
    prefill = out["report"]["functions"]["prefill"]
    assert prefill["calls"] == 128 and prefill["aot"] == 128 and prefill["fallback"] == 0
    # to_json() is JSON text (a log line), to_dict() the same data
    assert (
        isinstance(out["text"], str) and json.loads(out["text"])["functions"]["prefill"] == prefill
    )
    assert prefill["loaded"] == prefill["buckets"] == 8
    assert prefill["padded"] > 100
    assert (
        sum(prefill["raw_sizes"]["seq"].values()) == 128 and len(prefill["raw_sizes"]["seq"]) == 128
    )
    decode = out["report"]["functions"]["decode_step"]
    assert (
        decode["aot"] == 3 and decode["fallback"] == 0
    )  # donation and a static kwarg, through the runtime
    assert out["shapes"][0][1:] == [1, 512] and out["shapes"][2][1:] == [3, 512]  # logits cut back
    assert out["worst_padded"] <= 1e-5  # the same program as jax.jit on the padded inputs
    # Causal + right padding: the valid region is the unpadded call's result, up to the bf16 kv
    # cache (another shape is another XLA program; a last-bit difference can round k/v apart).
    assert out["worst_valid"] <= 2e-3
    assert out["report"]["warnings"] == []


def test_out_of_bucket_is_an_error_by_default_and_compiles_when_asked(warmed_example) -> None:
    env, _ = warmed_example
    code = (
        COUNT_EVENTS
        + f"""
import numpy as np
sys.path.insert(0, {str(REPO)!r})
import cachectl
from examples import lm
params = lm.init_params(jax.random.key(0))
tokens = np.zeros((1, 200), np.int32)
rt = cachectl.serving({str(EXAMPLE)!r})
try:
    rt["prefill"](params, tokens)
    error = None
except cachectl.OutOfBucket as exc:
    error = str(exc)
    is_value_error = isinstance(exc, ValueError)
try:
    rt["decode_step"](params, np.zeros((1, 2, 1, 256, 4, 32), np.float32), np.zeros((1, 1), np.int32),
                      np.int32(0), np.zeros(2, np.uint32), sampling="sample")
    static_error = None
except cachectl.OutOfBucket as exc:
    static_error = str(exc)
rt2 = cachectl.serving({str(EXAMPLE)!r}, overflow="compile")
logits, _ = rt2["prefill"](params, tokens)
print(json.dumps({{"error": error, "is_value_error": is_value_error, "static_error": static_error,
                  "shape": list(np.shape(logits)), "report": rt2.report().to_dict()["functions"]["prefill"],
                  "first": rt.report().to_dict()["functions"]["prefill"]}}))
"""
    )
    out = last_json(run_py(code, env, check=True))
    assert out["is_value_error"]
    assert (
        "prefill" in out["error"]
        and "seq=200" in out["error"]
        and "largest bucket 128" in out["error"]
    )
    assert "sampling='sample'" in out["static_error"] and "greedy" in out["static_error"]
    assert out["first"]["out_of_bucket"] == 1
    assert out["shape"] == [1, 200, 512]
    assert out["report"]["out_of_bucket"] == 1 and out["report"]["aot"] == 0


def test_a_params_tree_of_another_layout_is_refused_with_its_path(warmed_example) -> None:
    env, _ = warmed_example
    code = f"""
import json, sys
import numpy as np, jax
sys.path.insert(0, {str(REPO)!r})
import cachectl
from examples import lm
params = lm.init_params(jax.random.key(0))
params["extra"] = params.pop("final_norm")
rt = cachectl.serving({str(EXAMPLE)!r})
try:
    rt["prefill"](params, np.zeros((1, 8), np.int32))
    print(json.dumps({{"error": None}}))
except cachectl.StructureMismatch as exc:
    print(json.dumps({{"error": str(exc)}}))
"""
    out = last_json(run_py(code, env, check=True))
    assert out["error"] and "prefill" in out["error"] and "final_norm" in out["error"], out


# --------------------------------------------------------------------------- fallback

TINY_MODULE = """
import jax.numpy as jnp

def affine(x, w):
    return jnp.tanh(x @ w)
"""

TINY_MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: sv_tiny:affine
    args:
      - {shape: [batch, 8], dtype: float32}
      - {shape: [8, 8], dtype: float32}
    buckets: {batch: [2, 4]}
"""

TINY_SERVICE = (
    COUNT_EVENTS
    + """
import logging, numpy as np
logging.basicConfig(level=logging.WARNING, format="%(message)s")
requests = {{"n": 0, "hits": 0}}
def _ev(e, **kw):
    if e == "/jax/compilation_cache/compile_requests_use_cache": requests["n"] += 1
    if e == "/jax/compilation_cache/cache_hits": requests["hits"] += 1
jax.monitoring.register_event_listener(_ev)
sys.path.insert(0, {dir!r})
import cachectl
rt = cachectl.serving({manifest!r})
f = rt["affine"]
outs = [np.asarray(f(np.ones((n, 8), np.float32), np.eye(8, dtype=np.float32))).tolist() for n in (1, 2, 3, 4, 1)]
print(json.dumps({{"report": rt.report().to_dict(), "requests": requests, "outs": outs}}))
"""
)


def tiny_warmed(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    (tmp_path / "sv_tiny.py").write_text(TINY_MODULE)
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text(TINY_MANIFEST)
    return manifest, warm(str(manifest))


def serve_tiny(tmp_path: Path, manifest: Path) -> tuple[dict[str, Any], str]:
    proc = run_py(TINY_SERVICE.format(dir=str(tmp_path), manifest=str(manifest)), check=True)
    return last_json(proc), proc.stderr


def _delete(namespace: Path, key: str) -> None:
    (namespace / f"{key}-aot").unlink()


def _corrupt(namespace: Path, key: str) -> None:
    path = namespace / f"{key}-aot"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))


def _sha_mismatch(namespace: Path, key: str) -> None:
    db = Path(os.environ["XDG_DATA_HOME"]) / "cachectl" / "index.db"
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE entries SET aot_sha256 = ? WHERE key = ?", ("0" * 64, key))


@pytest.mark.parametrize(
    "damage", [_delete, _corrupt, _sha_mismatch], ids=["deleted", "corrupted", "sha-mismatch"]
)
def test_a_broken_executable_falls_back_to_the_persistent_cache(tmp_path: Path, damage) -> None:
    manifest, report = tiny_warmed(tmp_path)
    namespace = Path(report["namespace"])
    for b in report["buckets"]:
        damage(namespace, b["key"])
    out, stderr = serve_tiny(tmp_path, manifest)
    fn = out["report"]["functions"]["affine"]
    assert fn["calls"] == 5 and fn["fallback"] == 5 and fn["aot"] == 0
    # Through jax.jit, the padded calls hit what warm wrote: nothing compiled.
    assert out["requests"]["n"] >= 1 and out["requests"]["n"] == out["requests"]["hits"], out[
        "requests"
    ]
    assert stderr.count("serving through jax.jit") == 1, stderr  # one warning per function
    assert (
        out["outs"][0] == out["outs"][4] and len(out["outs"][2]) == 4
    )  # padded: no outputs: declared


def test_the_tiny_manifest_serves_without_fallback(tmp_path: Path) -> None:
    manifest, _ = tiny_warmed(tmp_path)
    out, stderr = serve_tiny(tmp_path, manifest)
    fn = out["report"]["functions"]["affine"]
    assert fn["aot"] == 5 and fn["fallback"] == 0 and fn["padded"] == 3, fn
    assert out["requests"]["n"] == 0  # JAX's compile path was never entered
    assert "jax.jit" not in stderr


def test_changed_source_is_never_served_from_a_stale_executable(tmp_path: Path) -> None:
    manifest, _ = tiny_warmed(tmp_path)
    (tmp_path / "sv_tiny.py").write_text(TINY_MODULE.replace("jnp.tanh", "jnp.sin"))
    out, stderr = serve_tiny(tmp_path, manifest)
    fn = out["report"]["functions"]["affine"]
    assert fn["aot"] == 0 and fn["fallback"] == 5
    assert "source code" in (fn["fallback_reason"] or "")
    import numpy as np

    assert out["outs"][1][0][0] == pytest.approx(
        float(np.sin(1.0)), rel=1e-6
    )  # the new code's answer


def check_tiny(manifest: Path) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["warm-check", str(manifest)])
    return result.exit_code, result.output


def test_a_manifest_that_grows_keeps_every_bucket_trace_free(tmp_path: Path) -> None:
    """Executables are bound to the function and the bucket, not to the whole manifest entry:
    a bucket added, or a second manifest naming the function at some of the buckets (a CI
    subset), leaves every stored executable in use (issue 69)."""
    manifest, _ = tiny_warmed(tmp_path)  # batch [2, 4]
    manifest.write_text(TINY_MANIFEST.replace("[2, 4]", "[2, 4, 8]"))
    grown = warm(str(manifest))
    assert [b["status"] for b in grown["buckets"]] == ["cached", "cached", "compiled"]
    subset = tmp_path / "subset.yaml"
    subset.write_text(TINY_MANIFEST.replace("[2, 4]", "[4]"))
    assert warm(str(subset))["summary"]["cached"] == 1
    code, output = check_tiny(manifest)
    assert code == 0, output
    assert "stored executables: 3/3 load and run" in output
    for served in (manifest, subset):
        out, stderr = serve_tiny(tmp_path, served)
        fn = out["report"]["functions"]["affine"]
        assert (fn["aot"], fn["fallback"]) == (5, 0), (served.name, fn, stderr)
        assert out["requests"]["n"] == 0  # nothing traced through jit


def _as_stored_before_binding(namespace: Path, key: str, spec: Any) -> None:
    """Rewrite ``key``'s executable as cachectl wrote it before per-bucket binding (the whole
    manifest entry's digest, no binding digest), and its index row to match."""
    from cachectl.storage import executables

    path = namespace / f"{key}-aot"
    header, payload = executables.split_artifact(path.read_bytes())
    fields = {**header.to_json(), "spec_digest": executables.spec_digest(spec)}
    for name in ("format", "jax_version", "jaxlib_version", "payload_sha256", "binding_digest"):
        fields.pop(name, None)
    data = executables.pack(payload, **fields)
    path.write_bytes(data)
    db = Path(os.environ["XDG_DATA_HOME"]) / "cachectl" / "index.db"
    with sqlite3.connect(db) as conn:
        sha = hashlib.sha256(data).hexdigest()
        conn.execute("UPDATE entries SET aot_sha256 = ? WHERE key = ?", (sha, key))


def test_executables_stored_before_per_bucket_binding(tmp_path: Path) -> None:
    """One stored for the same whole entry still serves; after the entry grows it is refused,
    warm-check fails on it (it hits, and a service would trace it), and warm stores it again."""
    from cachectl.manifest import parse_manifest

    manifest, first = tiny_warmed(tmp_path)
    namespace = Path(first["namespace"])
    spec = parse_manifest(TINY_MANIFEST, "tiny.yaml").functions[0]
    for b in first["buckets"]:
        _as_stored_before_binding(namespace, b["key"], spec)
    out, _ = serve_tiny(tmp_path, manifest)
    assert out["report"]["functions"]["affine"]["aot"] == 5  # the entry it was stored for
    # The same buckets, by another entry: a bucket listed, and excluded.
    manifest.write_text(TINY_MANIFEST.replace("[2, 4]}", "[2, 4, 8]}\n    exclude: [{batch: 8}]"))
    code, output = check_tiny(manifest)
    assert code == 1, output
    assert "2 stored executable(s) a service will not use: affine[batch=2]" in output
    assert "0/2 load and run (0.0%); 2 stored but refused (a service would trace them)" in output
    assert "before executables were bound per bucket" in output
    again = warm(str(manifest))
    assert [b["status"] for b in again["buckets"]] == ["compiled", "compiled"]  # stored anew
    assert warm(str(manifest))["summary"]["cached"] == 2
    code, output = check_tiny(manifest)
    assert code == 0 and "stored executables: 2/2 load and run" in output, output


# A module that reads a file at import (as a service deserializes an exported model): the value
# is baked into the program, and serving, which never lowers, cannot see the file change.
SCALED_MODULE = """
import json, pathlib
import jax.numpy as jnp
SCALE = json.loads((pathlib.Path(__file__).parent / "scale.json").read_text())["scale"]

def affine(x, w):
    return jnp.tanh(x @ w) * SCALE
"""


def test_a_changed_depends_on_file_is_never_served_stale(tmp_path: Path) -> None:
    """depends_on binds each file's sha256 into the executables: a changed file refuses them
    (serving falls back with a warning naming it, warm-check fails naming it); a missing one is
    bad input to warm."""
    import numpy as np

    (tmp_path / "sv_scaled.py").write_text(SCALED_MODULE)  # a name no other test imports
    scale = tmp_path / "scale.json"
    scale.write_text('{"scale": 2.0}')
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text(
        TINY_MANIFEST.replace("sv_tiny:", "sv_scaled:").replace(
            "    args:", "    depends_on: [scale.json]\n    args:", 1
        )
    )
    warm(str(manifest))
    out, _ = serve_tiny(tmp_path, manifest)
    assert out["report"]["functions"]["affine"]["aot"] == 5
    scale.write_text('{"scale": 3.0}')  # a new model exported to the same file
    out, stderr = serve_tiny(tmp_path, manifest)
    fn = out["report"]["functions"]["affine"]
    assert (fn["aot"], fn["fallback"]) == (0, 5), fn
    assert "scale.json (depends_on) changed since warm" in stderr, stderr
    assert out["outs"][1][0][0] == pytest.approx(3 * float(np.tanh(1.0)), rel=1e-6)  # not 2x
    code, output = check_tiny(manifest)
    assert code == 1 and "scale.json (depends_on) changed since warm" in output, output
    scale.unlink()
    result = CliRunner().invoke(cli, ["warm", str(manifest)])
    assert result.exit_code == 2, result.output
    assert "depends_on[0]: scale.json is not a file" in result.output


def test_rewarm_reports_cached_only_when_both_kinds_are_present(tmp_path: Path) -> None:
    manifest, first = tiny_warmed(tmp_path)
    assert {b["status"] for b in first["buckets"]} == {"compiled"}
    assert warm(str(manifest))["summary"]["cached"] == 2
    namespace = Path(first["namespace"])
    (namespace / f"{first['buckets'][0]['key']}-aot").unlink()
    again = warm(str(manifest))
    assert [b["status"] for b in again["buckets"]] == ["compiled", "cached"]
    assert (namespace / f"{first['buckets'][0]['key']}-aot").exists()
    none = warm(str(manifest), "--no-executables")
    assert {b["aot_bytes"] for b in none["buckets"]} == {None}


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
  - fn: sv_mesh:step
    mesh: {axes: {data: 4}}
    args:
      - {shape: [batch, 16], dtype: float32, sharding: [data, null]}
      - {pytree: sv_mesh:weights}
    buckets: {batch: [4, 8]}
"""


def test_mesh_manifest_serves_on_four_devices_with_zero_compiles(tmp_path: Path) -> None:
    (tmp_path / "sv_mesh.py").write_text(MESH_MODULE)
    manifest = tmp_path / "mesh.yaml"
    manifest.write_text(MESH_MANIFEST)
    flags = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    run_py(
        f"""
        import sys
        from cachectl.cli import main
        sys.argv = ["cachectl", "warm", {str(manifest)!r}, "--json"]
        main()
    """,
        flags,
        check=True,
    )
    code = (
        COUNT_EVENTS
        + f"""
import numpy as np
sys.path.insert(0, {str(tmp_path)!r})
import cachectl
rt = cachectl.serving({str(manifest)!r})
w = {{"w": np.ones((16, 16), np.float32)}}
before = compiles()
outs = [rt["step"](np.ones((n, 16), np.float32), w) for n in (1, 4, 5, 8)]
shardings = [str(o.sharding) for o in outs]
during = compiles()
print(json.dumps({{"before": before, "during": during, "devices": jax.device_count(),
                  "shapes": [list(o.shape) for o in outs], "report": rt.report().to_dict()["functions"]["step"],
                  "sharding": shardings[-1]}}))
"""
    )
    out = last_json(run_py(code, flags, check=True))
    assert out["devices"] == 4
    assert out["during"] == out["before"]
    assert out["report"]["aot"] == 4 and out["report"]["fallback"] == 0
    assert out["shapes"] == [[4], [4], [8], [8]]
    assert "data" in out["sharding"]


# --------------------------------------------------------------------------- object storage


@pytest.mark.parametrize("store", ["s3", "az"])
def test_serving_from_an_object_store(tmp_path: Path, store: str, request) -> None:
    """cachectl.serving loads stored executables from moto's S3 and from Azurite's Blob service."""
    bucket = request.getfixturevalue({"s3": "s3_bucket", "az": "az_container"}[store])
    (tmp_path / "sv_tiny.py").write_text(TINY_MODULE)
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text(TINY_MANIFEST)
    result = CliRunner().invoke(cli, ["cache", "add", "remote", f"{bucket}/jax"])
    assert result.exit_code == 0, result.output
    warm(str(manifest), "--cache", "remote")
    out = last_json(
        run_py(
            TINY_SERVICE.replace(
                "cachectl.serving({manifest!r})", "cachectl.serving({manifest!r}, cache='remote')"
            ).format(dir=str(tmp_path), manifest=str(manifest)),
            check=True,
        )
    )
    fn = out["report"]["functions"]["affine"]
    assert fn["aot"] == 5 and fn["fallback"] == 0, out["report"]
    assert out["report"]["namespace"].startswith(f"{bucket}/jax/")


def test_warm_check_reports_executable_coverage_from_a_fresh_process(tmp_path: Path) -> None:
    manifest, report = tiny_warmed(tmp_path)
    result = CliRunner().invoke(cli, ["warm-check", str(manifest), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["summary"]["aot_loaded"] == 2 and data["summary"]["aot_coverage"] == 100.0
    assert {b["aot"] for b in data["buckets"]} == {"loaded"}
    (Path(report["namespace"]) / f"{report['buckets'][1]['key']}-aot").unlink()
    result = CliRunner().invoke(cli, ["warm-check", str(manifest)])
    assert result.exit_code == 0  # the persistent cache still covers everything
    assert (
        "coverage: 2/2 buckets hit (100.0%); stored executables: 1/2 load and run (50.0%)"
        in result.stdout
    )


def test_served_calls_reach_the_index_as_telemetry(tmp_path: Path) -> None:
    """Counts, raw sizes before padding, and a hit on every loaded entry (so LRU gc keeps them)."""
    from datetime import timedelta

    from cachectl.index import open_index
    from cachectl.index.telemetry_queries import serving_usage

    manifest, report = tiny_warmed(tmp_path)
    serve_tiny(tmp_path, manifest)  # the collector flushes at exit
    db = Path(os.environ["XDG_DATA_HOME"]) / "cachectl" / "index.db"
    index = open_index(f"sqlite:///{db}")
    try:
        usage = serving_usage(index, "default", timedelta(hours=1))
        env = index.find_environment("default", report["environment"]["digest"])
        hits = {e.key: (e.hit_count, e.last_access_at) for e in index.list_entries(env.id)}
    finally:
        index.close()
    assert len(usage) == 1
    row = usage[0]
    assert (row.function, row.calls, row.aot, row.fallback, row.padded) == ("affine", 5, 5, 0, 3)
    assert row.sizes == {"batch": {1: 2, 2: 1, 3: 1, 4: 1}}
    for b in report["buckets"]:
        count, last = hits[b["key"]]
        assert count >= 1 and last is not None


COMMITTED_MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: sv_tiny:affine
    args:
      - {shape: [batch, 8], dtype: float32, sharding: single_device}
      - {shape: [8, 8], dtype: float32, sharding: single_device}
    buckets: {batch: [2, 4]}
"""


def test_single_device_sharding_matches_a_service_that_commits_its_arrays(tmp_path: Path) -> None:
    (tmp_path / "sv_tiny.py").write_text(TINY_MODULE)
    manifest = tmp_path / "committed.yaml"
    manifest.write_text(COMMITTED_MANIFEST)
    warm(str(manifest))
    code = f"""
import json, sys
import numpy as np, jax
sys.path.insert(0, {str(tmp_path)!r})
import cachectl
cachectl.activate()
import sv_tiny
counts = dict()
jax.monitoring.register_event_listener(lambda e, **kw: counts.__setitem__(e, counts.get(e, 0) + 1))
device = jax.devices()[0]
x = jax.device_put(np.ones((2, 8), np.float32), device)
w = jax.device_put(np.eye(8, dtype=np.float32), device)
jax.jit(sv_tiny.affine)(x, w).block_until_ready()
print(json.dumps({{"requests": counts.get("/jax/compilation_cache/compile_requests_use_cache", 0),
                  "hits": counts.get("/jax/compilation_cache/cache_hits", 0)}}))
"""
    out = last_json(run_py(code, check=True))
    assert out["requests"] == 1 and out["hits"] == 1, out  # committed arrays hit what warm wrote
    served, _ = serve_tiny(tmp_path, manifest)
    assert served["report"]["functions"]["affine"]["aot"] == 5


def test_serving_from_a_verified_mirror(tmp_path: Path) -> None:
    manifest, report = tiny_warmed(tmp_path)
    mirror = tmp_path / "mirror"
    code = TINY_SERVICE.replace(
        "cachectl.serving({manifest!r})", "cachectl.serving({manifest!r}, mirror={mirror!r})"
    )
    out = last_json(
        run_py(
            code.format(dir=str(tmp_path), manifest=str(manifest), mirror=str(mirror)), check=True
        )
    )
    fn = out["report"]["functions"]["affine"]
    assert fn["aot"] == 5 and fn["fallback"] == 0, out["report"]
    assert out["report"]["namespace"] == str(mirror)
    assert sorted(p.name for p in mirror.glob("*-aot")) == sorted(
        f"{b['key']}-aot" for b in report["buckets"]
    )


def test_eqx_filter_jit_functions_are_refused_with_what_to_write(tmp_path: Path) -> None:
    pytest.importorskip("equinox")
    (tmp_path / "sv_eqx.py").write_text(
        "import equinox as eqx, jax.numpy as jnp\n\n@eqx.filter_jit\ndef step(x):\n    return jnp.sin(x)\n"
    )
    manifest = tmp_path / "eqx.yaml"
    manifest.write_text(
        "version: 1\nfunctions:\n  - fn: sv_eqx:step\n    args:\n"
        "      - {shape: [4], dtype: float32}\n"
    )
    result = CliRunner().invoke(cli, ["warm", str(manifest), "--dry-run"])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert "eqx.filter_jit" in line and "plain function" in line and "eqx.yaml:3" in line, line


# --------------------------------------------------------------------------- library kernels

# Programs calling kernels JAX makes ready only when it lowers an op that uses them (LAPACK's
# are registered at import, but point at scipy's LAPACK only once a lowering initialized them),
# or registers only when a module is imported (CPU sparse): a service never lowers.
KERNEL_MODULE = """
import jax.numpy as jnp
from jax.experimental import sparse

def solve(a, b):
    l = jnp.linalg.cholesky(a @ jnp.swapaxes(a, -1, -2) + 4 * jnp.eye(a.shape[-1]))
    return jnp.linalg.solve(l, b[..., None])[..., 0]

def spectrum(x):
    return jnp.abs(jnp.fft.fft(x)) + jnp.fft.irfft(jnp.fft.rfft(x), n=x.shape[-1])

def spmm(data, indices, indptr, v):
    return sparse.BCSR((data, indices, indptr), shape=(8, 8)) @ v
"""

KERNEL_CASES = {
    "solve": (
        "- {shape: [batch, 8, 8], dtype: float32}\n      - {shape: [batch, 8], dtype: float32}",
        "rng.normal(size=(4, 8, 8)).astype(np.float32), rng.normal(size=(4, 8)).astype(np.float32)",
    ),
    "spectrum": (
        "- {shape: [batch, 16], dtype: float32}",
        "rng.normal(size=(4, 16)).astype(np.float32),",
    ),
    "spmm": (
        "- {shape: [16], dtype: float32}\n      - {shape: [16], dtype: int32}\n"
        "      - {shape: [9], dtype: int32}\n      - {shape: [8, batch], dtype: float32}",
        "rng.normal(size=16).astype(np.float32), np.tile(np.arange(0, 8, 4, dtype=np.int32), 8),"
        " np.arange(0, 17, 2, dtype=np.int32), rng.normal(size=(8, 4)).astype(np.float32)",
    ),
}

KERNEL_MANIFEST = """
version: 1
target: {{backend: cpu}}
functions:
  - fn: sv_kernels:{name}
    args:
      {args}
    buckets: {{batch: [1, 4]}}
"""

# The stored executable is called first, in a process that has lowered nothing; jax.jit's answer
# on the same inputs comes after (its lowering would make the kernels ready).
KERNEL_SERVICE = """
import json, sys
import numpy as np
sys.path.insert(0, {dir!r})
import cachectl
rng = np.random.default_rng(0)
args = ({inputs})
rt = cachectl.serving({manifest!r})
out = np.asarray(rt[{name!r}](*args))
report = rt.report().to_dict()["functions"][{name!r}]
import jax, sv_kernels
expected = np.asarray(jax.jit(getattr(sv_kernels, {name!r}))(*args))
print(json.dumps(dict(report=report, out=out.tolist(), expected=expected.tolist())))
"""


@pytest.mark.parametrize("name", sorted(KERNEL_CASES))
def test_a_program_calling_library_kernels_is_served_by_a_fresh_process(
    tmp_path: Path, name: str
) -> None:
    import numpy as np

    args, inputs = KERNEL_CASES[name]
    (tmp_path / "sv_kernels.py").write_text(KERNEL_MODULE)
    manifest = tmp_path / "kernels.yaml"
    manifest.write_text(KERNEL_MANIFEST.format(name=name, args=args))
    report = warm(str(manifest))
    assert report["summary"]["failed"] == 0, report
    service = KERNEL_SERVICE.format(
        dir=str(tmp_path), manifest=str(manifest), name=name, inputs=inputs
    )
    out = last_json(run_py(service, check=True))  # a segfault fails here, with its exit code
    assert out["report"]["aot"] == 1 and out["report"]["fallback"] == 0, out["report"]
    np.testing.assert_allclose(
        np.asarray(out["out"]), np.asarray(out["expected"]), rtol=1e-5, atol=1e-5
    )


# --------------------------------------------------------------------------- import order

IMPORT_MODULE = """
import jax
import jax.numpy as jnp

# Built when the module is imported, as a Brax env or a Keras model is: a program compiles.
SCALE = float(jax.jit(lambda n: (jnp.arange(8.0) * n).sum())(0.5))

def scale(x):
    return x * SCALE
"""

IMPORT_MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: sv_import:scale
    args: [{shape: [batch, 8], dtype: float32}]
    buckets: {batch: [2]}
"""

IMPORT_SERVICE = """
import json, logging, sys
import numpy as np
logging.basicConfig(level=logging.WARNING, format="%(message)s")
sys.path.insert(0, {dir!r})
import jax
requests = dict(n=0)
def _ev(e, **kw):
    if e == "/jax/compilation_cache/compile_requests_use_cache": requests["n"] += 1
jax.monitoring.register_event_listener(_ev)
import cachectl
rt = cachectl.serving({manifest!r})  # imports sv_import
at_import = requests["n"]
out = np.asarray(rt["scale"](np.ones((2, 8), np.float32))).tolist()
print(json.dumps(dict(report=rt.report().to_dict(), at_import=at_import, after=requests["n"], out=out)))
"""


def test_serving_activates_the_cache_before_importing_the_manifests_modules(
    tmp_path: Path,
) -> None:
    (tmp_path / "sv_import.py").write_text(IMPORT_MODULE)
    manifest = tmp_path / "import.yaml"
    manifest.write_text(IMPORT_MANIFEST)
    assert warm(str(manifest))["summary"]["failed"] == 0
    proc = run_py(IMPORT_SERVICE.format(dir=str(tmp_path), manifest=str(manifest)), check=True)
    out = last_json(proc)
    assert "compiled before" not in proc.stderr, proc.stderr
    assert not any("compiled before" in w for w in out["report"]["warnings"]), out["report"]
    # The import-time program went through the persistent cache; the call did not compile.
    assert out["at_import"] == out["after"] == 1, out
    assert out["report"]["functions"]["scale"]["aot"] == 1 and out["out"] == [[14.0] * 8] * 2


# --------------------------------------------------------------------------- warm-up

WARMUP_SERVICE = (
    COUNT_EVENTS
    + """
import time
import numpy as np
sys.path.insert(0, {dir!r})
import cachectl
from cachectl.dispatch import router
served = []
_call = router.ServedFunction.__call__
def counted(self, *args, **kwargs):
    served.append(self.name)
    return _call(self, *args, **kwargs)
router.ServedFunction.__call__ = counted
rt = cachectl.serving({manifest!r}, warmup={warmup})
during_build = len(served)
f = rt["affine"]
w = np.eye(8, dtype=np.float32)
seconds = []
for n in (2, 4, 2, 4):
    started = time.perf_counter()
    np.asarray(f(np.ones((n, 8), np.float32), w))
    seconds.append(time.perf_counter() - started)
print(json.dumps(dict(report=rt.report().to_dict(), compiles=compiles(), seconds=seconds,
                      during_build=during_build, passes=router.SERVED_WARMUP_PASSES)))
"""
)


def test_warmup_runs_every_bucket_before_the_first_request(tmp_path: Path) -> None:
    manifest, _ = tiny_warmed(tmp_path)
    out = {
        warmup: last_json(
            run_py(
                WARMUP_SERVICE.format(dir=str(tmp_path), manifest=str(manifest), warmup=warmup),
                check=True,
            )
        )
        for warmup in (False, True)
    }
    cold, warmed = out[False]["report"], out[True]["report"]
    assert cold["warmup_seconds"] == 0 and cold["warm_ready_seconds"] is None, cold
    assert warmed["warmup_seconds"] > 0, warmed
    assert warmed["warm_ready_seconds"] >= warmed["ready_seconds"] > 0, warmed
    # The warm-up called the stored executables: nothing traced or compiled, no fallback.
    assert out[True]["compiles"] == {}, out[True]
    fn = warmed["functions"]["affine"]
    assert fn["aot"] == 4 and fn["fallback"] == 0 and fn["calls"] == 4, fn
    # Each bucket went through the request path too (in the building thread, every bucket in
    # turn, twice), counted nowhere: the counters and sizes are the four requests' alone.
    assert fn["buckets"] == 2 and out[True]["passes"] == 2, out[True]
    assert out[True]["during_build"] == 4 and out[False]["during_build"] == 0
    assert fn["raw_sizes"] == cold["functions"]["affine"]["raw_sizes"], (fn, cold)
    assert fn["padded"] == cold["functions"]["affine"]["padded"], (fn, cold)


OPENS_SERVICE = """
import json, sys
opened = []

def _count(event, args):
    # A real hook, not a patch: every sqlite3 connection this process makes, SQLAlchemy's too.
    if event == "sqlite3.connect" and "index.db" in str(args[0]):
        opened.append(str(args[0]))

sys.addaudithook(_count)
sys.path.insert(0, {dir!r})
import numpy as np
import cachectl
rt = cachectl.serving({manifest!r}, telemetry=False)
out = rt["affine"](np.ones((2, 8), np.float32), np.eye(8, dtype=np.float32))
np.asarray(out)
print(json.dumps({{"opens": opened, "functions": rt.report().to_dict()["functions"]}}))
"""


def test_serving_opens_the_index_once(tmp_path: Path) -> None:
    """activate() opens the index and hands it to cachectl.serving in its Activation: the
    verified sha256s are read through it, not through a second connection."""
    manifest, _ = tiny_warmed(tmp_path)
    proc = run_py(OPENS_SERVICE.format(dir=str(tmp_path), manifest=str(manifest)), check=True)
    out = last_json(proc)
    assert out["functions"]["affine"]["aot"] == 1, out  # served, so the index was read
    assert len(out["opens"]) == 1, out["opens"]


def test_serving_an_s3_cache_reads_through_its_own_endpoint_whatever_aws_endpoint_url_says(
    tmp_path: Path, s3_bucket: str, s3_env: dict[str, str]
) -> None:
    """Issue 62 finding 8: the cache names its endpoint (``endpoint_url``) and the service's
    environment points AWS_ENDPOINT_URL elsewhere. Every store the service opens, serving's own
    listing included, carries the cache's options: every stored executable loads from the
    cache's endpoint."""
    (tmp_path / "sv_tiny.py").write_text(TINY_MODULE)
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text(TINY_MANIFEST)
    endpoint = s3_env["AWS_ENDPOINT_URL"]
    option = f"endpoint_url={endpoint}"
    added = CliRunner().invoke(
        cli, ["cache", "add", "remote", f"{s3_bucket}/jax", "--storage-option", option]
    )
    assert added.exit_code == 0, added.output
    argv = ["cachectl", "warm", str(manifest), "--cache", "remote"]
    warm_code = f"import sys; sys.argv = {argv!r}\nfrom cachectl.cli import main; main()"
    # A fresh process: JAX's s3 filesystem is built once per process.
    run_py(warm_code, {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, check=True)
    code = TINY_SERVICE.replace(
        "cachectl.serving({manifest!r})", "cachectl.serving({manifest!r}, cache='remote')"
    ).format(dir=str(tmp_path), manifest=str(manifest))
    proc = run_py(code, {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, check=True)
    fn = last_json(proc)["report"]["functions"]["affine"]
    assert fn["aot"] == 5 and fn["fallback"] == 0, proc.stderr[-3000:]
