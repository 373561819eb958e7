"""The cachectl server's HTTP client, used when CACHECTL_SERVER (and CACHECTL_TOKEN) are set.

The server answers with the library's own dataclasses as JSON (cachectl.core.jsonable);
``wire.decode`` rebuilds them, so the CLI prints exactly what it prints in direct mode,
and server errors come back as the same CachectlError (``transport``: same message, same
exit code). ``remote.RemoteIndex`` is the ``http`` index driver (cachectl.index.open): the
IndexBackend protocol over HTTP, so listing, stats and warm registration run unchanged
(``service_client``: the short timeouts of activate()).
"""

from __future__ import annotations

from cachectl.client.remote import (
    SERVICE_CONNECT_TIMEOUT_S,
    SERVICE_TIMEOUT_S,
    RemoteIndex,
    service_client,
)
from cachectl.client.server_client import PAGE, ServerClient
from cachectl.client.transport import API, DEFAULT_TIMEOUT_S, Transport, seg
from cachectl.client.wire import decode, telemetry_wire

__all__ = [
    "API",
    "DEFAULT_TIMEOUT_S",
    "PAGE",
    "SERVICE_CONNECT_TIMEOUT_S",
    "SERVICE_TIMEOUT_S",
    "RemoteIndex",
    "ServerClient",
    "Transport",
    "seg",
    "decode",
    "service_client",
    "telemetry_wire",
]
