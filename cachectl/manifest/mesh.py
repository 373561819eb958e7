"""The manifest's mesh, built as services build theirs, and JAX's mesh errors in its words.

A function's ``mesh: {axes: {data: 2, model: 4}}`` is the mesh a service gets from
``jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))``: devices in
``jax.devices()`` order, Auto axes. JAX's key covers both (the device assignment is in the
compile options, the axis types in the lowered program), so a manifest that builds another
mesh than the service's warms programs the service never asks for. A service that calls
``jax.make_mesh`` instead gets Explicit axes (JAX 0.10's default there) and, on a TPU slice,
the slice's physical order (v5e:2x2: devices 0, 1, 3, 2); its manifest says
``axis_types: explicit`` and ``device_order: make_mesh``.

A pytree argument's leaves may carry their own PartitionSpecs: leaves whose sharding is a
``NamedSharding`` over a ``jax.sharding.AbstractMesh`` of the same axes lower over the
manifest's mesh (JAX takes the devices from the other arguments; an abstract mesh names none,
so the same pytree function serves a deviceless warm): tests/test_mesh_manifest.py.

Uses JAX inside its functions only, as lowering.py does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from cachectl.core.errors import BadInput, EnvironmentMismatch
from cachectl.manifest.schema import FunctionSpec

# JAX's words when the arguments of one program are sharded over meshes that differ (jax 0.10's
# lax utilities), most often only in their axis types.
MESH_MISMATCH = "Mesh for all inputs should be equal"
_AXIS_TYPES = re.compile(r"axis_types=\(([^)]*)\)")


def build_mesh(spec: FunctionSpec, devices: Sequence[Any]) -> Any:
    """``spec.mesh`` over ``devices`` (this machine's ``jax.devices()``, or a slice's
    compile-only devices in the order ``jax.devices()`` gives them there)."""
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    assert spec.mesh is not None
    if spec.mesh.size > len(devices):
        raise EnvironmentMismatch(
            spec._source.message(
                spec._loc("mesh", "axes"),
                f"the mesh needs {spec.mesh.size} devices; this machine has {len(devices)} "
                f"{devices[0].platform} device{'s' if len(devices) != 1 else ''}",
            )
        )
    kind = {"auto": AxisType.Auto, "explicit": AxisType.Explicit, "manual": AxisType.Manual}
    types = (kind[spec.mesh.axis_types],) * len(spec.mesh.axes)
    sizes, names = tuple(spec.mesh.axes.values()), tuple(spec.mesh.axes)
    if spec.mesh.device_order == "make_mesh":
        return jax.make_mesh(sizes, names, axis_types=types, devices=list(devices))
    grid = np.empty(spec.mesh.size, dtype=object)
    grid[:] = list(devices[: spec.mesh.size])
    return Mesh(grid.reshape(sizes), names, axis_types=types)


def explain_mesh_error(exc: BaseException) -> str | None:
    """JAX's "Mesh for all inputs should be equal" said with what to change; None for any other
    error. The meshes usually differ only in axis types: ``jax.make_mesh`` gives Explicit axes,
    ``jax.sharding.Mesh`` and the manifest's mesh (by default) Auto ones."""
    text = str(exc)
    if isinstance(exc, BadInput) or MESH_MISMATCH not in text:
        return None
    found = [m.replace(" ", "") for m in _AXIS_TYPES.findall(text)]
    seen = " and ".join(f"({t})" for t in dict.fromkeys(found)) or "(unknown)"
    return (
        f"the arguments are sharded over meshes whose axis_types differ: {seen} (JAX: "
        f"{MESH_MISMATCH}); the manifest's mesh has Auto axes unless it sets axis_types, as "
        "jax.sharding.Mesh(...) builds it, while jax.make_mesh gives Explicit ones: set the "
        "function's mesh: {axis_types: explicit} (or auto) to the axis types of the mesh the "
        "service's shardings are over, or give pytree leaves a NamedSharding over a "
        "jax.sharding.AbstractMesh"
    )
