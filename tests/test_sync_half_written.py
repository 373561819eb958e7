"""Half-written files: sync never indexes them, and verify re-reads before it quarantines."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from click.testing import CliRunner

from cachectl.cli import cli
from cachectl.context import Context
from cachectl.lifecycle.verify_execute import execute_verify
from cachectl.lifecycle.verify_plan import plan_verify
from cachectl.lifecycle.verify_records import Fix, VerifyOptions

MODULE = """
import jax.numpy as jnp

def affine(x, w):
    return jnp.tanh(x @ w)
"""

MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: hw_tiny:affine
    args:
      - {shape: [batch, 8], dtype: float32}
      - {shape: [8, 8], dtype: float32}
    buckets: {batch: [2]}
"""

FAKE_KEY = "jit_affine-" + "ab" * 32


def run_json(*args: str) -> dict:
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def warmed(tmp_path: Path) -> tuple[Path, bytes]:
    (tmp_path / "hw_tiny.py").write_text(MODULE)
    (tmp_path / "m.yaml").write_text(MANIFEST)
    report = run_json("warm", str(tmp_path / "m.yaml"))
    ns = Path(report["namespace"])
    return ns, (ns / f"{report['buckets'][0]['key']}-cache").read_bytes()


def test_sync_leaves_young_files_and_never_indexes_a_truncated_one(tmp_path: Path) -> None:
    ns, entry = warmed(tmp_path)
    half = ns / f"{FAKE_KEY}-cache"
    half.write_bytes(entry[: len(entry) // 2])  # a copy still being written

    young = run_json("sync")
    (item,) = [n for n in young["plan"]["namespaces"] if n["too_young"]]
    assert [e["key"] for e in item["too_young"]] == [FAKE_KEY]
    assert young["entries_added"] == 0

    old = time.time() - 3600
    os.utime(half, (old, old))
    later = run_json("sync")
    assert later["entries_added"] == 0
    assert len(later["broken"]) == 1 and FAKE_KEY in later["broken"][0]
    listed = run_json("ls", "--env", ns.name)
    assert FAKE_KEY not in json.dumps(listed)


def test_verify_rereads_before_it_quarantines(tmp_path: Path) -> None:
    ns, entry = warmed(tmp_path)
    target = ns / f"{FAKE_KEY}-cache"
    target.write_bytes(entry)
    old = time.time() - 3600
    os.utime(target, (old, old))
    assert run_json("sync")["entries_added"] == 1
    target.write_bytes(entry[:-7])  # looks truncated to the check ...
    ctx = Context()
    cache = ctx.cache()
    plan = plan_verify(ctx, cache, VerifyOptions(Fix.QUARANTINE))
    assert any(f.key == FAKE_KEY for f in plan.findings)
    target.write_bytes(entry)  # ... and the write finished before verify acted
    result = execute_verify(ctx, cache, plan, started=time.monotonic())
    assert target.exists() and result.quarantined == 0
