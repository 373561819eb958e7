"""`cachectl exec` remembers the environment a child read, so a service's start opens the
accelerator once, and never trusts a remembered environment its own runtime contradicts.

On a TPU every open of the chip costs about 10 s, and exec's child read doubled a
service's start. These tests run exec under test_one_process_accelerator's one-holder rule,
which also logs every process that opened the "accelerator": the reading child is one of
them, the service the other.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from support.infra import run_cachectl  # noqa: E402
from support.one_holder import one_holder_env as _env

SERVICE = (
    "import os, jax, jax.numpy as jnp; jax.jit(lambda v: v * 2)(jnp.ones(3)); "
    "print(os.environ['JAX_COMPILATION_CACHE_DIR']); "
    "print(os.environ.get('CACHECTL_EXEC_REMEMBERED', '-'))"
)


def _exec(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[list[str], list[str], str]:
    """exec's service; (its two printed lines, the processes that opened a backend, stderr)."""
    out = tmp_path.parent / f"{tmp_path.name}-out"  # off sys.path: its mtime is in the key
    out.mkdir(exist_ok=True)
    log = out / "opened.log"
    log.unlink(missing_ok=True)
    report = out / "parent.json"
    variables = {**_env(tmp_path, report), "ONE_HOLDER_LOG": str(log), **(env or {})}
    run = run_cachectl(tmp_path, "exec", *args, "--", sys.executable, "-c", SERVICE, env=variables)
    assert run.returncode == 0, run.stderr
    assert json.loads(report.read_text()) == []  # exec itself never opens a backend
    opened = log.read_text().splitlines() if log.exists() else []
    return run.stdout.split(), opened, run.stderr


def _memos(state: Path) -> list[Path]:
    return sorted((state / "cachectl" / "environments").glob("*.json"))


def _reader(opened: list[str]) -> list[str]:
    return [p for p in opened if "cachectl.core.probe" in p]


def test_exec_opens_the_accelerator_once_when_nothing_changed(tmp_path: Path) -> None:
    state = Path(os.environ["XDG_STATE_HOME"])
    (cache_dir, remembered), opened, _ = _exec(tmp_path)
    assert remembered == "-"
    assert len(_reader(opened)) == 1 and len(opened) == 2  # the reading child, the service
    (memo,) = _memos(state)

    (again_dir, remembered), opened, stderr = _exec(tmp_path)
    assert (again_dir, remembered) == (cache_dir, str(memo))
    assert _reader(opened) == [] and len(opened) == 1  # the service alone
    assert "remembered" not in stderr  # its runtime matched

    _, opened, _ = _exec(tmp_path, "--fresh")
    assert len(_reader(opened)) == 1


def test_a_change_the_reading_depends_on_reads_afresh(tmp_path: Path) -> None:
    _exec(tmp_path)
    _, opened, _ = _exec(tmp_path, env={"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"})
    assert len(_reader(opened)) == 1  # a variable XLA reads
    _, opened, _ = _exec(tmp_path, env={"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"})
    assert _reader(opened) == []
    (tmp_path / "site" / "__pycache__").mkdir(exist_ok=True)  # bytecode: not an install
    (tmp_path / "site" / "notes.txt").write_text("")
    _, opened, _ = _exec(tmp_path, env={"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"})
    assert _reader(opened) == []
    (tmp_path / "site" / "newly_installed-1.0.dist-info").mkdir()  # a package installed
    _, opened, _ = _exec(tmp_path, env={"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"})
    assert len(_reader(opened)) == 1


def test_a_remembered_runtime_the_service_contradicts_is_forgotten(tmp_path: Path) -> None:
    state = Path(os.environ["XDG_STATE_HOME"])
    (cache_dir, _), _, _ = _exec(tmp_path)
    (memo,) = _memos(state)
    # As if the devices changed within this boot: the memo names another environment the index
    # recorded (one it never recorded is refused before the service starts: test_trust_probe_exec).
    _exec(tmp_path, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    (other,) = [m for m in _memos(state) if m != memo]
    data = json.loads(memo.read_text())
    data["environment"] = json.loads(other.read_text())["environment"]
    memo.write_text(json.dumps(data))

    (stale_dir, remembered), opened, stderr = _exec(tmp_path)
    assert remembered == str(memo) and _reader(opened) == []
    assert stale_dir != cache_dir  # the namespace it named, as the warning says
    assert "not the one `cachectl exec` remembered (device_count 8 -> 1; topology " in stderr
    assert not memo.exists()

    (fresh_dir, remembered), opened, _ = _exec(tmp_path)
    assert (fresh_dir, remembered) == (cache_dir, "-") and len(_reader(opened)) == 1


def test_a_damaged_or_foreign_remembered_file_is_read_afresh(tmp_path: Path) -> None:
    state = Path(os.environ["XDG_STATE_HOME"])
    (cache_dir, _), _, _ = _exec(tmp_path)
    (memo,) = _memos(state)
    good = memo.read_text()
    for damaged in ("{not json", json.dumps({**json.loads(good), "key": "0" * 64}), "[]"):
        memo.write_text(damaged)
        (served_dir, remembered), opened, stderr = _exec(tmp_path)
        assert (served_dir, remembered) == (cache_dir, "-"), damaged
        assert len(_reader(opened)) == 1 and "Traceback" not in stderr
        assert json.loads(memo.read_text()) == json.loads(good)  # rewritten by the fresh read


def test_no_telemetry_still_checks_a_remembered_environment(tmp_path: Path) -> None:
    _exec(tmp_path, "--no-telemetry")
    words, opened, _ = _exec(tmp_path, "--no-telemetry")
    assert words[1] != "-" and _reader(opened) == []
    run = run_cachectl(
        tmp_path, "exec", "--no-telemetry", "--", "sh", "-c", "echo ${CACHECTL_EXEC_TELEMETRY:-off}"
    )
    assert run.stdout.strip() == "off", run.stderr


def test_nothing_is_remembered_where_the_boot_cannot_be_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a boot id a reboot (new devices, drivers) could not be told: read every time."""
    from cachectl.core import probe

    assert probe.memo_key() is not None
    monkeypatch.setattr(probe, "BOOT_ID", tmp_path / "no-boot-id")
    assert probe.memo_key() is None
    for _ in range(2):
        probed = probe.remembered_environment()
        assert (probed.remembered, probed.memo) == (False, None)
        assert probed.environment.backend == "cpu"
    assert _memos(Path(os.environ["XDG_STATE_HOME"])) == []


def test_the_remembered_files_are_bounded(tmp_path: Path) -> None:
    from cachectl.core import probe

    environment = probe.Environment.from_dict(
        json.loads(_memo_after_one_exec(tmp_path).read_text())["environment"]
    )
    for n in range(probe.MEMO_KEEP + 5):
        probe._write_memo(probe.memo_dir() / f"{n:064x}.json", f"{n:064x}", environment)
    assert len(_memos(Path(os.environ["XDG_STATE_HOME"]))) == probe.MEMO_KEEP


def _memo_after_one_exec(tmp_path: Path) -> Path:
    _exec(tmp_path)
    (memo,) = _memos(Path(os.environ["XDG_STATE_HOME"]))
    return memo


def test_only_the_service_exec_started_checks_not_its_helpers(tmp_path: Path) -> None:
    """A helper the service starts with other devices is not a contradiction."""
    helper = (
        "import jax, jax.numpy as jnp; jax.jit(lambda v: v - 1)(jnp.ones(2)); "
        "print('helper devices', len(jax.devices()))"
    )
    service = (
        "import os, subprocess, sys, jax, jax.numpy as jnp; jax.jit(lambda v: v * 3)(jnp.ones(3)); "
        "print('remembered', os.environ.get('CACHECTL_EXEC_REMEMBERED', '-'), flush=True); "
        "env = {**os.environ, 'XLA_FLAGS': '--xla_force_host_platform_device_count=2'}; "
        "env['ONE_HOLDER_LOCK'] += '.helper'; "  # a device of its own, as a helper would have
        f"sys.exit(subprocess.run([sys.executable, '-c', {helper!r}], env=env).returncode)"
    )
    _exec(tmp_path)
    state = Path(os.environ["XDG_STATE_HOME"])
    (memo,) = _memos(state)
    run = run_cachectl(tmp_path, "exec", "--", sys.executable, "-c", service, env=_env(tmp_path))
    assert run.returncode == 0, run.stderr
    assert "helper devices 2" in run.stdout
    assert f"remembered {memo}" in run.stdout  # the service used it, and so did the helper
    assert "remembered" not in run.stderr
    assert memo.exists()
