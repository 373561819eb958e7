"""`cachectl env` and `cachectl exec` with the index down or corrupt: warn, fall back, run the service."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

DEAD_PG = "postgresql+psycopg://nobody:x@127.0.0.1:9/none"


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cachectl", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def index_file() -> Path:
    return Path(os.environ["XDG_DATA_HOME"]) / "cachectl" / "index.db"


def variables(stdout: str) -> dict[str, str]:
    out = {}
    for line in stdout.splitlines():
        key, _, value = line.partition("=")
        out[key] = value
    return out


def test_env_with_the_index_down_uses_cachectl_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    proc = cli(
        "--db",
        DEAD_PG,
        "--cache",
        "prod",
        "env",
        "--format",
        "dotenv",
        env={"CACHECTL_ROOT": str(root)},
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("index unavailable") == 1 and "CACHECTL_ROOT" in proc.stderr
    assert variables(proc.stdout)["JAX_COMPILATION_CACHE_DIR"].startswith(str(root))
    assert (
        variables(proc.stdout)["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "1000000000.0"
    )  # read only


def test_a_corrupt_index_falls_back_to_the_namespace_last_resolved_here() -> None:
    first = cli("env", "--format", "dotenv")
    assert first.returncode == 0, first.stderr
    namespace = variables(first.stdout)["JAX_COMPILATION_CACHE_DIR"]
    index_file().write_bytes(b"this is not a database" * 100)
    again = cli("env", "--format", "dotenv")
    assert again.returncode == 0, again.stderr
    assert "Traceback" not in again.stderr and "index unavailable" in again.stderr
    assert variables(again.stdout)["JAX_COMPILATION_CACHE_DIR"] == namespace
    run = cli(
        "exec",
        "--",
        sys.executable,
        "-c",
        "import os; print(os.environ['JAX_COMPILATION_CACHE_DIR'])",
    )
    assert run.returncode == 0 and run.stdout.strip() == namespace, run.stderr


def test_exec_always_runs_the_command_even_when_nothing_is_known(tmp_path: Path) -> None:
    env_only = cli("--db", DEAD_PG, "--cache", "prod", "env")
    assert env_only.returncode == 2 and env_only.stdout == ""
    assert len(env_only.stderr.strip().splitlines()) == 1 and "CACHECTL_ROOT" in env_only.stderr
    marker = tmp_path / "ran"
    run = cli(
        "--db",
        DEAD_PG,
        "--cache",
        "prod",
        "exec",
        "--",
        sys.executable,
        "-c",
        f"import os, sys; open({str(marker)!r}, 'w').write(os.environ.get('JAX_COMPILATION_CACHE_DIR', '-')); sys.exit(7)",
    )
    assert run.returncode == 7, run.stderr  # the service's own exit code
    assert marker.read_text() == "-"
    assert "without a managed cache" in run.stderr and "Traceback" not in run.stderr
