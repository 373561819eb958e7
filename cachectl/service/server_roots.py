"""The root each named cache had when this machine last reached it through the server.

In server mode a node does not hold the cache's root; it reads through the server into its node
tier, whose directory is named after the server and the cache (storage/node_tier.py
``source_dir``). The root URL itself comes from the index. With the server down, the default
cache still knows its root (the embedded default's), but a named cache knew it only from the
index: remembering it here lets a named cache keep serving from its node tier, as the default
does (the node tier's record decides what may be read, as always).

One small JSON file under the state directory, readable and writable by this user alone
(``core/probe.py`` ``read_private``: no link followed, no FIFO waited on, bounded).
"""

from __future__ import annotations

import contextlib
import json

from cachectl.core.config import state_dir
from cachectl.core.probe import MEMO_MAX_BYTES, Untrusted, read_private
from cachectl.core.temps import atomic_write

FILE = "server-roots.json"
MAX_CACHES = 256  # one machine's named caches; more are not remembered


def _key(server: str, cache: str) -> str:
    return f"{server.rstrip('/')}#{cache}"


def _read() -> dict[str, str]:
    try:
        known = json.loads(read_private(state_dir() / FILE, MEMO_MAX_BYTES))
    except (OSError, ValueError, Untrusted):
        return {}
    if not isinstance(known, dict):
        return {}
    return {k: v for k, v in known.items() if isinstance(k, str) and isinstance(v, str)}


def remembered(server: str, cache: str) -> str | None:
    """The root URL cache ``cache`` had when this machine last reached ``server``, or None."""
    return _read().get(_key(server, cache))


def remember(server: str, cache: str, root_url: str) -> None:
    """Keep ``root_url`` for a restart with the server down; best effort."""
    known = _read()
    key = _key(server, cache)
    if known.get(key) == root_url or (key not in known and len(known) >= MAX_CACHES):
        return
    known[key] = root_url
    data = json.dumps(known, indent=1, sort_keys=True).encode()
    with contextlib.suppress(OSError):  # only the fallback is lost
        atomic_write(str(state_dir() / FILE), 0o600, lambda fh: fh.write(data))
