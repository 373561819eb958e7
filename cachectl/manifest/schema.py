"""The manifest schema (pydantic, strict): types and per-field rules; cross-field rules are in checks.py.

Dtype names resolve through numpy and ml_dtypes (bfloat16, float8_*, int4, ...), the
same names and dtypes ``jax.numpy.dtype`` gives, so validating never imports JAX."""

from __future__ import annotations

import fnmatch
import math
import re
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from cachectl.core.errors import BadInput
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


class _Model(BaseModel):
    # strict: YAML already yields exact types, so "4" for 4 or true for 1 is a mistake to report.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Target(_Model):
    """The hardware the manifest is for; warm refuses (exit 3) to compile it elsewhere."""

    backend: Literal["cpu", "gpu", "tpu"]
    device_kind: str | None = None
    device_count: int | None = Field(default=None, gt=0)

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


class JitSpec(_Model):
    """Options passed to ``jax.jit``; they are part of the program, so they must match the service's."""

    static_argnums: list[int] = []
    static_argnames: list[str] = []
    donate_argnums: list[int] = []
    donate_argnames: list[str] = []
    keep_unused: bool = False
    inline: bool = False
    compiler_options: dict[str, Any] | None = None

    _scalars_to_lists = field_validator(
        "static_argnums", "static_argnames", "donate_argnums", "donate_argnames", mode="before"
    )(_as_list)


class MeshSpec(_Model):
    """A device mesh, built as ``jax.make_mesh(sizes, names)`` over ``jax.devices()``."""

    axes: dict[str, int] = Field(min_length=1)
    # None follows jax.make_mesh's own default; set it to match how the service builds its mesh.
    axis_types: Literal["auto", "explicit", "manual"] | None = None

    @field_validator("axes")
    @classmethod
    def _positive(cls, axes: dict[str, int]) -> dict[str, int]:
        for name, size in axes.items():
            if size <= 0:
                raise ValueError(f"mesh axis {name!r} must have a positive size, got {size}")
        return axes

    @property
    def size(self) -> int:
        return math.prod(self.axes.values())


class ArgSpec(_Model):
    """One positional argument: an array ``{shape, dtype}``, a ``{pytree}`` or a static ``{value}``."""

    shape: list[Any] | None = None
    dtype: str | None = None
    weak_type: bool = False
    pytree: str | None = None
    value: Any = None
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

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, name: str | None) -> str | None:
        if name is not None and name not in COMMON_DTYPES:
            dtype_named(name)
        return name

    @field_validator("pytree")
    @classmethod
    def _ref_form(cls, ref: str | None) -> str | None:
        return None if ref is None else _check_ref(ref)

    @property
    def kind(self) -> Literal["array", "pytree", "value"]:
        if self.pytree is not None:
            return "pytree"
        if "value" in self.model_fields_set:
            return "value"
        return "array"


class OutputSpec(_Model):
    """How cachectl.serving cuts one output back from the bucket to the request's sizes."""

    shape: list[Any]


class FunctionSpec(_Model):
    """A function to compile, its abstract arguments and the bucket axes that vary them."""

    name: str
    fn: str
    jit: JitSpec = JitSpec()
    args: list[ArgSpec] = []
    kwargs: dict[str, Any] = {}
    buckets: dict[str, list[Any]] = {}
    exclude: list[dict[str, Any]] = []
    mesh: MeshSpec | None = None
    # One per output leaf (null: returned as computed, padded), for cachectl.serving.
    outputs: list[OutputSpec | None] | None = None

    _source: Source = PrivateAttr(default=NO_SOURCE)
    _index: int = PrivateAttr(default=0)

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: Any) -> Any:
        """``name`` defaults to the function's own name, which is also JAX's module name."""
        if isinstance(data, dict) and "name" not in data:
            fn = data.get("fn")
            if isinstance(fn, str) and REF_RE.fullmatch(fn):
                name = fn.rsplit(":", 1)[1].rsplit(".", 1)[-1]
            else:
                name = "_"  # fn's own error is the one to report; this never outlives validation
            data = {**data, "name": name}
        return data

    @field_validator("fn")
    @classmethod
    def _ref_form(cls, ref: str) -> str:
        return _check_ref(ref)

    @field_validator("name")
    @classmethod
    def _name_form(cls, name: str) -> str:
        if not _NAME_RE.fullmatch(name):
            raise ValueError(
                f"invalid name {name!r}: use letters, digits, '_', '.' or '-', starting with a letter"
            )
        return name

    def _loc(self, *rest: str | int) -> Loc:
        return ("functions", self._index, *rest)

    def _bad(self, loc: Loc, problem: str) -> BadInput:
        return BadInput(self._source.message(self._loc(*loc), problem))


class Manifest(_Model):
    """A validated manifest; build it with :func:`load_manifest` or :func:`parse_manifest`."""

    version: int
    cache: str | None = Field(default=None, min_length=1)
    target: Target | None = None
    functions: list[FunctionSpec] = Field(min_length=1)

    _source: Source = PrivateAttr(default=NO_SOURCE)

    @field_validator("version")
    @classmethod
    def _supported(cls, version: int) -> int:
        if version != MANIFEST_VERSION:
            raise ValueError(
                f"unsupported manifest version {version}: this cachectl reads version {MANIFEST_VERSION}"
            )
        return version

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
