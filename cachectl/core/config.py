"""Settings: flags > CACHECTL_* environment > config file > XDG defaults.

The embedded default needs no setup: an SQLite index under the XDG data dir
and a cache named ``default`` under the XDG cache dir, created on first use.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import platformdirs

from cachectl.core.errors import BadInput
from cachectl.core.units import parse_size

DEFAULT_CACHE = "default"

# warm's choices, here rather than in cachectl.warm so that `cachectl warm --help` builds its
# options without importing the warm stack (JAX, pydantic, SQLAlchemy).
WARM_EXECUTORS = ("thread", "process")
# Chosen from bench/warm.py (BENCHMARKS.md, "Warm"): threads beat processes on CPU.
DEFAULT_WARM_EXECUTOR = "thread"
# The most buckets one manifest may expand to (the product of each function's axes);
# `warm --max-buckets N` raises it through the environment, so warm's worker processes
# (which load the manifest again) apply the same limit.
DEFAULT_MAX_BUCKETS = 10_000
MAX_BUCKETS_ENV = "CACHECTL_MAX_BUCKETS"

# Other values the commands' options show (envvars, defaults, choices), here for the same reason:
# `cachectl CMD --help` builds every command's options without importing the library behind it.
# The library modules named import them from here.
# cachectl.trust.signing: the private key writers sign with when --sign-key is not given.
SIGNING_KEY_ENV = "CACHECTL_SIGNING_KEY"
# cachectl.trust.gate: a service reads a cache nothing can verify only with this opt-in.
RUN_UNVERIFIED_ENV = "CACHECTL_RUN_UNVERIFIED_CODE"
# cachectl.core.records (cachectl.trust.tokens): a server token's roles, least to most privileged.
TOKEN_ROLES = ("reader", "writer", "admin")
# cachectl.lifecycle.gc: the eviction orders.
GC_POLICIES = ("lru", "cost")
# cachectl.storage.store: paths per storage delete call (S3's DeleteObjects takes at most 1000).
DELETE_BATCH = 1000
# cachectl.service.mirror: parallel copies of pull and push.
MIRROR_WORKERS = 8
# cachectl.trust.caches: a cache's service_writes policy.
SERVICE_WRITES = ("allow", "deny")
# `cachectl serve`'s listening address (SERVER_HOST is also cachectl_server.config's default).
SERVER_HOST = "127.0.0.1"
SERVER_PORT = 8700


# Every storage request cachectl makes, and JAX's own reads and writes of an object-store cache
# (cachectl hands JAX the same bounds): seconds to connect, seconds of silence while a response
# is awaited or read, seconds for one whole request (a body trickled byte by byte ends here). s3fs
# repeats a request that timed out (its own retries); a cachectl command's own check of a bucket
# (`cache add`) ends after the whole bound, however many tries. Environment only: a service
# has no flags, and the bound is the process's, not a cache's.
STORAGE_CONNECT_TIMEOUT_ENV = "CACHECTL_STORAGE_CONNECT_TIMEOUT"
STORAGE_READ_TIMEOUT_ENV = "CACHECTL_STORAGE_READ_TIMEOUT"
STORAGE_TIMEOUT_ENV = "CACHECTL_STORAGE_TIMEOUT"
DEFAULT_STORAGE_CONNECT_TIMEOUT_S = 3.0
DEFAULT_STORAGE_READ_TIMEOUT_S = 10.0
DEFAULT_STORAGE_TIMEOUT_S = 60.0
# After requests to a storage endpoint timed out (JAX's: once; cachectl's own: twice in a row),
# the next ones there fail at once for this long (storage/bounded_http.py): a dead endpoint costs
# a service or a command a bound or two, not one per try of every operation.
STORAGE_PAUSE_S = 60.0
JAX_PAUSE_AFTER = 1
COMMAND_PAUSE_AFTER = 2


@dataclass(frozen=True)
class StorageBounds:
    """How long one storage request may wait (seconds): to connect, in silence, in all."""

    connect_s: float = DEFAULT_STORAGE_CONNECT_TIMEOUT_S
    read_s: float = DEFAULT_STORAGE_READ_TIMEOUT_S
    total_s: float = DEFAULT_STORAGE_TIMEOUT_S


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise BadInput(f"bad {name}={raw!r}: give a positive number of seconds, e.g. {default:g}")
    return value


def storage_bounds() -> StorageBounds:
    """The storage bounds this process applies (CACHECTL_STORAGE_*TIMEOUT, read at each call)."""
    return StorageBounds(
        _seconds(STORAGE_CONNECT_TIMEOUT_ENV, DEFAULT_STORAGE_CONNECT_TIMEOUT_S),
        _seconds(STORAGE_READ_TIMEOUT_ENV, DEFAULT_STORAGE_READ_TIMEOUT_S),
        _seconds(STORAGE_TIMEOUT_ENV, DEFAULT_STORAGE_TIMEOUT_S),
    )


def default_jobs() -> int:
    """The cores this process may use: warm's default --jobs."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


ENV_PREFIX = "CACHECTL_"


# The XDG base directories (XDG_DATA_HOME, XDG_CACHE_HOME, XDG_STATE_HOME, XDG_CONFIG_HOME),
# read at each call.
def distributed_requested(flag: bool | None) -> bool:
    """warm's --distributed, --no-distributed, or auto: a coordinator address in the environment."""
    if flag is not None:
        return flag
    return bool(os.environ.get("JAX_COORDINATOR_ADDRESS", "").strip())


def data_dir() -> Path:
    return Path(platformdirs.user_data_dir("cachectl", appauthor=False))


def cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir("cachectl", appauthor=False))


def state_dir() -> Path:
    return Path(platformdirs.user_state_dir("cachectl", appauthor=False))


def config_path() -> Path:
    explicit = os.environ.get(ENV_PREFIX + "CONFIG")
    return (
        Path(explicit)
        if explicit
        else Path(platformdirs.user_config_dir("cachectl", appauthor=False)) / "config.toml"
    )


@dataclass(frozen=True)
class Settings:
    db: str
    cache: str
    default_root: str
    root: str | None = None
    server: str | None = None
    token: str | None = None
    readonly: bool | None = None
    # Public keys a service trusts on its own (CACHECTL_TRUST): checked with no index (signing.py).
    trust: tuple[str, ...] = ()
    db_is_default: bool = False
    config_file: str | None = None
    # The node-local tier in front of a remote (storage/node_tier.py): its directory ("off": none)
    # and its size limit in bytes (CACHECTL_NODE_CACHE, CACHECTL_NODE_CACHE_SIZE).
    node_cache: str | None = None
    node_cache_size: int | None = None

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


def parse_list(value: Any) -> tuple[str, ...]:
    """A list setting: a list (config file) or text split at commas and whitespace."""
    items = value if isinstance(value, (list, tuple)) else str(value).replace(",", " ").split()
    return tuple(str(v).strip() for v in items if str(v).strip())


def env_flag(name: str) -> bool | None:
    """A boolean environment variable; None when it is unset or empty."""
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    return parse_bool(name, value)


def _read_file(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    import tomllib  # only where a config file exists: a service's start seldom has one

    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise BadInput(f"config file {path} is not valid TOML: {exc}") from exc
    unknown = set(data) - _FILE_KEYS
    if unknown:
        raise BadInput(
            f"config file {path}: unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(_FILE_KEYS))}"
        )
    return data


@dataclass(frozen=True)
class Key:
    """One setting: its field, its environment variable, how a value becomes the field's, and
    whether the config file may set it. The CLI's keys are ``KEYS``; the server adds its own."""

    field: str
    env: str
    parse: Callable[[str, Any], Any] = lambda _name, value: value
    in_file: bool = False


def resolve(
    keys: Iterable[Key], flags: Mapping[str, Any], file_values: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The one precedence: flag > environment > config file, per key; a key set nowhere is left
    out (its dataclass default applies). An empty environment variable counts as unset."""
    values: dict[str, Any] = {}
    for key in keys:
        raw = flags.get(key.field)
        if raw is None and os.environ.get(key.env):
            raw = os.environ[key.env]
        if raw is None and key.in_file and file_values:
            raw = file_values.get(key.field)
        if raw is not None:
            values[key.field] = key.parse(key.env, raw)
    return values


def _parse_size(name: str, value: Any) -> int:
    try:
        return parse_size(value)
    except BadInput as exc:
        raise BadInput(f"{name}: {exc.message}") from None


KEYS = (
    Key("db", ENV_PREFIX + "DB", in_file=True),
    Key("cache", ENV_PREFIX + "CACHE", in_file=True),
    Key("server", ENV_PREFIX + "SERVER", in_file=True),
    Key("token", ENV_PREFIX + "TOKEN"),
    Key("root", ENV_PREFIX + "ROOT", in_file=True),
    Key("readonly", ENV_PREFIX + "READONLY", parse_bool, in_file=True),
    Key("trust", ENV_PREFIX + "TRUST", lambda _name, value: parse_list(value), in_file=True),
    Key("node_cache", ENV_PREFIX + "NODE_CACHE", in_file=True),
    Key("node_cache_size", ENV_PREFIX + "NODE_CACHE_SIZE", _parse_size, in_file=True),
)
# The file also names a token file (never the token) and where the embedded default cache lives.
_FILE_KEYS = {k.field for k in KEYS if k.in_file} | {"token_file", "default_root"}


def load_settings(
    *,
    db: str | None = None,
    cache: str | None = None,
    server: str | None = None,
    token: str | None = None,
    root: str | None = None,
    readonly: bool | None = None,
) -> Settings:
    """Resolve settings in precedence order: arguments, environment, file, defaults."""
    path = config_path()
    file_values = _read_file(path)
    values = resolve(
        KEYS,
        {
            "db": db,
            "cache": cache,
            "server": server,
            "token": token,
            "root": root,
            "readonly": readonly,
        },
        file_values,
    )
    if values.get("token") is None and file_values.get("token_file"):
        token_path = Path(file_values["token_file"]).expanduser()
        try:
            values["token"] = token_path.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = (
                exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
            )
            raise BadInput(
                f"cannot read token_file {str(token_path)!r} (from {path}): {reason}"
            ) from None
    chosen_db = values.pop("db", None)
    return Settings(
        db=chosen_db or f"sqlite:///{data_dir() / 'index.db'}",
        db_is_default=not chosen_db,
        cache=values.pop("cache", None) or DEFAULT_CACHE,
        default_root=str(file_values.get("default_root") or cache_dir() / DEFAULT_CACHE),
        config_file=str(path) if file_values else None,
        **values,
    )
