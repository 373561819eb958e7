"""Warm's bytes to the server, from a machine that does not hold the cache root.

In server mode where the root is another machine's local disk (storage/node_tier.py
``via_server``), warm compiles into this node's tier (``Context.store``) and sends what it wrote
over the server's entry routes: the entry first (the server checks it as every upload), then
its stored executable. Only then is the row registered, and the server finds the bytes it holds.
An entry the server already holds is never sent again (warm counted it cached, not compiled).
"""

from __future__ import annotations

from typing import Any

from cachectl.core.errors import CachectlError


def upload(
    client: Any, cache: str, digest: str, key: str, entry: bytes | None, executable: bytes | None
) -> str | None:
    """Send ``entry`` (None: the server holds it) and ``executable``; why not, or None."""
    try:
        if entry is not None:
            client.upload_entry(cache, digest, key, entry)
        if executable is not None:
            client.upload_executable(cache, digest, key, executable)
    except (CachectlError, OSError) as exc:
        return f"could not upload it to the server: {getattr(exc, 'message', None) or exc}"
    return None
