"""Stored executables: a compiled bucket a service calls without tracing, lowering or compiling.

A ``<key>-aot`` file sits beside the JAX entry ``<key>-cache`` it belongs to. It
holds what ``jax.experimental.serialize_executable.serialize`` pickles (the
unloaded executable with its shardings and avals, the arguments' info) and the
input/output pytree structures, but not the XLA executable itself: that is
pickled as a reference to the JAX entry, whose bytes JAX already stores. Loading
reads both files, checks the entry is the one the artifact was made with
(sha256), and rebuilds a ``jax.stages.Compiled``. So a namespace gains a few KB
per bucket, not a second copy of every program (docs/jax-facts.md, fact 7 for why loading is trusted).

Loading an artifact is code execution, like loading a JAX entry: only the gate
(cachectl/trust/gate.py ``load_executable``) loads one, after its sha256 and its entry's
matched a record the cache trusts; this module packs artifacts and reads their headers.

Every JAX internal this reads (the pickler classes, the private parts of a
``jax.stages.Compiled``) is in cachectl/core/jax_seam.py, pinned by tests/test_jax_seam.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
from dataclasses import dataclass
from typing import Any

from cachectl.core import jax_seam
from cachectl.manifest.schema import as_data
from cachectl.storage.entries import EXECUTABLE_SUFFIX, CorruptEntry

MAGIC = b"CCTLAOT\x01"
FORMAT = 1
# The header is JSON of a few hundred bytes; anything larger is not ours.
_MAX_HEADER = 64 * 1024
_LEN_BYTES = 4
# What the payload holds in place of the XLA executable.
ENTRY_REF = ("cachectl-entry",)


class ExecutableError(Exception):
    """An artifact that cannot be used here: corrupt, for another entry, or refused by JAX."""


@dataclass(frozen=True)
class ExecutableHeader:
    """What an artifact says about itself, readable without unpickling anything."""

    key: str
    entry_sha256: str
    function: str | None
    bucket: dict[str, Any] | None
    jax_version: str
    jaxlib_version: str
    payload_sha256: str
    format: int = FORMAT
    # What the runtime compares before loading (FunctionBinding.refusal): the function's
    # manifest entry (whole, as stored before per-bucket binding), the file defining it, and
    # (binding_digest) the function's entry as it shapes this bucket's program, with the
    # bucket's values. An executable of other code must not be served.
    spec_digest: str | None = None
    source_digest: str | None = None
    # The custom-call targets the executable calls (jax_seam.custom_call_targets), which the
    # runtime makes ready before loading it; None (stored before they were recorded): unknown.
    custom_calls: list[str] | None = None
    # The backend's platform_version it was compiled for (libtpu's build on TPU): the runtime
    # refuses it on any other backend version, where loading may crash the process. None:
    # stored before it was recorded.
    platform_version: str | None = None
    # binding_entry's digest with this bucket's values; None: stored before it was recorded,
    # then spec_digest (the whole entry) must match.
    binding_digest: str | None = None
    # The sha256 of each file the function's ``depends_on`` names (by the name written there);
    # None: stored before it was recorded, or for a function that names none.
    depends_on: dict[str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "key": self.key,
            "entry_sha256": self.entry_sha256,
            "function": self.function,
            "bucket": self.bucket,
            "jax_version": self.jax_version,
            "jaxlib_version": self.jaxlib_version,
            "payload_sha256": self.payload_sha256,
            "spec_digest": self.spec_digest,
            "source_digest": self.source_digest,
            "custom_calls": self.custom_calls,
            "platform_version": self.platform_version,
            "binding_digest": self.binding_digest,
            "depends_on": self.depends_on,
        }


def spec_digest(spec: Any) -> str:
    """What warm and the runtime must agree on about one function: its manifest entry, as
    compact JSON (the bytes pydantic's ``model_dump_json`` gave when the schema was pydantic's
    models, so executables stored then still match; tests/test_manifest.py pins it)."""
    text = json.dumps(
        as_data(spec, program=True), separators=(",", ":"), ensure_ascii=False, default=str
    )
    return hashlib.sha256(text.encode()).hexdigest()


# Fields of a function entry that shape no bucket's program: which buckets exist (``buckets``,
# ``exclude``) and how serving cuts outputs. With each argument's ``pad`` (what serving pads
# with), they are left out of the binding, so adding a bucket, or naming the function in a
# second manifest with other buckets, leaves every other bucket's executable bound.
_UNBOUND_FIELDS = ("buckets", "exclude", "outputs")
_UNBOUND_ARG_FIELDS = ("pad",)


def binding_entry(spec: Any) -> str:
    """The part of a function's manifest entry one bucket's program depends on, as compact
    JSON: its name and ``fn``, args, kwargs, jit options and mesh (``as_data(program=True)``
    without the fields above)."""
    data = as_data(spec, program=True)
    for name in _UNBOUND_FIELDS:
        data.pop(name, None)
    data["args"] = [
        {k: v for k, v in arg.items() if k not in _UNBOUND_ARG_FIELDS} for arg in data["args"]
    ]
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def binding_digest(entry: str, bucket: dict[str, Any]) -> str:
    """What one bucket's executable is bound to: ``binding_entry`` and the bucket's values."""
    values = json.dumps(bucket, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(f"{entry}\n{values}".encode()).hexdigest()


@dataclass(frozen=True)
class FunctionBinding:
    """What a function's stored executables must have been stored for, computed once per
    function by warm and by the runtime; :meth:`refusal` is the one check both make."""

    entry: str
    spec_digest: str
    source_digest: str | None
    # (name as depends_on writes it, the file's sha256 here; None: it cannot be read here).
    files: tuple[tuple[str, str | None], ...] = ()

    @classmethod
    def of(cls, spec: Any, fn: Any) -> FunctionBinding:
        files = tuple((name, _file_sha256(path)) for name, path in spec.depends_on_files())
        return cls(
            binding_entry(spec),
            spec_digest(spec),
            source_digest(fn) if fn is not None else None,
            files,
        )

    def digest(self, bucket: dict[str, Any]) -> str:
        return binding_digest(self.entry, bucket)

    def depends_on(self) -> dict[str, str] | None:
        """What a header records of the ``depends_on`` files (only those read here)."""
        return {name: sha for name, sha in self.files if sha is not None} or None

    def refusal(self, header: ExecutableHeader, bucket: dict[str, Any]) -> str | None:
        """Why ``header``'s executable must not serve ``bucket`` of this function; None: it
        may. One stored before per-bucket binding (no binding_digest) is accepted only when
        its whole manifest entry is this one, which proves the program the same."""
        if header.binding_digest is not None:
            if header.binding_digest != self.digest(bucket):
                return (
                    "stored for another program of this bucket: the function's args, kwargs, "
                    "jit options or mesh in the manifest differ from warm's (run `cachectl warm`)"
                )
        elif header.spec_digest is not None and header.spec_digest != self.spec_digest:
            return (
                "stored for another version of this function's manifest entry, before "
                "executables were bound per bucket (run `cachectl warm`: it stores it again)"
            )
        if (
            header.source_digest is not None
            and self.source_digest is not None
            and header.source_digest != self.source_digest
        ):
            return "stored for other source code of the function (its file changed since warm)"
        stored = header.depends_on or {}
        for name, sha in self.files:
            if sha is None:
                return f"refused: {name} (depends_on) cannot be read here"
            if name not in stored:
                return f"stored before {name} was named in depends_on (run `cachectl warm`)"
            if stored[name] != sha:
                return (
                    f"refused: {name} (depends_on) changed since warm: its sha256 is not the "
                    "one this executable was stored with (run `cachectl warm`)"
                )
        return None


def _file_sha256(path: Any) -> str | None:
    """sha256 of a file's bytes; None when it cannot be read."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            while block := fh.read(1 << 20):
                digest.update(block)
    except OSError:
        return None
    return digest.hexdigest()


def source_digest(fn: Any) -> str | None:
    """sha256 of the file that defines ``fn``: an executable of other code is stale."""
    import inspect
    from pathlib import Path

    try:
        path = inspect.getsourcefile(inspect.unwrap(fn))
        return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else None
    except (TypeError, OSError, ValueError):
        return None


def aot_filename(key: str) -> str:
    return key + EXECUTABLE_SUFFIX


def _pickler_classes() -> tuple[type, type, type]:
    return jax_seam.pjrt_pickler_classes()


def payload_of(compiled: Any) -> bytes:
    """The picklable part of ``compiled``: everything but its XLA executable, which stays in
    the JAX entry. Plain bytes, so a warm worker process can hand it to its parent.

    Raises ExecutableError when JAX cannot serialize this program (constants captured
    in the program, closed-over mutable arrays, a backend without serialization).
    """
    import jax

    pickler_base, _, loaded_type = _pickler_classes()
    # A compile for devices this machine does not have (warm --topology) holds an unloaded
    # executable: the same program as the JAX entry, so it is referenced, not copied, too.
    executable_types = (loaded_type, jax_seam.unloaded_executable_type())

    class _EntryRefPickler(pickler_base):  # type: ignore[misc, valid-type]
        def persistent_id(self, obj: Any) -> Any:
            if isinstance(obj, executable_types):
                return ENTRY_REF
            return super().persistent_id(obj)

    unloaded = jax_seam.unloaded_executable(compiled)
    if unloaded is None:
        raise ExecutableError("JAX cannot serialize this compiled program")
    if jax_seam.closes_over_mutable(unloaded):
        raise ExecutableError("the program closes over a mutable array: pass it as an argument")
    if jax_seam.captures_constants(compiled):
        raise ExecutableError(
            "the program captures constants (closed-over arrays): pass weights as arguments"
        )
    args_info_flat, in_tree = jax.tree_util.tree_flatten(compiled.args_info)
    try:
        with io.BytesIO() as buf:
            _EntryRefPickler(buf).dump((unloaded, args_info_flat, jax_seam.no_kwargs(compiled)))
            meta = buf.getvalue()
        # The devices it runs on: loading onto any other list breaks it (a 1-device
        # program loaded for all 4 host devices expects 4 shards per argument).
        device_ids = jax_seam.executable_device_ids(unloaded)
        # A custom node whose unpickled treedef is not the same (Equinox modules), or whose
        # static fields are callables pickle cannot take (a flax TrainState's apply_fn and
        # optax closures), is left out: the runtime takes the inputs' structure from the first
        # call and the outputs' from the function traced on it (Unbound), and checks every
        # leaf's aval as for any Compiled.
        stored_in = in_tree if _survives_pickle(in_tree) else None
        stored_out = compiled.out_tree if _survives_pickle(compiled.out_tree) else None
        return pickle.dumps(
            (meta, stored_in, stored_out, device_ids), protocol=pickle.HIGHEST_PROTOCOL
        )
    except (pickle.PicklingError, TypeError, AttributeError, ValueError) as exc:
        raise ExecutableError(
            f"JAX cannot serialize this program: {type(exc).__name__}: {exc}"
        ) from None


def _survives_pickle(tree: Any) -> bool:
    try:
        return bool(pickle.loads(pickle.dumps(tree)) == tree)
    except Exception:  # noqa: BLE001 - any failure means: do not store it
        return False


class Unbound:
    """A loaded executable whose input or output structure was not storable: bound at its first
    call.

    ``bind`` takes the call's own input structure, and the outputs' structure from the function
    traced on that call (``jax.eval_shape``: a trace, no compile) where it was not stored; the
    executable then checks every leaf's shape and dtype against what warm compiled, as for any
    Compiled.
    """

    def __init__(
        self,
        loaded: Any,
        args_info_flat: list[Any],
        out_tree: Any,
        no_kwargs: bool,
        in_tree: Any = None,
    ) -> None:
        self._loaded, self._args_info_flat = loaded, args_info_flat
        self._out_tree, self._no_kwargs, self._in_tree = out_tree, no_kwargs, in_tree

    @property
    def num_leaves(self) -> int:
        return len(self._args_info_flat)

    @property
    def needs_out_tree(self) -> bool:
        return self._out_tree is None

    def bind(self, in_tree: Any, out_tree: Any = None) -> Any:
        in_tree = self._in_tree if self._in_tree is not None else in_tree
        out_tree = self._out_tree if self._out_tree is not None else out_tree
        if out_tree is None:
            raise ExecutableError("the outputs' structure was not stored and not given")
        if in_tree.num_leaves != len(self._args_info_flat):
            raise ExecutableError(
                f"the call has {in_tree.num_leaves} array leaves; the stored executable takes "
                f"{len(self._args_info_flat)}"
            )
        return jax_seam.make_compiled(
            self._loaded, in_tree.unflatten(self._args_info_flat), out_tree, self._no_kwargs
        )


def pack(
    payload: bytes,
    *,
    key: str,
    entry_sha256: str,
    function: str | None = None,
    bucket: dict[str, Any] | None = None,
    spec_digest: str | None = None,
    source_digest: str | None = None,
    custom_calls: Any = None,
    platform_version: str | None = None,
    binding_digest: str | None = None,
    depends_on: dict[str, str] | None = None,
) -> bytes:
    """Artifact bytes: a JSON header (readable without unpickling) and the payload."""
    import jax
    import jaxlib

    header = ExecutableHeader(
        key=key,
        entry_sha256=entry_sha256,
        function=function,
        bucket=bucket,
        jax_version=jax.__version__,
        jaxlib_version=jaxlib.__version__,
        payload_sha256=hashlib.sha256(payload).hexdigest(),
        spec_digest=spec_digest,
        source_digest=source_digest,
        custom_calls=None if custom_calls is None else sorted(custom_calls),
        platform_version=platform_version,
        binding_digest=binding_digest,
        depends_on=depends_on,
    )
    head = json.dumps(header.to_json(), sort_keys=True).encode()
    return MAGIC + len(head).to_bytes(_LEN_BYTES, "big") + head + payload


def serialize(
    compiled: Any,
    *,
    key: str,
    entry_bytes: bytes,
    function: str | None = None,
    bucket: dict[str, Any] | None = None,
) -> bytes:
    """Artifact bytes for ``compiled``, whose XLA executable is the JAX entry ``entry_bytes``."""
    return pack(
        payload_of(compiled),
        key=key,
        entry_sha256=hashlib.sha256(entry_bytes).hexdigest(),
        function=function,
        bucket=bucket,
        custom_calls=jax_seam.custom_call_targets(compiled),
    )


def read_header(data: bytes) -> ExecutableHeader:
    """Parse and check an artifact's header and payload checksum; unpickles nothing."""
    header, _ = split_artifact(data)
    return header


def split_artifact(data: bytes) -> tuple[ExecutableHeader, bytes]:
    if not data.startswith(MAGIC):
        raise CorruptEntry("not a cachectl stored executable (bad magic)")
    start = len(MAGIC) + _LEN_BYTES
    if len(data) < start:
        raise CorruptEntry("stored executable truncated in its header")
    size = int.from_bytes(data[len(MAGIC) : start], "big")
    if size > _MAX_HEADER or len(data) < start + size:
        raise CorruptEntry("stored executable truncated in its header")
    try:
        fields = json.loads(data[start : start + size])
        header = ExecutableHeader(**fields)
    except (ValueError, TypeError) as exc:
        raise CorruptEntry(f"stored executable header is not valid: {exc}") from None
    if header.format != FORMAT:
        raise CorruptEntry(
            f"stored executable format {header.format}, this cachectl reads {FORMAT}"
        )
    payload = data[start + size :]
    if hashlib.sha256(payload).hexdigest() != header.payload_sha256:
        raise CorruptEntry(
            "stored executable payload does not match its checksum (truncated or altered)"
        )
    return header, payload
