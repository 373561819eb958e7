"""What JAX's persistent cache may read in a service's namespace (``NamespaceVerifier``).

activate() and a process ``cachectl exec`` started install it as JAX's verifying cache
(core/jax_cache_io.py): an entry is handed to JAX only when its sha256 is one the index
verified or this owner's processes wrote; a miss goes through the compile lease
(service/compile_lease.py), and reads through the node tier where there is one
(service/node_source.py). ``CACHECTL_RUN_UNVERIFIED_CODE`` is the only opt-out.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from cachectl.core import jax_seam
from cachectl.core.config import RUN_UNVERIFIED_ENV, Settings, load_settings, parse_bool
from cachectl.core.errors import BadInput
from cachectl.core.fingerprint import Environment
from cachectl.service import compile_lease, node_source, node_upload
from cachectl.service.service_index import open_service_index
from cachectl.storage.store import Store
from cachectl.trust import pins

if TYPE_CHECKING:
    from collections.abc import Callable

    from cachectl.index.protocol import IndexBackend

log = logging.getLogger(__name__)


class NamespaceVerifier(jax_seam.EntryVerifier):
    """What JAX's persistent cache may read in this namespace: the entry sha256s of
    :func:`namespace_verified` (asked at the first lookup, not at activate) and what this process
    wrote itself (and what this owner's services wrote before, ``pins.written``); one warning for
    the first refused entry."""

    def __init__(
        self,
        settings: Settings,
        digest: str,
        namespace: str,
        read: Callable[[str], bytes],
        warn: Callable[[str], None],
        unverified_ok: bool = False,
        index: IndexBackend | None = None,
        node: node_source.RemoteFiles | None = None,
        writer: bool = False,
    ) -> None:
        """``index``: the one activate() holds, asked instead of opening one (in this process
        only: a forked child opens its own); ``node``: the node tier reads go through.
        ``writer``: JAX writes the namespace (it may take compile leases,
        service/compile_lease.py)."""
        self._node = node
        self._uploads = node_upload.for_service(settings, node, digest, writer, warn)
        self._args = (settings, digest, namespace, read)
        self._writer = writer
        self._leases: Any = None
        self._no_lease = False  # the cache trusts keys, or nothing verifies it
        self._index = index
        self._index_pid = os.getpid()
        self._warn = warn
        self._unverified_ok = unverified_ok
        self._shas: dict[str, str] | None = None
        self._any = False
        self._mine: dict[str, str] = {}
        self._lock = threading.Lock()
        self._warned = False

    def _known(self) -> dict[str, str]:
        with self._lock:
            if self._shas is None:
                from cachectl.service.verified import namespace_verified

                warnings: list[str] = []
                found = namespace_verified(
                    *self._args,
                    warnings,
                    self._unverified_ok,
                    open_service_index,
                    held=self._index if os.getpid() == self._index_pid else None,
                    first_only=True,  # cachectl.serving, which asked first, printed them
                    node=self._node.files if self._node is not None else None,
                )
                self._shas = {k: v.sha256 for k, v in (found or {}).items()}
                self._no_lease = found is None or found.trusted
                settings, digest = self._args[0], self._args[1]
                mine = pins.written(
                    settings.server or settings.db, settings.cache, digest, warnings
                )
                self._mine = {**mine, **self._mine}
                self._any = found is None and self._unverified_ok
                for line in warnings:
                    self._warn(line)
            return self._shas

    def expected(self, key: str) -> str | None:
        known = self._known()
        if self._any:
            return jax_seam.ANY_ENTRY
        return self._mine.get(key) or known.get(key)

    def refused(self, key: str, why: str) -> None:
        with self._lock:
            if self._warned:
                return
            self._warned = True
        settings = self._args[0]
        self._warn(
            f"cachectl: refused JAX entry {key} of cache {settings.cache!r} ({why}); it compiles "
            "in memory: someone without a trusted key rewrote it (`cachectl verify` lists such "
            "files)"
        )

    def read_entry(
        self, key: str, expected: str, base: Callable[[str], bytes | None]
    ) -> bytes | None:
        """Through the node tier when there is one: this node's copy, else one fetch."""
        if self._node is None:
            return base(key)
        return node_source.read_entry(self._node, key, expected, self.refused)

    def wrote(self, key: str, sha256: str) -> None:
        with self._lock:
            self._mine[key] = sha256
        settings, digest = self._args[0], self._args[1]
        pins.remember_written(settings.server or settings.db, settings.cache, digest, key, sha256)
        if self._uploads is not None:  # on the server before the lease says written
            self._uploads.wrote(key)
        if self._leases:  # the bytes handed to put, never a file read back at the key
            self._leases.wrote(key, sha256)

    def missed(self, key: str, read: Callable[[str], bytes | None]) -> bytes | None:
        """A miss: through the compile lease (wait for another process's compile, or hold the
        lease while compiling), unless the cache trusts keys or nothing verifies it."""
        self._known()
        with self._lock:
            if self._leases is None:
                self._leases = self._compile_leases()
        return self._leases.missed(key, read) if self._leases else None

    def _compile_leases(self) -> Any:
        """The process's compile leases (False: none). A cache that trusts keys has none: a
        service's entry counts there only when a trusted key signed it, so nobody would wait."""
        if self._no_lease or not compile_lease.lease_enabled():
            return False
        settings, digest = self._args[0], self._args[1]

        def lessor() -> compile_lease.Lessor | None:
            index = self._index if os.getpid() == self._index_pid else None
            if index is None:
                index = open_service_index(settings, [])[0]
            return compile_lease.lessor_for(index, settings.cache, digest)

        return compile_lease.CompileLeases(lessor, writer=self._writer, warn=self._warn)


def verify_exec_cache(path: str, environment: dict[str, Any]) -> None:
    """In a process `cachectl exec` started (service/exec_hook.py): JAX's cache at ``path`` reads
    only what activate()'s would verify for the environment exec resolved."""
    settings = load_settings()
    env = Environment.from_dict(environment)

    def read(name: str) -> bytes:
        return Store(path).read_bytes(name)

    node = node_source.for_jax_path(settings, path, env.digest, env.namespace, _warn)
    verifier = NamespaceVerifier(
        settings, env.digest, env.namespace, read, _warn, run_unverified(None), node=node
    )
    if node is not None:
        node_source.remember(path, node)
    jax_seam.install_verifying_cache(path, verifier)


def install_verifier(
    settings: Settings,
    env: Environment,
    path: str,
    options: dict[str, Any],
    node: node_source.RemoteFiles | None,
    writer: bool,
    unverified_ok: bool,
    index: IndexBackend | None,
) -> None:
    """activate()'s: JAX's persistent cache at ``path`` reads only verified entries of the
    namespace (a mirror holds only what its pull verified, and what this owner's processes
    wrote)."""

    def read(name: str) -> bytes:
        return Store(path, options).read_bytes(name)

    verifier = NamespaceVerifier(
        settings, env.digest, env.namespace, read, _warn, unverified_ok, index, node, writer
    )
    if node is not None:
        node_source.remember(path, node)
    jax_seam.install_verifying_cache(path, verifier)


def run_unverified(explicit: bool | None) -> bool:
    """The caller's choice, else ``CACHECTL_RUN_UNVERIFIED_CODE``; False unless asked for."""
    if explicit is not None:
        return explicit
    value = os.environ.get(RUN_UNVERIFIED_ENV, "").strip()
    try:
        return parse_bool(RUN_UNVERIFIED_ENV, value)
    except BadInput:
        _warn(f"cachectl: ignoring {RUN_UNVERIFIED_ENV}={value!r}: use 1 or 0")
        return False


def _warn(message: str) -> None:
    """One warning, through logging (its last-resort handler prints it if none is set up)."""
    log.warning(message)
