"""Settings: flags > CACHECTL_* environment > config file > XDG defaults.

The embedded default needs no setup: an SQLite index under the XDG data dir
and a cache named ``default`` under the XDG cache dir, created on first use.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import platformdirs

from cachectl.errors import BadInput

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_CACHE = "default"
ENV_PREFIX = "CACHECTL_"
_FILE_KEYS = {"db", "cache", "server", "token_file", "root", "readonly", "default_root"}


# The XDG base directories (XDG_DATA_HOME, XDG_CACHE_HOME, XDG_CONFIG_HOME), read at each call.
def data_dir() -> Path:
    return Path(platformdirs.user_data_dir("cachectl", appauthor=False))


def cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir("cachectl", appauthor=False))


def config_path() -> Path:
    explicit = os.environ.get(ENV_PREFIX + "CONFIG")
    return Path(explicit) if explicit else Path(platformdirs.user_config_dir("cachectl", appauthor=False)) / "config.toml"


@dataclass(frozen=True)
class Settings:
    db: str
    cache: str
    default_root: str
    root: str | None = None
    server: str | None = None
    token: str | None = None
    readonly: bool | None = None
    db_is_default: bool = False
    config_file: str | None = None

    def with_overrides(self, **overrides: Any) -> Settings:
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def parse_bool(name: str, value: Any) -> bool:
    """The one boolean parser for settings (CLI, service and server): empty is false."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in TRUE_WORDS:
        return True
    if text in FALSE_WORDS or text == "":
        return False
    raise BadInput(f"bad boolean {value!r} for {name}: use true or false")


def env_flag(name: str) -> bool | None:
    """A boolean environment variable; None when it is unset or empty."""
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    return parse_bool(name, value)


def _read_file(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise BadInput(f"config file {path} is not valid TOML: {exc}") from exc
    unknown = set(data) - _FILE_KEYS
    if unknown:
        raise BadInput(f"config file {path}: unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(_FILE_KEYS))}")
    return data


def load_settings(*, db: str | None = None, cache: str | None = None, server: str | None = None,
                  token: str | None = None, root: str | None = None,
                  readonly: bool | None = None) -> Settings:
    """Resolve settings in precedence order: arguments, environment, file, defaults."""
    path = config_path()
    file_values = _read_file(path)
    env = os.environ

    def pick(name: str, arg: Any) -> Any:
        if arg is not None:
            return arg
        if env.get(ENV_PREFIX + name.upper()):
            return env[ENV_PREFIX + name.upper()]
        return file_values.get(name)

    default_db = f"sqlite:///{data_dir() / 'index.db'}"
    chosen_db = pick("db", db)
    token_value = pick("token", token)
    if token_value is None and file_values.get("token_file"):
        token_path = Path(file_values["token_file"]).expanduser()
        try:
            token_value = token_path.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
            raise BadInput(f"cannot read token_file {str(token_path)!r} (from {path}): {reason}") from None
    ro = pick("readonly", readonly)
    return Settings(
        db=chosen_db or default_db,
        db_is_default=not chosen_db,
        cache=pick("cache", cache) or DEFAULT_CACHE,
        default_root=str(file_values.get("default_root") or cache_dir() / DEFAULT_CACHE),
        root=pick("root", root),
        server=pick("server", server),
        token=token_value,
        readonly=None if ro is None else parse_bool("CACHECTL_READONLY", ro),
        config_file=str(path) if file_values else None,
    )
