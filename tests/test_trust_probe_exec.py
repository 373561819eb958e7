"""Issue 50, findings 4 and 5: the probe child and `cachectl exec`'s remembered environment under
hostile input. Real `cachectl exec` processes, real files, FIFOs and symlinks, and a second uid
(65534) that plants a file where an older version left the directory open to it.

The probe child reads the environment isolated from the working directory and its output
bounded; the remembered file lives owner-only, is checked field by field, is forgotten on any
damage, names only an environment the index recorded, is checked by the service's first
Python process even behind ``sh -c``, and never keeps a service from starting.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cachectl.core import probe
from cachectl.core.fingerprint import Environment
from cachectl.index import open_index

OTHER_UID = 65534
# What a service was told: its namespace, and the remembered file exec named ('-' for none).
TOLD = (
    "print(os.environ['JAX_COMPILATION_CACHE_DIR']); "
    "print(os.environ.get('CACHECTL_EXEC_REMEMBERED', '-'))"
)
SERVICE = "import os; " + TOLD  # the parent's side: no JAX needed in the service
JAX_SERVICE = "import os, jax, jax.numpy as jnp; jax.jit(lambda v: v * 2)(jnp.ones(3)); " + TOLD
CACHECTL = str(Path(sys.executable).parent / "cachectl")


def _state() -> Path:
    return Path(os.environ["XDG_STATE_HOME"]) / "cachectl"


def _memos() -> list[Path]:
    return sorted((_state() / "environments").glob("*.json"))


def run_cachectl(
    cwd: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """The installed `cachectl` script, as a user runs it (``python -m`` would put the working
    directory on the parent's own path)."""
    return subprocess.run(
        [CACHECTL, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
    )


def _exec(
    cwd: Path, *args: str, env: dict[str, str] | None = None, command: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    run = run_cachectl(
        cwd, "exec", *args, "--", *(command or [sys.executable, "-c", SERVICE]), env=env
    )
    assert "Traceback" not in run.stderr, run.stderr
    return run


def _served(run: subprocess.CompletedProcess[str]) -> tuple[str, str]:
    """The service's namespace and the remembered file it was told about ('-' for none)."""
    assert run.returncode == 0, run.stderr
    cache_dir, remembered = run.stdout.split()[-2:]
    return cache_dir, remembered


def _environments() -> list[str]:
    index = open_index(f"sqlite:///{Path(os.environ['XDG_DATA_HOME'])}/cachectl/index.db")
    try:
        return sorted(e.environment.digest for e in index.environment_stats("default"))
    finally:
        index.close()


# -- finding 4: the probe child ------------------------------------------------------------------


def test_the_probe_child_never_imports_from_the_working_directory(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    planted = tmp_path / "planted-code-ran"
    (work / "json.py").write_text(f"open({str(planted)!r}, 'w').write('ran')\n")
    run = _exec(work, "--fresh", command=["true"])
    assert run.returncode == 0, run.stderr
    assert "without a managed cache" not in run.stderr  # the environment was read
    assert not planted.exists()


def test_a_probe_child_that_prints_too_much_is_one_line_not_memory(tmp_path: Path) -> None:
    """A sitecustomize on the path that prints 256 MiB in the probe child: the parent stops at
    1 MiB, says so in one line, and the service still starts (as plain JAX would)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\nif b'cachectl.core.probe' in open('/proc/self/cmdline', 'rb').read():\n"
        "    block = b'x' * (1 << 20)\n"
        "    for _ in range(256):\n        os.write(1, block)\n"
    )
    measure = (
        "import resource, subprocess, sys; "
        f"p = subprocess.run([{CACHECTL!r}, 'exec', '--fresh', '--', 'true'], "
        "capture_output=True, text=True); "
        "sys.stderr.write(p.stderr); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, p.returncode)"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run(
        [sys.executable, "-c", measure], capture_output=True, text=True, env=env, timeout=120
    )
    peak_kib, returncode = (int(w) for w in run.stdout.split()[-2:])
    assert returncode == 0, run.stderr
    assert "printed more than 1 MiB" in run.stderr and "Traceback" not in run.stderr
    assert len([line for line in run.stderr.splitlines() if "cachectl" in line]) == 1
    assert peak_kib < 200 * 1024, peak_kib  # the 256 MiB printed never reached the parent


# -- finding 5: exec's remembered environment --------------------------------------------------


def _umask_exec(cwd: Path, umask: int) -> subprocess.CompletedProcess[str]:
    script = f'umask {umask:03o}; exec {CACHECTL} exec -- {sys.executable} -c "$SERVICE"'
    run = subprocess.run(
        ["sh", "-c", script],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "SERVICE": SERVICE},
        timeout=120,
    )
    assert "Traceback" not in run.stderr, run.stderr
    return run


def test_the_remembered_environment_is_owner_only_under_umask_000(tmp_path: Path) -> None:
    _served(_umask_exec(tmp_path, 0))
    (memo,) = _memos()
    for path, mode in (
        (memo.parent, 0o700),
        (memo, 0o600),
        (_state() / "last-namespaces.json", 0o600),
    ):
        assert stat.S_IMODE(path.stat().st_mode) == mode, (path, oct(path.stat().st_mode))
    _, remembered = _served(_umask_exec(tmp_path, 0))
    assert remembered == str(memo)


def _as_other_uid(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run by uid 65534, with the system's Python (this venv's lies under /root)."""
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 for the second uid")

    def drop() -> None:
        os.setgid(OTHER_UID)
        os.setuid(OTHER_UID)

    return subprocess.run(
        [python, "-I", "-c", code],
        capture_output=True,
        text=True,
        preexec_fn=drop,
        timeout=60,
        check=False,
    )


@pytest.fixture
def reachable_state(monkeypatch: pytest.MonkeyPatch) -> Path:
    """A state directory another uid can reach (pytest's own temporary tree is root's alone)."""
    top = Path(tempfile.mkdtemp(prefix="cachectl-state-"))
    top.chmod(0o711)
    monkeypatch.setenv("XDG_STATE_HOME", str(top))
    return top


def test_a_file_another_uid_planted_steers_nothing(tmp_path: Path, reachable_state: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to act as a second uid")
    cache_dir, _ = _served(_exec(tmp_path))
    (memo,) = _memos()
    # A directory only its owner may write: the other uid cannot plant anything.
    planted = json.loads(memo.read_text())
    planted["environment"]["device_count"] = 4
    plant = f"open({str(memo)!r} + '.new', 'w').write({json.dumps(planted)!r})"
    denied = _as_other_uid(plant)
    assert denied.returncode != 0 and "PermissionError" in denied.stderr
    # A directory an older version left open (0777 under umask 000): the other uid plants a file.
    memo.parent.chmod(0o777)
    _state().chmod(0o755)
    done = _as_other_uid(f"import os; {plant}; os.replace({str(memo)!r} + '.new', {str(memo)!r})")
    assert done.returncode == 0, done.stderr
    assert memo.stat().st_uid == OTHER_UID
    run = _exec(tmp_path)
    assert _served(run) == (cache_dir, "-")  # read afresh: the planted device count unused
    assert "remembered environments ignored" in run.stderr and "writable by others" in run.stderr
    # The owner closes the directory: the planted file (another uid's) is forgotten, not used.
    memo.parent.chmod(0o700)
    run = _exec(tmp_path)
    assert _served(run) == (cache_dir, "-")
    assert f"belongs to uid {OTHER_UID}" in run.stderr
    assert memo.stat().st_uid == os.geteuid()  # rewritten by the fresh read
    assert _served(_exec(tmp_path)) == (cache_dir, str(memo))


def _damage_cases(good: dict) -> list[tuple[str, object]]:
    """The issue's three (an int device_kind, a FIFO, a symlink to /dev/zero) and a huge file."""
    return [
        ("an int device_kind", {**good, "environment": {**good["environment"], "device_kind": 7}}),
        ("a FIFO", "fifo"),
        ("a symlink to /dev/zero", "zero"),
        ("a huge file", "huge"),
    ]


def test_a_damaged_remembered_file_is_forgotten_and_never_stops_the_service(tmp_path: Path) -> None:
    cache_dir, _ = _served(_exec(tmp_path))
    (memo,) = _memos()
    good = json.loads(memo.read_text())
    for name, damage in _damage_cases(good):
        memo.unlink()
        if damage == "fifo":
            os.mkfifo(memo, 0o600)
        elif damage == "zero":
            memo.symlink_to("/dev/zero")
        elif damage == "huge":
            memo.write_text(" " * (1 << 20) + json.dumps(good))
            memo.chmod(0o600)
        else:
            memo.write_text(json.dumps(damage))
            memo.chmod(0o600)
        run = _exec(tmp_path)
        assert _served(run) == (cache_dir, "-"), name
        assert "is forgotten" in run.stderr, (name, run.stderr)
        assert memo.is_file() and not memo.is_symlink(), name
        assert json.loads(memo.read_text()) == good, name  # rewritten by the fresh read


EDITS = (
    ("xla_flags", ["--xla_made_up_flag=1"]),
    ("compression", "zlib"),
    ("include_metadata_in_key", True),
    ("process_count", 3),
)


def test_an_edited_remembered_field_registers_nothing(tmp_path: Path) -> None:
    cache_dir, _ = _served(_exec(tmp_path))
    recorded = _environments()
    (memo,) = _memos()
    good = json.loads(memo.read_text())
    for field, value in EDITS:
        data = json.loads(json.dumps(good))
        if data["environment"][field] == value:
            value = "zstandard" if value == "zlib" else not value
        data["environment"][field] = value
        memo.write_text(json.dumps(data))
        run = _exec(tmp_path)
        assert _served(run) == (cache_dir, "-"), field
        assert "names an environment the index never recorded" in run.stderr, (field, run.stderr)
        assert _environments() == recorded, field  # no made-up environment registered
        assert json.loads(memo.read_text()) == good, field


def _a_recorded_but_wrong_memo(tmp_path: Path) -> tuple[Path, str]:
    """The memo of this state names another environment the index did record (two devices)."""
    cache_dir, _ = _served(_exec(tmp_path))
    (memo,) = _memos()
    _served(_exec(tmp_path, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}))
    (other,) = [m for m in _memos() if m != memo]
    data = json.loads(memo.read_text())
    data["environment"] = json.loads(other.read_text())["environment"]
    memo.write_text(json.dumps(data))
    return memo, cache_dir


def test_behind_sh_c_the_service_still_checks_every_field(tmp_path: Path) -> None:
    memo, cache_dir = _a_recorded_but_wrong_memo(tmp_path)
    shell = f'true; {sys.executable} -c "$SERVICE"'  # sh stays; python is its child
    run = run_cachectl(
        tmp_path, "exec", "--", "sh", "-c", shell, env={"SERVICE": JAX_SERVICE}, timeout=120
    )
    assert run.returncode == 0, run.stderr
    stale_dir, remembered = run.stdout.split()[-2:]
    assert remembered == str(memo) and stale_dir != cache_dir
    assert "not the one `cachectl exec` remembered" in run.stderr, run.stderr
    assert "device_count 2 -> 1" in run.stderr
    assert not memo.exists()
    assert _served(_exec(tmp_path)) == (cache_dir, "-")


def test_a_removed_working_directory_never_keeps_the_service_from_starting(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    script = (
        f'cd "{gone}" && rmdir "{gone}" && exec {CACHECTL} exec -- {sys.executable} -c "$SERVICE"'
    )
    for _ in range(2):  # read afresh, then remembered
        run = subprocess.run(
            ["sh", "-c", script],
            capture_output=True,
            text=True,
            env={**os.environ, "SERVICE": SERVICE},
            timeout=120,
        )
        assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
        assert "without a managed cache" not in run.stderr, run.stderr
        gone.mkdir()
    assert run.stdout.split()[-1] != "-"  # the second start used what the first remembered


def test_a_symlinked_memo_directory_is_ignored_and_its_files_kept(tmp_path: Path) -> None:
    mine = tmp_path / "my-json-files"
    mine.mkdir()
    for n in range(probe.MEMO_KEEP + 5):
        (mine / f"notes-{n}.json").write_text("{}")
    _state().mkdir(parents=True, exist_ok=True)
    (_state() / "environments").symlink_to(mine)
    run = _exec(tmp_path)
    _served(run)
    assert "not a directory (a symlink?)" in run.stderr
    assert len(list(mine.glob("*.json"))) == probe.MEMO_KEEP + 5


def test_pruning_removes_only_remembered_files(tmp_path: Path) -> None:
    _served(_exec(tmp_path))
    (memo,) = _memos()
    environment = probe.strict_environment(json.loads(memo.read_text())["environment"])
    for n in range(5):
        (memo.parent / f"notes-{n}.json").write_text("{}")
    for n in range(probe.MEMO_KEEP + 5):
        probe._write_memo(memo.parent / f"{n:064x}.json", f"{n:064x}", environment)
    names = [p.name for p in memo.parent.iterdir()]
    assert len([n for n in names if n.startswith("notes-")]) == 5
    assert len([n for n in names if probe._MEMO_NAME.fullmatch(n)]) == probe.MEMO_KEEP


# platform_version as JAX 0.10.2 with libtpu reported it on a TPU v5e (three lines).
TPU_PLATFORM_VERSION = (
    "PJRT C API\nTFRT TPU v5 lite\nBuilt on Jun 17 2026 11:08:48 (1781719728) cl/933746096"
)


def test_a_tpu_environment_is_remembered_and_a_control_character_is_not(tmp_path: Path) -> None:
    """libtpu's platform_version spans lines: a memo holding it is read back as written (on the
    chip every `cachectl exec` read the environment afresh while line breaks were refused),
    while any other control character in it still makes the memo forgotten."""
    tpu = {  # the rest of that chip's environment too
        "jax_version": "0.10.2",
        "jaxlib_version": "0.10.2",
        "backend": "tpu",
        "platform_version": TPU_PLATFORM_VERSION,
        "device_kind": "TPU v5 lite",
        "device_count": 1,
        "process_count": 1,
        "topology": "02ec453b5b091aba",
        "xla_flags": ["--xla_tpu_use_enhanced_launch_barrier=true"],
        "compression": "zstandard",
        "enable_xla_caches": "none",
        "include_metadata_in_key": False,
    }
    memo = tmp_path / f"{'a' * 64}.json"
    probe._write_memo(memo, "a" * 64, Environment.from_dict(tpu))
    environment, reason = probe._read_memo(memo, "a" * 64)
    assert reason is None and environment is not None
    assert environment.platform_version == TPU_PLATFORM_VERSION
    for bad in ("\x1b[2J", "\r", "\t", "\x00"):
        with pytest.raises(ValueError, match="field platform_version"):
            probe.strict_environment({**tpu, "platform_version": f"PJRT C API{bad}v5"})


def test_verify_deep_and_warm_check_children_never_import_from_the_working_directory(
    tmp_path: Path,
) -> None:
    """Issue 62 finding 5: the children of `verify --deep` and `warm-check` (coverage, then the
    calls) start isolated as the probe does, so a ``json.py`` in the working directory never
    runs; the manifest's own modules still import, and both commands pass."""
    from support.warming import tiny

    manifest = tiny(tmp_path)
    warm = run_cachectl(tmp_path, "warm", str(manifest), "--json", timeout=600)
    assert warm.returncode == 0, warm.stderr
    work = tmp_path / "work"
    work.mkdir()
    planted = tmp_path / "planted-code-ran"
    (work / "json.py").write_text(f"open({str(planted)!r}, 'w').write('ran')\n")
    check = run_cachectl(work, "warm-check", str(manifest), timeout=600)
    assert check.returncode == 0, check.stdout + check.stderr
    assert not planted.exists(), "warm-check"
    deep = run_cachectl(work, "verify", "--deep", timeout=600)
    assert deep.returncode == 0, deep.stdout + deep.stderr
    assert not planted.exists(), "verify --deep"
