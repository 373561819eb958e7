"""docs/fleet.md's walkthrough, run as written on two "machines".

Machine A is the test's HOME: it runs the page's first block (a named cache, a writer token into
``fleet.token``) and the `cachectl serve` line, on loopback. Machine B is its own HOME in its own
mount namespace (`unshare -m`), A's home hidden under a tmpfs, holding only a copy of the
repository's examples/ and the token file A wrote, as a node would. The blocks run in bash with
``set -e``; the one change made to them is the server's address (``machine-a:8700`` becomes the
port the test's server bound, and ``0.0.0.0`` becomes loopback).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import infra
from support.machines import machine_env

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "fleet.md"
SECTION = "## A walkthrough"
_FENCE = re.compile(r"^```sh\n(?P<body>.*?)^```$", re.S | re.M)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="machine B is a mount namespace: needs root and unshare",
)


def walkthrough_blocks() -> list[str]:
    text = PAGE.read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    return [m["body"] for m in _FENCE.finditer(text[start:end])]


def _machine_env(home: Path) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CACHECTL_", "XDG_", "JAX_"))}
    return {**base, **machine_env(home), "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}


def _on_b(home: Path, hidden: Path, script: str) -> subprocess.CompletedProcess[str]:
    """``script`` in bash on machine B: its HOME and working directory ``home``, ``hidden``
    (machine A's home) under an empty tmpfs."""
    mounts = f"mount --make-rprivate / && mount -t tmpfs tmpfs {shlex.quote(str(hidden))}"
    wrapped = f'{mounts} && test -z "$(ls -A {shlex.quote(str(hidden))})" && exec bash -ec "$1"'
    return subprocess.run(
        ["unshare", "-m", "bash", "-c", wrapped, "machine-b", script],
        env={**_machine_env(home), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
        cwd=home,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _report(path: Path) -> dict[str, tuple[int, int]]:
    report = json.loads(path.read_text())
    return {n: (f["fallback"], f["loaded"]) for n, f in report["functions"].items()}


@pytest.mark.timeout(900)  # a cold fleet of three replicas, a deploy warm and its check
def test_the_fleet_walkthrough_runs_as_written_on_two_machines(isolated_home, tmp_path) -> None:
    a_setup, b_setup, cold_fleet, deploy, restart = walkthrough_blocks()
    *a_lines, serve_line = [line for line in a_setup.strip().splitlines() if line.strip()]
    assert serve_line.startswith("cachectl serve "), serve_line
    a_env = {
        **os.environ,
        "HOME": str(isolated_home),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    made = subprocess.run(
        ["bash", "-ec", "\n".join(a_lines)],
        env=a_env,
        cwd=isolated_home,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    serve = shlex.split(serve_line.replace("0.0.0.0", infra.LOOPBACK))
    server = infra.start_server(
        "cachectl-serve",
        lambda port: [sys.executable, "-m", "cachectl", *serve[1:-2], "--port", str(port)],
        tmp_path / "logs",
    )
    b = tmp_path / "b"
    b.mkdir()
    shutil.copytree(REPO / "examples", b / "examples")
    shutil.copy(isolated_home / "fleet.token", b / "fleet.token")
    here = server.url
    try:
        on_b = "\n".join([b_setup, cold_fleet, deploy]).replace("http://machine-a:8700", here)
        proc = _on_b(b, isolated_home, on_b)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    finally:
        server.stop()
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for i in (1, 2, 3):  # every replica answered every request
        assert set(_report(b / f"replica-{i}.json")) == {"prefill", "decode_step"}
    checked = re.search(
        r"coverage: (\d+)/(\d+) buckets hit .*; stored executables: (\d+)/(\d+) load and run",
        proc.stdout,
    )
    assert checked, proc.stdout[-3000:]
    assert checked[1] == checked[2] == checked[3] == checked[4] == "11", checked[0]
    # the server down: the node serves every bucket from its node tier, trace-free
    setup = b_setup.replace("cachectl doctor", "").replace("http://machine-a:8700", here)
    down = _on_b(b, isolated_home, setup + restart)
    assert down.returncode == 0, down.stderr[-3000:]
    assert _report(b / "restart.json") == {"prefill": (0, 8), "decode_step": (0, 3)}, down.stderr
    assert "fetched and verified before" in down.stderr
