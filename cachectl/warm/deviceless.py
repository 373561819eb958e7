"""Warm for a TPU slice this machine does not have: libtpu's compile-only devices.

``warm --topology v5e:1x1`` (or ``target.topology`` in the manifest) on a CPU machine with
libtpu installed compiles every bucket for that slice and files it under the namespace
``cachectl fingerprint`` names on the slice itself, so a service there finds every program.
What makes the keys equal (each pinned in tests/test_deviceless.py):

- LIBTPU_INIT_ARGS carries what cloud_tpu_init adds on a TPU VM (topologies.CLOUD_TPU_INIT_FLAGS),
  set before libtpu starts and kept for the process, as there;
- a plain jit is lowered with unsharded ShapeDtypeStructs under ``jax.default_device`` of the
  slice's first device (manifest.lowering.lowering_scope), meshes are built over the slice's
  devices as ``jax.devices()`` would give them there;
- the Environment is read from the compile-only devices (fingerprint.compile_only_environment).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from cachectl.core import jax_seam
from cachectl.core.errors import BadInput, EnvironmentMismatch
from cachectl.core.fingerprint import Environment, compile_only_environment
from cachectl.core.topologies import (
    INSTALL_HINT,
    TpuTopology,
    libtpu_init_args,
    libtpu_startup_env,
    parse_topology,
)


@dataclass(frozen=True)
class DevicelessTarget:
    """A TPU slice to compile for: its name, compile-only devices and the slice's Environment."""

    topology: TpuTopology
    devices: tuple[Any, ...]
    environment: Environment
    libtpu_version: str


def set_cloud_tpu_flags() -> None:
    """LIBTPU_INIT_ARGS as cloud_tpu_init leaves it on a TPU VM (JAX's key hashes it)."""
    os.environ["LIBTPU_INIT_ARGS"] = libtpu_init_args(os.environ.get("LIBTPU_INIT_ARGS"))


def resolve(name: str, *, startup_warnings: bool = False) -> DevicelessTarget:
    """The slice named ``name``: BadInput (2) for an unknown name, EnvironmentMismatch (3) where
    this machine cannot compile for TPU (no libtpu).

    libtpu is told the slice's accelerator type and worker (as a TPU VM's metadata would; a
    user's own values are kept), which keeps its start-up warnings off stderr; with
    ``startup_warnings`` (``-v``) it is told nothing and prints them. Its errors print either way."""
    topology = parse_topology(name)
    version = jax_seam.libtpu_version()
    if version is None:
        raise EnvironmentMismatch(
            f"cannot compile for TPU topology {name!r} here: libtpu is not installed; {INSTALL_HINT}"
        )
    set_cloud_tpu_flags()
    if not startup_warnings:
        for variable, value in libtpu_startup_env(topology).items():
            os.environ.setdefault(variable, value)
    try:
        devices = jax_seam.tpu_topology_devices(
            topology.libtpu_name, topology.chips_per_host_bounds, topology.wrap
        )
    except Exception as exc:  # noqa: BLE001 - libtpu's refusal, said in one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise BadInput(
            f"libtpu {version} cannot describe TPU topology {name!r} "
            f"({topology.libtpu_name}): {first}"
        ) from None
    if len(devices) != topology.chips or devices[0].device_kind != topology.device_kind:
        raise BadInput(
            f"libtpu {version} describes {name!r} as {len(devices)} {devices[0].device_kind!r} "
            f"devices, expected {topology.chips} {topology.device_kind!r}"
        )
    return DevicelessTarget(topology, tuple(devices), compile_only_environment(devices), version)


def deviceless_import_words(target: DevicelessTarget) -> str:
    """Where warm --topology imports the user's modules, for their import errors: here, whose
    ``jax.devices()`` are not the slice's."""
    t = target.topology
    return (
        f" on this machine to warm for the TPU slice {t.name} (jax.devices() here are this "
        f"machine's, not the slice's {t.chips} {t.device_kind})"
    )
