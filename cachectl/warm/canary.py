"""warm-check's canary: a stored executable's outputs against a fresh compile on this machine.

The calling process (cachectl.warm.check.call_main) calls a bucket's stored executable on seeded
random inputs, then compiles the same function for the same inputs with ``jax.jit`` (a new
in-memory jit, JAX's persistent cache off for that compile, so nothing the namespace holds is
read) and calls it on the same inputs. Both run on this process's backend: a stored executable
that is what this machine would compile gives outputs equal to the bit, so the comparison is
exact (NaN equal to NaN, dtype and shape part of equality). A difference fails warm-check.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cachectl.dispatch.padding import is_key
from cachectl.manifest import build_call, jit_function
from cachectl.manifest.buckets import Bucket
from cachectl.manifest.schema import FunctionSpec
from cachectl.warm.compiling import persistent_cache_off

EQUAL = "equal"


def random_inputs(
    spec: FunctionSpec, bucket: Bucket, paths: Sequence[str], seed: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The bucket's call with every abstract array replaced by seeded random values.

    Floats in [0, 0.1) (an optimizer's second moments must be neither negative nor big),
    integers in [0, 8), typed PRNG keys from random key data; each placed with the sharding
    the manifest declares, so a multi-device executable gets the inputs it was compiled for.
    """
    import jax

    args, kwargs = build_call(spec, bucket, paths)
    rng = np.random.default_rng(seed)

    def concrete(leaf: Any) -> Any:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        shape = tuple(leaf.shape)
        if is_key(leaf.dtype):
            impl = leaf.dtype._impl
            data = rng.integers(0, 2**32, shape + tuple(impl.key_shape), dtype=np.uint32)
            value: Any = jax.random.wrap_key_data(data, impl=impl.name)  # type: ignore[arg-type]
        else:
            dtype = np.dtype(leaf.dtype)
            if dtype == np.bool_:
                value = rng.random(shape) < 0.5
            elif np.issubdtype(dtype, np.integer):
                value = rng.integers(0, 8, shape).astype(dtype)
            else:
                value = (rng.random(shape) * 0.1).astype(dtype)
        sharding = getattr(leaf, "sharding", None)
        return jax.device_put(value, sharding) if sharding is not None else value

    return jax.tree_util.tree_map(concrete, args), kwargs


def fresh_outputs(spec: FunctionSpec, paths: Sequence[str], args: Any, kwargs: Any) -> Any:
    """The function compiled here and now with JAX's persistent cache off, called on ``args``."""
    import jax

    with persistent_cache_off():
        jitted = jit_function(spec, paths)
        return jax.block_until_ready(jitted(*args, **kwargs))


def _host(leaf: Any) -> tuple[str, np.ndarray]:
    """(dtype name, a numpy array that holds every value exactly): bfloat16 and float8 as float64,
    typed keys by their key data."""
    import jax

    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and is_key(dtype):
        return str(dtype), np.asarray(jax.random.key_data(leaf))
    array = np.asarray(leaf)
    name = str(array.dtype)
    if array.dtype.kind in "fV" or name not in np.sctypeDict:
        try:
            return name, array.astype(np.float64)
        except (TypeError, ValueError):
            return name, array
    return name, array


def compare(stored: Any, fresh: Any) -> str:
    """``equal``, or ``differs (...)`` saying where: count, dtype or shape, or the largest
    absolute difference over values finite on both sides (NaN equals NaN)."""
    import jax

    a = [_host(x) for x in jax.tree_util.tree_leaves(stored)]
    b = [_host(x) for x in jax.tree_util.tree_leaves(fresh)]
    if len(a) != len(b):
        return f"differs ({len(a)} outputs from the stored executable, {len(b)} from jit)"
    worst = 0.0
    nan_mismatch = False
    unequal = 0
    for i, ((da, xa), (db, xb)) in enumerate(zip(a, b, strict=True)):
        if da != db or xa.shape != xb.shape:
            return f"differs (output {i}: {da}{list(xa.shape)} stored, {db}{list(xb.shape)} by jit)"
        inexact = xa.dtype.kind in "fc"
        if np.array_equal(xa, xb, equal_nan=inexact):
            continue
        unequal += 1
        if not inexact:
            diff = np.abs(xa.astype(np.float64) - xb.astype(np.float64))
            worst = max(worst, float(diff.max(initial=0.0)))
            continue
        finite = np.isfinite(xa) & np.isfinite(xb)
        nan_mismatch |= bool((np.isnan(xa) != np.isnan(xb)).any())
        if finite.any():
            worst = max(worst, float(np.abs(xa[finite] - xb[finite]).max()))
    if not unequal:
        return EQUAL
    nan = "; NaN on one side only" if nan_mismatch else ""
    return f"differs (max abs diff {worst:.3g} in {unequal} of {len(a)} outputs{nan})"
