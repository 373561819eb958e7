"""Issue 50, findings 7 and 8: what cachectl creates is never world-writable, whatever the umask;
`cachectl doctor` checks every path it keeps; a read-only or full disk, and a uid with no name,
cost one line and an exit code, never a traceback. Real `cachectl` processes under umask 000, a
real JAX warm, real tmpfs mounts (read-only, full) and a real second uid with no passwd entry.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.warming import tiny

CACHECTL = str(Path(sys.executable).parent / "cachectl")
NO_PASSWD_UID = 54321


def _home(top: Path) -> dict[str, str]:
    env = {}
    for var, sub in (
        ("XDG_DATA_HOME", "data"),
        ("XDG_CACHE_HOME", "cache"),
        ("XDG_CONFIG_HOME", "config"),
        ("XDG_STATE_HOME", "state"),
    ):
        env[var] = str(top / sub)
    return env


def _cachectl(
    cwd: Path, *args: str, env: dict[str, str], umask: int = 0o000, code: int | None = 0
) -> subprocess.CompletedProcess[str]:
    """``cachectl ARGS`` under ``umask`` (000: some containers and CI runners run so)."""
    run = subprocess.run(
        ["sh", "-c", f'umask {umask:03o}; exec "$@"', "sh", CACHECTL, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
        check=False,
    )
    if code is not None:
        assert run.returncode == code, (args, run.returncode, run.stdout, run.stderr)
    assert "Traceback" not in run.stderr, run.stderr
    return run


def _world_writable(top: Path) -> list[str]:
    found = []
    for path in [top, *top.rglob("*")]:
        st = path.lstat()
        if not stat.S_ISLNK(st.st_mode) and st.st_mode & stat.S_IWOTH:
            found.append(f"{path.relative_to(top)} {stat.S_IMODE(st.st_mode):o}")
    return found


def test_nothing_cachectl_creates_under_umask_000_is_world_writable(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    manifest = tiny(work)
    made, installed = tmp_path / "made", tmp_path / "installed"
    a, b = _home(made), _home(installed)
    _cachectl(work, "warm", str(manifest), env=a)
    _cachectl(work, "key", "generate", str(made / "keys" / "ci.key"), env=a)
    bundle = made / "cache.tar.zst"
    _cachectl(work, "bundle", "create", "--manifest", str(manifest), "-o", str(bundle), env=a)
    _cachectl(work, "bundle", "install", str(bundle), env=b)
    _cachectl(work, "exec", "--", "true", env=a)
    _cachectl(work, "exec", "--", "true", env=b)
    assert (made / "keys" / "ci.key.pub").is_file()
    assert list((made / "cache").rglob("*-cache")) and list((installed / "cache").rglob("*-cache"))
    assert list((made / "state").rglob("*.json")) and list((made / "data").rglob("index.db"))
    assert _world_writable(made) == [] and _world_writable(installed) == []


def test_exec_keeps_the_world_write_bit_off_for_its_service(tmp_path: Path) -> None:
    run = _cachectl(tmp_path, "exec", "--", "sh", "-c", "umask", env=_home(tmp_path / "h"))
    assert run.stdout.strip() == "0002"


# A writing activate() service; the minimum compile time is dropped so JAX writes its programs.
WRITING_SERVICE = """
import jax, jax.numpy as jnp
import cachectl
cachectl.activate(readonly=False)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.ones(3))
"""


def test_an_activate_service_under_umask_000_leaves_nothing_world_writable(
    tmp_path: Path,
) -> None:
    """Issue 62 finding 7: a service's own process (not a cachectl command, which sets its umask)
    writes JAX entries, its index and its state; none is world-writable, and one warning names
    the umask."""
    home = tmp_path / "h"
    run = subprocess.run(
        ["sh", "-c", 'umask 000; exec "$@"', "sh", sys.executable, "-c", WRITING_SERVICE],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, **_home(home), "JAX_PLATFORMS": "cpu"},
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("runs under umask 000") == 1, run.stderr
    assert list((home / "cache").rglob("*-cache")) and list((home / "state").rglob("*.txt"))
    assert _world_writable(home) == []


def test_doctor_checks_every_path_cachectl_keeps(tmp_path: Path) -> None:
    home = _home(tmp_path / "h")
    _cachectl(tmp_path, "exec", "--", "true", env=home, umask=0o022)
    ok = _cachectl(tmp_path, "doctor", env=home, umask=0o022, code=None)
    assert "world-writable path(s) cachectl keeps" not in ok.stdout + ok.stderr
    index = Path(home["XDG_DATA_HOME"]) / "cachectl" / "index.db"
    memo_dir = Path(home["XDG_STATE_HOME"]) / "cachectl" / "environments"
    for path in (index, index.parent, memo_dir):
        path.chmod(stat.S_IMODE(path.stat().st_mode) | 0o002)
    run = _cachectl(tmp_path, "doctor", env=home, umask=0o022, code=1)
    assert "world-writable path(s) cachectl keeps" in run.stdout, run.stdout


@contextlib.contextmanager
def _tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_read_only_storage_and_a_full_disk_cost_one_line(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    manifest = tiny(work)
    home = _home(tmp_path / "h")
    with _tmpfs(Path(home["XDG_CACHE_HOME"]), "64m") as cache:
        _cachectl(work, "warm", str(manifest), env=home, umask=0o022)
        bundle = tmp_path / "cache.tar.zst"
        _cachectl(
            work, "bundle", "create", "--manifest", str(manifest), "-o", str(bundle), env=home
        )
        before = sorted(str(p) for p in cache.rglob("*"))
        subprocess.run(["mount", "-o", "remount,ro", str(cache)], check=True)
        time.sleep(1.5)  # every entry older than --older-than 1s
        for args in (("prune", "--older-than", "1s"), ("gc", "--max-size", "1")):
            run = _cachectl(work, *args, env=home, umask=0o022, code=None)
            assert run.returncode == 4, (args, run.returncode, run.stdout, run.stderr)
            (line,) = [x for x in run.stderr.splitlines() if x.startswith("cachectl: error:")]
            assert "Read-only file system" in line, run.stderr
        assert sorted(str(p) for p in cache.rglob("*")) == before
    full = _home(tmp_path / "full")
    with _tmpfs(Path(full["XDG_CACHE_HOME"]), "16k"):
        run = _cachectl(work, "bundle", "install", str(bundle), env=full, umask=0o022, code=None)
        assert run.returncode == 1, (run.returncode, run.stdout, run.stderr)
        (line,) = [x for x in run.stderr.splitlines() if x.startswith("cachectl: error:")]
        assert "No space left on device" in line, run.stderr


def test_a_uid_with_no_name_gets_a_clear_answer(tmp_path: Path) -> None:
    """No passwd entry and no USER: a cache with writers refuses in one line (exit 4)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to become a uid with no passwd entry")
    top = Path(tempfile.mkdtemp(prefix="cachectl-nouser-"))
    try:
        home = _home(top)
        for path in home.values():
            Path(path).mkdir(parents=True)
        env = {
            k: v for k, v in os.environ.items() if k not in ("USER", "LOGNAME", "LNAME", "USERNAME")
        }
        env.update(home)
        root = top / "team"
        add = subprocess.run(
            [CACHECTL, "cache", "add", "team", str(root), "--writers", "alice"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
        assert add.returncode == 0, add.stderr
        for path in (top, *top.rglob("*")):
            os.lchown(path, NO_PASSWD_UID, NO_PASSWD_UID)

        def become() -> None:
            os.setgid(NO_PASSWD_UID)
            os.setuid(NO_PASSWD_UID)

        # The system's Python with this venv's packages: the venv's interpreter lies under /root.
        python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
        if python is None:
            pytest.skip("no system python3 for the second uid")
        site_dir = sysconfig.get_paths()["purelib"]
        code = (
            f"import site, sys; site.addsitedir({site_dir!r}); "
            "sys.argv = ['cachectl', '--cache', 'team', 'prune', '--older-than', '1s']; "
            "from cachectl.cli import main; main()"
        )
        run = subprocess.run(
            [python, "-c", code],
            cwd=top,
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            preexec_fn=become,
            check=False,
        )
        assert run.returncode == 4 and "Traceback" not in run.stderr, (run.returncode, run.stderr)
        assert f"user 'uid {NO_PASSWD_UID}' may not" in run.stderr, run.stderr
    finally:
        subprocess.run(["rm", "-rf", str(top)], check=False)
