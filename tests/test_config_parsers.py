"""One boolean parser for settings, and the XDG directories through platformdirs."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachectl.config import cache_dir, config_path, data_dir, env_flag, parse_bool
from cachectl.errors import BadInput


def test_parse_bool_and_env_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [parse_bool("X", v) for v in ("1", "TRUE", " yes ", "on", True)] == [True] * 5
    assert [parse_bool("X", v) for v in ("0", "false", "No", "off", "", False)] == [False] * 6
    with pytest.raises(BadInput, match="bad boolean 'maybe' for X: use true or false"):
        parse_bool("X", "maybe")
    monkeypatch.delenv("CACHECTL_T_FLAG", raising=False)
    assert env_flag("CACHECTL_T_FLAG") is None
    monkeypatch.setenv("CACHECTL_T_FLAG", "")
    assert env_flag("CACHECTL_T_FLAG") is None
    monkeypatch.setenv("CACHECTL_T_FLAG", "on")
    assert env_flag("CACHECTL_T_FLAG") is True


def test_xdg_directories_follow_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "d"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "f"))
    monkeypatch.delenv("CACHECTL_CONFIG", raising=False)
    assert data_dir() == tmp_path / "d" / "cachectl"
    assert cache_dir() == tmp_path / "c" / "cachectl"
    assert config_path() == tmp_path / "f" / "cachectl" / "config.toml"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data_dir() == tmp_path / "home" / ".local" / "share" / "cachectl"
