"""What warm lowers: the jitted function and the abstract ``(args, kwargs)`` of one bucket.

The only part of the manifest package that uses JAX; it imports JAX inside its functions,
so importing the package stays cheap for the CLI."""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from cachectl.core import jax_seam
from cachectl.manifest.buckets import Bucket
from cachectl.manifest.imports import identity, is_jitted, resolve_in
from cachectl.manifest.mesh import build_mesh
from cachectl.manifest.schema import ArgSpec, FunctionSpec, dtype_named, jit_options, leaf_path

log = logging.getLogger("cachectl.manifest")

# The devices warm compiles for when they are not this machine's (``warm --topology``): meshes and
# single-device shardings are built over them, and every lowering runs with the first as JAX's
# default device. None: this machine's jax.devices().
_TARGET_DEVICES: list[Any] | None = None


@contextlib.contextmanager
def compiling_for(devices: list[Any] | None) -> Iterator[None]:
    """Build meshes and shardings over ``devices`` (compile-only ones) for the duration."""
    global _TARGET_DEVICES
    saved, _TARGET_DEVICES = _TARGET_DEVICES, devices
    try:
        yield
    finally:
        _TARGET_DEVICES = saved


def target_platform() -> str | None:
    """The platform warm compiles for when not this machine's ("tpu"); None: this machine's."""
    return None if _TARGET_DEVICES is None else str(_TARGET_DEVICES[0].platform)


def lowering_scope() -> contextlib.AbstractContextManager[Any]:
    """Where a bucket is lowered: under ``jax.default_device`` of the target's first device when
    compiling for other devices (a plain jit's uncommitted arguments land there, as in a service
    on that hardware), else as it is. JAX's default device is per thread: enter it in the thread
    that lowers."""
    if _TARGET_DEVICES is None:
        return contextlib.nullcontext()
    return jax_seam.default_device(_TARGET_DEVICES[0])


def _devices() -> list[Any]:
    import jax

    return list(jax.devices()) if _TARGET_DEVICES is None else list(_TARGET_DEVICES)


def jit_function(spec: FunctionSpec, search_paths: Sequence[str | Path] = ()) -> Any:
    """What warm calls ``.lower`` on: the function itself if already jitted, else ``jax.jit(fn, **opts)``."""
    import jax

    fn = resolve_in(spec, spec.fn, ("fn",), search_paths)
    return fn if is_jitted(fn) else jax.jit(fn, **jit_options(spec))


def _freeze(value: Any) -> Any:
    """Lists become tuples: jax.jit needs static values to be hashable."""
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _build_mesh(spec: FunctionSpec) -> Any:
    return build_mesh(spec, _devices())


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
            dtype = jax.dtypes.canonicalize_dtype(dtype_named(str(arg.dtype)))
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


def _check_leaf_axes(
    spec: FunctionSpec, a: int, arg: ArgSpec, bucket: Bucket, tree: Any, takes: list[str]
) -> None:
    """The leaves' declared bucket dimensions are the bucket's sizes; a pytree that varies with
    the buckets but declares none is said once, since serving cannot route its calls."""
    import jax

    if not arg.leaf_axes:
        if takes and (spec.name, a) not in _SAID_NO_LEAF_AXES:
            _SAID_NO_LEAF_AXES.add((spec.name, a))
            log.warning(
                "%s: argument %d (pytree %s) varies with bucket axis %s but declares no leaf_axes: "
                "cachectl.serving refuses calls whose leaves are not exactly a bucket's; declare "
                "them, e.g. leaf_axes: {0: %s}",
                spec.name,
                a,
                arg.pytree,
                ", ".join(takes),
                takes[0],
            )
        return
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        where = leaf_path(path)
        for d, axis in arg.leaf_dims(where, len(leaf.shape)):
            if leaf.shape[d] != bucket.values[axis]:
                raise spec._bad(
                    ("args", a, "leaf_axes"),
                    f"leaf {where or '(root)'} has size {leaf.shape[d]} at dimension {d}, but the "
                    f"bucket has {axis}={bucket.values[axis]}: name that leaf's bucket dimensions "
                    "by path",
                )


def _single_device() -> Any:
    return jax_seam.single_device_sharding(_devices()[0])


_PYTREE_CACHE: dict[tuple[Any, tuple[tuple[str, Any], ...]], Any] = {}
_SAID_NO_LEAF_AXES: set[tuple[str, int]] = set()


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
    make = resolve_in(spec, str(arg.pytree), loc, search_paths)
    params: Mapping[str, inspect.Parameter]
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
    _check_leaf_axes(spec, a, arg, bucket, tree, [k for k, _ in call_kwargs])

    if arg.sharding == "single_device":
        device = _single_device()
        return jax.tree_util.tree_map(
            lambda leaf: jax.ShapeDtypeStruct(
                leaf.shape, leaf.dtype, sharding=device, weak_type=leaf.weak_type
            ),
            tree,
        )
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
        return jax.eval_shape(identity, leaf)
    raise _LeafError(
        f"a {type(leaf).__name__} at {jax.tree_util.keystr(path) or 'the root'}; "
        "leaves must be arrays, jax.ShapeDtypeStruct or numbers"
    )
