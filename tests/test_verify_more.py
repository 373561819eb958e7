"""verify: XLA sub-cache directories, stray files, service writes a read-only policy did not stop,
and --deep loading of every entry in a subprocess."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

from click.testing import CliRunner
from support.infra import run_py  # noqa: E402

from cachectl.cli import cli
from cachectl.storage.entries import decompress as entry_decompress
from cachectl.storage.entries import make_entry, read_header, sha256

MODULE = """
import jax.numpy as jnp

def affine(x, w):
    return jnp.tanh(x @ w)

def other(x):
    return jnp.sin(x) * 2
"""

MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: vm_tiny:affine
    args:
      - {shape: [batch, 8], dtype: float32}
      - {shape: [8, 8], dtype: float32}
    buckets: {batch: [2, 4]}
"""


def invoke(*args: str, code: int | None = 0) -> dict:
    result = CliRunner().invoke(cli, [*args, "--json"])
    if code is not None:
        assert result.exit_code == code, result.output
    return json.loads(result.stdout)


def warmed(tmp_path: Path, *cache: str) -> dict:
    (tmp_path / "vm_tiny.py").write_text(MODULE)
    (tmp_path / "m.yaml").write_text(MANIFEST)
    return invoke("warm", str(tmp_path / "m.yaml"), *cache)


def kinds(report: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for f in report["plan"]["findings"]:
        out.setdefault(f["kind"], []).append(f)
    return out


def test_verify_reports_xla_subcaches_and_stray_files(tmp_path: Path) -> None:
    report = warmed(tmp_path)
    ns = Path(report["namespace"])
    sub = ns / "xla_gpu_per_fusion_autotune_cache_dir"
    sub.mkdir()
    (sub / "a.textproto").write_text("x")
    (sub / "b.textproto").write_text("y")
    root = ns.parent.parent.parent
    (root / "notes.txt").write_text("left here by someone")
    found = kinds(invoke("verify", code=1))
    assert [f["path"].rsplit("/", 1)[-1] for f in found["xla-subcache"]] == [
        "xla_gpu_per_fusion_autotune_cache_dir"
    ]
    assert "enable_xla_caches" in found["xla-subcache"][0]["detail"]
    assert [f["path"] for f in found["stray-file"]] == ["notes.txt"]
    assert set(found) == {"xla-subcache", "stray-file"}


def test_verify_reports_entries_a_service_wrote_despite_a_read_only_policy(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    invoke("cache", "add", "ro", str(root), "--service-writes", "deny", code=None)
    warmed(tmp_path, "--cache", "ro")
    code = f"""
        import sys, jax
        sys.path.insert(0, {str(tmp_path)!r})
        import cachectl, vm_tiny
        cachectl.activate("ro", telemetry=False)          # read-only by the cache's policy ...
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # ... which a process can undo
        jax.jit(vm_tiny.other)(jax.numpy.ones(3)).block_until_ready()
    """
    run_py(code, check=True)
    invoke("--cache", "ro", "sync", "--min-age", "0")
    found = kinds(invoke("--cache", "ro", "verify", code=1))
    writes = found["service-write"]
    assert any(w["key"].startswith("jit_other-") for w in writes), writes
    assert all("read-only is advisory" in w["detail"] for w in writes)
    assert not any(w["key"].startswith("jit_affine-") for w in writes)  # warm's own entries are not


def test_verify_deep_loads_every_entry_and_reports_one_that_does_not_load(tmp_path: Path) -> None:
    report = warmed(tmp_path)
    assert invoke("verify", "--deep")["plan"]["findings"] == []
    ns = Path(report["namespace"])
    key = report["buckets"][0]["key"]
    path = ns / f"{key}-cache"
    compression, raw = entry_decompress(path.read_bytes())
    executable = bytearray(raw[4:])
    executable[len(executable) // 3 : len(executable) // 3 + 64] = b"\xff" * 64
    bad = make_entry(bytes(executable), compile_seconds=1, compression=compression)
    read_header(bad)  # the header is fine: only loading can tell
    path.write_bytes(bad)
    db = Path(os.environ["XDG_DATA_HOME"]) / "cachectl" / "index.db"
    (ns / f"{key}-aot").unlink()  # its stored executable was made for the old bytes
    with sqlite3.connect(db) as conn:
        conn.execute(
            "UPDATE entries SET sha256 = ?, size_bytes = ?, aot_sha256 = NULL, aot_size_bytes = NULL "
            "WHERE key = ?",
            (sha256(bad), len(bad), key),
        )
    assert invoke("verify")["plan"]["findings"] == []  # sha256 and header agree with the index
    found = kinds(invoke("verify", "--deep", code=1))
    (nl,) = found["not-loadable"]
    assert nl["key"] == key, nl
