"""How one server process is configured: a dataclass, filled by cachectl.core.config's loader from flags and env.

Deployments run several stateless replicas over one PostgreSQL index, so
nothing here is per-replica state: every replica can be started the same way.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from cachectl.core.config import SERVER_HOST as DEFAULT_HOST
from cachectl.core.config import Key, load_settings, parse_bool, resolve
from cachectl.core.errors import BadInput
from cachectl.core.units import parse_duration, parse_size

# The largest body the server accepts for one entry when the cache sets no max entry
# size. Uploads are streamed to a temporary file and checked by streaming, so memory
# stays small whatever the size; this bounds disk and CPU per upload.
DEFAULT_MAX_UPLOAD = 1024**3
# An entry may decompress to at most EXPANSION_RATIO times the size it may have on the
# wire (the cache's max entry size, else the upload limit), and never past this.
# JAX executables compress a few times; a decompression bomb a thousand times or more.
EXPANSION_RATIO = 16
DEFAULT_MAX_DECOMPRESSED = 4 * 1024**3
# Every JSON body (telemetry, registrations, resolve, jobs...) is refused past this, before
# it is parsed; the largest legitimate one (10,000 registered entries) is a few MiB.
DEFAULT_MAX_JSON = 8 * 1024**2
DEFAULT_TELEMETRY_RETENTION_S = 30 * 86400.0
# A request's head (request line and headers) must arrive within this of its first byte, or of
# the connection opening (server/http_edge.py): a client trickling headers in, or sending nothing,
# cannot hold a connection longer. Generous: a loaded client may pause seconds between connecting
# and writing its request.
DEFAULT_HEADER_TIMEOUT_S = 30.0
# cachectl/index/compile_leases.py MAX_TTL_S: the longest compile lease a take is granted.
DEFAULT_LEASE_MAX_TTL_S = 60.0


@dataclass(frozen=True)
class ServerSettings:
    """Everything create_app() needs; defaults suit tests and a first deployment."""

    db: str
    # Scheduled maintenance (prune + gc per cache policy); None = off.
    maintenance_interval_s: float | None = None
    # First scheduled tick this long after start (None: min(60 s, interval)).
    maintenance_initial_delay_s: float | None = None
    # Serve /metrics without a token (Prometheus scrapers on a private network).
    metrics_public: bool = False
    # Serve the dashboard read-only without a token.
    dashboard_public: bool = False
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD
    max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED
    max_json_bytes: int = DEFAULT_MAX_JSON
    # Where uploads are spooled while they are checked (None: the system temp directory).
    upload_dir: str | None = None
    # Telemetry rows older than this are deleted by scheduled maintenance (None: kept forever).
    telemetry_retention_s: float | None = DEFAULT_TELEMETRY_RETENTION_S
    # The address the server listens on: dashboard cookies are Secure unless it is loopback.
    host: str = DEFAULT_HOST
    # Background workers for prune/gc/verify jobs in this replica.
    job_workers: int = 2
    # Mark cookies Secure: True/False force it; None (default) = Secure unless ``host`` is loopback.
    secure_cookies: bool | None = None
    # Seconds a valid token is trusted without asking the index again (0 = ask every time):
    # a token revoked elsewhere is refused by this replica at most this much later.
    token_cache_s: float = 2.0
    # Seconds a request's head may take to arrive (`cachectl serve`'s connections; 408 after).
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    # Behind nginx (server/accel.py): a GET of bytes on local disk is answered with an
    # X-Accel-Redirect to this internal location, and nginx sends the file. None: sent here.
    accel_redirect: str | None = None
    # The longest ttl a compile lease's take or renew is granted (server/lease_routes.py): a holder
    # whose heartbeat stops loses its lease within this, whatever it asked for.
    lease_max_ttl_s: float = DEFAULT_LEASE_MAX_TTL_S

    def with_overrides(self, **overrides: Any) -> ServerSettings:
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


def parse_interval(text: str | None) -> float | None:
    """``1h`` -> 3600.0; ``off``/``0``/empty -> None (no scheduled maintenance)."""
    if text is None or text.strip().lower() in ("", "0", "off", "none"):
        return None
    return parse_duration(text).total_seconds()


def _interval(_name: str, value: Any) -> float | None:
    return value if isinstance(value, (int, float)) else parse_interval(value)


def _size(_name: str, value: Any) -> int:
    return parse_size(value)


def _staleness(name: str, value: Any) -> float:
    seconds = value if isinstance(value, (int, float)) else parse_duration(value).total_seconds()
    if not seconds >= 0:
        raise BadInput(f"{name} must be 0 s or more, not {value!r}")
    return float(seconds)


def _seconds(name: str, value: Any) -> float:
    seconds = value if isinstance(value, (int, float)) else parse_duration(value).total_seconds()
    if not seconds > 0:
        raise BadInput(f"{name} must be above 0 s, not {value!r}")
    return float(seconds)


def _accel_prefix(name: str, value: Any) -> str | None:
    text = str(value).strip()
    if text.lower() in ("", "off", "none"):
        return None
    if not re.fullmatch(r"/[A-Za-z0-9_\-/]*/", text):
        raise BadInput(
            f"{name} must be nginx's internal location, a path such as /_cachectl_files/, "
            f"not {value!r}"
        )
    return text


# The server's keys, on top of the CLI's (cachectl.core.config.KEYS gives it ``db``); environment only.
SERVER_KEYS = (
    Key("maintenance_interval_s", "CACHECTL_SERVER_MAINTENANCE_INTERVAL", _interval),
    Key("maintenance_initial_delay_s", "CACHECTL_SERVER_MAINTENANCE_DELAY", _interval),
    Key("metrics_public", "CACHECTL_SERVER_METRICS_PUBLIC", parse_bool),
    Key("dashboard_public", "CACHECTL_SERVER_DASHBOARD_PUBLIC", parse_bool),
    Key("secure_cookies", "CACHECTL_SERVER_SECURE_COOKIES", parse_bool),
    Key("telemetry_retention_s", "CACHECTL_SERVER_TELEMETRY_RETENTION", _interval),
    Key("max_upload_bytes", "CACHECTL_SERVER_MAX_UPLOAD", _size),
    Key("header_timeout_s", "CACHECTL_SERVER_HEADER_TIMEOUT", _seconds),
    Key("token_cache_s", "CACHECTL_SERVER_TOKEN_CACHE", _staleness),
    Key("accel_redirect", "CACHECTL_SERVER_ACCEL_REDIRECT", _accel_prefix),
    Key("lease_max_ttl_s", "CACHECTL_SERVER_LEASE_MAX_TTL", _seconds),
)

# `cachectl serve --workers N`: each worker process builds its app from the settings the command
# resolved, passed in this variable (uvicorn starts workers as fresh interpreters).
WORKER_SETTINGS_ENV = "CACHECTL_SERVER_WORKER_SETTINGS"
WORKER_LOG_LEVEL_ENV = "CACHECTL_SERVER_WORKER_LOG_LEVEL"


def settings_to_env(settings: ServerSettings) -> str:
    return json.dumps(asdict(settings))


def settings_from_env() -> ServerSettings | None:
    """The settings `cachectl serve --workers N` left for its workers, or None outside one."""
    text = os.environ.get(WORKER_SETTINGS_ENV)
    return ServerSettings(**json.loads(text)) if text else None


def load_server_settings(
    db: str | None = None, *, flags: Mapping[str, Any] | None = None, **overrides: Any
) -> ServerSettings:
    """cachectl.core.config's one loader: flags > CACHECTL_SERVER_* / CACHECTL_* environment > file > defaults.

    ``flags`` are the serve command's values as typed (``"1h"``, ``"off"``), parsed like the
    environment's; ``overrides`` are typed values (None: not given).
    """
    settings = ServerSettings(db=load_settings(db=db).db, **resolve(SERVER_KEYS, flags or {}))
    return settings.with_overrides(**overrides)
