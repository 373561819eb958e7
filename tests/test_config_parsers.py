"""One boolean parser for settings, and the XDG directories through platformdirs."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachectl.core.config import cache_dir, config_path, data_dir, env_flag, parse_bool
from cachectl.core.errors import BadInput


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


def test_xdg_directories_follow_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
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


def test_server_settings_come_from_the_same_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """flags > CACHECTL_SERVER_* environment > defaults; the db from the CLI's keys (flag > env > file)."""
    from cachectl_server.config import DEFAULT_TELEMETRY_RETENTION_S, load_server_settings

    config = tmp_path / "config.toml"
    config.write_text('db = "sqlite:///from-file.db"\n')
    monkeypatch.setenv("CACHECTL_CONFIG", str(config))
    for name in (
        "DB",
        "SERVER_MAINTENANCE_INTERVAL",
        "SERVER_TELEMETRY_RETENTION",
        "SERVER_METRICS_PUBLIC",
        "SERVER_SECURE_COOKIES",
        "SERVER_MAX_UPLOAD",
    ):
        monkeypatch.delenv(f"CACHECTL_{name}", raising=False)
    s = load_server_settings()
    assert (s.db, s.maintenance_interval_s, s.telemetry_retention_s) == (
        "sqlite:///from-file.db",
        None,
        DEFAULT_TELEMETRY_RETENTION_S,
    )
    assert (s.metrics_public, s.secure_cookies) == (False, None)

    monkeypatch.setenv("CACHECTL_DB", "sqlite:///from-env.db")
    monkeypatch.setenv("CACHECTL_SERVER_MAINTENANCE_INTERVAL", "2h")
    monkeypatch.setenv("CACHECTL_SERVER_TELEMETRY_RETENTION", "off")
    monkeypatch.setenv("CACHECTL_SERVER_METRICS_PUBLIC", "yes")
    monkeypatch.setenv("CACHECTL_SERVER_SECURE_COOKIES", "")  # empty is unset
    monkeypatch.setenv("CACHECTL_SERVER_MAX_UPLOAD", "2MiB")
    s = load_server_settings()
    assert (s.db, s.maintenance_interval_s, s.telemetry_retention_s) == (
        "sqlite:///from-env.db",
        7200.0,
        None,
    )
    assert (s.metrics_public, s.secure_cookies, s.max_upload_bytes) == (True, None, 2 * 1024**2)

    s = load_server_settings(
        db="sqlite:///flag.db",
        host="0.0.0.0",
        flags={"maintenance_interval_s": "off", "telemetry_retention_s": "1d"},
    )
    assert (s.db, s.host, s.maintenance_interval_s, s.telemetry_retention_s) == (
        "sqlite:///flag.db",
        "0.0.0.0",
        None,
        86400.0,
    )

    monkeypatch.setenv("CACHECTL_SERVER_METRICS_PUBLIC", "maybe")
    with pytest.raises(BadInput, match="bad boolean 'maybe' for CACHECTL_SERVER_METRICS_PUBLIC"):
        load_server_settings()
