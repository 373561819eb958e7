"""open_backend: the one place that chooses the index a command works with.

Direct mode (no CACHECTL_SERVER): the SQL :class:`cachectl.index.Index` at ``settings.db``.
Server mode: :class:`cachectl.client.RemoteIndex`, the server's HTTP API with the token.
Both implement :class:`cachectl.index.protocol.IndexBackend`. (activate() makes the same
choice with short timeouts and without Alembic: cachectl.service.activate.open_service_index.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cachectl.client import RemoteIndex, ServerClient, client_from_settings
from cachectl.index import open_index
from cachectl.index.protocol import IndexBackend

if TYPE_CHECKING:
    from cachectl.core.config import Settings


def open_backend(settings: Settings, *, client: ServerClient | None = None) -> IndexBackend:
    """The index for ``settings``; ``client`` reuses an open ServerClient in server mode."""
    client = client or client_from_settings(settings)
    if client is not None:
        return RemoteIndex(client)
    return open_index(settings.db)


__all__ = ["IndexBackend", "open_backend"]
