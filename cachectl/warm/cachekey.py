"""A lowered program's persistent-cache key, computed the way ``.compile()`` would, without compiling.

Re-warm needs only to know that a bucket's entry and stored executable exist;
``.compile()`` of a hit would read and deserialize the executable just to log
its key. JAX has no public call for the key, so this follows
``pxla.UnloadedMeshExecutable.from_hlo`` -> ``compiler.compile_or_get_cached``
(jax 0.10): the same compile options, the same ``compilation_cache.get_cache_key``.
Whatever this cannot follow exactly (PGLE, shape polymorphism, a program over
several processes, another lowering type, a JAX whose internals moved) gives None, and the caller compiles as before;
a wrong key can only miss a file, never claim one.
"""

from __future__ import annotations

from typing import Any


def cache_key(lowered: Any) -> str | None:
    """The key ``lowered.compile()`` would look up in the persistent cache, or None when unsure."""
    try:
        return _cache_key(lowered)
    except Exception:  # noqa: BLE001 - JAX internals differ: the caller compiles instead
        return None


def _cache_key(lowered: Any) -> str | None:
    import numpy as np
    from jax._src import cache_key as jax_cache_key
    from jax._src import compilation_cache, config
    from jax._src.interpreters import pxla

    computation = getattr(lowered, "_lowering", None)
    if not isinstance(computation, pxla.MeshComputation):
        return None
    if config.enable_pgle.value or config.compilation_cache_expect_pgle.value:
        return None
    args = computation.compile_args
    poly = args.get("shape_poly_state")
    if poly is not None and poly.uses_dim_vars:
        return None
    devices = computation._device_list
    if devices is None or len({d.process_index for d in devices}) > 1:
        return None  # a program over several processes compiles collectively: every process must call it
    in_shardings = tuple(pxla.maybe_concretize_mesh(s, devices) for s in args["in_shardings"])
    out_shardings = tuple(pxla.maybe_concretize_mesh(s, devices) for s in args["out_shardings"])
    to_inputs, to_outputs = pxla.get_prop_to_input_output(in_shardings, out_shardings,
                                                          len(args["ordered_effects"]))
    device_array = np.vectorize(lambda i: devices[i], otypes=[object])(np.arange(len(devices)))
    hlo = computation._hlo
    options = pxla.create_compile_options(hlo, args["tuple_args"], to_inputs, to_outputs, args["backend"],
                                          device_array, dict(computation._compiler_options_kvs))
    ignore = (jax_cache_key.IgnoreCallbacks.CUSTOM_PARTITIONING
              if config.remove_custom_partitioning_ptr_from_cache_key.value
              else jax_cache_key.IgnoreCallbacks.NO)
    key: str = compilation_cache.get_cache_key(hlo, device_array, options, args["backend"], ignore)
    return key
