"""`cachectl warm` reads its manifest file once per process, and records the digest of the very
bytes it compiled: counted by an audit hook on "open" in a real `cachectl warm` process."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from pathlib import Path

from support.infra import run_py  # noqa: E402
from support.warming import tiny  # noqa: E402

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

# `cachectl ARGS` in this process, with every open of the manifest file counted (sys.addaudithook
# sees each open() of the interpreter, pathlib's included); the count goes to stderr at the end.
COUNTED = """
import os, runpy, sys
manifest = os.path.realpath({manifest!r})
opens = []

def hook(event, args):
    if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        if os.path.realpath(os.fsdecode(args[0])) == manifest:
            opens.append(args[1])

sys.addaudithook(hook)
sys.argv = ["cachectl", *{args!r}]
try:
    runpy.run_module("cachectl", run_name="__main__")
finally:
    sys.stderr.write(f"\\nMANIFEST_OPENS={{len(opens)}}\\n")
"""


def _opens(stderr: str) -> int:
    lines = [line for line in stderr.splitlines() if line.startswith("MANIFEST_OPENS=")]
    assert len(lines) == 1, stderr[-3000:]
    return int(lines[0].split("=", 1)[1])


def test_warm_reads_its_manifest_once_and_records_the_digest_of_those_bytes(
    tmp_path: Path,
) -> None:
    manifest = tiny(tmp_path, ONE_BUCKET)
    args = ["warm", str(manifest), "--json", "--jobs", "1"]
    proc = run_py(COUNTED.format(manifest=str(manifest), args=args), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert [b["status"] for b in report["buckets"]] == ["compiled"]
    assert _opens(proc.stderr) == 1  # the signing check, the plan and the run row share one read

    db = Path(os.environ["XDG_DATA_HOME"]) / "cachectl" / "index.db"
    with sqlite3.connect(db) as conn:
        recorded = conn.execute("SELECT manifest_digest FROM warm_runs").fetchall()
    assert recorded == [(hashlib.sha256(manifest.read_bytes()).hexdigest(),)]


def test_the_open_counter_counts_every_read(tmp_path: Path) -> None:
    """The hook sees pathlib's reads: a command that reads the manifest twice counts 2."""
    manifest = tiny(tmp_path, ONE_BUCKET)
    code = COUNTED.format(manifest=str(manifest), args=["--help"]).replace(
        "runpy.run_module",
        "from pathlib import Path; Path(manifest).read_bytes(); "
        "Path(manifest).read_text(); runpy.run_module",
    )
    proc = run_py(code, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _opens(proc.stderr) == 2
