"""The JAX seam's cache key: the key ``lowered.compile()`` would look up, and JAX's own digest of
each of its components, computed as JAX's compiler computes them (part of the seam,
cachectl/core/jax_seam.py, which re-exports the public names; split off so each module stays
short).

Importing this module costs nothing: JAX is imported inside the functions.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from typing import Any


def persistent_cache_key(lowered: Any) -> str | None:
    """The key ``lowered.compile()`` would look up (pxla.UnloadedMeshExecutable.from_hlo ->
    compiler.compile_or_get_cached, in jax 0.9 to 0.12: tests/test_jax_seam.py compares it with the
    key JAX logs, on every version the matrix runs); None where that path differs: PGLE, shape
    polymorphism, auto-SPMD or pmap, a program over several processes, an unknown JAX. Re-warm then
    compiles as before."""
    try:
        return _persistent_cache_key(lowered)
    except Exception:  # noqa: BLE001 - internals of another JAX: the caller compiles instead
        return None


def _persistent_cache_key(lowered: Any) -> str | None:
    from jax._src import compilation_cache

    inputs = _key_inputs(lowered)
    if inputs is None:
        return None
    key: str = compilation_cache.get_cache_key(*inputs)
    return key


# What jax/_src/cache_key.py's get() logs at DEBUG for each (name, hashfn) pair of the key: the
# sha256 of that component alone (the other line it logs is the running hash).
_COMPONENT_LOG = "get_cache_key hash of serialized %s: %s"
_KEY_LOG_LOCK = threading.Lock()


def key_components(lowered: Any) -> dict[str, str] | None:
    """JAX's own digest of each component of the key ``lowered.compile()`` would look up
    ("computation", "jax_lib version", "backend version", "XLA flags", "compile_options",
    "accelerator_config", "compression", "custom_hook" in jax 0.10), read off the debug record
    cache_key.get() writes for each; None where :func:`persistent_cache_key` is None. Two keys
    that differ differ in at least one of these: the names say where."""
    try:
        inputs = _key_inputs(lowered)
        if inputs is None:
            return None
        from jax._src import cache_key as jax_cache_key
        from jax._src import compilation_cache

        found: dict[str, str] = {}
        me = threading.get_ident()

        class _Components(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                # Only this call's records: another thread may compute a key meanwhile.
                if record.thread != me or record.msg != _COMPONENT_LOG:
                    return
                if len(record.args or ()) == 2:
                    name, digest = record.args  # type: ignore[misc]
                    found[str(name)] = str(digest)

        logger = jax_cache_key.logger
        handler = _Components(logging.DEBUG)
        with _KEY_LOG_LOCK:  # one reader at a time sets and restores the logger
            level, propagate = logger.level, logger.propagate
            logger.addHandler(handler)
            logger.setLevel(logging.DEBUG)
            logger.propagate = False  # these records are ours, not the user's log's
            try:
                compilation_cache.get_cache_key(*inputs)
            finally:
                logger.removeHandler(handler)
                logger.setLevel(level)
                logger.propagate = propagate
        return found or None
    except Exception:  # noqa: BLE001 - internals of another JAX: no components, as no key
        return None


def _key_inputs(lowered: Any) -> tuple[Any, ...] | None:
    """The arguments compilation_cache.get_cache_key takes for ``lowered``, as
    compiler.compile_or_get_cached builds them; None where that path differs."""
    import numpy as np
    from jax._src import cache_key as jax_cache_key
    from jax._src import config
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
    if args.get("auto_spmd_lowering") or args.get("pmap_nreps", 1) != 1:
        return None
    devices = computation._device_list
    if devices is None or len({d.process_index for d in devices}) > 1:
        return None  # a program over several processes compiles collectively: every process must call it
    in_shardings = tuple(pxla.maybe_concretize_mesh(s, devices) for s in args["in_shardings"])
    out_shardings = tuple(pxla.maybe_concretize_mesh(s, devices) for s in args["out_shardings"])
    to_inputs, to_outputs = pxla.get_prop_to_input_output(
        in_shardings, out_shardings, len(args["ordered_effects"])
    )
    device_array = np.vectorize(lambda i: devices[i], otypes=[object])(np.arange(len(devices)))
    hlo, backend = computation._hlo, args["backend"]
    options = dict(computation._compiler_options_kvs)
    # Typed for the installed JAX only: each branch calls one version's signature.
    create_compile_options: Any = pxla.create_compile_options
    if "spmd_lowering" in _parameters(
        pxla.create_compile_options
    ):  # jax 0.9: mesh, SPMD and pmap arguments
        options = create_compile_options(
            hlo,
            None,
            args["spmd_lowering"],
            args["tuple_args"],
            False,
            to_inputs,
            to_outputs,
            backend,
            device_array,
            1,
            options,
        )
    else:  # jax 0.10 - 0.12
        options = create_compile_options(
            hlo, args["tuple_args"], to_inputs, to_outputs, backend, device_array, options
        )
    # The callback-ignoring mode as compiler._get_cache_key picks it (an enum in 0.9 and 0.10, a bool
    # in 0.12); not that function itself, whose is_cache_used() would open the cache as a side effect.
    remove = config.remove_custom_partitioning_ptr_from_cache_key.value
    modes = getattr(jax_cache_key, "IgnoreCallbacks", None)
    ignore = remove if modes is None else (modes.CUSTOM_PARTITIONING if remove else modes.NO)
    return (hlo, device_array, options, backend, ignore)


@functools.cache
def _parameters(function: Any) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)
