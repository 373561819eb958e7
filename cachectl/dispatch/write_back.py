"""Write-back: a writer service in server mode stores the executables of the buckets it compiled.

A replica of a cold fleet on ``cachectl.serving`` (``readonly=False``, a cache with
``--service-writes allow``, a writer token, the root not on this machine) finds a bucket with
no stored executable. Rather than call ``jax.jit`` for good, it compiles the bucket once at the
manifest's abstract call (as warm lowers it: the same key), through JAX's persistent cache as
activate() set it up: the node tier, the compile lease, the verifying read. JAX then holds the
entry in this node's tier, the server's bytes (a hit, verified) or its own (a miss, which the
service uploaded before its lease said written: service/node_upload.py). The bucket's executable
is made for those bytes and sent over the same route as warm's (``node_upload.upload``), which
the server checks as any upload: the next replica loads it, trace-free, without a warm.

Nothing here hands JAX bytes: JAX reads its entries through the verifying cache only. A bucket
whose executable cannot be made or is refused is served through jit as before, with one warning.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from cachectl.core import jax_seam
from cachectl.core.config import load_settings
from cachectl.index.open import driver
from cachectl.manifest import build_call, lowering_scope
from cachectl.service import node_source
from cachectl.service.node_upload import upload
from cachectl.storage import executables

log = logging.getLogger("cachectl.dispatch")


class WriteBack:
    """One serving process's write-back: each bucket tried once."""

    def __init__(
        self,
        client_of: Callable[[], Any],
        cache: str,
        digest: str,
        directory: str,
        paths: tuple[str, ...],
        warn: Callable[[str], None],
    ) -> None:
        self._client_of = client_of
        self._client: Any = None
        self.cache, self.digest, self.directory, self._paths = cache, digest, directory, paths
        self._warn = warn
        self._tried: set[int] = set()
        self._lock = threading.Lock()
        self._warned = False
        self.sent = 0

    def compiled(self, served: Any, slot: Any) -> Any | None:
        """The bucket compiled here, its executable uploaded; None: serve it through jit."""
        with self._lock:
            if id(slot) in self._tried:
                return None
            self._tried.add(id(slot))
        try:
            args, kwargs = build_call(served.spec, slot.bucket, self._paths)
            with lowering_scope():
                lowered = served._jit().lower(*args, **kwargs)
            key = jax_seam.persistent_cache_key(lowered)
            compiled = lowered.compile()  # JAX's cache: a hit, or a compile under the lease
            payload = executables.payload_of(compiled)
        except Exception as exc:  # noqa: BLE001 - that bucket goes through jit, as before
            self._say(served.name, f"{type(exc).__name__}: {exc}")
            return None
        if key is None:
            self._say(served.name, "JAX gave this program no persistent-cache key")
            return compiled
        gate = jax_seam.verifier_at(self.directory)
        entry_sha256 = gate.handed(key) if gate is not None else None
        if entry_sha256 is None:  # bound to the bytes the gate handed JAX, never a file read back
            self._say(served.name, "JAX was handed no verified entry for it on this node")
            return compiled
        data = executables.pack(
            payload,
            key=key,
            entry_sha256=entry_sha256,
            function=served.name,
            bucket=dict(slot.values),
            spec_digest=executables.spec_digest(served.spec),
            source_digest=executables.source_digest(served._fn),
            custom_calls=jax_seam.custom_call_targets(compiled),
            platform_version=str(jax_seam.default_backend().platform_version),
        )
        with self._lock:
            if self._client is None:
                self._client = self._client_of()
        if self._client is None:
            self._say(served.name, "no server client")
            return compiled
        failed = upload(self._client, self.cache, self.digest, key, None, data)
        if failed is not None:
            self._say(served.name, failed)
        else:
            self.sent += 1
        return compiled

    def _say(self, name: str, why: str) -> None:
        with self._lock:
            if self._warned:
                return
            self._warned = True
        self._warn(
            f"cachectl.serving: {name}: could not store the executable of a bucket compiled "
            f"here ({why.splitlines()[0][:300]}): other replicas compile it "
            "until `cachectl warm` stores it"
        )


def for_serving(
    activation: Any, paths: tuple[str, ...], warn: Callable[[str], None]
) -> WriteBack | None:
    """The write-back of a serving process that writes through the node tier in server mode;
    None for any other (a reader, a root or bucket this machine reads itself)."""
    if not activation.active or activation.readonly:
        return None
    node = node_source.opened(activation.path)
    if node is None or not node.via_server:
        return None
    settings = load_settings(cache=activation.cache)

    def client() -> Any:
        return getattr(driver("http")(settings, "service"), "client", None)

    return WriteBack(client, activation.cache, activation.digest, node.directory, paths, warn)
