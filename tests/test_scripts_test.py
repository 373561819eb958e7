"""scripts/test stops what it started: the real script, in a copy of the checkout's root.

The copy has its own .test-registry and its own runs directory (TMPDIR), so the registry it
starts is its own and no other scripts/test (this suite's own, say) counts as running. Its
.venv is this one (a link; the stamp says it is installed), and its pytest only prints its
version: what is checked is the daemon's life, not a suite.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    not all(shutil.which(c) for c in ("docker-registry", "htpasswd", "openssl", "curl")),
    reason="needs Debian's docker-registry, htpasswd, openssl and curl (scripts/test installs them)",
)


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    """The copy; a registry it leaves behind (a failing run) is stopped here."""
    root = _root(tmp_path)
    yield root
    pid_file = root / ".test-registry" / "pid"
    if pid_file.exists() and _alive(pid := int(pid_file.read_text())):
        os.kill(pid, signal.SIGTERM)


def _root(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    shutil.copy2(REPO / "scripts" / "test", root / "scripts" / "test")
    shutil.copy2(REPO / "scripts" / "installed_matches.py", root / "scripts")
    shutil.copy2(REPO / "pyproject.toml", root / "pyproject.toml")
    venv = Path(sys.prefix)
    (root / ".venv").symlink_to(venv)
    stamp = venv / ".cachectl-installed"
    if (
        not stamp.exists()
        or stamp.read_text() != ""
        or stamp.stat().st_mtime <= (root / "pyproject.toml").stat().st_mtime
    ):
        pytest.skip("this venv carries no scripts/test stamp: the copy would run pip")
    return root


def _run(root: Path, tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CACHECTL_TEST_OCI")}
    runs = tmp_path / "runs-tmp"
    runs.mkdir(exist_ok=True)
    base.update(
        TMPDIR=str(runs),
        CACHECTL_TEST_NO_PG="1",
        CACHECTL_TEST_NO_CHROMIUM="1",
        CACHECTL_TEST_NO_NGINX="1",
        CACHECTL_TEST_NO_AZURITE="1",
        CACHECTL_TEST_REFERRERS_REGISTRY="/bin/true",
        CACHECTL_TEST_WORKERS="1",
        **env,
    )
    return subprocess.run(
        ["bash", str(root / "scripts" / "test"), *args],
        cwd=root,
        env=base,
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text()


def test_the_registry_it_started_is_stopped_at_exit_kept_on_request_and_stopped_by_stop(
    root: Path, tmp_path: Path
) -> None:
    pid_file = root / ".test-registry" / "pid"

    done = _run(root, tmp_path, "--version")
    assert done.returncode == 0, done.stderr
    assert "starting the OCI registry" in done.stderr, done.stderr
    assert "stopped the OCI registry it started" in done.stderr, done.stderr
    assert not pid_file.exists()

    kept = _run(root, tmp_path, "--version", CACHECTL_TEST_KEEP_DAEMONS="1")
    assert kept.returncode == 0, kept.stderr
    assert "left running (CACHECTL_TEST_KEEP_DAEMONS)" in kept.stderr, kept.stderr
    assert "scripts/test --stop" in kept.stderr
    pid = int(pid_file.read_text())
    assert _alive(pid)

    # A run that finds it running reuses it and leaves it: it did not start it.
    reused = _run(root, tmp_path, "--version")
    assert reused.returncode == 0, reused.stderr
    assert "starting the OCI registry" not in reused.stderr and _alive(pid), reused.stderr

    stopped = _run(root, tmp_path, "--stop")
    assert stopped.returncode == 0, stopped.stderr
    assert f"stopped the OCI registry it started (pid {pid})" in stopped.stderr, stopped.stderr
    assert not _alive(pid) and not pid_file.exists()
    assert "pip" not in stopped.stderr  # --stop installs nothing
