"""URL dispatch: which storage a root URL names and its canonical form.

The one place a URL's scheme is read (ARCHITECTURE.md: never a prefix test elsewhere). In core so
that a cache's policy (core/cache_info.py) and the service's start can ask without the store.
"""

from __future__ import annotations

import os

from cachectl.core.errors import BadInput

# fsspec protocol -> the kind of storage cachectl manages.
PROTOCOLS = {
    None: "file",
    "file": "file",
    "local": "file",
    "s3": "s3",
    "s3a": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "memory": "memory",
}
# The scheme JAX (through etils epath) understands for each protocol.
URL_SCHEME = {"s3": "s3", "gcs": "gs", "memory": "memory"}


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
        raise BadInput(
            "empty storage URL: give a local path, file://, gs://, s3:// or memory:// URL"
        )
    url = url.strip()
    protocol, path = split_protocol(url)
    if protocol not in PROTOCOLS:
        raise BadInput(
            f"unsupported storage URL scheme {f'{protocol}://'!r} in {url!r}: "
            "use a local path, file://, gs://, s3:// or memory://"
        )
    kind = PROTOCOLS[protocol]
    if kind == "file":
        return os.path.abspath(os.path.expanduser(path))
    path = path.strip("/")
    if not path:
        raise BadInput(f"storage URL {url!r} names no bucket: use e.g. {protocol}://bucket/prefix")
    return f"{URL_SCHEME[kind]}://{path}"


def url_kind(url: str) -> str | None:
    """The storage a URL names ("file", "s3", "gcs", "memory"; None for a scheme not managed):
    what callers ask instead of testing a URL's prefix."""
    return PROTOCOLS.get(split_protocol(url.strip())[0])
