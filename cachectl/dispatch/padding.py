"""What serving may pad a pytree's leaves with: the rule, in one place (README, "Padding").

A bucket dimension that ``leaf_axes`` declares for a leaf is padded

- with the value ``leaf_pad`` declares for that leaf (by its path or a subtree's, the longest
  path first; a bare number for every leaf of the argument);
- else with zeros when the leaf holds floating, complex or bool values, or typed PRNG keys
  (key data of zeros): values that index nothing, padded rows a model masks or ignores, as it
  does an array argument's;
- never implicitly when the leaf holds integers: an integer leaf may index another padded
  dimension (a graph's ``senders`` and ``receivers`` index its nodes), where 0 is a real
  element and a zero-padded answer is silently wrong. :class:`Unpaddable` names it; serving
  then runs that call through ``jax.jit`` at its own shapes and warns once.

A leaf that stays empty when padded (``[n, 0]``: no contacts yet) is padded whatever its
dtype: no value is written.

An argument with ``pad_fn`` is padded by that function instead, whole (``jraph.pad_with_graphs``
adds a padding graph its nodes and edges belong to): the one way to pad what zeros cannot.

Everything is on the host, without tracing: a key leaf is padded as its key data and wrapped
again (``jax.random.wrap_key_data`` and ``key_data`` run no program).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from cachectl.manifest import ArgSpec, resolve_callable
from cachectl.manifest.schema import leaf_path

# leaf_pad's answer where nothing may pad a leaf.
REFUSED: Any = object()


class OutOfBucket(ValueError):
    """A call no warmed bucket covers (above the largest bucket, or a static value not warmed)."""


def pad_to(x: Any, target: tuple[int, ...], value: Any, dtype: Any) -> np.ndarray:
    """Pad on the host: a jnp.pad would compile a program per shape (docs/jax-facts.md, fact 8)."""
    host = np.asarray(x, dtype=dtype)
    if host.shape == target:
        return host
    if host.ndim != len(target) or any(s > t for s, t in zip(host.shape, target, strict=False)):
        raise OutOfBucket(f"shape {host.shape} does not fit the bucket shape {target}")
    out = np.full(target, value, dtype=dtype)
    out[tuple(slice(0, s) for s in host.shape)] = host
    return out


class Unpaddable(ValueError):
    """A call whose padding could change its answer: an integer leaf with no declared pad."""

    def __init__(self, leaves: list[tuple[str, Any]], index: int = -1) -> None:
        super().__init__(f"no safe pad value for leaves {leaves}")
        self.leaves, self.index = leaves, index

    @classmethod
    def explained(cls, exc: Unpaddable, fn: str, plans: Any) -> Unpaddable:
        """The same refusal, its message the warning serving gives: where, why, the fix."""
        arg = plans[exc.index].arg
        out = cls(exc.leaves, exc.index)
        out.args = (refusal(fn, exc.index, exc.leaves, sorted(arg.pytree_axes())),)
        return out


class PadFnRefused(ValueError):
    """An argument's pad_fn raised for a bucket: that bucket is too small for what it adds."""


def is_key(dtype: Any) -> bool:
    """A typed PRNG key dtype (``jax.random.key``'s ``key<fry>``), which numpy cannot hold."""
    if isinstance(dtype, np.dtype):
        return False
    import jax

    return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))


def leaf_dtype(x: Any) -> Any:
    dtype = getattr(x, "dtype", None)
    return dtype if dtype is not None else np.asarray(x).dtype


def pad_value(arg: ArgSpec, path: str, dtype: Any) -> Any:
    """What the leaf at ``path`` is padded with, or :data:`REFUSED` (the rule above)."""
    pads = arg.leaf_pad
    if isinstance(pads, dict):
        best = max(
            (k for k in pads if path == k or path.startswith(k + ".")), key=len, default=None
        )
        if best is not None:
            return pads[best]
    elif pads is not None:
        return pads
    if is_key(dtype):
        return 0
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return False
    if dtype.kind in "fc" or (dtype.kind == "V" and "float" in dtype.name):  # bfloat16, float8_*
        return 0
    return REFUSED


def refusal(fn: str, index: int, leaves: list[tuple[str, Any]], axes: list[str]) -> str:
    """Why a call is not padded, and the fix: the warning serving gives once."""
    named = ", ".join(f"{path or '(the argument itself)'} ({dtype})" for path, dtype in leaves)
    sizes = ", ".join(f"{a}=..." for a in axes)
    values = ", ".join(f"{path}: VALUE" for path, _ in leaves if path) or "VALUE"
    return (
        f"{fn}: argument {index}'s integer leaves {named} are not zero-padded (0 may be a real "
        "index: a padded answer could be wrong): this call is served through jax.jit at its own "
        "shapes, which compiles per shape. Declare how to pad them: a pad function for argument "
        f"{index} (pad_fn: module:fn, called as fn(tree, {sizes}), e.g. jraph:pad_with_graphs for "
        f"a GraphsTuple), or values that are safe (leaf_pad: {{{values}}})"
    )


def pad_leaf(x: Any, target: tuple[int, ...], value: Any) -> Any:
    """``x`` padded to ``target`` with ``value`` on the host; a typed key array by its key data."""
    dtype = leaf_dtype(x)
    if not is_key(dtype):
        return pad_to(x, target, value, dtype)
    import jax

    data = np.asarray(jax.random.key_data(x))
    trailing = data.shape[len(np.shape(x)) :]
    padded = pad_to(data, tuple(target) + trailing, 0, data.dtype)
    return jax.random.wrap_key_data(padded, impl=jax.random.key_impl(x))  # type: ignore[arg-type]


def zeros(shape: tuple[int, ...], dtype: Any) -> Any:
    """Zeros of an abstract argument, typed keys (key data of zeros) and zero sizes included."""
    if is_key(dtype):
        import jax

        impl = dtype._impl  # the key's PRNGImpl: its key shape and name
        data = np.zeros(tuple(shape) + tuple(impl.key_shape), np.uint32)
        return jax.random.wrap_key_data(data, impl=impl.name)  # type: ignore[arg-type]
    return np.zeros(shape, np.dtype(dtype))


def host_slice(x: Any, index: tuple[slice, ...]) -> Any:
    """``x[index]`` on the host (slicing on a device compiles); a typed key array by its data."""
    if is_key(leaf_dtype(x)):
        import jax

        data = np.asarray(jax.random.key_data(x))[index]
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))  # type: ignore[arg-type]
    return np.asarray(x)[index]


def call_pad_fn(arg: ArgSpec, tree: Any, values: dict[str, Any], paths: Any) -> Any:
    """The argument padded by its ``pad_fn`` to a bucket: ``fn(tree, **{axis: size})``, the
    axes its leaf_axes names; PadFnRefused when the function raises (that bucket is too small)."""
    assert arg.pad_fn is not None
    fn = resolve_callable(arg.pad_fn, paths)  # imported once: later, a sys.modules lookup
    sizes = {axis: values[axis] for axis in sorted(arg.pytree_axes())}
    try:
        return fn(tree, **sizes)
    except Exception as exc:  # noqa: BLE001 - the user's function says the bucket does not fit
        raise PadFnRefused(
            f"pad_fn {arg.pad_fn} refused every bucket that covers the call, the last "
            f"{sizes}: {type(exc).__name__}: {exc}"
        ) from None


def undeclared(slot: Any, dynamic: tuple[Any, ...], positions: list[int], axes: list[str]) -> str:
    """Which leaf of which argument differs from what ``slot``'s executable was compiled for
    (an undeclared pytree argument), and the leaf_axes that would declare it."""
    import jax

    want = jax.tree_util.tree_flatten_with_path(slot.compiled.args_info[0])[0]
    have = jax.tree_util.tree_flatten_with_path(dynamic)[0]

    for (path, info), (_, leaf) in zip(want, have, strict=False):
        shape, dtype = tuple(np.shape(leaf)), leaf_dtype(leaf)
        if shape == tuple(info.shape) and str(dtype) == str(info.dtype):
            continue
        index, rest = positions[path[0].idx], leaf_path(path[1:])
        dims = {
            d: a
            for d, (n, m) in enumerate(zip(shape, info.shape, strict=False))
            if n != m
            for a in axes
            if slot.values.get(a) == m
        }
        fix = ", ".join(f"{d}: {a}" for d, a in dims.items()) or f"0: {axes[0]}"
        declare = f"{{{rest}: {{{fix}}}}}" if rest else f"{{{fix}}}"
        return (
            f"argument {index}'s leaf {rest or '(the argument itself)'} is {dtype}{list(shape)}, "
            f"compiled as {info.dtype}{list(info.shape)}; declare its bucket dimensions "
            f"(leaf_axes: {declare}) and, for integer leaves, how to pad them (pad_fn or leaf_pad)"
        )
    return "declare the argument's bucket dimensions in leaf_axes"


def fit(slots: Iterable[Any], convert: Callable[..., Any], args: Any, flat: Any) -> Any:
    """(bucket, the call padded to it, padded?) for the first of ``slots`` (those that cover the
    call, smallest first) that its pad functions take: one that raises for a bucket (too small
    for the padding graph it adds) passes to the next; all refused: PadFnRefused, the last
    one's reason. (None, args, False): no bucket covers the call."""
    refused: PadFnRefused | None = None
    for slot in slots:
        try:
            call_args, padded = convert(args, slot.values, flat)
        except PadFnRefused as exc:
            refused = exc
            continue
        return slot, call_args, padded
    if refused is not None:
        raise refused
    return None, list(args), False


def undeclared_warning(fn: str, unrouted: list[str], pytrees: list[int]) -> str:
    """Serving's start warning for bucket axes that no argument declares."""
    named = " and ".join(f"pytree argument {i}" for i in pytrees)
    return (
        f"cachectl.serving: {fn}: bucket axis {', '.join(unrouted)} shapes no array argument, "
        f"and {named} declare{'s' if len(pytrees) == 1 else ''} no leaf_axes: calls go to the "
        "smallest bucket and go through jax.jit at their own shapes unless their leaves match it; declare which leaf "
        f"dimensions each axis sizes, by leaf path (leaf_axes: {{LEAF.PATH: {{0: {unrouted[0]}}}}}), "
        "and a pad_fn or leaf_pad for integer leaves (serving never zero-pads those)"
    )
