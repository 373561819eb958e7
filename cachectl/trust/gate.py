"""The gate: bytes reach JAX's loader only when their sha256 matches a record this cache trusts.

This module owns that rule, for every read path: JAX's persistent cache in ``activate()`` and in
a process ``cachectl exec`` started (:class:`EntryGate`, installed by
``service/namespace_verifier.py`` through ``jax_seam.install_verifying_cache``), the stored
executables of ``cachectl.serving`` and warm-check's children (:func:`load_executable`, the one
place an ``-aot`` file is unpickled), ``verify --deep``'s loading child
(:func:`deserialize_entry`), ``pull``, the node tier online and offline, the compile lease's
waiters and ``bundle install`` (:func:`matches`, the one comparison). No other module reads an
entry or a stored executable for loading, or deserializes one (tests/test_architecture.py).

The records it trusts, one per fact (:meth:`EntryGate.accepts`):

- the index row of an authorized writer (a cache that never had keys), or a content list a
  trusted key signed (``CACHECTL_TRUST``, else the keys pinned for this cache in the owner's
  state file, ``trust/pins.py``, else the index's, which are then pinned): the fact;
- this process's own ``put``: the bytes it handed JAX (its own compile), for that key, in this
  process;
- the sha256s this owner's earlier processes handed JAX's ``put`` (``pins.written``), only for a
  key the index has no row for (not indexed yet): never over a row, so an entry ``warm``
  rewrote is the one every later process loads;
- with the index unreachable, the copy of its rows the node tier kept when it last answered
  (``.cachectl-verified.json``, written only from a verified answer).

Every writer records the sha256 of the bytes it handed ``put`` (or compiled), never of a file
read back: JAX's ``put`` skips a key whose file exists, so a file read back may be anyone's.
Where nothing can verify (no index and no key), nothing loads unless the process opted in to
running unverified code (``CACHECTL_RUN_UNVERIFIED_CODE=1``, ``activate(run_unverified_code=True)``).
One answer per namespace and process (:func:`namespace_verified`, one index query at the first
need).
"""

from __future__ import annotations

import hashlib
import io
import pickle
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from cachectl.core import jax_seam
from cachectl.core.config import RUN_UNVERIFIED_ENV, Settings
from cachectl.core.errors import BadInput, NotFound
from cachectl.storage.entries import CACHE_SUFFIX, EXECUTABLE_SUFFIX, CorruptEntry, entry_payload
from cachectl.trust import pins
from cachectl.trust.signing import (
    Coverage,
    Untrusted,
    pinned_keys,
    stored_signature,
    verified_files,
)

if TYPE_CHECKING:
    from cachectl.index.protocol import IndexBackend
    from cachectl.storage.executables import ExecutableHeader
    from cachectl.storage.node_tier import NodeFiles


class Indexed(NamedTuple):
    """A verified record of one stored executable: its entry's and its own sha256, and why
    warm-check found it unusable (None: usable, or never checked)."""

    sha256: str
    aot_sha256: str | None
    unusable: str | None = None


class Verified(dict[str, Indexed]):
    """key -> (entry sha256, executable sha256) from a verified record: the index's rows, or
    a content list a trusted key signed. ``refusal`` is a bucket's reason when its key is absent."""

    def __init__(self, shas: dict[str, Indexed], refusal: str, *, trusted: bool = False) -> None:
        super().__init__(shas)
        self.refusal = refusal
        self.trusted = trusted  # the cache trusts signing keys: only a signed list counts


UNINDEXED = "the index does not know this stored executable (run `cachectl sync`)"


def _from_signed(
    files: dict[str, tuple[int, str]], refusal: str, unusable: dict[str, str | None]
) -> Verified:
    """The keys whose entry a trusted key signed, with their executable's sha256 when that was
    signed too (with warm-check's marks from the index, which can only refuse more)."""
    shas: dict[str, Indexed] = {}
    for name, (_, sha) in files.items():
        if name.endswith(CACHE_SUFFIX):
            key = name[: -len(CACHE_SUFFIX)]
            aot = files.get(key + EXECUTABLE_SUFFIX)
            shas[key] = Indexed(sha, aot[1] if aot else None, unusable.get(key))
    return Verified(shas, refusal)


class _IndexSays(NamedTuple):
    keys: tuple[str, ...] | None  # None: the index did not answer
    signed: dict[str, Any] | None
    shas: dict[str, Indexed] | None


# How a service opens its index: service/activate.py open_service_index (passed in, so that
# activate() imports this module only at its first compile, and no import cycle forms).
OpenIndex = Callable[[Settings, list[str]], tuple[Any, Any]]


def _read_index(
    settings: Settings,
    digest: str,
    problems: list[str],
    open_index: OpenIndex,
    held: IndexBackend | None,
) -> _IndexSays:
    """The cache's trusted keys, the environment's signed list and its recorded sha256s: three
    small reads on ``held`` (the index activate() opened), else on one opened (and closed) here."""
    from cachectl.index import reads  # the read SQL: a service's first compile, not its import

    index = held if held is not None else open_index(settings, problems)[0]
    if index is None:
        return _IndexSays(None, None, None)
    keys: tuple[str, ...] | None = None
    signed: dict[str, Any] | None = None
    shas: dict[str, Indexed] | None = None
    try:
        keys = tuple(index.get_cache(settings.cache).trusted_keys or ())
        env = index.find_environment(settings.cache, digest)
        if index.dialect == "remote":  # the server's rows, over HTTP
            shas = {
                e.key: Indexed(e.sha256, e.aot_sha256, getattr(e, "aot_unusable", None))
                for e in index.list_entries(env.id)
            }
        else:
            signed = reads.Queries(index.reader).content_signature(env.id)
            shas = {
                k: Indexed(*row)
                for k, row in reads.executable_digests(index.reader, env.id).items()
            }
    except NotFound as exc:  # an environment the index does not know yet: nothing verified
        shas = {} if keys is not None else None
        problems.append(exc.message)
    except Exception as exc:  # noqa: BLE001 - unknown environment or index error
        problems.append(str(exc) or type(exc).__name__)
    finally:
        if held is None:
            index.close()
    return _IndexSays(keys, signed, shas)


def _trusted(
    settings: Settings, said: _IndexSays, warnings: list[str], prefix: str
) -> tuple[str, ...]:
    """The keys this service trusts for the cache: its own setting, else the pin, else the
    index's (pinned now); a pin the index contradicts stays, and the warning says so."""
    own = pinned_keys(settings)
    if own:
        return own
    problems: list[str] = []
    where = settings.server or settings.db
    remembered = pins.pinned(where, settings.cache, problems)
    index_keys = said.keys or ()
    if remembered:
        if said.keys is not None and not index_keys:
            warnings.append(
                f"{prefix}: the index lists no trusted keys for cache {settings.cache!r}, but "
                f"keys are pinned for it in {pins.pins_path()}: the pinned keys still apply"
            )
        elif said.keys is not None and set(index_keys) != set(remembered):
            warnings.append(
                f"{prefix}: the index lists other trusted keys for cache {settings.cache!r} than "
                f"those pinned in {pins.pins_path()}: only the pinned keys are trusted (set "
                "CACHECTL_TRUST, or edit that file, to trust others)"
            )
        trusted = remembered
    else:
        trusted = index_keys
        if index_keys:
            pins.pin(where, settings.cache, index_keys, problems)
    warnings.extend(f"{prefix}: trust pins: {p}" for p in problems)
    return tuple(trusted)


def _verify(
    settings: Settings,
    digest: str,
    namespace: str,
    read: Callable[[str], bytes],
    warnings: list[str],
    unverified_ok: bool,
    open_index: OpenIndex,
    held: IndexBackend | None,
    node: NodeFiles | None,
) -> Verified | None:
    prefix = "cachectl"
    problems: list[str] = []
    where = f"namespace {namespace}"
    try:
        said = _read_index(settings, digest, problems, open_index, held)
        trusted = _trusted(settings, said, warnings, prefix)
    except BadInput as exc:  # a bad pin or CACHECTL_TRUST: nothing can be trusted
        warnings.append(f"{prefix}: {exc.message}; nothing is read from cache {settings.cache!r}")
        return Verified({}, f"refused: {exc.message}", trusted=True)
    if trusted:
        reasons = []
        for doc in [d for d in (said.signed, stored_signature(read)) if d is not None]:
            try:
                files = verified_files(doc, trusted, digest, where)
            except (Untrusted, BadInput) as exc:  # BadInput: a damaged pinned key
                reasons.append(exc.message)
                continue
            marks = {k: v.unusable for k, v in (said.shas or {}).items()}
            found = _from_signed(files, Coverage(files).reason(), marks)
            found.trusted = True
            return found
        why = "; ".join(reasons) or f"{where} has no signed content list"
        warnings.append(
            f"{prefix}: nothing is read from cache {settings.cache!r} ({why}): it trusts only "
            "content a trusted key signed; every program compiles in memory (sign it with a "
            "trusted key: `cachectl warm --sign-key`)"
        )
        return Verified({}, f"refused: {why}", trusted=True)
    if said.shas is not None:
        if node is not None and said.shas:
            node.keep_record({k: list(v) for k, v in said.shas.items()})
        return Verified(said.shas, UNINDEXED)
    kept = node.record() if node is not None else None
    if node is not None and kept:
        warnings.append(
            f"{prefix}: the index cannot be reached ({'; '.join(problems)}): reading the "
            f"{len(kept)} entries this node fetched and verified before ({node.directory})"
        )
        shas = {k: Indexed(str(v[0]), v[1], v[2] if len(v) > 2 else None) for k, v in kept.items()}
        return Verified(shas, UNINDEXED)
    if unverified_ok:
        warnings.append(
            f"{prefix}: cache {settings.cache!r} is read UNVERIFIED ("
            + "; ".join(problems)
            + f"): {RUN_UNVERIFIED_ENV} is set, so this process runs code that anyone who can "
            "write the cache may have put there"
        )
        return None
    warnings.append(
        f"{prefix}: nothing is read from cache {settings.cache!r}: it cannot be verified ("
        + "; ".join(problems)
        + "): no index to check its sha256s and no trusted keys; every program compiles in "
        f"memory (start the index, set CACHECTL_TRUST, or set {RUN_UNVERIFIED_ENV}=1 to run "
        "unverified code that anyone who can write the cache may have put there)"
    )
    return None


_LOCK = threading.Lock()
_DONE: dict[tuple[str, str, str, bool], tuple[Verified | None, tuple[str, ...]]] = {}


def namespace_verified(
    settings: Settings,
    digest: str,
    namespace: str,
    read: Callable[[str], bytes],
    warnings: list[str],
    unverified_ok: bool,
    open_index: OpenIndex,
    *,
    held: IndexBackend | None = None,
    first_only: bool = False,
    node: NodeFiles | None = None,
) -> Verified | None:
    """What may load from this namespace (None: nothing can verify it); asked once per process,
    its warnings added to ``warnings`` each time (``first_only``: only by the call that asked,
    so that one warning is printed once where another caller prints it). ``held``: an index the
    caller holds open (Activation.index), asked instead of opening one. ``node``: the node tier
    (storage/node_tier.py), which keeps the index's record for a restart with the index gone."""
    ident = (settings.server or settings.db, settings.cache, digest, unverified_ok)
    with _LOCK:
        done = _DONE.get(ident)
        asked = done is None
        if done is None:
            said: list[str] = []
            found = _verify(
                settings, digest, namespace, read, said, unverified_ok, open_index, held, node
            )
            done = (found, tuple(said))
            _DONE[ident] = done
    if asked or not first_only:
        warnings.extend(done[1])
    return done[0]


# -- the one comparison ------------------------------------------------------------------------


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def matches(data: bytes, sha256: str | None) -> bool:
    """Whether ``data`` is the bytes a trusted record names (None: no record, never)."""
    return sha256 is not None and sha256_of(data) == sha256


# -- JAX's persistent cache --------------------------------------------------------------------


class EntryGate(jax_seam.EntryVerifier):
    """What JAX's persistent cache's ``get`` hands JAX in one namespace (the verifying cache,
    core/jax_cache_io.py, asks :meth:`get` and tells :meth:`put`): an entry only when its sha256
    is one :meth:`accepts` names. The hooks (``read_entry``, ``missed``, ``refused``,
    ``after_put``) are the service's: the node tier, the compile lease, the uploads
    (service/namespace_verifier.py)."""

    def __init__(
        self,
        settings: Settings,
        digest: str,
        namespace: str,
        read: Callable[[str], bytes],
        warn: Callable[[str], None],
        unverified_ok: bool,
        open_index: OpenIndex,
        held: Callable[[], IndexBackend | None],
        node: NodeFiles | None,
    ) -> None:
        self._args = (settings, digest, namespace, read)
        self._warn = warn
        self._unverified_ok = unverified_ok
        self._open_index = open_index
        self._held = held
        self._node = node
        self._rows: dict[str, str] | None = None
        self._verified: Verified | None = None
        self._any = False
        self._earlier: dict[str, str] = {}  # pins.written: this owner's earlier puts
        self._puts: dict[str, set[str]] = {}  # this process's own puts
        self._handed: dict[str, str] = {}  # key -> sha256 of the bytes last handed to JAX
        self._lock = threading.Lock()

    def records(self) -> dict[str, str]:
        """The verified record's entry sha256s (asked at the first lookup, once)."""
        with self._lock:
            if self._rows is None:
                warnings: list[str] = []
                found = namespace_verified(
                    *self._args,
                    warnings,
                    self._unverified_ok,
                    self._open_index,
                    held=self._held(),
                    first_only=True,  # cachectl.serving, which asked first, printed them
                    node=self._node,
                )
                self._verified = found
                self._rows = {k: v.sha256 for k, v in (found or {}).items()}
                settings, digest = self._args[0], self._args[1]
                self._earlier = pins.written(
                    settings.server or settings.db, settings.cache, digest, warnings
                )
                self._any = found is None and self._unverified_ok
                for line in warnings:
                    self._warn(line)
            return self._rows

    @property
    def nothing_verifies(self) -> bool:
        """Whether no record can vouch for anything (or the cache trusts keys): no lease."""
        self.records()
        return self._verified is None or self._verified.trusted

    def accepts(self, key: str) -> tuple[str, ...] | None:
        """The sha256s the entry at ``key`` may have, the record of the fact first: the index
        row (or the signed list), then this process's own puts, then (only where the record
        has no row) what this owner's earlier processes handed ``put``. None: anything (the
        process opted in to unverified code)."""
        rows = self.records()
        if self._any:
            return None
        with self._lock:
            own = sorted(self._puts.get(key, ()))
        row = rows.get(key)
        found = [row] if row is not None else []
        found += [s for s in own if s != row]
        if row is None:
            earlier = self._earlier.get(key)
            if earlier is not None and earlier not in found:
                found.append(earlier)
        return tuple(found)

    def get(self, key: str, base: Callable[[str], bytes | None]) -> bytes | None:
        """JAX's ``get``: the entry's bytes when a record names their sha256, else a miss
        (through the compile lease: ``missed``), so JAX compiles."""
        accepted = self.accepts(key)
        if accepted is None:
            return self.read_entry(key, jax_seam.ANY_ENTRY, base)
        data = self.read_entry(key, accepted[0], base) if accepted else None
        if data is None:  # a waiter's read, checked by the lease against its holder's put
            data = self.missed(key, lambda k: self.read_entry(k, jax_seam.ANY_ENTRY, base))
            if data is not None:
                with self._lock:
                    self._handed[key] = sha256_of(data)
            return data
        sha = sha256_of(data)
        if sha not in accepted:
            self.refused(key, "its sha256 differs from its verified record")
            return None
        with self._lock:
            self._handed[key] = sha
        return bytes(data)

    def handed(self, key: str) -> str | None:
        with self._lock:
            return self._handed.get(key)

    def put(self, key: str, value: bytes) -> None:
        """JAX's ``put`` was handed ``value`` for ``key`` (whether or not it wrote it: JAX skips a
        key whose file exists): this process may read back exactly these bytes, and every writer
        records their sha256, never a file read back."""
        sha = sha256_of(value)
        with self._lock:
            self._puts.setdefault(key, set()).add(sha)
            self._handed[key] = sha
        settings, digest = self._args[0], self._args[1]
        pins.remember_written(settings.server or settings.db, settings.cache, digest, key, sha)
        self.after_put(key, sha, value)

    def after_put(self, key: str, sha256: str, value: bytes) -> None:
        """What else a writer does with the bytes it handed ``put`` (uploads, the lease)."""

    def read_entry(
        self, key: str, expected: str, base: Callable[[str], bytes | None]
    ) -> bytes | None:
        """The read path: the bytes read for ``key`` (checked by :meth:`get` against the records;
        ``expected`` lets a node tier check what it fetches). ``base`` is JAX's own get."""
        return base(key)

    def missed(self, key: str, read: Callable[[str], bytes | None]) -> bytes | None:
        """No record names the bytes at ``key``: another process's compile to use after all
        (service/compile_lease.py checks it against the sha256 its lease row recorded from the
        writer's put), or None to compile."""
        return None

    def refused(self, key: str, why: str) -> None:
        """The entry at ``key`` was read and refused (``why``); JAX compiles it in memory."""


# -- stored executables and entries outside JAX's cache --------------------------------------


def _executables() -> Any:
    """storage/executables.py, imported at the first load (it imports the manifest's schema,
    which a plain ``activate()`` never needs)."""
    from cachectl.storage import executables

    return executables


def load_executable(
    key: str,
    read: Callable[[str], bytes],
    indexed: Verified | None,
    *,
    devices: Any = None,
) -> tuple[ExecutableHeader, Any]:
    """Read a stored executable and its JAX entry, refuse either unless its sha256 is the
    verified record's (``indexed``; None only where the process opted in to unverified code),
    then deserialize: the one place an ``-aot`` is unpickled. Raises ExecutableError,
    CorruptEntry or OSError."""
    executables = _executables()
    data = read(key + EXECUTABLE_SUFFIX)
    entry = read(key + CACHE_SUFFIX)
    if indexed is not None:
        known = indexed.get(key)
        if known is None or not matches(data, known.aot_sha256):
            raise executables.ExecutableError(
                "refused: its sha256 differs from its verified record"
            )
        if not matches(entry, known.sha256):
            raise executables.ExecutableError(
                "refused: the JAX entry's sha256 differs from its verified record"
            )
    return _deserialize_executable(data, entry, devices)


def _deserialize_executable(
    data: bytes, entry_bytes: bytes, devices: Any
) -> tuple[ExecutableHeader, Any]:
    """Rebuild the ``jax.stages.Compiled`` from an artifact and its JAX entry's bytes (checked by
    the caller). Raises CorruptEntry for bytes that are not an intact artifact, ExecutableError
    when the entry is not the one the artifact was made with or JAX refuses to load it."""
    import jax

    executables = _executables()
    header, payload = executables.split_artifact(data)
    if sha256_of(entry_bytes) != header.entry_sha256:
        raise executables.ExecutableError(
            "the JAX entry is not the one this executable was stored with (sha256 differs)"
        )
    if header.jax_version != jax.__version__:
        raise executables.ExecutableError(
            f"stored with jax {header.jax_version}, this process runs jax {jax.__version__}"
        )
    executable = entry_payload(entry_bytes)
    _, unpickler_base, _ = jax_seam.pjrt_pickler_classes()

    class _EntryRefUnpickler(unpickler_base):  # type: ignore[misc, valid-type]
        def persistent_load(self, pid: Any) -> Any:
            if tuple(pid) == executables.ENTRY_REF:
                return self.backend.deserialize_executable(
                    executable, executable_devices=self.execution_devices
                )
            return super().persistent_load(pid)

    try:
        meta, in_tree, out_tree, device_ids = pickle.loads(payload)
        backend = (devices[0] if devices else jax.devices()[0]).client
        if devices:
            execution = list(devices)
        else:
            by_id = {d.id: d for d in backend.devices()}
            missing = [i for i in device_ids if i not in by_id]
            if missing:
                raise executables.ExecutableError(
                    f"stored for devices {device_ids}; this process has no device {missing[0]}"
                )
            execution = [by_id[i] for i in device_ids]
        unloaded, args_info_flat, no_kwargs = _EntryRefUnpickler(
            io.BytesIO(meta), backend, execution
        ).load()
        if in_tree is None or out_tree is None:
            compiled = executables.Unbound(
                unloaded.load(), args_info_flat, out_tree, no_kwargs, in_tree
            )
        else:
            compiled = jax_seam.make_compiled(
                unloaded.load(), in_tree.unflatten(args_info_flat), out_tree, no_kwargs
            )
    except (executables.ExecutableError, CorruptEntry):
        raise
    except Exception as exc:  # noqa: BLE001 - whatever JAX raises, the caller falls back to jit
        raise executables.ExecutableError(
            f"JAX could not load the stored executable: {type(exc).__name__}: {exc}"
        ) from None
    return header, compiled


def deserialize_entry(data: bytes, sha256: str, devices: list[Any]) -> None:
    """``verify --deep``'s child: load a JAX entry's executable as JAX's own cache hit does (on
    every device, else a one-device program on the first), only when its bytes are the index
    row's (``sha256``). Raises CorruptEntry, ExecutableError, or whatever JAX raises."""
    if not matches(data, sha256):
        raise _executables().ExecutableError("refused: its sha256 differs from its index row")
    executable = entry_payload(data)
    backend = devices[0].client
    try:
        backend.deserialize_executable(executable, executable_devices=jax_seam.device_list(devices))
    except Exception:  # noqa: BLE001 - a one-device program: try its own device list
        backend.deserialize_executable(
            executable, executable_devices=jax_seam.device_list(devices[:1])
        )
