"""Bytes a machine without the cache root compiled, sent to the server over its entry routes.

In server mode where the root is another machine's local disk (storage/node_tier.py
``via_server``), JAX writes into this node's tier. What it wrote reaches the other nodes only
through the server: ``PUT .../entries/{key}`` (and ``.../aot`` for a stored executable), which
the server checks and indexes as any upload (cachectl/storage/ingest.py, the one way in).

Two writers send that way: ``cachectl warm`` (warm/settle.py) and a service allowed to write
(``--service-writes allow`` and a writer token), at each entry JAX stores, before its compile
lease is marked written (service/compile_lease.py), so a waiter on another node finds the
entry on the server when it reads. What is sent is the bytes the process handed JAX's ``put``
(trust/gate.py ``EntryGate.put``), never the file found at the key.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from cachectl.core.errors import CachectlError, EntryConflict, PermissionDenied
from cachectl.index.open import driver

log = logging.getLogger(__name__)


def upload(
    client: Any, cache: str, digest: str, key: str, entry: bytes | None, executable: bytes | None
) -> str | None:
    """Send ``entry`` (None: the server holds it) and ``executable``; why not, or None. An
    entry the server holds with other bytes raises EntryConflict: the caller binds to the
    server's (warm/server_held.py)."""
    try:
        if entry is not None:
            client.upload_entry(cache, digest, key, entry)
        if executable is not None:
            client.upload_executable(cache, digest, key, executable)
    except EntryConflict:
        raise
    except (CachectlError, OSError) as exc:
        return f"could not upload it to the server: {getattr(exc, 'message', None) or exc}"
    return None


class ServiceUploads:
    """A writer service's uploads: each entry JAX stored in the node tier, sent once.

    An entry the server holds with other bytes (another node's compile of the same program,
    a hedge) is left as it is, quietly: the server keeps the first. Anything else that fails
    costs one warning, and a refused token stops the uploads for the process; the service
    runs on, its entries on this node only (other nodes compile them themselves)."""

    def __init__(
        self,
        client_of: Callable[[], Any],
        cache: str,
        digest: str,
        directory: str,
        warn: Callable[[str], None],
    ) -> None:
        self._client_of = client_of
        self._client: Any = None
        self.cache, self.digest, self.directory = cache, digest, directory
        self._warn = warn
        self._off = False
        self._warned = False
        self._lock = threading.Lock()
        self.sent = 0

    def wrote(self, key: str, data: bytes) -> None:
        """JAX's put was handed ``data`` for ``key``: send those bytes to the server (before the
        lease says written), never the file at the key, which JAX's put leaves as it found it
        (a co-tenant's plant in a shared node directory)."""
        if self._off:
            return
        try:
            with self._lock:
                if self._client is None:
                    self._client = self._client_of()
            if self._client is None:  # no server client after all: nothing to send to
                self._off = True
                return
            self._client.upload_entry(self.cache, self.digest, key, data)
            self.sent += 1
        except EntryConflict:
            log.debug("cachectl: the server holds %s with another writer's bytes", key)
        except (CachectlError, OSError) as exc:
            self._off = isinstance(exc, PermissionDenied)
            self._say(key, getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}")

    def _say(self, key: str, why: str) -> None:
        with self._lock:
            if self._warned:
                return
            self._warned = True
        self._warn(
            f"cachectl: could not upload entry {key} to the server ({why.splitlines()[0][:300]}): "
            "it stays on this node; other nodes compile it themselves"
        )


def for_service(
    settings: Any, node: Any, digest: str, writer: bool, warn: Callable[[str], None]
) -> ServiceUploads | None:
    """The uploads of a service that writes through the node tier in server mode; None for
    any other (a reader, a root or bucket this machine writes itself)."""
    if not writer or node is None or not node.via_server:
        return None

    def client() -> Any:
        index = driver("http")(settings, "service")  # the http driver: the service's timeouts
        return getattr(index, "client", None)

    return ServiceUploads(client, settings.cache, digest, node.directory, warn)
