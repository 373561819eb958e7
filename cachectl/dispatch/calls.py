"""Fitting a call to a bucket, on the host: per-argument plans, padding, the mask, the errors.

Nothing here traces or compiles: a jnp.pad or a device slice would compile a program per
shape (docs/jax-facts.md, fact 8), which is what serving from stored executables avoids."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from cachectl.dispatch import padding

# Re-exported: the names serving and its callers have always imported from here.
from cachectl.dispatch.padding import OutOfBucket as OutOfBucket
from cachectl.dispatch.padding import pad_to as pad_to
from cachectl.manifest import ArgSpec, FunctionSpec, dtype_named
from cachectl.manifest.schema import leaf_path


class StructureMismatch(TypeError):
    """Arguments whose pytree structure differs from the warmed one: never silently recompiled."""


def mask(sizes: Sequence[int] | np.ndarray, bucket: int) -> np.ndarray:
    """Valid-region mask of a padded axis: ``mask([3, 1], 4)`` -> [[T,T,T,F],[T,F,F,F]].

    A model must ignore what padding adds (attention masks, loss weights): this
    is the mask to give it.
    """
    lengths = np.asarray(sizes).reshape(-1, 1)
    return np.arange(bucket)[None, :] < lengths


@dataclass(frozen=True)
class _ArgPlan:
    kind: str  # array | pytree | value
    dims: tuple[tuple[int, str], ...] = ()  # (dimension, axis) of each bucketed dimension
    shape: tuple[Any, ...] = ()
    dtype: Any = None
    pad: Any = 0
    weak: bool = False
    value: Any = None
    arg: ArgSpec | None = None  # a pytree's spec, whose leaf_axes name its bucket dimensions
    # _declared_leaves' plans for this pytree argument, by (structure, leaf ranks)
    leaf_plans: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def has_leaf_axes(self) -> bool:
        return self.arg is not None and bool(self.arg.leaf_axes)

    def target(self, values: dict[str, Any]) -> tuple[int, ...]:
        return tuple(values[d] if isinstance(d, str) else d for d in self.shape)


def arg_plans(spec: FunctionSpec) -> list[_ArgPlan]:
    plans = []
    for arg in spec.args:
        if arg.kind == "array":
            shape = tuple(arg.shape or ())
            dtype = np.dtype(dtype_named(str(arg.dtype)))
            if (
                dtype == np.float64
                or dtype == np.int64
                or dtype == np.uint64
                or dtype == np.complex128
            ):
                import jax

                dtype = np.dtype(jax.dtypes.canonicalize_dtype(dtype))
            pad = arg.pad if arg.pad is not None else (False if dtype == np.bool_ else 0)
            plans.append(
                _ArgPlan(
                    "array",
                    tuple((d, a) for d, a in enumerate(shape) if isinstance(a, str)),
                    shape,
                    dtype,
                    pad,
                    arg.weak_type,
                )
            )
        elif arg.kind == "value":
            plans.append(_ArgPlan("value", value=arg.value))
        else:
            plans.append(_ArgPlan("pytree", arg=arg))
    return plans


# Leaf plans kept per pytree argument: one per (structure, leaf ranks) seen, up to this many.
MAX_LEAF_PLANS = 64


# A flattened pytree argument: leaves, structure, shapes, (leaf index, declared dimensions,
# leaf path).
DeclaredLeaves = tuple[
    list[Any],
    Any,
    list[tuple[int, ...]],
    tuple[tuple[int, tuple[tuple[int, str], ...], str], ...],
]


def _declared_leaves(plan: _ArgPlan, tree: Any) -> DeclaredLeaves:
    """The pytree's leaves, structure and shapes, and (leaf index, its declared bucket dimensions)
    for the leaves that have some: computed from the leaves' paths once per structure and leaf
    ranks (a Brax State has hundreds of leaves: their paths, per call, were most of its cost)."""
    import jax

    assert plan.arg is not None
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    shapes = [np.shape(leaf) for leaf in leaves]
    key = (treedef, tuple(len(shape) for shape in shapes))
    declared = plan.leaf_plans.get(key)
    if declared is None:
        paths = [leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
        declared = tuple(
            (i, dims, path)
            for i, (path, shape) in enumerate(zip(paths, shapes, strict=True))
            if (dims := plan.arg.leaf_dims(path, len(shape)))
        )
        if len(plan.leaf_plans) < MAX_LEAF_PLANS:
            plan.leaf_plans[key] = declared
    return leaves, treedef, shapes, declared


def pytree_sizes(plan: _ArgPlan, tree: Any, raw: dict[str, int]) -> DeclaredLeaves:
    """Raise ``raw``'s sizes to the largest a pytree's declared leaf dimensions hold; returns
    the flattened tree for :func:`pad_pytree` (a Brax State flattens in Python: once a call)."""
    flat = _declared_leaves(plan, tree)
    _, _, shapes, declared = flat
    for i, dims, _ in declared:
        shape = shapes[i]
        for d, axis in dims:
            if shape[d] > raw.get(axis, -1):
                raw[axis] = shape[d]
    return flat


def pad_pytree(
    plan: _ArgPlan, tree: Any, values: dict[str, Any], flat: DeclaredLeaves | None = None
) -> tuple[Any, bool]:
    """The pytree with its declared leaf dimensions padded to the bucket's sizes, on the host
    (the same tree when nothing needs padding); ``flat``: :func:`pytree_sizes`' for this tree.
    Each leaf is padded with what padding.pad_value allows; raises Unpaddable (the paths and
    dtype) for a leaf nothing may pad, before anything is padded."""
    assert plan.arg is not None
    leaves, treedef, shapes, declared = flat or _declared_leaves(plan, tree)
    leaves = list(leaves)
    todo, refused = [], []
    for i, dims, path in declared:
        target = _target(shapes[i], dims, values)
        if target == shapes[i]:
            continue
        dtype = padding.leaf_dtype(leaves[i])
        # an empty leaf (a Brax State's contacts: [n, 0]) stays empty: no value is written
        value = 0 if 0 in target else padding.pad_value(plan.arg, path, dtype)
        if value is padding.REFUSED:
            refused.append((path, dtype))
        todo.append((i, target, value))
    if refused:
        raise padding.Unpaddable(refused)
    for i, target, value in todo:
        leaves[i] = padding.pad_leaf(leaves[i], target, value)
    return (treedef.unflatten(leaves) if todo else tree), bool(todo)


def _target(
    shape: tuple[int, ...], dims: tuple[tuple[int, str], ...], values: dict[str, Any]
) -> tuple[int, ...]:
    target = list(shape)
    for d, axis in dims:
        target[d] = values[axis]
    return tuple(target)


def fit_pytree(
    plan: _ArgPlan,
    index: int,
    tree: Any,
    values: dict[str, Any],
    flat: DeclaredLeaves | None,
    paths: Sequence[str],
) -> tuple[Any, bool]:
    """Pytree argument ``index`` fitted to a bucket: by its pad_fn (which pads it whole) when
    the manifest names one, else by :func:`pad_pytree`; an Unpaddable names the argument."""
    assert plan.arg is not None
    if plan.arg.pad_fn:
        return padding.call_pad_fn(plan.arg, tree, values, paths), True
    try:
        return pad_pytree(plan, tree, values, flat)
    except padding.Unpaddable as exc:
        exc.index = index
        raise


def first_difference(expected: Any, given: Any) -> str:
    """The first pytree path where the call's arguments differ from the warmed structure."""
    import jax

    want = [
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(
            expected.unflatten([0] * expected.num_leaves)
        )[0]
    ]
    have = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(given)[0]]
    for w, h in zip(want, have, strict=False):
        if w != h:
            return f"expected a leaf at {w}, got one at {h}"
    if len(want) != len(have):
        longer, which = (want, "missing") if len(want) > len(have) else (have, "unexpected")
        return f"{which} leaf at {longer[min(len(want), len(have))]}"
    return "the node types differ (e.g. a dict where a list was warmed)"


class _HasValues(Protocol):
    @property
    def values(self) -> Mapping[str, Any]: ...


SlotT = TypeVar("SlotT", bound=_HasValues)


def smallest_first(
    slots: Iterable[SlotT], shape_axes: set[str], static_axes: set[str]
) -> list[SlotT]:
    """Buckets ordered so that the first one covering a call is the cheapest one."""
    return sorted(
        slots,
        key=lambda s: (
            tuple(s.values[a] for a in sorted(shape_axes)),
            [str(s.values.get(a)) for a in sorted(static_axes)],
        ),
    )


def coverings(
    slots: Sequence[SlotT], raw: Mapping[str, int], static: Mapping[str, Any]
) -> Iterator[SlotT]:
    """The buckets (in :func:`smallest_first`'s order) at least as large as the call's sizes on
    every axis and equal on its static values."""
    for slot in slots:
        values = slot.values
        if all(values[a] >= n for a, n in raw.items()) and all(
            values[a] == v for a, v in static.items()
        ):
            yield slot


def covering(
    slots: Sequence[SlotT], raw: Mapping[str, int], static: Mapping[str, Any]
) -> SlotT | None:
    """The first of :func:`coverings`; None: no bucket covers the call."""
    return next(coverings(slots, raw, static), None)
