"""A full disk during warm: broken entries are reported failed and removed, and a rerun with space compiles them.

The cache lives on a real 256 KiB tmpfs (root only; skipped elsewhere), so JAX's
own writes hit ENOSPC and leave the 0-byte files they leave in production.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

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
  - fn: df_tiny:affine
    args:
      - {shape: [batch, 8], dtype: float32}
      - {shape: [8, 8], dtype: float32}
    buckets: {batch: [2, 4, 8, 16, 32, 64]}
"""


@pytest.fixture
def tiny_disk(tmp_path: Path):
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def warm(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(cli, ["warm", *args, "--json", "--jobs", "1"])
    return result.exit_code, json.loads(result.stdout)


def test_full_disk_buckets_fail_with_the_reason_and_a_rerun_compiles_them(
    tmp_path: Path, tiny_disk: Path
) -> None:
    (tmp_path / "df_tiny.py").write_text(MODULE)
    manifest = tmp_path / "m.yaml"
    manifest.write_text(MANIFEST)
    filler = tiny_disk / "filler"
    filler.write_bytes(b"\0" * 220 * 1024)
    assert CliRunner().invoke(cli, ["cache", "add", "small", str(tiny_disk / "c")]).exit_code == 0

    code, report = warm(str(manifest), "--cache", "small")
    failed = [b for b in report["buckets"] if b["status"] == "failed"]
    assert code == 1 and failed, report["summary"]
    for b in failed:
        assert "broken entry" in b["error"] and "no space left" in b["error"], b["error"]
    namespace = Path(report["namespace"])
    assert [
        p for p in namespace.glob("*-cache") if p.stat().st_size == 0
    ] == []  # removed, not indexed
    compiled = {b["key"] for b in report["buckets"] if b["status"] == "compiled"}

    filler.unlink()
    code, again = warm(str(manifest), "--cache", "small")
    assert code == 0, [b["error"] for b in again["buckets"]]
    assert again["summary"]["failed"] == 0
    assert {b["key"] for b in again["buckets"] if b["status"] == "cached"} <= compiled
    recompiled = {b["key"] for b in again["buckets"] if b["status"] == "compiled"}
    assert {b["key"] for b in failed} <= recompiled
    assert all(p.stat().st_size > 0 for p in namespace.glob("*-cache"))
