"""Which platform a program is for, read from JAX's internals: the seam's third module.

A deviceless warm (``warm --topology``) compiles for a TPU slice from a CPU machine; a program
that JAX compiles for this machine's own backend there (a function jitted over a concrete
``Mesh(jax.devices())``, a side computation run while tracing) must never be written into the
slice's namespace. JAX decides the platform when it lowers (the lowering's backend, from its
arguments' and its own shardings' devices) and hands that backend to the persistent cache's
write (``compilation_cache.put_executable_and_time``); both are read here, pinned in
tests/test_deviceless_tpu.py against the installed JAX and libtpu.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

_GUARD_LOCK = threading.Lock()
# The platform every program written to JAX's persistent cache must be for (None: any), and
# what is told of each refused write: (module name, its platform).
_REQUIRED: list[tuple[str, Callable[[str, str], None]]] = []


def lowered_platform(lowered: Any) -> str | None:
    """The platform ``lowered.compile()`` compiles for ("cpu", "tpu"); None where this JAX's
    lowering does not say (then the caller cannot check, and says nothing)."""
    computation = getattr(lowered, "_lowering", None)
    args = getattr(computation, "compile_args", None)
    backend = args.get("backend") if isinstance(args, dict) else None
    platform = getattr(backend, "platform", None)
    return platform if isinstance(platform, str) else None


def _install() -> None:
    """Wrap JAX's persistent-cache write once per process; the wrapper checks the platform only
    while :func:`only_platform` is active, and is otherwise JAX's own write."""
    from jax._src import compilation_cache

    original = compilation_cache.put_executable_and_time
    if getattr(original, "_cachectl_platform_guard", False):
        return

    def put(
        cache_key: str, module_name: str, executable: Any, backend: Any, compile_time: int
    ) -> None:
        with _GUARD_LOCK:
            required = _REQUIRED[-1] if _REQUIRED else None
        platform = getattr(backend, "platform", None)
        if required is not None and platform != required[0]:
            required[1](module_name, str(platform))
            return
        original(cache_key, module_name, executable, backend, compile_time)

    put._cachectl_platform_guard = True  # type: ignore[attr-defined]
    compilation_cache.put_executable_and_time = put


@contextlib.contextmanager
def only_platform(platform: str, refused: Callable[[str, str], None]) -> Iterator[None]:
    """For the duration, JAX writes to its persistent cache only programs compiled for
    ``platform``; each other one is not written and ``refused(module, its platform)`` is told."""
    _install()
    with _GUARD_LOCK:
        _REQUIRED.append((platform, refused))
    try:
        yield
    finally:
        with _GUARD_LOCK:
            _REQUIRED.remove((platform, refused))
