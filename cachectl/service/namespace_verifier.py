"""What JAX's persistent cache may read in a service's namespace (``NamespaceVerifier``).

activate() and a process ``cachectl exec`` started install it as JAX's verifying cache
(core/jax_cache_io.py): the gate (trust/gate.py ``EntryGate``) hands JAX an entry only when its
sha256 is one a record the cache trusts names; a miss goes through the compile lease
(service/compile_lease.py), and reads through the node tier where there is one
(service/node_source.py). ``CACHECTL_RUN_UNVERIFIED_CODE`` is the only opt-out.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from cachectl.core import jax_seam
from cachectl.core.config import RUN_UNVERIFIED_ENV, Settings, load_settings, parse_bool
from cachectl.core.errors import BadInput
from cachectl.core.fingerprint import Environment
from cachectl.service import compile_lease, node_source, node_upload
from cachectl.service.service_index import open_service_index
from cachectl.storage.store import Store
from cachectl.trust import gate

if TYPE_CHECKING:
    from collections.abc import Callable

    from cachectl.index.protocol import IndexBackend

log = logging.getLogger(__name__)


class NamespaceVerifier(gate.EntryGate):
    """JAX's persistent cache in a service's namespace: the gate (trust/gate.py ``EntryGate``:
    what may be read, and the records of what this process wrote), with the service's read
    path (the node tier), its misses (the compile lease) and its writes' uploads; one warning
    for the first refused entry."""

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
        self._index = index
        self._index_pid = os.getpid()
        super().__init__(
            settings,
            digest,
            namespace,
            read,
            warn,
            unverified_ok,
            open_service_index,
            self._held_index,
            node.files if node is not None else None,
        )
        self._remote = node
        self._uploads = node_upload.for_service(settings, node, digest, writer, warn)
        self._writer = writer
        self._leases: Any = None
        self._warned = False

    def _held_index(self) -> IndexBackend | None:
        return self._index if os.getpid() == self._index_pid else None

    def refused(self, key: str, why: str) -> None:
        with self._lock:
            if self._warned:
                return
            self._warned = True
        settings = self._args[0]
        self._warn(
            f"cachectl: refused JAX entry {key} of cache {settings.cache!r} ({why}); it compiles "
            "in memory: no record this cache trusts names its bytes (`cachectl verify` lists "
            "such files, and records that disagree)"
        )

    def read_entry(
        self, key: str, expected: str, base: Callable[[str], bytes | None]
    ) -> bytes | None:
        """Through the node tier when there is one: this node's copy, else one fetch."""
        if self._remote is None:
            return base(key)
        return node_source.read_entry(self._remote, key, expected, self.refused)

    def after_put(self, key: str, sha256: str, value: bytes) -> None:
        """Upload the bytes handed to put (never the file at the key: JAX skips a key whose
        file exists), before the lease says written, with the put's sha256."""
        if self._uploads is not None:  # on the server before the lease says written
            self._uploads.wrote(key, value)
        if self._leases:  # the bytes handed to put, never a file read back at the key
            self._leases.wrote(key, sha256)

    def missed(self, key: str, read: Callable[[str], bytes | None]) -> bytes | None:
        """A miss: through the compile lease (wait for another process's compile, or hold the
        lease while compiling), unless the cache trusts keys or nothing verifies it."""
        no_lease = self.nothing_verifies
        with self._lock:
            if self._leases is None:
                self._leases = self._compile_leases(no_lease)
        return self._leases.missed(key, read) if self._leases else None

    def _compile_leases(self, no_lease: bool) -> Any:
        """The process's compile leases (False: none). A cache that trusts keys has none: a
        service's entry counts there only when a trusted key signed it, so nobody would wait."""
        if no_lease or not compile_lease.lease_enabled():
            return False
        settings, digest = self._args[0], self._args[1]

        def lessor() -> compile_lease.Lessor | None:
            index = self._held_index()
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
