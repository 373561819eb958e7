"""The benchmarks' child processes import cachectl as an installed package does: with bytecode.

An inherited PYTHONDONTWRITEBYTECODE=1 once made every service process in bench/field.py
(and bench/hidden_model.py, which reuses it) compile cachectl's sources again, about 250 ms
that the hand-rolled floor, importing only installed packages, never paid.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import field  # noqa: E402


def test_service_environment_lets_python_use_bytecode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    env = field._env(tmp_path)
    (tmp_path / "mod.py").write_text("X = 1\n")
    out = subprocess.run(
        [sys.executable, "-c", "import sys, mod; print(sys.dont_write_bytecode)"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False"
    assert list((tmp_path / "__pycache__").glob("mod.*.pyc")) != []
