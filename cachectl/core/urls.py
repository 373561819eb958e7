"""URL dispatch and the store registry: which store a root URL names and its canonical form.

The one place a URL's scheme is read (ARCHITECTURE.md: never a prefix test elsewhere). In core so
that a cache's policy (core/cache_info.py) and the service's start can ask without the store.

``STORES`` is the registry, like fsspec's ``registry.py``: one line per store, naming the URL
schemes it answers to and its backend module under ``cachectl/storage/backends/``, imported only
when a store of that kind is opened (``storage/backends/__init__.py``, ``backend``). Adding a store
is one line here plus that module (ARCHITECTURE.md, "How to add a store").
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from cachectl.core.errors import BadInput


@dataclass(frozen=True)
class StoreEntry:
    """One store in the registry."""

    module: str  # its backend module (storage/backends/), imported on first use
    schemes: tuple[str, ...]  # the URL schemes (fsspec protocols) naming it; the first is canonical
    object_store: (
        bool  # reached over the network: services only read it unless a cache allows writes
    )


# kind -> its registry line.
STORES: dict[str, StoreEntry] = {
    "file": StoreEntry("cachectl.storage.backends.local", ("file", "local"), object_store=False),
    "memory": StoreEntry("cachectl.storage.backends.memory", ("memory",), object_store=False),
    "s3": StoreEntry("cachectl.storage.backends.s3", ("s3", "s3a"), object_store=True),
    "gcs": StoreEntry("cachectl.storage.backends.gcs", ("gs", "gcs"), object_store=True),
    "az": StoreEntry("cachectl.storage.backends.az", ("az",), object_store=True),
}

# URL scheme (fsspec protocol) -> the kind of store cachectl manages; a bare path is a local one.
PROTOCOLS: dict[str | None, str] = {
    None: "file",
    **{scheme: kind for kind, entry in STORES.items() for scheme in entry.schemes},
}
# The scheme a URL of each kind is written with (what JAX, through etils epath, understands).
URL_SCHEME = {kind: entry.schemes[0] for kind, entry in STORES.items() if kind != "file"}
_SCHEMES_TEXT = "a local path, " + ", ".join(f"{entry.schemes[0]}://" for entry in STORES.values())


def split_protocol(url: str) -> tuple[str | None, str]:
    """fsspec.core.split_protocol without importing fsspec (a service's start needs only paths)."""
    if "://" in url:
        protocol, path = url.split("://", 1)
        if len(protocol) > 1:  # not a Windows drive letter
            return protocol, path
    if url.startswith("data:"):
        return "data", url[5:]
    return None, url


def normalize_url(url: str) -> str:
    """Canonical form of a root URL; raises BadInput for schemes we do not manage."""
    if not url or not url.strip():
        raise BadInput(f"empty storage URL: give {_SCHEMES_TEXT} URL")
    url = url.strip()
    protocol, path = split_protocol(url)
    if protocol not in PROTOCOLS:
        raise BadInput(
            f"unsupported storage URL scheme {f'{protocol}://'!r} in {url!r}: use {_SCHEMES_TEXT}"
        )
    kind = PROTOCOLS[protocol]
    if kind == "file":
        return os.path.abspath(os.path.expanduser(path))
    path = path.strip("/")
    if not path:
        raise BadInput(f"storage URL {url!r} names no bucket: use e.g. {protocol}://bucket/prefix")
    return f"{URL_SCHEME[kind]}://{path}"


def url_kind(url: str) -> str | None:
    """The store a URL names (a key of ``STORES``: "file", "s3", "gcs", "az", "memory"; None for a
    scheme not managed): what callers ask instead of testing a URL's prefix."""
    return PROTOCOLS.get(split_protocol(url.strip())[0])


def is_object_store(url: str) -> bool:
    """Whether the URL names an object store (the registry's answer, never a list of schemes)."""
    kind = url_kind(url)
    return kind is not None and STORES[kind].object_store
