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

from cachectl import jax_seam


def cache_key(lowered: Any) -> str | None:
    """The key ``lowered.compile()`` would look up in the persistent cache, or None when unsure."""
    try:
        return jax_seam.persistent_cache_key(lowered)
    except Exception:  # noqa: BLE001 - JAX internals differ: the caller compiles instead
        return None
