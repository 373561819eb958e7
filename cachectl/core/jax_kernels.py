"""The JAX seam's kernel families: what a stored executable's custom calls need made ready.

Part of the seam (cachectl/core/jax_seam.py re-exports its API, and tests/test_jax_seam.py pins
each fact and allows this module ``jax._src`` too); apart so that each seam module stays
readable. Importing it costs nothing: JAX is imported inside the functions.
"""

from __future__ import annotations

import functools
import importlib
import re
import threading
from collections.abc import Callable
from typing import Any

# -- kernels a stored executable calls -----------------------------------------------------
#
# An XLA executable names the library kernels it calls by custom-call target; JAX makes some of
# them ready only when it lowers an op that uses them, and a service loading a stored executable
# never lowers. In jax 0.9 to 0.12:
#
# - LAPACK (``lapack_*`` targets): ``jax._src.lax.linalg`` registers the targets when it is imported
#   (``register_module_custom_calls(lapack)``, done by ``import jax``), but their kernels point at
#   scipy's LAPACK only after ``lapack._lapack.initialize()``, which the lowering rules call
#   (``lapack.prepare_lapack_call``); calling an uninitialized one segfaults. JAX's own exported-
#   function path calls ``linalg.initialize_lapack()`` for the same reason.
# - CPU sparse (``cpu_csr_*``): registered only when ``jax.experimental.sparse`` is imported.
# - GPU linalg, solver, sparse and PRNG kernels (cuSolver, cuBLAS, cuSPARSE, hip*): registered when
#   ``jax._src.lax.linalg`` and the PRNG module (``jax._src.random.prng``, ``jax._src.prng``
#   up to 0.9) are imported; no initialize step.
#
# FFT on CPU is a built-in XLA op (DUCC inside XLA), not a custom call: nothing to prepare.

CUSTOM_CALL_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_READY: dict[str, str | None] = {}  # family -> None (ready) or why it could not be made ready
_READY_LOCK = threading.Lock()


def custom_call_targets(compiled: Any) -> tuple[str, ...] | None:
    """The custom-call targets a ``jax.stages.Compiled`` calls (from its optimized HLO text;
    JAX has no public API listing them); None when the text cannot be read."""
    try:
        text = compiled.as_text()
    except Exception:  # noqa: BLE001 - no text on this backend: unknown, the runtime readies all
        return None
    if not isinstance(text, str):
        return None
    return tuple(sorted(set(CUSTOM_CALL_TARGET.findall(text))))


@functools.cache
def _registered_names(*modules: str) -> frozenset[str]:
    """The target names jaxlib modules (attributes of ``jax._src.lib``) register, where they say."""
    names: set[str] = set()
    lib = importlib.import_module("jax._src.lib")
    for name in modules:
        try:
            module: Any = getattr(lib, name, None)
            registrations = module.registrations() if hasattr(module, "registrations") else {}
            for targets in registrations.values():
                names.update(str(target[0]) for target in targets)
        except Exception:  # noqa: BLE001 - module absent in this jaxlib (no GPU plugin)
            continue
    return frozenset(names)


def _is_lapack(target: str) -> bool:
    return target.startswith("lapack_")


def _is_cpu_sparse(target: str) -> bool:
    return target in _registered_names("cpu_sparse")


def _is_gpu(target: str) -> bool:
    return target in _registered_names("gpu_linalg", "gpu_solver", "gpu_sparse", "gpu_prng")


def _ready_lapack() -> None:
    importlib.import_module("jax._src.lax.linalg")  # registers the targets (at import)
    from jax._src.lib import lapack

    initialize = getattr(getattr(lapack, "_lapack", None), "initialize", None)
    if initialize is None:  # another jaxlib: JAX's own helper, else lower a LAPACK op
        linalg = importlib.import_module("jax._src.lax.linalg")
        initialize = getattr(linalg, "initialize_lapack", None)
    if initialize is not None:
        initialize()
        return
    import jax
    import jax.numpy as jnp

    sds = jax.ShapeDtypeStruct((2, 2), jnp.float32)
    jax.jit(jnp.linalg.cholesky).trace(sds).lower(lowering_platforms=("cpu",))


def _ready_cpu_sparse() -> None:
    importlib.import_module("jax.experimental.sparse")  # its import registers the targets


def _ready_gpu() -> None:
    importlib.import_module("jax._src.lax.linalg")
    # The PRNG module that registers the GPU PRNG targets moved: jax._src.prng up to 0.9,
    # jax._src.random.prng after.
    for name in ("jax._src.random.prng", "jax._src.prng"):
        try:
            importlib.import_module(name)
            return
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError("neither jax._src.random.prng nor jax._src.prng")


# (family, does a target belong to it, make the family ready)
KERNEL_FAMILIES: tuple[tuple[str, Callable[[str], bool], Callable[[], None]], ...] = (
    ("LAPACK", _is_lapack, _ready_lapack),
    ("CPU sparse", _is_cpu_sparse, _ready_cpu_sparse),
    ("GPU linalg/solver/sparse/PRNG", _is_gpu, _ready_gpu),
)


def prepare_custom_calls(targets: Any) -> list[str]:
    """Make ready, once per process, the kernel families JAX readies only when it lowers, for an
    executable calling ``targets``; None (not known: an executable stored before cachectl recorded
    them) readies every family. Returns one line per needed family this JAX could not make ready
    (the caller serves through jax.jit, whose lowering readies it); never raises."""
    needed = [
        (family, ready)
        for family, belongs, ready in KERNEL_FAMILIES
        if targets is None or any(belongs(str(t)) for t in targets)
    ]
    problems = []
    for family, ready in needed:
        with _READY_LOCK:
            if family not in _READY:
                try:
                    ready()
                    _READY[family] = None
                except Exception as exc:  # noqa: BLE001 - another JAX: say so, serve through jit
                    _READY[family] = f"{type(exc).__name__}: {exc}"
            problem = _READY[family]
        if problem is not None:
            problems.append(f"cannot make JAX's {family} kernels ready in this process ({problem})")
    return problems
