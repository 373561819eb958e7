"""Server mode for a service's activate() and for the CLI: the client a set of settings asks for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cachectl.client.remote import RemoteIndex
from cachectl.client.server_client import ServerClient
from cachectl.core.records import CacheInfo

if TYPE_CHECKING:
    from cachectl.core.config import Settings

# A service's activate() must not wait long on a server that is down: it warns and
# runs as plain JAX would.
SERVICE_TIMEOUT_S = 10.0
SERVICE_CONNECT_TIMEOUT_S = 3.0


def service_client(settings: Settings) -> ServerClient:
    """A client with short timeouts, for activate() and its telemetry."""
    import httpx

    assert settings.server is not None  # server mode: the callers checked settings.server
    return ServerClient(
        settings.server,
        settings.token,
        timeout=httpx.Timeout(SERVICE_TIMEOUT_S, connect=SERVICE_CONNECT_TIMEOUT_S),
    )


def remote_index_for_service(settings: Settings) -> RemoteIndex:
    return RemoteIndex(service_client(settings))


def open_for_service(settings: Settings) -> tuple[RemoteIndex, CacheInfo]:
    """Server mode for activate(): the server's index and this cache's policy."""
    remote = remote_index_for_service(settings)
    try:
        return remote, remote.get_cache(settings.cache)
    except Exception:
        remote.close()
        raise


def client_from_settings(settings: Settings) -> ServerClient | None:
    """The client for CACHECTL_SERVER / CACHECTL_TOKEN, or None in direct mode."""
    if not settings.server:
        return None
    return ServerClient(settings.server, settings.token)
