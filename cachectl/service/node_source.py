"""Where a process's cache bytes come from when a node tier is on (storage/node_tier.py).

Three modes (DOCS-NOTES.md):
- a local-disk root this machine reads: straight from the root, no tier;
- server mode (CACHECTL_SERVER) where the root is not here: the server's entry routes, into the
  node tier (by default under the XDG cache home), which is also the directory JAX opens;
- an object-store root (s3://, gs://, az://) with CACHECTL_NODE_CACHE set: the bucket, into the
  node tier; JAX's own reads come through the verifying cache (core/jax_seam.py), its writes still
  go to the bucket.

``CACHECTL_NODE_CACHE=off`` turns the tier off (server mode then reads the root's path, as before).
One :class:`RemoteFiles` per JAX directory and process (``opened``): activate() makes it, JAX's
verifier, ``cachectl.serving`` and warm-check's children read through it.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from cachectl.client.transport import BodyRefused
from cachectl.core.config import Settings
from cachectl.core.errors import NotFound
from cachectl.core.jax_seam import ANY_ENTRY
from cachectl.core.urls import is_object_store
from cachectl.index.open import driver
from cachectl.storage.entries import CACHE_SUFFIX, EXECUTABLE_SUFFIX
from cachectl.storage.node_tier import (
    DEFAULT_LIMIT,
    NodeFiles,
    NodeTier,
    Refused,
    node_dir,
    via_server,
)
from cachectl.storage.store import Store

log = logging.getLogger(__name__)

__all__ = ["Refused", "RemoteFiles", "open_remote_files", "opened", "remember"]

if TYPE_CHECKING:
    from cachectl.client.remote import RemoteIndex
    from cachectl.client.server_client import ServerClient


@dataclass
class RemoteFiles:
    """One namespace's files, read through the node tier from the remote (``source``)."""

    files: NodeFiles
    source: str
    cache: str
    fetch_of: Callable[[str], Callable[[], bytes]]
    via_server: bool

    @property
    def directory(self) -> str:
        return self.files.directory

    def read(self, name: str, sha256: str | None) -> bytes:
        return self.files.read(name, sha256, self.fetch_of(name))


_LOCK = threading.Lock()
_TIERS: dict[str, NodeTier] = {}
_OPENED: dict[str, RemoteFiles] = {}


def tier_at(directory: str, limit: int | None, warn: Callable[[str], None]) -> NodeTier:
    """The process's one NodeTier for ``directory`` (its counts and warnings shared)."""
    with _LOCK:
        tier = _TIERS.get(directory)
        if tier is None:
            tier = _TIERS[directory] = NodeTier(directory, limit or DEFAULT_LIMIT, warn)
        return tier


def _server_fetch(
    client: ServerClient, cache: str, digest: str
) -> Callable[[str], Callable[[], bytes]]:
    """A file's fetch over the server's entry routes (the fast lane): a 404 is a missing file; a
    body is read only up to the index's recorded size, each request within the client's deadline
    (cachectl/client/transport.py ``read_body``)."""

    def fetch_of(name: str) -> Callable[[], bytes]:
        def fetch() -> bytes:
            if not name.endswith((CACHE_SUFFIX, EXECUTABLE_SUFFIX)):
                raise FileNotFoundError(name)  # the entry routes serve entries and executables
            try:
                if name.endswith(EXECUTABLE_SUFFIX):
                    key = name[: -len(EXECUTABLE_SUFFIX)]
                    return bytes(client.download_executable(cache, digest, key))
                return bytes(client.download_entry(cache, digest, name[: -len(CACHE_SUFFIX)]))
            except NotFound as exc:
                raise FileNotFoundError(name) from exc
            except BodyRefused as exc:  # longer than, or other than, the index's record of it
                raise Refused(errno.EIO, exc.message) from exc

        return fetch

    return fetch_of


def _store_fetch(
    root_url: str, options: dict[str, Any], namespace: str
) -> Callable[[str], Callable[[], bytes]]:
    """A file's fetch from the root's store (the storage client built at the first miss)."""
    made: list[Store] = []

    def fetch_of(name: str) -> Callable[[], bytes]:
        def fetch() -> bytes:
            if not made:
                made.append(Store(root_url, options))
            return made[0].read_bytes(f"{namespace}/{name}")

        return fetch

    return fetch_of


def open_remote_files(
    settings: Settings,
    root_url: str,
    options: dict[str, Any],
    digest: str,
    namespace: str,
    warn: Callable[[str], None],
) -> RemoteFiles | None:
    """The node tier in front of this cache's remote, or None where bytes come from the root
    itself (a local-disk root here, or no tier set for an object store)."""
    directory = node_dir(settings, root_url)
    if directory is None:
        return None
    through_server = via_server(settings, root_url)
    if not through_server and not is_object_store(root_url):
        return None  # a local-disk root read here: a second copy on the same disk buys nothing
    tier = tier_at(directory, settings.node_cache_size, warn)
    source = settings.server if through_server else root_url
    assert source is not None
    fetch_of: Callable[[str], Callable[[], bytes]]
    if through_server:
        client = cast(
            "RemoteIndex", driver("http")(settings, "service")
        ).client  # the service's short timeouts
        fetch_of = _server_fetch(client, settings.cache, digest)
    else:
        fetch_of = _store_fetch(root_url, options, namespace)
    files = tier.files(source, settings.cache, namespace)
    return RemoteFiles(files, source, settings.cache, fetch_of, through_server)


def server_files(
    settings: Settings,
    client: ServerClient,
    cache: Any,
    digest: str,
    namespace: str,
    warn: Callable[[str], None],
) -> RemoteFiles | None:
    """A command's node tier in front of the server for ``cache`` (read over ``client``, the
    command's own): the directory warm's JAX opens in server mode; None without a tier."""
    directory = node_dir(settings, cache.root_url)
    if directory is None or not settings.server:
        return None
    tier = tier_at(directory, settings.node_cache_size, warn)
    files = tier.files(settings.server, cache.name, namespace)
    fetch_of = _server_fetch(client, cache.name, digest)
    return RemoteFiles(files, settings.server, cache.name, fetch_of, True)


def for_service(
    settings: Settings,
    root_url: str,
    options: dict[str, Any],
    env: Any,
    warn: Callable[[str], None],
    problems: list[str],
) -> RemoteFiles | None:
    """activate()'s node tier, its directories made (0700) and checked: one this user does not
    own alone is said once, and its reads then go to the remote (storage/node_tier.py
    ``NodeTier.refusal``). None (and a problem said) where the settings cannot open one."""
    try:
        node = open_remote_files(settings, root_url, options, env.digest, env.namespace, warn)
        if node is not None:
            node.files.usable()
        return node
    except Exception as exc:  # noqa: BLE001 - a node disk we cannot use: read from the remote
        problems.append(f"node cache off ({type(exc).__name__}: {exc})".splitlines()[0])
        return None


def read_entry(
    node: RemoteFiles, key: str, expected: str, refused: Callable[[str, str], None]
) -> bytes | None:
    """JAX's read of ``key`` through the node tier (the gate's read path, trust/gate.py
    ``EntryGate.read_entry``): None is a miss, and JAX compiles (the remote lacks it, refused
    it, or cannot be reached)."""
    try:
        return node.read(key + CACHE_SUFFIX, None if expected == ANY_ENTRY else expected)
    except FileNotFoundError:
        return None
    except Refused as exc:
        refused(key, str(exc))
        return None
    except Exception as exc:  # noqa: BLE001 - a remote that is down: JAX compiles
        node.files.tier.warn_once(
            "fetch", f"cachectl: cannot fetch {key} ({type(exc).__name__}: {exc}); compiling"
        )
        return None


def for_jax_path(
    settings: Settings, path: str, digest: str, namespace: str, warn: Callable[[str], None]
) -> RemoteFiles | None:
    """The node tier behind the JAX directory `cachectl env` handed a process (service/env.py
    names the node tier's directory in server mode, the bucket's namespace otherwise)."""
    if settings.server:
        root = node_dir(settings, "")  # "": no root here, so the server-mode default applies
        if root is not None and path.startswith(root.rstrip("/") + "/"):
            tier = tier_at(root, settings.node_cache_size, warn)
            client = cast("RemoteIndex", driver("http")(settings, "service")).client
            fetch_of = _server_fetch(client, settings.cache, digest)
            return RemoteFiles(
                NodeFiles(tier, path), settings.server, settings.cache, fetch_of, True
            )
    if is_object_store(path) and path.endswith("/" + namespace):
        root_url = path[: -len(namespace) - 1]
        return open_remote_files(settings, root_url, {}, digest, namespace, warn)
    return None


def remember(path: str, files: RemoteFiles) -> None:
    """What activate() opened for the JAX directory ``path``: serving reads through the same."""
    with _LOCK:
        _OPENED[path] = files


def opened(path: str) -> RemoteFiles | None:
    """The RemoteFiles activate() opened for ``path`` in this process, if any."""
    with _LOCK:
        return _OPENED.get(path)


@dataclass(frozen=True)
class Listed:
    """One file of a namespace as the index lists it (what ``Store.list`` gives pull)."""

    path: str
    size: int


class RemoteNamespace:
    """A namespace on the server as ``cachectl pull`` lists and reads it: the server's index rows
    (the server holds what it indexed), each file's bytes through the node tier."""

    def __init__(self, files: RemoteFiles, namespace: str, entries: list[Any]) -> None:
        self.files = files
        self.namespace = namespace
        self._rows: dict[str, tuple[int, str]] = {}
        for e in entries:
            self._rows[e.key + CACHE_SUFFIX] = (e.size, e.sha256)
            if e.aot_sha256 is not None:
                self._rows[e.key + EXECUTABLE_SUFFIX] = (e.aot_size or 0, e.aot_sha256)

    def list(self, prefix: str) -> list[Listed]:
        return [Listed(f"{prefix}/{name}", size) for name, (size, _) in self._rows.items()]

    def read_bytes(self, rel: str) -> bytes:
        name = rel.rsplit("/", 1)[-1]
        known = self._rows.get(name)
        return self.files.read(name, known[1] if known else None)

    def url_for(self, rel: str = "") -> str:
        return f"{self.files.source} (cache {self.files.cache}, through {self.files.directory})"


def remote_namespace(
    settings: Settings, index: Any, cache: str, root_url: str, env: Any
) -> RemoteNamespace | None:
    """The namespace of ``env`` on the server, for pull; None unless bytes come over the server."""
    if not via_server(settings, root_url):
        return None
    files = open_remote_files(
        settings.with_overrides(cache=cache), root_url, {}, env.digest, env.namespace, log.warning
    )
    if files is None:
        return None
    info = index.find_environment(cache, env.digest)
    return RemoteNamespace(files, env.namespace, index.list_entries(info.id))
