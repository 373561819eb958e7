"""Which argument a service placed otherwise than the stored executable was compiled for.

A stored executable takes host arrays (it places them with its own input shardings) and device
arrays already placed as it expects. A service that shards its params its own way (a
NamedSharding over its mesh) hands it arrays it refuses with JAX's "compiled for input shardings
that disagree"; serving then answers through jit at the service's shardings and says, once,
which argument differs and how: the warm can then declare that sharding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cachectl.manifest.schema import leaf_path


def sharding_difference(compiled: Any, dynamic: tuple[Any, ...], positions: Sequence[int]) -> str:
    """'argument I (leaf PATH) is placed SHARDING; the stored executable takes SHARDING', for the
    first device array whose sharding the executable's input sharding is not equivalent to."""
    import jax

    try:
        wanted = jax.tree_util.tree_flatten_with_path(compiled.input_shardings[0])[0]
    except Exception:  # noqa: BLE001 - an executable that cannot say: the generic reason
        wanted = []
    have = jax.tree_util.tree_flatten_with_path(dynamic)[0]
    for (path, expected), (_, leaf) in zip(wanted, have, strict=False):
        placed = getattr(leaf, "sharding", None)
        if placed is None or not hasattr(leaf, "ndim"):
            continue  # a host array: the executable places it itself
        try:
            same = placed.is_equivalent_to(expected, leaf.ndim)
        except Exception:  # noqa: BLE001 - shardings of different kinds: not the same
            same = False
        if same:
            continue
        index, rest = positions[path[0].idx], leaf_path(path[1:])
        where = f"argument {index}" + (f" (leaf {rest})" if rest else "")
        return (
            f"{where} is placed {_short(placed)}; the stored executable takes {_short(expected)} "
            "(declare the service's sharding in the manifest, `sharding:` or the mesh's, and warm "
            "again, or pass host arrays)"
        )
    return "an argument's sharding is not the one the stored executable was compiled for"


def _short(sharding: Any) -> str:
    """A sharding in a line: its spec and mesh axes for a NamedSharding, else its repr."""
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if spec is not None and mesh is not None:
        axes = dict(getattr(mesh, "shape", {}))
        return f"NamedSharding({spec}, mesh {axes})"
    return repr(sharding)
