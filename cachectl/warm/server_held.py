"""Warm through the server (server mode without the root here): the entries the server holds.

The deploy warm after a cold fleet finds the replicas' entries on the server. It compiles none of
them: the server's entry is read into this node's tier, where JAX's persistent cache finds it
(a hit, deserialized as any entry), and the bucket's stored executable is made for those bytes
(its header's ``entry_sha256`` is the server's row's), so the server accepts its upload. A bucket
JAX compiled all the same (the process executor, which asks nothing before compiling; a replica's
upload that landed during the run) is bound to the server's entry too: the same key is the same
program, and the executable's payload holds everything but the XLA executable, which stays the
entry's. An upload the server refuses fails its bucket.

:func:`ServerEntries.bring` is the one place a warm hands JAX bytes it did not compile: the
server's bytes, their sha256 checked against the server's index row before they land where JAX
reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
from typing import Any

from cachectl.core.errors import CachectlError
from cachectl.service.node_source import Refused, RemoteFiles, server_files
from cachectl.storage.entries import CACHE_SUFFIX

log = logging.getLogger(__name__)


class ServerEntries:
    """The server's entries of one namespace, read through this node's tier for a warm."""

    def __init__(self, ctx: Any, cache: Any, env: Any) -> None:
        self._ctx, self._cache, self._env = ctx, cache, env
        self._files: RemoteFiles | None = None
        self._lock = threading.Lock()

    def _opened(self) -> RemoteFiles | None:
        with self._lock:
            if self._files is None:
                client = self._ctx.index.client  # the http driver's: the command's timeouts
                self._files = server_files(
                    self._ctx.settings,
                    client,
                    self._cache,
                    self._env.digest,
                    self._env.namespace,
                    log.warning,
                )
            return self._files

    def bring(self, key: str, sha256: str) -> tuple[bytes | None, str | None]:
        """The server's entry at ``key`` in this node's tier, where JAX reads it, its sha256
        checked against the server's row (``sha256``) first: (its bytes, None), or (None, why
        not). A file of this node's own at the key (its compile of the same program, which the
        server did not keep) is replaced by the server's."""
        files = self._opened()
        if files is None:
            return None, "this machine has no node tier to read the server's entry into"
        name = key + CACHE_SUFFIX
        path = files.files.path(name)
        with contextlib.suppress(OSError), open(path, "rb") as fh:
            if hashlib.sha256(fh.read()).hexdigest() != sha256:
                os.unlink(path)  # not the server's bytes: JAX must not load them
        try:
            return files.read(name, sha256), None
        except FileNotFoundError:
            return None, "the server lists it but does not serve it"
        except Refused as exc:
            return None, str(exc)
        except (CachectlError, OSError) as exc:
            return None, getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
