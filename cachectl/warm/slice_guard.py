"""A deviceless warm writes only TPU programs into the slice's namespace.

``warm --topology v5e:2x2`` imports the user's module on a CPU machine. A function jitted there
over concrete devices (``jax.jit(f, in_shardings=NamedSharding(Mesh(jax.devices()...)))``: this
machine's CPUs, with extra host devices) lowers for the CPU, whatever warm asks; compiled, it
would land in the TPU namespace as an x86 program that no slice can load. Three checks:

- before anything compiles, the first bucket of each function is lowered and a function whose
  program is for this machine's platform is refused in one line, exit 2, with the fix
  (:func:`refuse_concrete_devices`);
- each bucket's lowering is checked again before it compiles (:func:`refuse_foreign_program`):
  JAX writes the entry while it compiles, so after would be too late; that bucket fails, nothing
  of it written;
- JAX's persistent-cache write refuses any other program of another platform for the run (a
  computation run while tracing: :func:`only_target_programs`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from cachectl.core.errors import BadInput
from cachectl.core.jax_platforms import lowered_platform, only_platform
from cachectl.manifest import Bucket, FunctionSpec, compiling_for, lowering_scope
from cachectl.manifest.lowering import target_platform

log = logging.getLogger("cachectl.warm")

# What works (tests/test_mesh_manifest.py): the plain function with the manifest's mesh and
# shardings compiles the program a service's jax.jit(f, in_shardings=...) over its own
# Mesh(jax.devices()) runs, key for key. A jit whose in_shardings are over an AbstractMesh does
# not lower in JAX 0.10 (memory kinds differ), so it is no way out for a jitted function.
FIX = (
    "name the function jax.jit wraps, not the jitted one, and declare its shardings in the "
    "manifest (mesh: and each argument's sharding:; a pytree's leaves may carry a "
    "NamedSharding over a jax.sharding.AbstractMesh)"
)


def _foreign(platform: str, target: str) -> str:
    return (
        f"it lowers for this machine's {platform} devices, not the {target.upper()} slice's "
        "(its jit shardings, a pytree leaf's sharding or an array it closes over are on concrete "
        f"devices, such as a Mesh of jax.devices()): {FIX}"
    )


def refuse_foreign_program(lowered: Any) -> None:
    """BadInput when warm compiles for a slice and ``lowered`` is for another platform."""
    target = target_platform()
    if target is None:
        return
    platform = lowered_platform(lowered)
    if platform is not None and platform != target:
        raise BadInput(f"not compiled: {_foreign(platform, target)}")


def refuse_concrete_devices(
    specs: Sequence[FunctionSpec],
    firsts: Sequence[Bucket],
    jitted: Mapping[str, Any],
    calls: Mapping[int, Any],
    devices: list[Any],
) -> None:
    """Lower ``firsts`` (each function's first bucket, with its ``calls`` by position) for the
    slice's ``devices``; a program for another platform is BadInput (exit 2) naming the
    function and the fix. A bucket whose call could not be built, or that fails to lower, is
    left to fail on its own when it runs."""
    by_name = {spec.name: spec for spec in specs}
    target = str(devices[0].platform)
    with compiling_for(devices):
        for position, bucket in enumerate(firsts):
            call = calls.get(position)
            if bucket.function not in jitted or not isinstance(call, tuple):
                continue
            try:
                with lowering_scope():
                    lowered = jitted[bucket.function].lower(*call[0], **call[1])
            except Exception:  # noqa: BLE001 - the bucket reports its own error when it runs
                continue
            platform = lowered_platform(lowered)
            if platform is not None and platform != target:
                spec = by_name[bucket.function]
                problem = (
                    f"{spec.fn} cannot be warmed for a TPU slice: {_foreign(platform, target)}"
                )
                raise spec._bad(("fn",), problem)


@contextlib.contextmanager
def only_target_programs(devices: list[Any] | None) -> Iterator[None]:
    """While warm compiles for a slice's ``devices``, JAX's cache writes only their platform's
    programs; any other is not written, and said once per module."""
    if devices is None:
        yield
        return
    target = str(devices[0].platform)
    said: set[str] = set()

    def refused(module: str, platform: str) -> None:
        if module not in said:
            said.add(module)
            log.warning(
                "%s: not written to the %s namespace: JAX compiled it for this machine's %s",
                module,
                target.upper(),
                platform,
            )

    with only_platform(target, refused):
        yield
