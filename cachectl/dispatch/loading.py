"""Loading stored executables: which one serves each bucket, checked against the index, read once."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cachectl.core import jax_seam
from cachectl.core.config import load_settings
from cachectl.manifest import Bucket, FunctionSpec
from cachectl.service import node_source
from cachectl.service.service_index import open_service_index
from cachectl.storage import executables
from cachectl.storage.entries import (
    CACHE_SUFFIX,
    EXECUTABLE_SUFFIX,
    CorruptEntry,
    parse_aot_filename,
)
from cachectl.storage.node_tier import NodeFiles
from cachectl.storage.store import Store
from cachectl.trust.gate import Verified, load_executable, namespace_verified


class Slot:
    """One bucket: its values, its stored executable (loaded once), or why it falls back."""

    __slots__ = (
        "bucket",
        "values",
        "key",
        "header",
        "compiled",
        "error",
        "lock",
        "load_seconds",
        "refused",
        "_loader",
    )

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self.values = dict(bucket.values)
        self.key: str | None = None
        self.header: executables.ExecutableHeader | None = None
        self.compiled: Any = None
        self.error: str | None = None
        self.lock = threading.Lock()
        self.load_seconds = 0.0
        # A stored executable exists for this bucket and none may serve it here (warm-check
        # fails on it: serving would not use what warm stored).
        self.refused = False
        self._loader: Callable[[Slot], None] | None = None

    def ensure_loaded(self) -> None:
        if self.compiled is not None or self.error is not None:
            return
        with self.lock:
            if self.compiled is None and self.error is None and self._loader is not None:
                self._loader(self)


NOTHING_WARMED = "no stored executable for this bucket (run `cachectl warm`)"


class NothingReadable(Verified):
    """No stored executable of the namespace can be read, for one cause every bucket shares
    (the cache is not active, or nothing can verify it): serving's fallback reason names it,
    not "run warm" (a wrong token, an unknown cache or a server down is no missing warm)."""

    def __init__(self, cause: str) -> None:
        super().__init__({}, cause)
        self.cause = cause


def _short(text: str, limit: int = 300) -> str:
    """A warning's cause: "... it cannot be verified (WHY): no index to ..." gives WHY."""
    head, sep, rest = text.partition("it cannot be verified (")
    if sep:
        text = rest.rsplit("): no index", 1)[0]
    return text[:limit]


class Executables:
    """A namespace's stored executables: every header read once (in parallel), one chosen per
    bucket by :meth:`bind`, its bytes loaded (and checked against the index) by :meth:`load`."""

    def __init__(
        self,
        read: Callable[[str], bytes],
        names: list[str],
        indexed: Verified | None,
        on_load: Callable[[str, str], None] | None,
        warn: Callable[[str], None],
        workers: int | None,
    ) -> None:
        self._read = read
        self._indexed = indexed
        self._on_load = on_load
        self._warn = warn
        self._platform_version: str | None = None  # the running backend's, read at first need
        self._headers = self._read_headers(names, workers)

    def _read_headers(
        self, names: list[str], workers: int | None
    ) -> dict[tuple[str, str], list[tuple[str, executables.ExecutableHeader]]]:
        """Every stored executable's header, by (function, bucket): small reads, in parallel."""

        def read(name: str) -> tuple[str, executables.ExecutableHeader | None]:
            parsed = parse_aot_filename(name)
            if parsed is None:
                return name, None
            try:
                return parsed.key, executables.read_header(self._read(name))
            except (CorruptEntry, OSError) as exc:
                self._warn(f"cachectl.serving: ignoring {name}: {exc}")
                return parsed.key, None

        def read_run(run: list[str]) -> list[tuple[str, executables.ExecutableHeader | None]]:
            return [read(name) for name in run]

        found: dict[tuple[str, str], list[tuple[str, executables.ExecutableHeader]]] = {}
        if not names:
            return found
        # One task per thread, a run of names each, in order: a task per name cost more than
        # the reads (1,000 names: ~0.3 s of futures, on the way to the first answer).
        count = workers or min(8, len(names))
        size = -(-len(names) // count)
        runs = [names[i : i + size] for i in range(0, len(names), size)]
        with ThreadPoolExecutor(max_workers=count) as pool:
            for run in pool.map(read_run, runs):
                for key, header in run:
                    if header is not None and header.function is not None:
                        where = (header.function, json.dumps(header.bucket, sort_keys=True))
                        found.setdefault(where, []).append((key, header))
        return found

    def bind(self, slot: Slot, spec: FunctionSpec, binding: executables.FunctionBinding) -> None:
        """Choose this bucket's stored executable, or say why it will be served by jit."""
        candidates = self._headers.get((spec.name, json.dumps(slot.values, sort_keys=True)), [])
        if not candidates:
            slot.error = getattr(self._indexed, "cause", None) or NOTHING_WARMED
            return
        slot.refused = True  # until one is chosen: stored, and not usable here
        reasons = []
        for key, header in candidates:
            refused = self._other_backend(header) or binding.refusal(header, slot.values)
            if refused is not None:
                reasons.append(refused)
                continue
            if self._indexed is not None:
                known = self._indexed.get(key)
                if known is None or known[1] is None:
                    reasons.append(self._indexed.refusal)
                    continue
                if known.unusable is not None:
                    reasons.append(
                        f"warm-check found this stored executable unusable: {known.unusable}"
                    )
                    continue
            slot.key, slot.header, slot._loader = key, header, self.load
            slot.error, slot.refused = None, False
            return
        slot.error = reasons[0]

    def _other_backend(self, header: executables.ExecutableHeader) -> str | None:
        """Why an executable compiled for another backend version is refused (loading one may
        crash the process); None when the versions agree or the header does not say."""
        if header.platform_version is None:
            return None
        if self._platform_version is None:
            self._platform_version = str(jax_seam.default_backend().platform_version)
        if header.platform_version == self._platform_version:
            return None
        stored, here = (
            " ".join(v.split()) for v in (header.platform_version, self._platform_version)
        )
        reason = (
            f"refused: compiled for backend version {stored!r}, this backend is {here!r} "
            "(loading it could crash the process)"
        )
        return reason  # the function's one fallback warning says it (router._via_jit)

    def load(self, slot: Slot) -> None:
        """Load the bucket's executable through the gate (trust/gate.py ``load_executable``:
        both files' sha256s against the verified record, then deserialize); any failure
        becomes the slot's reason to serve through jit."""
        started = time.perf_counter()
        assert slot.key is not None
        try:
            header, compiled = load_executable(slot.key, self._read, self._indexed)
            # Kernels JAX readies only when it lowers (LAPACK, ...): ready before the first call.
            problems = jax_seam.prepare_custom_calls(header.custom_calls)
            if problems:
                raise executables.ExecutableError("; ".join(problems))
            slot.compiled = compiled
        except FileNotFoundError as exc:
            slot.error = f"stored executable unavailable ({exc})"
        except (executables.ExecutableError, CorruptEntry, OSError) as exc:
            slot.error = str(exc)
        finally:
            slot.load_seconds = time.perf_counter() - started
        if slot.compiled is not None and self._on_load is not None:
            with contextlib.suppress(Exception):  # telemetry never breaks serving
                self._on_load(slot.key.rsplit("-", 1)[0], slot.key)

    # -- public -----------------------------------------------------------------


def namespace_reader(
    activation: Any, db: str | None, warnings: list[str]
) -> tuple[Callable[[str], bytes], list[str], Verified | None]:
    """Read files of the activated namespace, list its executables, and the verified sha256s."""

    def unreadable(name: str) -> bytes:
        raise FileNotFoundError(name)

    if not activation.active:
        warnings.append(
            "cachectl.serving: the cache is not active; every call goes through jax.jit"
        )
        why = (activation.warning or "").removeprefix("cachectl: ").splitlines()
        return (
            unreadable,
            [],
            NothingReadable("the cache is not active" + (f" ({_short(why[0])})" if why else "")),
        )
    node = node_source.opened(activation.path)
    if node is not None:
        return _node_reader(activation, db, node, warnings)
    try:
        store = Store(activation.path, getattr(activation, "storage_options", None) or None)
        names = [
            f.path
            for f in store.list("")
            if f.path.endswith(EXECUTABLE_SUFFIX) and "/" not in f.path
        ]
    except Exception as exc:  # noqa: BLE001 - storage down: serve through jit
        warnings.append(
            f"cachectl.serving: cannot list {activation.path} ({type(exc).__name__}: {exc}); "
            "serving through jax.jit"
        )
        return unreadable, [], None
    return store.read_bytes, names, _verified_shas(activation, db, store.read_bytes, warnings)


def _node_reader(
    activation: Any, db: str | None, node: node_source.RemoteFiles, warnings: list[str]
) -> tuple[Callable[[str], bytes], list[str], Verified | None]:
    """Through the node tier (service/node_source.py): the stored executables the verified
    record names, each read from this node or fetched once from the remote and checked."""
    verified = _verified_shas(
        activation, db, lambda name: node.read(name, None), warnings, node.files
    )
    if verified is None:  # unverified code opted in: what this node holds
        names = sorted(n for n in os.listdir(node.directory) if n.endswith(EXECUTABLE_SUFFIX))
    else:
        names = sorted(k + EXECUTABLE_SUFFIX for k, v in verified.items() if v.aot_sha256)

    def read(name: str) -> bytes:
        sha = None
        for suffix in (EXECUTABLE_SUFFIX, CACHE_SUFFIX):
            known = verified.get(name[: -len(suffix)]) if verified is not None else None
            if known is not None and name.endswith(suffix):
                sha = known.aot_sha256 if suffix == EXECUTABLE_SUFFIX else known.sha256
        return node.read(name, sha)

    return read, names, verified


def _verified_shas(
    activation: Any,
    db: str | None,
    read: Callable[[str], bytes],
    warnings: list[str],
    node: NodeFiles | None = None,
) -> Verified | None:
    """What executables may load, and their sha256s (cachectl/trust/gate.py, the same
    answer JAX's own cache gets); nothing where nothing can verify, unless the process opted in
    to running unverified code: then None, and the warning says so."""
    settings = load_settings(db=db, cache=activation.cache)
    unverified_ok = bool(getattr(activation, "run_unverified_code", False))
    said: list[str] = []
    found = namespace_verified(
        settings,
        activation.digest,
        activation.namespace,
        read,
        said,
        unverified_ok,
        open_service_index,
        held=getattr(activation, "index", None),  # the index activate() opened: never a second
        node=node,
    )
    warnings.extend(said)
    if found is not None or unverified_ok:
        return found
    why = next((w for w in said if "cannot be verified" in w), "")
    return NothingReadable(
        f"refused: cache {activation.cache!r} cannot be verified"
        + (f" ({_short(why)})" if why else "")
    )
