"""The JAX seam's devices and executables: a TPU slice's compile-only devices, what a stored
executable is made of, and how it is loaded back (part of the seam, cachectl/core/jax_seam.py,
which re-exports every name here; split off so each module stays short).

Importing this module costs nothing: JAX is imported inside the functions.
"""

from __future__ import annotations

from typing import Any

# -- compiling for a TPU this machine does not have ----------------------------------------


def tpu_topology_devices(
    name: str, chips_per_host_bounds: tuple[int, int, int], wrap: tuple[bool, bool, bool]
) -> list[Any]:
    """Compile-only devices of a TPU slice, described by libtpu (no TPU needed; the default
    backend stays what it was). Raises when libtpu is missing or refuses the name."""
    from jax.experimental import topologies

    desc = topologies.get_topology_desc(
        topology_name=name,
        platform="tpu",
        chip_config_name="default",
        chips_per_host_bounds=chips_per_host_bounds,
        num_slices=1,
        wrap=wrap,
    )
    return list(desc.devices)


def tpu_chips_here() -> int | None:
    """How many TPU chips this machine has, read the way cloud_tpu_init reads it (PCI devices),
    without opening any backend; None when this JAX cannot say."""
    try:
        from jax._src import hardware_utils

        return int(hardware_utils.num_available_tpu_chips_and_device_id()[0])
    except Exception:  # noqa: BLE001 - another JAX: the caller opens the backend instead
        return None


def device_client(device: Any) -> Any:
    """The client a device compiles with: its platform_version goes into JAX's key (for a
    compile-only device, libtpu's, the same string the chip's backend reports)."""
    return device.client


def libtpu_version() -> str | None:
    """The installed libtpu wheel's version; None when there is none."""
    from importlib import metadata

    for name in ("libtpu", "libtpu-nightly"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def default_device(device: Any) -> Any:
    """``jax.default_device(device)``: lowering a plain jit inside it gives the program a
    service's uncommitted arrays compile (tests/test_deviceless.py); thread-local, like JAX's."""
    import jax

    return jax.default_device(device)


# -- executables and jax.distributed -------------------------------------------------------


def pjrt_pickler_classes() -> tuple[type, type, type]:
    """(pickler, unpickler, LoadedExecutable) of jax.experimental.serialize_executable."""
    from jax._src.lib import xla_client
    from jax.experimental import serialize_executable

    return (
        serialize_executable._JaxPjrtPickler,
        serialize_executable._JaxPjrtUnpickler,
        xla_client.LoadedExecutable,
    )


def unloaded_executable_type() -> type:
    """The executable a compile for compile-only devices holds (not loaded on any device);
    serialize_executable pickles it by ``serialize()``, the bytes JAX's entry holds."""
    from jax._src.lib import _jax

    return _jax.Executable


def unloaded_executable(compiled: Any) -> Any | None:
    """The picklable (unloaded) executable behind a ``jax.stages.Compiled``; None where JAX has none."""
    return getattr(getattr(compiled, "_executable", None), "_unloaded_executable", None)


def closes_over_mutable(unloaded: Any) -> bool:
    """True when the program closes over a mutable array (its executable cannot be stored)."""
    mut = getattr(unloaded, "mut", None)
    return bool(mut is not None and getattr(mut, "in_mut", None))


def captures_constants(compiled: Any) -> bool:
    """True when the program captured constants (closed-over arrays), which are not pickled with it.
    ``const_args`` exists from jax 0.7 (before it, captured constants were folded into the HLO)."""
    return bool(getattr(getattr(compiled, "_params", None), "const_args", None))


def no_kwargs(compiled: Any) -> bool:
    """Whether the compiled program refuses keyword arguments (stored with it, as JAX pickles it)."""
    return bool(compiled._no_kwargs)


def executable_device_ids(unloaded: Any) -> list[int]:
    """The ids of the devices an unloaded executable runs on (jax < 0.7 names the list
    ``device_assignment``)."""
    devices = getattr(unloaded, "device_list", None)
    if devices is None:
        devices = unloaded.device_assignment
    return [d.id for d in devices]


def make_compiled(loaded: Any, args_info: Any, out_tree: Any, no_kwargs: bool) -> Any:
    """``jax.stages.Compiled`` from its parts, as serialize_executable.deserialize_and_load builds it:
    from jax 0.7 its constructor takes ``const_args`` second (none: they are refused at store)."""
    import inspect

    import jax

    # Its types describe the installed JAX's constructor; the two calls are two versions' own.
    compiled: Any = jax.stages.Compiled
    if "const_args" in inspect.signature(jax.stages.Compiled.__init__).parameters:
        return compiled(loaded, [], args_info, out_tree, no_kwargs=no_kwargs)
    return compiled(loaded, args_info, out_tree, no_kwargs=no_kwargs)  # jax 0.6.2


def device_list(devices: Any) -> Any:
    """An XLA DeviceList of ``devices``, as a backend's deserialize_executable takes it."""
    from jax._src.lib import xla_client

    return xla_client.DeviceList(tuple(devices))


def distributed_client() -> Any:
    """jax.distributed's coordination client in this process; None before initialize()."""
    from jax._src import distributed

    return distributed.global_state.client
