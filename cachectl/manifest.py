"""Manifests: the functions and shape buckets a service compiles, so ``warm`` can compile them first.

A manifest is YAML (see ``examples/manifest.yaml``)::

    version: 1
    target: {backend: cpu}
    functions:
      - fn: examples.lm:decode_step
        jit: {static_argnames: [sampling], donate_argnums: [1]}
        args:
          - {pytree: examples.lm:param_specs}
          - {shape: [2, 2, batch, 256, 4, 32], dtype: bfloat16}
        kwargs: {sampling: greedy}
        buckets: {batch: [1, 4, 8]}

The pipeline, in the order ``warm`` uses it:

1. :func:`load_manifest` parses and validates without importing any user code or
   JAX; every problem is a one-line :class:`~cachectl.errors.BadInput` that names
   ``file:line: field: problem``.
2. :func:`check_imports` imports every ``module:attr`` the manifest names and checks
   the arguments bind to the function's signature.
3. :func:`expand` lists the buckets (cartesian product of each function's axes,
   minus ``exclude``); :func:`select_shard` picks one machine's share.
4. :func:`jit_function` and :func:`build_call` give what to ``.lower(*args, **kwargs)``.

Field paths in messages index lists from 0 (``functions[1]`` is the second function).
JAX is imported lazily so that reading a manifest stays cheap for the CLI.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import functools
import hashlib
import importlib
import inspect
import itertools
import json
import math
import os
import re
import sys
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from cachectl.errors import BadInput, EnvironmentMismatch

__all__ = [
    "MANIFEST_VERSION",
    "ArgSpec",
    "Bucket",
    "FunctionSpec",
    "JitSpec",
    "Manifest",
    "MeshSpec",
    "Target",
    "build_call",
    "check_imports",
    "expand",
    "is_jitted",
    "jit_function",
    "jit_options",
    "load_manifest",
    "manifest_digest",
    "parse_manifest",
    "parse_shard",
    "resolve_callable",
    "select_shard",
]

MANIFEST_VERSION = 1

Loc = tuple[str | int, ...]

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_REF_RE = re.compile(rf"{_IDENT}(\.{_IDENT})*:{_IDENT}(\.{_IDENT})*")
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_DTYPE_HINT = "use a numpy/jax dtype name such as bfloat16, float32, int32"


# --------------------------------------------------------------------------- YAML with lines


class _Loader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys: PyYAML would silently keep the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # unhashable key: let PyYAML report it
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first given on line {first})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


# A manifest is a few hundred YAML nodes; one that expands (through aliases) to more than
# this is an alias bomb ("billion laughs"), refused before anything walks it.
MAX_MANIFEST_NODES = 100_000
# The most buckets one manifest may expand to (the product of each function's axes);
# `warm --max-buckets N` raises it through the environment, so warm's worker processes
# (which load the manifest again) apply the same limit.
DEFAULT_MAX_BUCKETS = 10_000
MAX_BUCKETS_ENV = "CACHECTL_MAX_BUCKETS"


def max_buckets() -> int:
    """The bucket limit: CACHECTL_MAX_BUCKETS (set by --max-buckets), else DEFAULT_MAX_BUCKETS."""
    text = os.environ.get(MAX_BUCKETS_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_BUCKETS
    if not text.isdigit() or int(text) < 1:
        raise BadInput(f"bad {MAX_BUCKETS_ENV} {text!r}: a positive number of buckets, e.g. 20000")
    return int(text)


def _expanded_size(root: yaml.Node, limit: int) -> int:
    """How many nodes the document has once every alias is expanded, stopping past ``limit``.
    Each distinct node is sized once (memoized), so this is linear in the text."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node) -> int:
        known = sizes.get(id(node))
        if known is not None:
            return known
        sizes[id(node)] = 1  # a recursive alias counts once
        total = 1
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                total += size(key_node) + size(value_node)
                if total > limit:
                    break
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                total += size(item)
                if total > limit:
                    break
        sizes[id(node)] = total
        return total

    return size(root)


def _line_map(loader: _Loader, root: yaml.Node) -> dict[Loc, int]:
    """Map each path in the document to its 1-based line: a mapping entry's key line, a list item's line."""
    lines: dict[Loc, int] = {(): root.start_mark.line + 1}

    def walk(node: yaml.Node, loc: Loc, active: frozenset[int]) -> None:
        if id(node) in active:  # a recursive alias
            return
        active = active | {id(node)}
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:  # merges were flattened in place on load
                try:
                    key = loader.construct_object(key_node, deep=True)
                    hash(key)
                except Exception:
                    continue
                lines[loc + (key,)] = key_node.start_mark.line + 1
                walk(value_node, loc + (key,), active)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                lines[loc + (i,)] = item.start_mark.line + 1
                walk(item, loc + (i,), active)

    walk(root, (), frozenset())
    return lines


@dataclasses.dataclass(frozen=True)
class _Source:
    """Where a manifest came from, so any later step can point at a line."""

    name: str
    directory: Path | None
    lines: Mapping[Loc, int]

    def line(self, loc: Loc) -> int:
        for end in range(len(loc), -1, -1):
            if loc[:end] in self.lines:
                return self.lines[loc[:end]]
        return 1

    def message(self, loc: Loc, problem: str) -> str:
        field = _field_path(loc)
        return f"{self.name}:{self.line(loc)}: {field + ': ' if field else ''}{problem}"


_NO_SOURCE = _Source("<manifest>", None, {})


def _field_path(loc: Loc) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]*", str(part)):
            out += f".{part}" if out else str(part)
        else:
            out += f"[{part!r}]"
    return out


# --------------------------------------------------------------------------- schema


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

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, name: str | None) -> str | None:
        if name is not None:
            _dtype(name)
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

    _source: _Source = PrivateAttr(default=_NO_SOURCE)
    _index: int = PrivateAttr(default=0)

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: Any) -> Any:
        """``name`` defaults to the function's own name, which is also JAX's module name."""
        if isinstance(data, dict) and "name" not in data:
            fn = data.get("fn")
            if isinstance(fn, str) and _REF_RE.fullmatch(fn):
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

    _source: _Source = PrivateAttr(default=_NO_SOURCE)

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
    if not _REF_RE.fullmatch(ref):
        raise ValueError(
            f"{ref!r} is not of the form module:attribute (e.g. examples.lm:decode_step)"
        )
    return ref


def _dtype(name: str) -> Any:
    """Resolve a dtype name the way JAX does; only numeric and bool dtypes make sense for arrays."""
    import jax.numpy as jnp

    try:
        dtype = jnp.dtype(name)
    except TypeError:
        dtype = None
    if dtype is None or not (jnp.issubdtype(dtype, jnp.number) or dtype == jnp.bool_):
        raise ValueError(f"unknown dtype {name!r} ({_DTYPE_HINT})")
    return dtype


# --------------------------------------------------------------------------- loading


def manifest_digest(path: str | Path) -> str:
    """sha256 hex of the file's bytes: records which manifest produced an entry."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_manifest(path: str | Path) -> Manifest:
    """Read and validate a manifest; every problem is a one-line ``BadInput`` naming file:line."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise BadInput(f"{name}: cannot read manifest: {reason}") from None
    return parse_manifest(text, name=name, directory=Path(path).resolve().parent)


def parse_manifest(text: str, name: str = "<manifest>", directory: Path | None = None) -> Manifest:
    """Validate manifest YAML given as text (``name`` is used in messages, ``directory`` for imports)."""
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
        if root is not None and _expanded_size(root, MAX_MANIFEST_NODES) > MAX_MANIFEST_NODES:
            raise BadInput(f"{name}: the YAML expands to more than {MAX_MANIFEST_NODES} nodes through "
                           "aliases (an alias bomb?): refused")
        data = loader.construct_document(root) if root is not None else None
        lines = _line_map(loader, root) if root is not None else {}
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        problem = exc.problem or "syntax error"
        if exc.context:
            problem += f" ({exc.context})"
        raise BadInput(f"{name}:{line}: invalid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise BadInput(f"{name}: invalid YAML: {exc}") from None
    finally:
        loader.dispose()
    source = _Source(name, directory, lines)
    if not isinstance(data, dict):
        raise BadInput(
            source.message(
                (), f"a manifest is a mapping with 'version' and 'functions', got {_describe(data)}"
            )
        )
    return _validate(data, source)


def _validate(data: dict[str, Any], source: _Source) -> Manifest:
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as exc:
        _raise_problems(source, list(_pydantic_problems(exc)))
        raise  # unreachable: _raise_problems always raises
    manifest._source = source
    for index, spec in enumerate(manifest.functions):
        spec._source = source
        spec._index = index
    problems = list(_semantic_problems(manifest))
    if problems:
        _raise_problems(source, problems)
    _check_bucket_count(manifest, source, max_buckets())
    return manifest


MAX_PROBLEMS = 20  # listed per manifest; the rest are counted


def _check_bucket_count(manifest: Manifest, source: _Source, limit: int) -> None:
    """BadInput when the functions' axes multiply out past ``limit`` buckets (counted before
    ``exclude``, without building them): a typo'd axis must not make warm build millions."""
    total = 0
    for index, spec in enumerate(manifest.functions):
        product = 1
        for values in spec.buckets.values():
            product *= max(len(values), 1)
        total += product
        if total > limit:
            raise BadInput(source.message(("functions", index, "buckets"),
                                          f"the manifest's axes multiply out to {total} buckets or more, "
                                          f"above the limit of {limit}: split the manifest, shrink the axes "
                                          "or raise --max-buckets"))


def _raise_problems(source: _Source, problems: list[tuple[Loc, str]]) -> None:
    """Report every problem (up to MAX_PROBLEMS), one ``file:line: field: problem`` per line.

    One run shows everything to fix, not one at a time. Document order; a missing
    field goes last: it is usually the consequence of a misspelled one.
    """
    suggested = {loc[:-1] + (name,) for loc, problem in problems
                 for name in re.findall(r"did you mean '([^']+)'", problem)}
    # "functons: unknown field (did you mean 'functions'?)" already says why functions is missing.
    problems = [(loc, p) for loc, p in problems if not (p == _MISSING and loc in suggested)]
    problems = sorted(problems, key=lambda p: (p[1] == _MISSING, source.line(p[0])))
    lines = list(dict.fromkeys(source.message(loc, problem) for loc, problem in problems))
    shown = lines[:MAX_PROBLEMS]
    more = len(lines) - len(shown)
    if more:
        shown.append(f"{source.name}: (and {more} more problem{'s' if more > 1 else ''})")
    raise BadInput("\n".join(shown))


_MISSING = "required field missing"
_FRIENDLY = {
    "dict_type": "expected a mapping",
    "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
    "list_type": "expected a list",
    "int_type": "expected an integer",
    "string_type": "expected a string",
    "bool_type": "expected true or false",
    "float_type": "expected a number",
}


def _pydantic_problems(exc: ValidationError) -> Iterator[tuple[Loc, str]]:
    for err in exc.errors(include_url=False):
        loc: Loc = tuple(err["loc"])
        kind = err["type"]
        if kind == "extra_forbidden":
            yield loc, _unknown_field(loc)
        elif kind == "missing":
            yield loc, _MISSING
        elif kind in ("value_error", "assertion_error"):
            yield loc, str(err["ctx"]["error"])
        elif kind == "too_short" and isinstance(err.get("input"), (list, dict)):
            yield loc, "must not be empty"
        elif kind in _FRIENDLY:
            yield loc, f"{_FRIENDLY[kind]}, got {_describe(err.get('input'))}"
        else:
            msg = err["msg"]
            yield loc, f"{msg[:1].lower()}{msg[1:]}, got {_describe(err.get('input'))}"


def _describe(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    return "nothing" if value is None else f"{type(value).__name__} {text}"


def _unknown_field(loc: Loc) -> str:
    model = _model_at(loc[:-1])
    key = str(loc[-1])
    if model is None:
        return f"unknown field {key!r}"
    allowed = list(model.model_fields)
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown field {key!r} ({hint}allowed: {', '.join(allowed)})"


def _model_at(loc: Loc) -> type[BaseModel] | None:
    """The schema model that validates the mapping at ``loc`` (to list its fields)."""
    tp: Any = Manifest
    for part in loc:
        tp = _unwrap_optional(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            field = tp.model_fields.get(str(part))
            if field is None:
                return None
            tp = field.annotation
        elif get_origin(tp) in (list, dict):
            tp = get_args(tp)[-1]
        else:
            return None
    tp = _unwrap_optional(tp)
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _unwrap_optional(tp: Any) -> Any:
    """``X | None`` -> ``X``."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


# --------------------------------------------------------------------------- cross-field checks


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool))


def _same(a: Any, b: Any) -> bool:
    """Equality that keeps true apart from 1 (Python says they are equal; YAML users do not)."""
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def _contains(values: Sequence[Any], value: Any) -> bool:
    return any(_same(v, value) for v in values)


def _semantic_problems(manifest: Manifest) -> Iterator[tuple[Loc, str]]:
    first_seen: dict[str, int] = {}
    for i, spec in enumerate(manifest.functions):
        loc: Loc = ("functions", i)
        line = manifest._source.line(loc)
        if spec.name in first_seen:
            yield (
                loc + ("name",),
                (
                    f"duplicate function name {spec.name!r} (also on line {first_seen[spec.name]}); "
                    "set 'name:' to tell them apart"
                ),
            )
        first_seen.setdefault(spec.name, line)
        yield from _function_problems(spec, loc, manifest.target)


def _function_problems(
    spec: FunctionSpec, loc: Loc, target: Target | None
) -> Iterator[tuple[Loc, str]]:
    axes = spec.buckets
    declared = ", ".join(axes) or "none"
    shape_axes: set[str] = set()

    # Arguments.
    for a, arg in enumerate(spec.args):
        aloc = loc + ("args", a)
        given = [k for k in ("shape", "pytree", "value") if k in arg.model_fields_set]
        if len(given) != 1:
            has = ", ".join(sorted(arg.model_fields_set)) or "nothing"
            yield (
                aloc,
                f"an argument needs exactly one of shape (with dtype), pytree or value; this one has {has}",
            )
            continue
        if arg.kind == "array":
            if arg.dtype is None:
                yield (
                    aloc + ("dtype",),
                    "required field missing (an array argument needs shape and dtype)",
                )
            for d, dim in enumerate(arg.shape or []):
                if isinstance(dim, str):
                    if dim in axes:
                        shape_axes.add(dim)
                    else:
                        yield (
                            aloc + ("shape", d),
                            f"unknown axis {dim!r} (declared axes: {declared})",
                        )
                elif not (_is_int(dim) and dim >= 0):
                    yield (
                        aloc + ("shape", d),
                        f"a dimension is a non-negative int or an axis name, got {_describe(dim)}",
                    )
        else:
            for key in ("dtype", "weak_type"):
                if key in arg.model_fields_set:
                    yield aloc + (key,), f"only an array argument (shape) takes {key}"
        if "pad" in arg.model_fields_set and (arg.kind != "array" or not _is_scalar(arg.pad)):
            yield aloc + ("pad",), "pad is a scalar, given only on an array argument (shape)"
        if arg.sharding == "single_device":
            if arg.kind == "value":
                yield aloc + ("sharding",), "a static value cannot be sharded"
            elif spec.mesh is not None:
                yield (aloc + ("sharding",),
                       "single_device is for a function without a mesh; with a mesh, list mesh axes")
        elif arg.sharding is not None:
            if arg.kind == "value":
                yield aloc + ("sharding",), "a static value cannot be sharded"
            elif spec.mesh is None:
                yield (
                    aloc + ("sharding",),
                    "sharding needs a mesh: add 'mesh: {axes: {NAME: SIZE}}' to this function",
                )
            else:
                yield from _sharding_problems(arg, aloc, spec.mesh)

    # Outputs (cut by cachectl.serving).
    for o, out in enumerate(spec.outputs or []):
        for d, dim in enumerate(out.shape if out is not None else []):
            if isinstance(dim, str) and dim not in shape_axes:
                yield (loc + ("outputs", o, "shape", d),
                       f"unknown axis {dim!r}: an output names axes used in the arguments' shapes")
            elif not isinstance(dim, str) and not (_is_int(dim) and dim >= 0):
                yield (loc + ("outputs", o, "shape", d),
                       f"a dimension is a non-negative int or an axis name, got {_describe(dim)}")

    # Bucket axes.
    for axis, values in axes.items():
        vloc = loc + ("buckets", axis)
        if not values:
            yield vloc, "an axis needs a non-empty list of values"
        for v, value in enumerate(values):
            if axis in shape_axes and not (_is_int(value) and value >= 0):
                yield (
                    vloc + (v,),
                    f"axis {axis!r} is used in a shape, so its values must be non-negative ints; got {_describe(value)}",
                )
            elif not _is_scalar(value):
                yield (
                    vloc + (v,),
                    f"axis values must be scalars (int, float, string, bool), got {_describe(value)}",
                )
            elif _contains(values[:v], value):
                yield vloc + (v,), f"duplicate value {value!r} in axis {axis!r}"

    # Excludes.
    for e, entry in enumerate(spec.exclude):
        eloc = loc + ("exclude", e)
        if not entry:
            yield eloc, "an exclude entry names at least one axis value, e.g. {batch: 16}"
        for axis, value in entry.items():
            if axis not in axes:
                yield eloc + (axis,), f"unknown axis {axis!r} (declared axes: {declared})"
            elif not _contains(axes[axis], value):
                yield eloc + (axis,), f"{value!r} is not a value of axis {axis!r} ({axes[axis]})"

    # Keyword arguments.
    for key, value in spec.kwargs.items():
        kloc = loc + ("kwargs", key)
        if isinstance(value, dict):
            if set(value) != {"axis"}:
                yield kloc, "a keyword value is a static literal or {axis: NAME}"
            elif value["axis"] not in axes:
                yield (
                    kloc + ("axis",),
                    f"unknown axis {value['axis']!r} (declared axes: {declared})",
                )

    # jit options against the argument list.
    nargs = len(spec.args)
    for field, wanted in (("static_argnums", "value"), ("donate_argnums", "array")):
        for n, num in enumerate(getattr(spec.jit, field)):
            nloc = loc + ("jit", field, n)
            if not -nargs <= num < nargs:
                yield nloc, f"{num} is out of range: the manifest lists {nargs} positional args"
                continue
            kind = spec.args[num].kind
            if wanted == "value" and kind != "value":
                yield (
                    nloc,
                    f"argument {num % nargs} is static, so give it as {{value: ...}}, not as {kind}",
                )
            if wanted == "array" and kind == "value":
                yield nloc, f"argument {num % nargs} is a static value and cannot be donated"

    # Mesh against the target.
    if (
        spec.mesh is not None
        and target is not None
        and target.device_count is not None
        and spec.mesh.size > target.device_count
    ):
        yield (
            loc + ("mesh", "axes"),
            (
                f"the mesh needs {spec.mesh.size} devices but target.device_count is {target.device_count}"
            ),
        )

    # Something to compile must remain, and shardings must divide every bucket's shapes.
    if (
        axes
        and all(values for values in axes.values())
        and next(_bucket_values(spec), None) is None
    ):
        yield loc + ("exclude",), "exclude removes every bucket of this function"
    if spec.mesh is not None:
        yield from _divisibility_problems(spec, loc)


def _sharding_problems(arg: ArgSpec, aloc: Loc, mesh: MeshSpec) -> Iterator[tuple[Loc, str]]:
    used: set[str] = set()
    names = ", ".join(mesh.axes)
    for s, entry in enumerate(arg.sharding or []):
        sloc = aloc + ("sharding", s)
        parts = entry if isinstance(entry, list) else [entry]
        for part in parts:
            if part is None and not isinstance(entry, list):
                continue
            if not isinstance(part, str):
                yield (
                    sloc,
                    f"a sharding entry is a mesh axis name, a list of them, or null; got {_describe(entry)}",
                )
            elif part not in mesh.axes:
                yield sloc, f"unknown mesh axis {part!r} (mesh axes: {names})"
            elif part in used:
                yield sloc, f"mesh axis {part!r} is used twice in one sharding"
            else:
                used.add(part)
    if arg.kind == "array" and arg.shape is not None and len(arg.sharding or []) > len(arg.shape):
        yield (
            aloc + ("sharding",),
            (
                f"{len(arg.sharding or [])} sharding entries for a {len(arg.shape)}-dimensional shape"
            ),
        )


def _divisibility_problems(spec: FunctionSpec, loc: Loc) -> Iterator[tuple[Loc, str]]:
    """Each sharded dimension must divide evenly by its mesh axes, in every bucket."""
    assert spec.mesh is not None
    for a, arg in enumerate(spec.args):
        if arg.kind != "array" or not isinstance(arg.sharding, list) or arg.shape is None:
            continue
        if len(arg.sharding) > len(arg.shape):
            continue  # reported already
        for d, entry in enumerate(arg.sharding):
            names = entry if isinstance(entry, list) else [entry]
            if not all(isinstance(n, str) and n in spec.mesh.axes for n in names) or entry is None:
                continue
            ways = math.prod(spec.mesh.axes[n] for n in names)
            dim = arg.shape[d]
            candidates = (
                [dim]
                if _is_int(dim)
                else list(
                    dict.fromkeys(
                        v[dim] for v in _bucket_values(spec) if dim in v and _is_int(v[dim])
                    )
                )
            )
            for size in candidates:
                if size % ways:
                    where = f"{dim}={size}" if isinstance(dim, str) else str(size)
                    yield (
                        loc + ("args", a, "sharding", d),
                        (
                            f"dimension {d} ({where}) does not divide by {ways} (mesh axes {'x'.join(names)})"
                        ),
                    )
                    break


# --------------------------------------------------------------------------- buckets


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One concrete compilation: a function and a value for each of its axes (in declared order)."""

    function: str
    values: dict[str, Any]
    index: int  # position in expand()'s list, 0-based

    @property
    def label(self) -> str:
        """``batch=4,seq=128``; empty for a function without axes."""
        return ",".join(f"{k}={_scalar_text(v)}" for k, v in self.values.items())

    @property
    def id(self) -> str:
        """16 hex digits from function and values, stable across machines, orderings and runs."""
        canon = json.dumps([self.function, sorted(self.values.items())], separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    def __str__(self) -> str:
        return f"{self.function}[{self.label}]"

    def __hash__(self) -> int:
        return hash((self.function, tuple(self.values.items()), self.index))


def _scalar_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _bucket_values(spec: FunctionSpec) -> Iterator[dict[str, Any]]:
    names = list(spec.buckets)
    for combo in itertools.product(*(spec.buckets[n] for n in names)):
        values = dict(zip(names, combo, strict=True))
        if not any(
            all(k in values and _same(values[k], v) for k, v in entry.items())
            for entry in spec.exclude
        ):
            yield values


def expand(manifest: Manifest) -> list[Bucket]:
    """Every bucket: functions in manifest order, each the product of its axes in declared order."""
    buckets: list[Bucket] = []
    for spec in manifest.functions:
        for values in _bucket_values(spec):
            buckets.append(Bucket(spec.name, values, len(buckets)))
    return buckets


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> (I, N), with I counted from 1: ``--shard 1/4`` .. ``--shard 4/4``."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match:
        raise BadInput(f"--shard: expected I/N such as 2/4, got {text!r}")
    i, n = int(match.group(1)), int(match.group(2))
    if n < 1 or not 1 <= i <= n:
        raise BadInput(f"--shard: {text!r} needs 1 <= I <= N (shards are counted from 1)")
    return i, n


def select_shard(buckets: Sequence[Bucket], i: int, n: int) -> list[Bucket]:
    """Shard i of n (1-based): every n-th bucket of the list, starting at the i-th.

    Round robin keeps the shards within one bucket of each other in size, and needs
    nothing but the list order, which :func:`expand` makes the same on every machine.
    """
    if n < 1 or not 1 <= i <= n:
        raise BadInput(f"shard {i}/{n}: needs 1 <= I <= N")
    return [b for k, b in enumerate(buckets) if k % n == i - 1]


# --------------------------------------------------------------------------- imports


def _search_paths(source: _Source, extra: Sequence[str | Path]) -> list[Path]:
    """--path dirs, then the manifest's dir, the root of the package holding it, and the cwd."""
    paths = [Path(p) for p in extra]
    if source.directory is not None:
        paths.append(source.directory)
        root = source.directory
        while (root / "__init__.py").exists() and root.parent != root:
            root = root.parent
        paths.append(root)
    paths.append(Path.cwd())
    return paths


def _add_to_sys_path(paths: Sequence[Path], front: int) -> None:
    """The first ``front`` paths go first (explicit --path), the rest last (never shadow)."""
    present = set(sys.path)
    head = [str(p.resolve()) for p in paths[:front]]
    for entry in reversed(head):
        if entry not in present:
            sys.path.insert(0, entry)
            present.add(entry)
    for p in paths[front:]:
        entry = str(p.resolve())
        if entry not in present:
            sys.path.append(entry)
            present.add(entry)
    importlib.invalidate_caches()


class _RefError(Exception):
    pass


def _import_ref(ref: str) -> Any:
    if not _REF_RE.fullmatch(ref):
        raise _RefError(
            f"{ref!r} is not of the form module:attribute (e.g. examples.lm:decode_step)"
        )
    module_name, attr = ref.split(":", 1)
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise _RefError(
                f"cannot import {module_name!r}: no module named {exc.name!r} "
                "(add its directory with --path)"
            ) from None
        raise _RefError(f"importing {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    except Exception as exc:
        raise _RefError(f"importing {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    walked = module_name
    for part in attr.split("."):
        if not hasattr(obj, part):
            close = difflib.get_close_matches(
                part, [n for n in dir(obj) if not n.startswith("_")], n=1
            )
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise _RefError(f"{walked!r} has no attribute {part!r}{hint}")
        obj = getattr(obj, part)
        walked += ("." if walked != module_name else ":") + part
    if not callable(obj):
        raise _RefError(f"{ref} is not callable: it is {_describe(obj)}")
    return obj


def resolve_callable(ref: str, search_paths: Sequence[str | Path] = ()) -> Any:
    """Import ``module:attr`` (attr may be dotted) after putting ``search_paths`` first on sys.path."""
    _add_to_sys_path([Path(p) for p in search_paths], front=len(search_paths))
    try:
        return _import_ref(ref)
    except _RefError as exc:
        raise BadInput(str(exc)) from None


def _resolve_in(spec: FunctionSpec, ref: str, loc: Loc, search_paths: Sequence[str | Path]) -> Any:
    _add_to_sys_path(_search_paths(spec._source, search_paths), front=len(search_paths))
    try:
        return _import_ref(ref)
    except _RefError as exc:
        raise spec._bad(loc, str(exc)) from None


def is_jitted(obj: Any) -> bool:
    """True for a ``jax.jit``-wrapped function: warm lowers it as is, with its own options."""
    if isinstance(obj, _jit_type()):
        return True
    return callable(getattr(obj, "lower", None)) and callable(getattr(obj, "trace", None))


def _is_filter_jit(obj: Any) -> bool:
    """Equinox's filter_jit wrappers: they have .lower but no .trace, and jax.jit around them
    compiles another program (DESIGN.md §7)."""
    kind = type(obj)
    return kind.__module__.startswith("equinox") and "jit" in kind.__name__.lower()


@functools.cache
def _jit_type() -> type:
    import jax

    return type(jax.jit(_identity))


def _identity(x: Any) -> Any:
    return x


def _needs_static(value: Any) -> bool:
    """Values jax.jit cannot trace (a string anywhere in them), so they must be declared static."""
    if value is None or isinstance(value, (int, float, complex)):
        return False
    if isinstance(value, (list, tuple)):
        return any(_needs_static(v) for v in value)
    return True


def check_imports(manifest: Manifest, search_paths: Sequence[str | Path] = ()) -> dict[str, Any]:
    """Import every function and pytree the manifest names; return {function name: callable}.

    Also checks what can only be known with the function in hand: the arguments bind to
    its signature, non-array static values are declared static, and an already-jitted
    function carries no ``jit:`` options (the service calls it with its own).
    """
    resolved: dict[str, Any] = {}
    for spec in manifest.functions:
        fn = _resolve_in(spec, spec.fn, ("fn",), search_paths)
        for a, arg in enumerate(spec.args):
            if arg.pytree is not None:
                _resolve_in(spec, arg.pytree, ("args", a, "pytree"), search_paths)
        if _is_filter_jit(fn):
            raise spec._bad(
                ("fn",),
                f"{spec.fn} is wrapped in eqx.filter_jit, which cachectl cannot lower as the service "
                "does: name the plain function, pass the model's arrays as a pytree argument "
                "(eqx.partition with a predicate that keeps ShapeDtypeStruct) and its static parts "
                "as values",
            )
        jitted = is_jitted(fn)
        if jitted and jit_options(spec):
            raise spec._bad(
                ("jit",),
                f"{spec.fn} is already jitted, so its jax.jit options are fixed; remove 'jit:' "
                "(a re-wrapped function would compile a different program than the service runs)",
            )
        if not jitted:
            static_names = set(spec.jit.static_argnames)
            for key, value in spec.kwargs.items():
                if isinstance(value, dict) and set(value) == {"axis"}:
                    values = spec.buckets.get(value["axis"], [])
                    needs = any(_needs_static(v) for v in values)
                else:
                    needs = _needs_static(value)
                if needs and key not in static_names:
                    raise spec._bad(
                        ("kwargs", key),
                        f"{key!r} is not an array or number, so jax.jit must treat it as static: "
                        "add it to jit.static_argnames",
                    )
            nargs = len(spec.args)
            static_nums = {n % nargs for n in spec.jit.static_argnums} if nargs else set()
            for a, arg in enumerate(spec.args):
                if arg.kind == "value" and _needs_static(arg.value) and a not in static_nums:
                    raise spec._bad(
                        ("args", a, "value"),
                        f"argument {a} is not an array or number, so jax.jit must treat it as "
                        "static: add it to jit.static_argnums",
                    )
        _check_signature(spec, fn)
        resolved[spec.name] = fn
    return resolved


def _check_signature(spec: FunctionSpec, fn: Any) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and some wrappers have none: let lowering tell
        return
    try:
        signature.bind(*([None] * len(spec.args)), **dict.fromkeys(spec.kwargs))
    except TypeError as exc:
        raise spec._bad(
            ("args",), f"the arguments do not fit {spec.fn}{signature}: {exc}"
        ) from None


# --------------------------------------------------------------------------- building a call


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


def jit_function(spec: FunctionSpec, search_paths: Sequence[str | Path] = ()) -> Any:
    """What warm calls ``.lower`` on: the function itself if already jitted, else ``jax.jit(fn, **opts)``."""
    import jax

    fn = _resolve_in(spec, spec.fn, ("fn",), search_paths)
    return fn if is_jitted(fn) else jax.jit(fn, **jit_options(spec))


def _freeze(value: Any) -> Any:
    """Lists become tuples: jax.jit needs static values to be hashable."""
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _build_mesh(spec: FunctionSpec) -> Any:
    import jax
    from jax.sharding import AxisType

    assert spec.mesh is not None
    devices = jax.devices()
    if spec.mesh.size > len(devices):
        raise EnvironmentMismatch(
            spec._source.message(
                spec._loc("mesh", "axes"),
                f"the mesh needs {spec.mesh.size} devices; this machine has {len(devices)} "
                f"{devices[0].platform} device{'s' if len(devices) != 1 else ''}",
            )
        )
    types = None
    if spec.mesh.axis_types is not None:
        kind = {"auto": AxisType.Auto, "explicit": AxisType.Explicit, "manual": AxisType.Manual}
        types = (kind[spec.mesh.axis_types],) * len(spec.mesh.axes)
    return jax.make_mesh(tuple(spec.mesh.axes.values()), tuple(spec.mesh.axes), axis_types=types)


def _partition_spec(entries: Sequence[Any]) -> Any:
    from jax.sharding import PartitionSpec

    return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in entries))


def build_call(
    spec: FunctionSpec, bucket: Bucket, search_paths: Sequence[str | Path] = ()
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The abstract ``(args, kwargs)`` for one bucket: ShapeDtypeStructs, pytrees and static values.

    With a mesh, arrays get ``NamedSharding(mesh, PartitionSpec(*sharding))``; those without a
    ``sharding`` (and pytree leaves without their own) are replicated.
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    if bucket.function != spec.name:
        raise ValueError(f"bucket {bucket} belongs to {bucket.function!r}, not {spec.name!r}")
    mesh = _build_mesh(spec) if spec.mesh is not None else None
    replicated = NamedSharding(mesh, PartitionSpec()) if mesh is not None else None
    args: list[Any] = []
    for a, arg in enumerate(spec.args):
        if arg.kind == "value":
            args.append(_freeze(arg.value))
        elif arg.kind == "array":
            shape = tuple(bucket.values[d] if isinstance(d, str) else d for d in arg.shape or [])
            dtype = jax.dtypes.canonicalize_dtype(_dtype(str(arg.dtype)))
            sharding = replicated
            if arg.sharding == "single_device":
                sharding = _single_device()
            elif mesh is not None and arg.sharding is not None:
                sharding = NamedSharding(mesh, _partition_spec(arg.sharding))
            args.append(
                jax.ShapeDtypeStruct(shape, dtype, sharding=sharding, weak_type=arg.weak_type)
            )
        else:
            args.append(_build_pytree(spec, a, arg, bucket, mesh, search_paths))
    kwargs: dict[str, Any] = {}
    for key, value in spec.kwargs.items():
        if isinstance(value, dict):
            kwargs[key] = bucket.values[value["axis"]]
        else:
            kwargs[key] = _freeze(value)
    return tuple(args), kwargs


def _single_device() -> Any:
    import jax
    from jax.sharding import SingleDeviceSharding

    return SingleDeviceSharding(jax.devices()[0])


_PYTREE_CACHE: dict[tuple[Any, tuple[tuple[str, Any], ...]], Any] = {}


def _build_pytree(
    spec: FunctionSpec,
    a: int,
    arg: ArgSpec,
    bucket: Bucket,
    mesh: Any,
    search_paths: Sequence[str | Path],
) -> Any:
    """Call the pytree function (passing the bucket values it names as parameters), then abstract it."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    loc = ("args", a, "pytree")
    make = _resolve_in(spec, str(arg.pytree), loc, search_paths)
    try:
        params = inspect.signature(make).parameters
    except (TypeError, ValueError):
        params = {}
    call_kwargs = tuple((k, v) for k, v in bucket.values.items() if k in params)
    cache_key = (make, call_kwargs)
    tree = _PYTREE_CACHE.get(cache_key)
    if tree is None:
        try:
            raw = make(**dict(call_kwargs))
        except Exception as exc:
            raise spec._bad(loc, f"{arg.pytree}() raised {type(exc).__name__}: {exc}") from None
        try:
            tree = jax.tree_util.tree_map_with_path(_abstract_leaf, raw)
        except _LeafError as exc:
            raise spec._bad(loc, f"{arg.pytree}() returned {exc}") from None
        _PYTREE_CACHE[cache_key] = tree

    if arg.sharding == "single_device":
        device = _single_device()
        return jax.tree_util.tree_map(
            lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device,
                                              weak_type=leaf.weak_type), tree)
    if mesh is None:
        return tree
    forced = (
        NamedSharding(mesh, _partition_spec(arg.sharding)) if arg.sharding is not None else None
    )

    def place(path: Any, leaf: Any) -> Any:
        sharding = forced
        if sharding is None:
            own = leaf.sharding
            sharding = own if own is not None else NamedSharding(mesh, PartitionSpec())
        elif len(arg.sharding or []) > len(leaf.shape):
            raise spec._bad(
                ("args", a, "sharding"),
                f"leaf {jax.tree_util.keystr(path)} has shape {leaf.shape}, too few dimensions for "
                f"{len(arg.sharding or [])} sharding entries",
            )
        return jax.ShapeDtypeStruct(
            leaf.shape, leaf.dtype, sharding=sharding, weak_type=leaf.weak_type
        )

    return jax.tree_util.tree_map_with_path(place, tree)


class _LeafError(Exception):
    pass


def _abstract_leaf(path: Any, leaf: Any) -> Any:
    """Arrays and ShapeDtypeStructs keep shape and dtype; Python numbers become weak-typed scalars."""
    import jax

    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        dtype = leaf.dtype
        if not jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
            dtype = jax.dtypes.canonicalize_dtype(dtype)
        return jax.ShapeDtypeStruct(
            tuple(leaf.shape), dtype, weak_type=bool(getattr(leaf, "weak_type", False))
        )
    if isinstance(leaf, (bool, int, float, complex)):
        return jax.eval_shape(_identity, leaf)
    raise _LeafError(
        f"a {type(leaf).__name__} at {jax.tree_util.keystr(path) or 'the root'}; "
        "leaves must be arrays, jax.ShapeDtypeStruct or numbers"
    )
