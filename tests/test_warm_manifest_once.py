"""`cachectl warm` reads its manifest file once per process, and records the digest of the very
bytes it compiled: counted by an audit hook on "open" in a real `cachectl warm` process
(`warm --push` is counted in tests/test_oci.py, where the registry is)."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from pathlib import Path

from support.warming import counting_opens, tiny  # noqa: E402

ONE_BUCKET = """
version: 1
target: {backend: cpu}
functions:
  - fn: wm_tiny:affine
    jit: {static_argnames: [mode]}
    args:
      - {shape: [batch, 8], dtype: float32}
      - {shape: [8, 8], dtype: float32}
    kwargs: {mode: {axis: mode}}
    buckets: {batch: [1], mode: [relu]}
"""


def test_warm_reads_its_manifest_once_and_records_the_digest_of_those_bytes(
    tmp_path: Path,
) -> None:
    manifest = tiny(tmp_path, ONE_BUCKET)
    proc, opens = counting_opens(
        manifest, ["warm", str(manifest), "--json", "--jobs", "1"], cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [b["status"] for b in json.loads(proc.stdout)["buckets"]] == ["compiled"]
    assert opens == 1  # the signing check, the plan and the run row share one read

    db = Path(os.environ["XDG_DATA_HOME"]) / "cachectl" / "index.db"
    with sqlite3.connect(db) as conn:
        recorded = conn.execute("SELECT manifest_digest FROM warm_runs").fetchall()
    assert recorded == [(hashlib.sha256(manifest.read_bytes()).hexdigest(),)]


def test_the_open_counter_counts_every_read(tmp_path: Path) -> None:
    """The hook sees pathlib's reads: two reads before a command that reads nothing count 2."""
    manifest = tiny(tmp_path, ONE_BUCKET)
    proc, opens = counting_opens(
        manifest,
        ["--help"],
        cwd=tmp_path,
        before="from pathlib import Path; Path(counted).read_bytes(); Path(counted).read_text()",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert opens == 2
