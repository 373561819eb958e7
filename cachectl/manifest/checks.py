"""Cross-field checks: what one field means for another (axes, shardings, jit options, excludes)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

from cachectl.manifest.buckets import bucket_values, same_value
from cachectl.manifest.schema import ArgSpec, FunctionSpec, MeshSpec, Target
from cachectl.manifest.source import Loc, Source, describe


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool))


def _contains(values: Sequence[Any], value: Any) -> bool:
    return any(same_value(v, value) for v in values)


def semantic_problems(
    specs: Sequence[FunctionSpec], target: Target | None, source: Source
) -> Iterator[tuple[Loc, str]]:
    """The cross-field problems of these function entries (each knows its ``_index``)."""
    first_seen: dict[str, int] = {}
    for spec in specs:
        loc: Loc = ("functions", spec._index)
        line = source.line(loc)
        if spec.name in first_seen:
            yield (
                loc + ("name",),
                (
                    f"duplicate function name {spec.name!r} (also on line {first_seen[spec.name]}); "
                    "set 'name:' to tell them apart"
                ),
            )
        first_seen.setdefault(spec.name, line)
        yield from _function_problems(spec, loc, target)


def _function_problems(
    spec: FunctionSpec, loc: Loc, target: Target | None
) -> Iterator[tuple[Loc, str]]:
    shape_axes: set[str] = set()  # the axes the arguments' shapes use, filled by their checks
    for a, arg in enumerate(spec.args):
        yield from _argument_problems(spec, arg, loc + ("args", a), shape_axes)
    yield from _extent_problems(spec, loc)
    yield from _output_problems(spec, loc, shape_axes)
    yield from _axis_problems(spec, loc, shape_axes)
    yield from _exclude_problems(spec, loc)
    yield from _kwarg_problems(spec, loc)
    yield from _jit_problems(spec, loc)

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
    axes = spec.buckets
    if axes and all(values for values in axes.values()) and next(bucket_values(spec), None) is None:
        yield loc + ("exclude",), "exclude removes every bucket of this function"
    if spec.mesh is not None:
        yield from _divisibility_problems(spec, loc)


def _argument_problems(
    spec: FunctionSpec, arg: ArgSpec, aloc: Loc, shape_axes: set[str]
) -> Iterator[tuple[Loc, str]]:
    """One argument's problems; the axes its shape (or leaf_axes) uses go into ``shape_axes``."""
    axes = spec.buckets
    given = [k for k in ("shape", "pytree", "value") if k in arg.given]
    if len(given) != 1:
        has = ", ".join(sorted(arg.given)) or "nothing"
        yield (
            aloc,
            f"an argument needs exactly one of shape (with dtype), pytree or value; this one has {has}",
        )
        return
    if arg.kind == "array":
        yield from _array_problems(arg, aloc, axes, shape_axes)
    else:
        for key in ("dtype", "weak_type"):
            if key in arg.given:
                yield aloc + (key,), f"only an array argument (shape) takes {key}"
    if arg.leaf_axes is not None:
        if arg.kind != "pytree":
            yield aloc + ("leaf_axes",), "only a pytree argument takes leaf_axes"
        else:
            for lloc, problem, axis in _leaf_axes_problems(arg.leaf_axes, aloc, axes):
                if problem:
                    yield lloc, problem
                else:
                    shape_axes.add(axis)
    if "pad" in arg.given and (arg.kind != "array" or not _is_scalar(arg.pad)):
        yield aloc + ("pad",), "pad is a scalar, given only on an array argument (shape)"
    yield from _pytree_pad_problems(arg, aloc)
    yield from _argument_sharding_problems(spec, arg, aloc)


def _array_problems(
    arg: ArgSpec, aloc: Loc, axes: dict[str, Any], shape_axes: set[str]
) -> Iterator[tuple[Loc, str]]:
    """An array argument's dtype and shape: each dimension an int or a declared axis."""
    if arg.dtype is None:
        yield (
            aloc + ("dtype",),
            "required field missing (an array argument needs shape and dtype)",
        )
    declared = ", ".join(axes) or "none"
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
                f"a dimension is a non-negative int or an axis name, got {describe(dim)}",
            )


def _argument_sharding_problems(
    spec: FunctionSpec, arg: ArgSpec, aloc: Loc
) -> Iterator[tuple[Loc, str]]:
    if arg.sharding == "single_device":
        if arg.kind == "value":
            yield aloc + ("sharding",), "a static value cannot be sharded"
        elif spec.mesh is not None:
            yield (
                aloc + ("sharding",),
                "single_device is for a function without a mesh; with a mesh, list mesh axes",
            )
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


def _output_problems(
    spec: FunctionSpec, loc: Loc, shape_axes: set[str]
) -> Iterator[tuple[Loc, str]]:
    """Outputs (cut by cachectl.serving): each dimension an int or an axis the arguments use."""
    for o, out in enumerate(spec.outputs or []):
        for d, dim in enumerate(out.shape if out is not None else []):
            if isinstance(dim, str) and dim not in shape_axes:
                yield (
                    loc + ("outputs", o, "shape", d),
                    f"unknown axis {dim!r}: an output names axes used in the arguments' shapes",
                )
            elif not isinstance(dim, str) and not (_is_int(dim) and dim >= 0):
                yield (
                    loc + ("outputs", o, "shape", d),
                    f"a dimension is a non-negative int or an axis name, got {describe(dim)}",
                )


def _axis_problems(spec: FunctionSpec, loc: Loc, shape_axes: set[str]) -> Iterator[tuple[Loc, str]]:
    """Bucket axes: non-empty lists of distinct scalars, non-negative ints where a shape uses them."""
    for axis, values in spec.buckets.items():
        vloc = loc + ("buckets", axis)
        if not values:
            yield vloc, "an axis needs a non-empty list of values"
        seen: set[tuple[bool, Any]] = set()  # same_value's equality, hashed: linear in the values
        for v, value in enumerate(values):
            if axis in shape_axes and not (_is_int(value) and value >= 0):
                yield (
                    vloc + (v,),
                    f"axis {axis!r} is used in a shape, so its values must be non-negative ints; got {describe(value)}",
                )
            elif not _is_scalar(value):
                yield (
                    vloc + (v,),
                    f"axis values must be scalars (int, float, string, bool), got {describe(value)}",
                )
            elif (isinstance(value, bool), value) in seen:
                yield vloc + (v,), f"duplicate value {value!r} in axis {axis!r}"
            else:
                seen.add((isinstance(value, bool), value))


def _exclude_problems(spec: FunctionSpec, loc: Loc) -> Iterator[tuple[Loc, str]]:
    axes = spec.buckets
    declared = ", ".join(axes) or "none"
    for e, entry in enumerate(spec.exclude):
        eloc = loc + ("exclude", e)
        if not entry:
            yield eloc, "an exclude entry names at least one axis value, e.g. {batch: 16}"
        for axis, value in entry.items():
            if axis not in axes:
                yield eloc + (axis,), f"unknown axis {axis!r} (declared axes: {declared})"
            elif not _contains(axes[axis], value):
                yield eloc + (axis,), f"{value!r} is not a value of axis {axis!r} ({axes[axis]})"


def _kwarg_problems(spec: FunctionSpec, loc: Loc) -> Iterator[tuple[Loc, str]]:
    declared = ", ".join(spec.buckets) or "none"
    for key, value in spec.kwargs.items():
        kloc = loc + ("kwargs", key)
        if isinstance(value, dict):
            if set(value) != {"axis"}:
                yield kloc, "a keyword value is a static literal or {axis: NAME}"
            elif value["axis"] not in spec.buckets:
                yield (
                    kloc + ("axis",),
                    f"unknown axis {value['axis']!r} (declared axes: {declared})",
                )


def _jit_problems(spec: FunctionSpec, loc: Loc) -> Iterator[tuple[Loc, str]]:
    """jit options against the argument list: in range, static ones values, donated ones not."""
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


_LEAF_AXES_FORM = (
    "leaf_axes maps a dimension to an axis for every leaf ({0: n}) or a leaf path to "
    "dimensions ({pipeline_state.qpos: {0: n}})"
)


def _leaf_axes_problems(
    leaf_axes: dict[Any, Any], aloc: Loc, axes: dict[str, Any]
) -> Iterator[tuple[Loc, str, str]]:
    """(where, problem, "") for each bad entry, ("", "", axis) for each good axis it names."""
    declared = ", ".join(axes) or "none"
    for key, value in leaf_axes.items():
        kloc = aloc + ("leaf_axes", key)
        pairs: list[tuple[Any, Any]]
        if _is_int(key):
            pairs = [(key, value)]
        elif isinstance(key, str) and key and isinstance(value, dict):
            pairs = list(value.items())
        else:
            yield kloc, _LEAF_AXES_FORM, ""
            continue
        for dim, axis in pairs:
            if not (_is_int(dim) and dim >= 0):
                yield kloc, f"a dimension is a non-negative int, got {describe(dim)}", ""
            elif not isinstance(axis, str) or axis not in axes:
                yield kloc, f"unknown axis {axis!r} (declared axes: {declared})", ""
            else:
                yield (), "", axis


def _pytree_pad_problems(arg: ArgSpec, aloc: Loc) -> Iterator[tuple[Loc, str]]:
    """leaf_pad and pad_fn: only with a pytree's leaf_axes (they pad what those declare)."""
    for key in ("leaf_pad", "pad_fn"):
        if key in arg.given and (arg.kind != "pytree" or not arg.leaf_axes):
            yield (
                aloc + (key,),
                f"only a pytree argument with leaf_axes takes {key} (it pads the dimensions "
                "leaf_axes declares)",
            )
            return
    pads = arg.leaf_pad
    if pads is None:
        return
    entries = pads.items() if isinstance(pads, dict) else [(None, pads)]
    for path, value in entries:
        where = aloc + ("leaf_pad",) + (() if path is None else (path,))
        if path is not None and not (isinstance(path, str) and path):
            yield where, f"leaf_pad maps a leaf path to a number, got key {describe(path)}"
        elif not isinstance(value, (int, float)):  # a bool too, for bool leaves
            yield (
                where,
                "leaf_pad is a number for every leaf (leaf_pad: 0) or by leaf path "
                f"({{senders: 7}}), got {describe(value)}",
            )


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
                    f"a sharding entry is a mesh axis name, a list of them, or null; got {describe(entry)}",
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


# The most elements one array argument may have in any bucket: XLA keeps a shape's element count
# and byte size in int64 and aborts the process past it ("overflow in static extent product", exit
# 134) mid-warm; 2^59 elements of the widest dtype (16 bytes) still fit.
MAX_ELEMENTS = 2**59


def _extent_problems(spec: FunctionSpec, loc: Loc) -> Iterator[tuple[Loc, str]]:
    """An array argument whose largest bucket (each axis at its largest value) holds more than
    MAX_ELEMENTS elements; arguments with other problems in their shape are left to those."""
    largest = {
        axis: max(values)
        for axis, values in spec.buckets.items()
        if values and all(_is_int(v) and v >= 0 for v in values)
    }
    for a, arg in enumerate(spec.args):
        if arg.kind != "array" or not arg.shape:
            continue
        dims: list[Any] = [largest.get(d) if isinstance(d, str) else d for d in arg.shape]
        if not all(_is_int(d) and d >= 0 for d in dims):
            continue
        elements = math.prod(int(d) for d in dims)
        if elements > MAX_ELEMENTS:
            yield (
                loc + ("args", a, "shape"),
                f"the largest bucket's shape {dims} has {elements} elements, more than the "
                f"2^59 an XLA array may have (its size in bytes must fit in int64)",
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
                        v[dim] for v in bucket_values(spec) if dim in v and _is_int(v[dim])
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
