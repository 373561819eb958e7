"""Machines of a test: machine B is its own HOME in its own mount namespace, machine A's home
hidden under a tmpfs (`unshare -m`), with only what a user gives it (CACHECTL_SERVER, a token)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHECTL = (sys.executable, "-m", "cachectl")

needs_unshare = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="machine B is a mount namespace: needs root and unshare",
)


def machine_env(home: Path) -> dict[str, str]:
    env = {"HOME": str(home)}
    for var, sub in (
        ("XDG_DATA_HOME", "data"),
        ("XDG_CACHE_HOME", "cache"),
        ("XDG_CONFIG_HOME", "config"),
        ("XDG_STATE_HOME", "state"),
    ):
        (home / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(home / sub)
    return env


class MachineB:
    """Commands run as machine B: its own HOME and mount namespace, ``hidden`` under a tmpfs."""

    def __init__(self, home: Path, hidden: Path, server: str, token: str) -> None:
        base = {
            k: v for k, v in os.environ.items() if not k.startswith(("CACHECTL_", "XDG_", "JAX_"))
        }
        self.env = {**base, **machine_env(home), "CACHECTL_SERVER": server}
        self.env["CACHECTL_TOKEN"] = token
        self.env["PYTHONPATH"] = str(REPO)
        self.hidden = hidden
        self.node = Path(self.env["XDG_CACHE_HOME"]) / "cachectl" / "node"

    def _argv(self, argv: tuple[str, ...], small_tmpfs: Path | None) -> list[str]:
        mounts = f"mount --make-rprivate / && mount -t tmpfs tmpfs {shlex.quote(str(self.hidden))}"
        if small_tmpfs is not None:  # a node disk that is full at its first write (0700: a
            # node directory group or others may write is refused before any write)
            small_tmpfs.mkdir(parents=True, exist_ok=True)
            mounts += (
                f" && mount -t tmpfs -o size=8k,mode=0700 tmpfs {shlex.quote(str(small_tmpfs))}"
            )
        script = f'{mounts} && test -z "$(ls -A {shlex.quote(str(self.hidden))})" && exec "$@"'
        return ["unshare", "-m", "bash", "-c", script, "machine-b", *argv]

    def run(
        self, *argv: str, env: dict[str, str] | None = None, small_tmpfs: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self._argv(argv, small_tmpfs),
            env={**self.env, **(env or {})},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )

    def start(self, *argv: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        """``argv`` on this machine, started (several run together)."""
        return subprocess.Popen(
            self._argv(argv, None),
            env={**self.env, **(env or {})},
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def serve(
        self, env: dict[str, str] | None = None, small_tmpfs: Path | None = None
    ) -> tuple[dict[str, tuple[int, int]], str]:
        """examples/serve.py on B: per function (fallback calls, buckets loaded), and stderr
        (JAX_LOG_COMPILES: every compile is a line of JAX's log)."""
        proc = self.run(
            sys.executable,
            "examples/serve.py",
            "--json",
            env={"JAX_LOG_COMPILES": "1", **(env or {})},
            small_tmpfs=small_tmpfs,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = json.loads(proc.stdout)
        return {
            n: (f["fallback"], f["loaded"]) for n, f in report["functions"].items()
        }, proc.stderr


def fleet(
    names: tuple[str, ...], base: Path, hidden: Path, server: str, token: str, cache: str
) -> dict[str, MachineB]:
    """Machines of a fleet on one named cache: each its own HOME under ``base/NAME``, its node
    tier there (CACHECTL_NODE_CACHE), JAX on the CPU."""
    machines = {}
    for name in names:
        m = MachineB(base / name, hidden, server, token)
        m.env.update(
            CACHECTL_CACHE=cache,
            CACHECTL_NODE_CACHE=str(base / name / "node"),
            JAX_PLATFORMS="cpu",
        )
        machines[name] = m
    return machines
