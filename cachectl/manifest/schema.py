"""The manifest schema: frozen dataclasses and their per-field rules; cross-field rules are in
checks.py.

One schema, two engines (load.py): :func:`build` takes a valid manifest without pydantic, and
pydantic (strict, unknown fields refused, through the same classes, rules and constraints)
validates one that ``build`` does not take, for its messages (problems.py). A service that
loads a valid manifest (``cachectl.serving``) never imports pydantic: about 45 ms of import
and 15 ms of model building, most of its start-up beyond JAX's own.

Dtype names resolve through numpy and ml_dtypes (bfloat16, float8_*, int4, ...), the
same names and dtypes ``jax.numpy.dtype`` gives, so validating never imports JAX."""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import math
import re
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from cachectl.core.errors import BadInput, path_words
from cachectl.manifest.source import NO_SOURCE, Loc, Source

if TYPE_CHECKING:
    import numpy as np
MANIFEST_VERSION = 1


_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
REF_RE = re.compile(rf"{_IDENT}(\.{_IDENT})*:{_IDENT}(\.{_IDENT})*")
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_DTYPE_HINT = "use a numpy/jax dtype name such as bfloat16, float32, int32"


def leaf_path(keys: Any) -> str:
    """A pytree leaf's path as ``leaf_axes`` names it: its keys, attribute names and indices
    joined with dots (``pipeline_state.qpos``, ``0.x``); jax's key objects, read without JAX."""
    parts = []
    for k in keys:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


class _Unset:
    """The default of a field whose absence means something (an argument's ``value``: null is a
    value); pickles and copies as the one :data:`UNSET`."""

    def __repr__(self) -> str:
        return "UNSET"

    def __reduce__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


class _After:
    """A field rule run on the value pydantic validated; a ValueError is the field's problem."""

    def __init__(self, check: Callable[[Any], Any]) -> None:
        self.check = check

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        return core_schema.no_info_after_validator_function(self.check, handler(source))


class _Before:
    """A field rule run on the raw YAML value, before pydantic validates it."""

    def __init__(self, convert: Callable[[Any], Any]) -> None:
        self.convert = convert

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        return core_schema.no_info_before_validator_function(self.convert, handler(source))


class _Schema:
    """A schema class: validated by pydantic from a mapping, strict in every field (YAML already
    yields exact types, so "4" for 4 or true for 1 is a mistake to report), no unknown fields."""

    __pydantic_config__: ClassVar[dict[str, Any]] = {"extra": "forbid", "strict": True}

    # A rule on the whole raw mapping, run before its fields are validated (None: none).
    __before__: ClassVar[Callable[[Any], Any] | None] = None

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        schema = handler(source)
        if schema.get("type") == "dataclass":
            # strict would take only an instance of the class; the input is YAML's mapping.
            schema["strict"] = False
        if cls.__before__ is not None:
            return _Before(cls.__before__).__get_pydantic_core_schema__(source, lambda _: schema)
        return schema


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target(_Schema):
    """The hardware the manifest is for; warm refuses (exit 3) to compile it elsewhere."""

    backend: Literal["cpu", "gpu", "tpu"]
    device_kind: str | None = None
    device_count: int | None = dataclasses.field(default=None, metadata={"gt": 0})
    # A TPU slice by name ("v5e:2x2", "v5litepod-4"): warm on a machine without a TPU compiles
    # for it (deviceless, cachectl/core/topologies.py), as ``warm --topology`` does.
    topology: str | None = None

    def mismatches(self, backend: str, device_kind: str, device_count: int) -> list[str]:
        """Why this machine does not match (empty when it does); device_kind may be a glob."""
        problems = []
        if backend != self.backend:
            problems.append(f"backend is {backend}, the manifest targets {self.backend}")
        if self.device_kind is not None and not fnmatch.fnmatchcase(device_kind, self.device_kind):
            problems.append(
                f"device kind is {device_kind!r}, the manifest targets {self.device_kind!r}"
            )
        if self.device_count is not None and device_count != self.device_count:
            problems.append(f"{device_count} devices, the manifest targets {self.device_count}")
        return problems


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, (int, str)) and not isinstance(value, bool) else value


def _positive_axes(axes: dict[str, int]) -> dict[str, int]:
    for name, size in axes.items():
        if size <= 0:
            raise ValueError(f"mesh axis {name!r} must have a positive size, got {size}")
    return axes


def _known_dtype(name: str | None) -> str | None:
    if name is not None and name not in COMMON_DTYPES:
        dtype_named(name)
    return name


def _ref_or_none(ref: str | None) -> str | None:
    return None if ref is None else _check_ref(ref)


def _name_form(name: str) -> str:
    if not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"invalid name {name!r}: use letters, digits, '_', '.' or '-', starting with a letter"
        )
    return name


def _supported(version: int) -> int:
    if version != MANIFEST_VERSION:
        raise ValueError(
            f"unsupported manifest version {version}: this cachectl reads version {MANIFEST_VERSION}"
        )
    return version


@dataclasses.dataclass(frozen=True, kw_only=True)
class JitSpec(_Schema):
    """Options passed to ``jax.jit``; they are part of the program, so they must match the service's."""

    static_argnums: Annotated[list[int], _Before(_as_list)] = dataclasses.field(
        default_factory=list
    )
    static_argnames: Annotated[list[str], _Before(_as_list)] = dataclasses.field(
        default_factory=list
    )
    donate_argnums: Annotated[list[int], _Before(_as_list)] = dataclasses.field(
        default_factory=list
    )
    donate_argnames: Annotated[list[str], _Before(_as_list)] = dataclasses.field(
        default_factory=list
    )
    keep_unused: bool = False
    inline: bool = False
    compiler_options: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshSpec(_Schema):
    """A device mesh, built as a service's ``jax.sharding.Mesh(np.array(jax.devices()[:n])
    .reshape(sizes), names)`` is (manifest/mesh.py): Auto axes, ``jax.devices()`` order."""

    axes: Annotated[dict[str, int], _After(_positive_axes)] = dataclasses.field(
        metadata={"min_length": 1}
    )
    # The axis types of the service's mesh: jax.sharding.Mesh's default is auto, jax.make_mesh's
    # (JAX 0.10) explicit. Both are in JAX's key.
    axis_types: Literal["auto", "explicit", "manual"] = "auto"
    # The devices' order: "devices" as jax.devices() lists them; "make_mesh" as jax.make_mesh
    # lays them out (the physical order on a TPU slice, v5e:2x2: 0, 1, 3, 2). In JAX's key.
    device_order: Literal["devices", "make_mesh"] = "devices"

    @property
    def size(self) -> int:
        return math.prod(self.axes.values())


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArgSpec(_Schema):
    """One positional argument: an array ``{shape, dtype}``, a ``{pytree}`` or a static ``{value}``."""

    shape: list[Any] | None = None
    dtype: Annotated[str | None, _After(_known_dtype)] = None
    weak_type: bool = False
    pytree: Annotated[str | None, _After(_ref_or_none)] = None
    value: Any = UNSET  # null is a value: absent is UNSET
    # A list of mesh axes per dimension (with a mesh), or "single_device": the service
    # commits its arrays to one device (jax.device_put(x, device), a checkpoint restore).
    sharding: list[Any] | Literal["single_device"] | None = None
    # What cachectl.serving pads a bucketed dimension with (default 0 / False).
    pad: Any = None
    # A pytree's bucket axes: ``{0: n}`` (dimension 0 of every leaf that has one is axis n) or
    # by leaf path, ``{pipeline_state.qpos: {0: n}}`` (a path names a leaf or a subtree; paths
    # are leaf_path's dotted form). cachectl.serving picks the bucket from these dimensions and
    # pads them; without them a pytree must match a bucket's leaves exactly.
    leaf_axes: dict[int | str, Any] | None = None
    # What cachectl.serving pads a pytree's declared leaf dimensions with, beyond its rule
    # (cachectl/dispatch/padding.py: zeros for float, complex, bool and key leaves, integer
    # leaves never implicitly): one scalar for every leaf, or by leaf path ({senders: 7}).
    # Serving only: not part of the program, so not of spec_digest.
    leaf_pad: Any = dataclasses.field(default=None, metadata={"serving_only": True})
    # A function ``module:fn`` that pads the whole argument, called as
    # ``fn(tree, **{axis: bucket size})`` for the axes leaf_axes names (jraph:pad_with_graphs
    # with axes n_node, n_edge, n_graph); one that raises means the bucket is too small.
    pad_fn: Annotated[str | None, _After(_ref_or_none)] = dataclasses.field(
        default=None, metadata={"serving_only": True}
    )

    def leaf_dims(self, path: str, ndim: int) -> tuple[tuple[int, str], ...]:
        """(dimension, axis) of the leaf at ``path`` (a leaf with ``ndim`` dimensions) that
        ``leaf_axes`` declares bucket axes; checks.py has made sure of their form."""
        found: dict[int, str] = {}
        for key, value in (self.leaf_axes or {}).items():
            if isinstance(key, int):
                if key < ndim:
                    found[key] = value
            elif path == key or path.startswith(key + "."):
                found.update({d: a for d, a in value.items() if d < ndim})
        return tuple(sorted(found.items()))

    def pytree_axes(self) -> set[str]:
        """The bucket axes ``leaf_axes`` names."""
        out: set[str] = set()
        for value in (self.leaf_axes or {}).values():
            out.update(value.values() if isinstance(value, dict) else [value])
        return {a for a in out if isinstance(a, str)}

    @property
    def given(self) -> frozenset[str]:
        """The fields the manifest set: those not at their default (``value``: not UNSET)."""
        return frozenset(
            f.name
            for f in dataclasses.fields(self)
            if not _is_default(getattr(self, f.name), f.default)
        )

    @property
    def kind(self) -> Literal["array", "pytree", "value"]:
        if self.pytree is not None:
            return "pytree"
        if self.value is not UNSET:
            return "value"
        return "array"


def _is_default(value: Any, default: Any) -> bool:
    return value is default or (type(value) is type(default) and value == default)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutputSpec(_Schema):
    """How cachectl.serving cuts one output back from the bucket to the request's sizes."""

    shape: list[Any]


def _default_name(data: Any) -> Any:
    """``name`` defaults to the function's own name, which is also JAX's module name."""
    if isinstance(data, dict) and "name" not in data:
        fn = data.get("fn")
        if isinstance(fn, str) and REF_RE.fullmatch(fn):
            name = fn.rsplit(":", 1)[1].rsplit(".", 1)[-1]
        else:
            name = "_"  # fn's own error is the one to report; this never outlives validation
        data = {**data, "name": name}
    return data


@dataclasses.dataclass(frozen=True, kw_only=True)
class FunctionSpec(_Schema):
    """A function to compile, its abstract arguments and the bucket axes that vary them."""

    name: Annotated[str, _After(_name_form)]
    fn: Annotated[str, _After(_check_ref)]
    jit: JitSpec = dataclasses.field(default_factory=JitSpec)
    args: list[ArgSpec] = dataclasses.field(default_factory=list)
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    buckets: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    exclude: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    mesh: MeshSpec | None = None
    # One per output leaf (null: returned as computed, padded), for cachectl.serving.
    outputs: list[OutputSpec | None] | None = None
    # Files the function reads (an exported model, weights, a config read at import), relative
    # to the manifest's directory: each file's sha256 binds its stored executables (one stored
    # with another version of the file is refused), so these are bound apart from the entry's
    # JSON (not in as_data(program=True): naming none leaves spec_digest as it was).
    depends_on: list[str] = dataclasses.field(default_factory=list, metadata={"bound_apart": True})

    # Where it was read (set by located(); not fields: not compared, not in as_data).
    _source: ClassVar[Source] = NO_SOURCE
    _index: ClassVar[int] = 0

    __before__: ClassVar[Callable[[Any], Any]] = staticmethod(_default_name)

    def _loc(self, *rest: str | int) -> Loc:
        return ("functions", self._index, *rest)

    def depends_on_files(self) -> list[tuple[str, Path]]:
        """Each ``depends_on`` path as written, and the file it names: relative to the
        manifest's directory (the working directory for a manifest not read from a file)."""
        base = self._source.directory or Path()
        return [(name, base / name) for name in self.depends_on]

    def missing_depends_on(self) -> BadInput | None:
        """The first ``depends_on`` file that is not there, as bad input naming its line."""
        for position, (name, path) in enumerate(self.depends_on_files()):
            if not path.is_file():
                return self._bad(
                    ("depends_on", position),
                    f"{name} is not a file (looked for {path_words(path)}); depends_on names "
                    "files relative to the manifest's directory",
                )
        return None

    def _bad(self, loc: Loc, problem: str) -> BadInput:
        return BadInput(self._source.message(self._loc(*loc), problem))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Manifest(_Schema):
    """A validated manifest; build it with :func:`load_manifest` or :func:`parse_manifest`."""

    version: Annotated[int, _After(_supported)]
    cache: str | None = dataclasses.field(default=None, metadata={"min_length": 1})
    target: Target | None = None
    functions: list[FunctionSpec] = dataclasses.field(metadata={"min_length": 1})

    _source: ClassVar[Source] = NO_SOURCE

    @property
    def path(self) -> str:
        """The file name as given to :func:`load_manifest` (used in every message)."""
        return self._source.name

    def function(self, name: str) -> FunctionSpec:
        for spec in self.functions:
            if spec.name == name:
                return spec
        raise BadInput(f"{self.path}: no function named {name!r} (have: {', '.join(self.names)})")

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.functions]


def located(obj: FunctionSpec | Manifest, source: Source, index: int | None = None) -> None:
    """Record where a validated manifest (or function entry) was read, for its messages."""
    object.__setattr__(obj, "_source", source)
    if index is not None:
        object.__setattr__(obj, "_index", index)


class Unchecked(Exception):
    """Data :func:`build` does not take as it is: pydantic validates it and says what is wrong."""


def build(tp: Any, data: Any) -> Any:
    """``data`` (YAML's plain values) as the schema type ``tp``, by the same rules pydantic
    applies (types exactly, as in strict mode; no unknown fields; ``_Before``, ``_After`` and
    the ``metadata`` constraints), without pydantic. Anything else raises :class:`Unchecked`,
    and load.py asks pydantic, whose errors make the messages; tests/test_manifest.py holds the
    two to the same verdict and the same result."""
    origin = get_origin(tp)
    if origin is Annotated:
        base, *marks = get_args(tp)
        for mark in marks:
            if isinstance(mark, _Before):
                data = mark.convert(data)
        value = build(base, data)
        for mark in marks:
            if isinstance(mark, _After):
                try:
                    value = mark.check(value)
                except ValueError:
                    raise Unchecked from None
        return value
    if tp is Any:
        return data
    if origin in (Union, types.UnionType):
        for option in get_args(tp):
            try:
                return build(option, data)
            except Unchecked:
                pass
        raise Unchecked
    if origin is Literal:
        if any(type(data) is type(v) and data == v for v in get_args(tp)):
            return data
        raise Unchecked
    if origin is list and type(data) is list:
        (item,) = get_args(tp)
        return [build(item, v) for v in data]
    if origin is dict and type(data) is dict:
        key, item = get_args(tp)
        return {build(key, k): build(item, v) for k, v in data.items()}
    if tp in (str, int, bool, type(None)):
        if type(data) is tp or (tp is type(None) and data is None):
            return data
        raise Unchecked
    if isinstance(tp, type) and issubclass(tp, _Schema):
        return _build_schema(tp, data)
    raise Unchecked


def _build_schema(cls: Any, data: Any) -> Any:
    if cls.__before__ is not None:
        data = cls.__before__(data)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if type(data) is not dict or not set(data) <= set(fields):
        raise Unchecked
    hints = _hints(cls)
    values = {}
    for name, raw in data.items():
        value = build(hints[name], raw)
        rules = fields[name].metadata
        if value is not None and (
            ("gt" in rules and not value > rules["gt"])
            or ("min_length" in rules and len(value) < rules["min_length"])
        ):
            raise Unchecked
        values[name] = value
    try:
        return cls(**values)
    except TypeError:  # a required field missing
        raise Unchecked from None


@functools.cache
def _hints(cls: Any) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def as_data(obj: Any, program: bool = False) -> Any:
    """A schema object as plain JSON data, every field in declared order (UNSET as null).
    ``program``: only what the compiled program depends on (fields marked ``serving_only``
    left out, and ``depends_on``, bound by its files' sha256 instead), what the stored executables' ``spec_digest`` hashes, byte for byte pydantic's
    dump before: declaring how serving pads does not make stored executables stale."""
    if isinstance(obj, _Schema):
        return {
            f.name: as_data(getattr(obj, f.name), program)
            for f in dataclasses.fields(obj)  # type: ignore[arg-type]
            if not (program and (f.metadata.get("serving_only") or f.metadata.get("bound_apart")))
        }
    if isinstance(obj, (list, tuple)):
        return [as_data(v, program) for v in obj]
    if isinstance(obj, dict):
        return {k: as_data(v, program) for k, v in obj.items()}
    return None if obj is UNSET else obj


def _check_ref(ref: str) -> str:
    if not REF_RE.fullmatch(ref):
        raise ValueError(
            f"{ref!r} is not of the form module:attribute (e.g. examples.lm:decode_step)"
        )
    return ref


# Names dtype_named accepts (tests/test_manifest.py holds it to that), checked without importing
# numpy and ml_dtypes: validating a manifest of these costs nothing.
COMMON_DTYPES = frozenset(
    (
        "bool",
        *(f"{kind}{bits}" for kind in ("int", "uint") for bits in (8, 16, 32, 64)),
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "bfloat16",
    )
)


def dtype_named(name: str) -> np.dtype[Any]:
    """Resolve a dtype name as ``jax.numpy.dtype`` does (it is ``numpy.dtype`` once ml_dtypes is
    loaded); only numeric and bool dtypes make sense for arrays. ml_dtypes' types are numbers
    to JAX though numpy does not class them under ``np.number``.

    numpy and ml_dtypes (0.5 s to import) load here, on the first dtype: commands that
    read a manifest's other fields (advise, misses) never pay for them."""
    import ml_dtypes  # noqa: F401 - registers bfloat16, float8_*, int4 ... with numpy
    import numpy as np

    try:
        dtype = np.dtype(name)
    except TypeError:
        dtype = None
    if dtype is None or not (
        np.issubdtype(dtype, np.number)
        or dtype == np.bool_
        or dtype.type.__module__.partition(".")[0] == "ml_dtypes"
    ):
        raise ValueError(f"unknown dtype {name!r} ({_DTYPE_HINT})")
    return dtype


def jit_options(spec: FunctionSpec) -> dict[str, Any]:
    """Keyword arguments for ``jax.jit``, only those the manifest sets (so defaults stay JAX's)."""
    jit = spec.jit
    options: dict[str, Any] = {}
    for key in ("static_argnums", "static_argnames", "donate_argnums", "donate_argnames"):
        if getattr(jit, key):
            options[key] = tuple(getattr(jit, key))
    if jit.keep_unused:
        options["keep_unused"] = True
    if jit.inline:
        options["inline"] = True
    if jit.compiler_options:
        options["compiler_options"] = dict(jit.compiler_options)
    return options
