"""Every JAX internal cachectl depends on, behind one seam: a JAX upgrade is checked here.

cachectl reads more from JAX than its public API offers: the persistent cache's
log calls (the only place that names a key), the lowering log (the only place that
names a program's input avals), a few private attributes and functions of
``jax._src``. All of it lives in this module, behind a small typed API, and
tests/test_jax_seam.py pins each fact against the installed JAX. No other module but
jax_kernels.py (the kernels a stored executable calls, re-exported here) and jax_platforms.py
(which platform a program is for: deviceless warm's guard) imports ``jax._src``
or matches a JAX log message (tests/test_jax_seam.py greps).

Importing this module costs nothing: JAX is imported inside the functions, as the
callers did before (``import cachectl`` and ``activate()`` never wait for it here).

What JAX (0.10.2) logs, and what each call carries:

- compiler logger: ``"Persistent compilation cache hit for '%s' with key '%s'"`` and
  ``"PERSISTENT COMPILATION CACHE MISS for '%s' with key '%s'"`` (module, key) at DEBUG,
  before loading or compiling; ``"Not writing persistent cache entry for '%s' because it
  uses host callbacks"`` or ``"... because it took < %.2f seconds to compile (%.2fs)"``
  after a miss JAX decided not to write (jax 0.12 writes programs with host callbacks and
  no longer logs the first).
- compilation-cache logger: ``"Writing %s to persistent compilation cache with key %r"``.
- pxla logger, once per lowering: ``"Compiling %s with global shapes and types %s.
  Argument mapping: %s."`` with the module name, the flat input avals (shape, dtype,
  weak_type) and the input shardings (``UnspecifiedValue`` for uncommitted arrays). The
  call is guarded by ``logger.isEnabledFor``.

Where JAX knows them, the frames of that lowering call say more: the lowering frame
(``_cached_lowering_to_hlo``) holds the jaxpr, whose ``debug_info.func_src_info`` is the
Python name and source location ("f at model.py:12"); the jit call's ``cache_miss`` frame
(``pjit.py``) holds the call's ``args``, ``kwargs`` and ``jit_info``, whose static argnums
and argnames give the static argument values. Only a ``jit`` call has that frame;
``.lower()`` and ``.trace()`` do not, so their static values stay unknown.

The order on one thread is: lowering log, request event, hit/miss log (module, key),
then the hit event or the write event or the not-writing log.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import inspect
import logging
import os
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

# The kernels a stored executable calls: jax_kernels.py, the seam's other module.
from cachectl.core.jax_kernels import (  # noqa: F401 - the seam's API
    KERNEL_FAMILIES,
    custom_call_targets,
    prepare_custom_calls,
)
from cachectl.core.temps import without_world_write

# -- loggers -------------------------------------------------------------------------------

COMPILER_LOGGER = "jax._src.compiler"
COMPILATION_CACHE_LOGGER = "jax._src.compilation_cache"
PXLA_LOGGER = "jax._src.interpreters.pxla"
CACHE_LOGGERS = (COMPILER_LOGGER, COMPILATION_CACHE_LOGGER)

# -- log messages (the templates' start, as JAX passes them to the logger) -----------------

HIT_PREFIX = "Persistent compilation cache hit for"
MISS_PREFIX = "PERSISTENT COMPILATION CACHE MISS for"
WRITE_PREFIX = "Writing "
WRITE_MARK = "persistent compilation cache"
NOT_WRITING_PREFIX = "Not writing persistent cache entry for"
HOST_CALLBACKS_MARK = "host callbacks"
LOWERING_PREFIX = "Compiling %s with global shapes and types"
KEY_IN_TEXT = re.compile(r"key '([^']+)'")
# Eager application of a primitive (jnp.asarray's ``stage``, ``x.astype``'s ``convert_element_type``,
# jnp.zeros' ``broadcast_in_dim``, NumPyro's eager ``mul``/``reshape``) compiles a one-primitive
# program around a function JAX defines in jax/_src/dispatch.py: its lowering's source names that
# file. These JAX-internal staging programs are looked up like any other, but no manifest can name
# them: telemetry counts them as not cacheable.
STAGING_SOURCE = re.compile(r" at .*[/\\]jax[/\\]_src[/\\]dispatch\.py:\d+$")
# JAX's default jax_persistent_cache_min_compile_time_secs: a program compiled faster than
# this is never written by a service with default settings (read-only services raise it).
DEFAULT_MIN_COMPILE_TIME_S = 1.0

# -- jax.monitoring events (docs/jax-facts.md, fact 5) ----------------------------------------------

EVENT_REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"
EVENT_HITS = "/jax/compilation_cache/cache_hits"
EVENT_WRITES = "/jax/compilation_cache/cache_misses"  # fires only when an entry is written
EVENT_SAVED = "/jax/compilation_cache/compile_time_saved_sec"
EVENT_RETRIEVAL = "/jax/compilation_cache/cache_retrieval_time_sec"
# The duration of pxla's compile stage around the persistent cache (lookup, then the XLA compile
# and write of a miss, or the load of a hit), fired after the hit or miss log on the same thread.
EVENT_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"

# -- frames of a lowering ------------------------------------------------------------------

LOWERING_FRAME = "_cached_lowering_to_hlo"
CALL_FRAME = "cache_miss"
CALL_FILE = "pjit.py"
_MAX_FRAMES = 40
_MAX_VALUE_TEXT = 80

# One leaf of a signature: (shape, dtype, weak_type, sharding or None for uncommitted); a dimension
# that is not an int (a symbolic one) is kept as its text.
Leaf = tuple[tuple[int | str, ...], str, bool, "str | None"]


def _module_logger(module: str, attribute: str, name: str) -> logging.Logger:
    """The logger object a JAX module logs through (the one it imported), else the named one."""
    try:
        candidate = getattr(importlib.import_module(module), attribute, None)
        if isinstance(candidate, logging.Logger):
            return candidate
    except ImportError:
        pass
    return logging.getLogger(name)


def compiler_logger() -> logging.Logger:
    """The logger JAX's compiler logs persistent-cache hits, misses and not-writing through."""
    return _module_logger("jax._src.compiler", "logger", COMPILER_LOGGER)


def pxla_logger() -> logging.Logger:
    """The logger JAX's pxla logs lowerings through."""
    return _module_logger("jax._src.interpreters.pxla", "logger", PXLA_LOGGER)


# -- reading log calls ---------------------------------------------------------------------


def compiler_call_reader(
    on_lookup: Callable[[bool, str, str], None],
    on_uncacheable: Callable[[str], None],
    on_host_callbacks: Callable[[str], None] | None = None,
) -> Callable[[Any, tuple[Any, ...]], None]:
    """A reader for a tap on the compiler logger: calls ``on_lookup(hit, module, key)`` for a hit or
    miss call and ``on_uncacheable(module)`` for a program JAX will never write, then
    ``on_host_callbacks(module)`` when the reason is its host callbacks; never raises.
    Built once, so the compile path pays one call per log call, as it did before the seam."""
    hit, miss, not_writing = HIT_PREFIX, MISS_PREFIX, NOT_WRITING_PREFIX
    mark = HOST_CALLBACKS_MARK

    def read(msg: Any, args: tuple[Any, ...]) -> None:
        try:
            if len(args) == 2 and isinstance(msg, str):
                if msg.startswith(hit):
                    on_lookup(True, str(args[0]), str(args[1]))
                elif msg.startswith(miss):
                    on_lookup(False, str(args[0]), str(args[1]))
            elif (
                args
                and isinstance(msg, str)
                and msg.startswith(not_writing)
                and uncacheable(args, msg)
            ):
                on_uncacheable(str(args[0]))
                if on_host_callbacks is not None and mark in msg:
                    on_host_callbacks(str(args[0]))
        except Exception:  # noqa: BLE001 - never raise into JAX's logging
            pass

    return read


# What a user can do about a program with host callbacks: warm's, warm-run's, warm-check --replay's,
# misses', stats' and serving's one explanation of it.
HOST_CALLBACKS_ADVICE = (
    "JAX never writes a program with host callbacks (jax.debug.print, pure_callback, "
    "equinox's runtime checks) to its persistent cache, so no warm can serve it: turn the "
    "library's callbacks off (equinox/diffrax: EQX_ON_ERROR=nan) or remove them"
)


def host_callbacks_cause(modules: Any) -> str:
    """One sentence naming the programs with host callbacks and the way out."""
    names = ", ".join(sorted(set(modules))) or "a program"
    return f"{names} uses host callbacks; {HOST_CALLBACKS_ADVICE}"


def host_callbacks_module(msg: Any, args: tuple[Any, ...]) -> str | None:
    """The module of JAX's "Not writing ... because it uses host callbacks" log call (warm's
    detector: the compiler says so after compiling a miss); None for any other call."""
    if (
        isinstance(msg, str)
        and msg.startswith(NOT_WRITING_PREFIX)
        and HOST_CALLBACKS_MARK in msg
        and args
    ):
        return str(args[0])
    return None


def is_host_callbacks_text(text: str | None) -> bool:
    """True for the text of that log record (warm's ``skip_reason``)."""
    return bool(text) and NOT_WRITING_PREFIX in str(text) and HOST_CALLBACKS_MARK in str(text)


@functools.cache
def never_writes_host_callbacks() -> bool:
    """Whether this JAX refuses to write a program with host callbacks: its compiler holds the
    not-writing message for them (jax 0.9 and 0.10 do; 0.12 writes such programs)."""
    try:
        from jax._src import compiler

        return "because it uses host" in inspect.getsource(compiler)  # split over two lines
    except Exception:  # noqa: BLE001 - no source to read: assume the older behaviour
        return True


def lowered_has_host_callbacks(lowered: Any) -> bool:
    """True when ``lowered.compile()`` would hand JAX's compiler host callbacks that it will not
    write (the list the compiler checks before it logs so: compile_args of the lowering, jax 0.9
    to 0.12; never on a JAX that writes them). For a process that lowers but never compiles
    (misses, serving's fallback); False where the lowering does not say."""
    if not never_writes_host_callbacks():
        return False
    try:
        args = getattr(getattr(lowered, "_lowering", None), "compile_args", None) or {}
        return bool(args.get("host_callbacks"))
    except Exception:  # noqa: BLE001 - internals of another JAX: unknown
        return False


def is_staging(source: str | None) -> bool:
    """True for a lowering whose source ("f at file:line", call_context) is JAX's eager dispatch of
    one primitive: a JAX-internal staging program (STAGING_SOURCE)."""
    return bool(source) and STAGING_SOURCE.search(str(source)) is not None


def uncacheable(args: tuple[Any, ...], msg: str) -> bool | None:
    """From a not-writing log call: True when JAX would never write the program
    (host callbacks, or faster than the default threshold), False when only this
    process's threshold kept it out; None when the call is not a not-writing log."""
    if not msg.startswith(NOT_WRITING_PREFIX):
        return None
    if HOST_CALLBACKS_MARK in msg:
        return True
    if len(args) >= 3:
        try:
            threshold, took = float(args[1]), float(args[2])
        except (TypeError, ValueError):
            return True
        return took < min(threshold, DEFAULT_MIN_COMPILE_TIME_S)
    return True


def is_lowering(msg: Any, args: tuple[Any, ...]) -> bool:
    """True for pxla's lowering log call: its args are (module, in_avals, in_shardings)."""
    return len(args) == 3 and isinstance(msg, str) and msg.startswith(LOWERING_PREFIX)


def classify_record(record: logging.LogRecord) -> tuple[str, str | None, str] | None:
    """(kind, key, message) of a persistent-cache log record; kind is hit | miss | write | skip."""
    template = str(record.msg)
    if template.startswith(HIT_PREFIX):
        kind = "hit"
    elif template.startswith(MISS_PREFIX):
        kind = "miss"
    elif template.startswith(WRITE_PREFIX) and WRITE_MARK in template:
        kind = "write"
    elif template.startswith(NOT_WRITING_PREFIX):
        kind = "skip"
    else:
        return None
    text = record.getMessage()
    key = None
    args = record.args if isinstance(record.args, tuple) else ()
    if kind != "skip" and len(args) >= 2 and isinstance(args[1], str):
        key = args[1]
    elif (match := KEY_IN_TEXT.search(text)) is not None:
        key = match.group(1)
    return kind, key, text


# -- signatures of a lowering --------------------------------------------------------------

_SHARDING_TEXT: dict[Any, str | None] = {}


def single_device_sharding(device: Any) -> Any:
    """A sharding on one device, by the constructor this JAX prefers.

    jax 0.12.1 deprecated the public ``SingleDeviceSharding`` name in favour of
    ``make_single_device_sharding``; the object is the same class either way,
    so ``sharding_text`` names it identically on every supported version.
    """
    import jax.sharding

    make = getattr(jax.sharding, "make_single_device_sharding", None)
    if make is not None:
        return make(device)
    return jax.sharding.SingleDeviceSharding(device)


def sharding_text(sharding: Any) -> str | None:
    """A short, stable name for an input sharding; None when JAX left it unspecified."""
    try:
        cached = _SHARDING_TEXT.get(sharding)
    except TypeError:  # unhashable
        cached = None
    if cached is not None or sharding in _SHARDING_TEXT:
        return cached
    kind = type(sharding).__name__
    if sharding is None or kind == "UnspecifiedValue":
        text = None
    elif kind == "SingleDeviceSharding":
        dev = next(iter(sharding.device_set))
        text = f"SingleDeviceSharding({dev.platform}:{dev.id})"
    elif kind == "NamedSharding":
        mesh = dict(sharding.mesh.shape)
        text = f"NamedSharding(mesh={mesh}, spec={tuple(sharding.spec)})"
    else:
        text = str(sharding)
    if len(_SHARDING_TEXT) < 1024:
        with contextlib.suppress(TypeError):
            _SHARDING_TEXT[sharding] = text
    return text


def leaves_of(in_avals: Any, in_shardings: Any) -> tuple[Leaf, ...]:
    """The signature leaves of one lowering log call's arguments."""
    out = []
    shardings = list(in_shardings) if in_shardings is not None else []
    for i, aval in enumerate(in_avals):
        shape = tuple(int(d) if isinstance(d, int) else str(d) for d in getattr(aval, "shape", ()))
        dtype = getattr(aval, "dtype", None)
        name = getattr(dtype, "name", None) or str(dtype)
        s = sharding_text(shardings[i]) if i < len(shardings) else None
        out.append((shape, name, bool(getattr(aval, "weak_type", False)), s))
    return tuple(out)


def _value_text(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_VALUE_TEXT else text[: _MAX_VALUE_TEXT - 1] + "…"


def call_context(skip: int = 2) -> tuple[str | None, tuple[tuple[Any, str], ...] | None]:
    """(source "f at file:line", ((argnum or argname, repr of value), ...) static values) of the
    jit call being lowered, read from the frames above the lowering log call; None where unknown."""
    source: str | None = None
    statics: tuple[tuple[Any, str], ...] | None = None
    try:
        frame: Any = sys._getframe(skip)
    except ValueError:
        return None, None
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        code = frame.f_code
        if source is None and code.co_name == LOWERING_FRAME:
            jaxpr = frame.f_locals.get("closed_jaxpr")
            info = getattr(getattr(jaxpr, "jaxpr", None), "debug_info", None)
            source = getattr(info, "func_src_info", None)
        elif code.co_name == CALL_FRAME and code.co_filename.endswith(CALL_FILE):
            local = frame.f_locals
            info, args, kwargs = (
                local.get("jit_info"),
                local.get("args", ()),
                local.get("kwargs", {}),
            )
            if info is not None:
                values = [
                    (i, _value_text(args[i]))
                    for i in getattr(info, "static_argnums", ())
                    if i < len(args)
                ]
                values += [
                    (k, _value_text(kwargs[k]))
                    for k in getattr(info, "static_argnames", ())
                    if k in kwargs
                ]
                statics = tuple(values)
            break
        frame = frame.f_back
    return source, statics


# The frame of JAX's compiler that reads the persistent cache (compiler._cache_read, jax 0.9 to
# 0.12), whose ``module_name`` names the program a cache lookup is for.
CACHE_READ_FRAME = "_cache_read"


def compiling_module(skip: int = 2) -> str | None:
    """The module name of the program whose persistent-cache lookup is on this thread's stack
    (the compile lease records and looks up compile times by it); None where JAX does not say."""
    try:
        frame: Any = sys._getframe(skip)
    except ValueError:
        return None
    for _ in range(8):
        if frame is None:
            return None
        if frame.f_code.co_name == CACHE_READ_FRAME:
            name = frame.f_locals.get("module_name")
            return name if isinstance(name, str) else None
        frame = frame.f_back
    return None


def on_compile_stage_end(callback: Callable[[], None]) -> None:
    """Call ``callback`` on the compiling thread each time pxla's compile stage around the
    persistent cache ends (EVENT_BACKEND_COMPILE: after a hit's load, or a miss's compile and
    write, and also when the compile raised: JAX records it on the context manager's exit)."""
    from jax import monitoring

    def on_duration(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == EVENT_BACKEND_COMPILE:
            with contextlib.suppress(Exception):  # never raise into JAX's compile path
                callback()

    monitoring.register_event_duration_secs_listener(on_duration)


# -- the persistent cache's process state --------------------------------------------------


def reset_persistent_cache() -> None:
    """Close the cache JAX opened, so its next compile opens the configured one (and re-decides
    whether to use a cache at all: JAX decides that once per process)."""
    from jax._src import compilation_cache

    compilation_cache.reset_cache()


def opened_cache_dir() -> str | None:
    """The directory JAX's persistent cache already opened in this process, if any."""
    from jax._src import compilation_cache

    cache = getattr(compilation_cache, "_cache", None)
    if cache is None:
        return None
    return str(getattr(cache, "_path", "") or "") or None


def cache_filesystem(url: str) -> Any | None:
    """The fsspec filesystem JAX's persistent cache opens ``url`` (not local) through: etils.epath's,
    one per protocol and process, built at its first use with fsspec's defaults for the protocol
    (``jax._src.path.Path`` is ``epath.Path``). None where JAX reads it another way (pathlib
    without etils, TensorFlow's gfile)."""
    from jax._src import path as jax_path

    if not getattr(jax_path, "epath_installed", False):
        return None
    backend = getattr(jax_path.Path(url), "_backend", None)
    fs = getattr(backend, "fs", None)
    return fs(url) if callable(fs) else None


def cache_checked() -> bool:
    """True once JAX compiled anything in this process (it checks its cache on the first compile)."""
    from jax._src import compilation_cache

    return bool(getattr(compilation_cache, "_cache_checked", False))


def entry_bytes(compiled: Any, seconds: float) -> bytes:
    """The JAX cache entry of a ``jax.stages.Compiled``, exactly as JAX's own put would write it."""
    from jax._src import compilation_cache

    executable = compiled._executable.xla_executable
    return compilation_cache.compress_executable(
        compilation_cache.combine_executable_and_time(executable.serialize(), int(seconds))
    )


# -- what the key is made of ---------------------------------------------------------------


def excluded_xla_flags() -> tuple[str, ...] | None:
    """The XLA flags JAX leaves out of its key; None when this JAX does not say."""
    try:
        from jax._src import cache_key

        return tuple(cache_key.xla_flags_to_exclude_from_cache_key)
    except (ImportError, AttributeError):
        return None


def extra_flag_prefixes() -> list[str]:
    """Argument prefixes besides ``--xla`` whose flags JAX hashes into its key."""
    try:
        from jax._src import cache_key

        return list(cache_key.get_flag_prefixes())
    except (ImportError, AttributeError):
        return []


def zstandard_compression() -> bool | None:
    """Whether JAX compresses entries with zstandard (else zlib); None when this JAX does not say."""
    try:
        from jax._src import compilation_cache
    except ImportError:  # pragma: no cover - JAX always ships it
        return None
    return getattr(compilation_cache, "zstandard", None) is not None


def topology_fingerprint(devices: list[Any]) -> int:
    """JAX's topology fingerprint of ``devices``; raises where the backend has none."""
    from jax._src.lib import xla_client

    return int(xla_client.get_topology_for_devices(devices).fingerprint())


def backends_opened() -> bool:
    """Whether this process opened a JAX backend (an accelerator is then held until it exits).

    Never imports JAX: a process that has not imported it has opened nothing."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(getattr(bridge, "_backends", None))


def default_backend() -> Any:
    """JAX's default backend client (its platform and platform_version go into the key)."""
    from jax._src import xla_bridge

    return xla_bridge.get_backend()


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


# -- a verifying persistent cache ----------------------------------------------------------------


# What EntryVerifier.expected answers for a process that opted in to unverified code.
ANY_ENTRY = "*"


class EntryVerifier:
    """What a verifying cache asks before it hands JAX an entry (cachectl/service/verified.py)."""

    def expected(self, key: str) -> str | None:
        """The sha256 the entry at ``key`` must have; None: report a miss without reading;
        ANY_ENTRY: whatever is there (the process opted in to unverified code)."""
        raise NotImplementedError

    def refused(self, key: str, why: str) -> None:
        """The entry at ``key`` was read and refused (``why``); JAX compiles it in memory."""

    def wrote(self, key: str, sha256: str) -> None:
        """This process wrote the entry at ``key`` (its own compile): it may read it back."""

    def read_entry(
        self, key: str, expected: str, base: Callable[[str], bytes | None]
    ) -> bytes | None:
        """The read path: the bytes JAX is handed for ``key`` (checked by the caller against
        ``expected``). ``base`` is JAX's own cache's get; a node tier (service/node_source.py)
        reads this node's copy first and fetches a missing one from the remote instead."""
        return base(key)

    def missed(self, key: str, read: Callable[[str], bytes | None]) -> bytes | None:
        """Nothing verified is stored at ``key``: the entry's bytes to use after all (another
        process compiled them meanwhile: service/compile_lease.py), or None to compile. ``read``
        reads what is stored at a key."""
        return None


# The files JAX's file cache writes per key: the entry, and its access time where it evicts.
_ENTRY_SUFFIXES = ("-cache", "-atime")


def install_verifying_cache(path: str, verifier: EntryVerifier) -> None:
    """From the next time JAX opens its persistent cache at ``path`` (it does that at its first
    compile, and again after reset_persistent_cache), its ``get`` returns an entry's bytes only when
    their sha256 is the one ``verifier`` expects for that key, and otherwise reports a miss, so JAX
    compiles in memory. JAX opens the cache in ``compilation_cache._initialize_cache`` through the
    module's ``get_file_cache(path)`` (jax 0.9 to 0.12: tests/test_jax_seam.py); the wrapper
    replaces that function once, and a later call replaces the verifier."""
    import hashlib

    from jax._src import compilation_cache
    from jax._src.compilation_cache_interface import CacheInterface

    original = getattr(compilation_cache.get_file_cache, "_cachectl_original", None)
    original = original or compilation_cache.get_file_cache
    wanted = str(path).rstrip("/")

    class VerifyingCache(CacheInterface):
        """JAX's own file cache, read only through ``verifier``."""

        def __init__(self, base: Any) -> None:
            self._base = base

        @property
        def _path(self) -> Any:  # JAX and opened_cache_dir() read the directory here
            return self._base._path

        @_path.setter
        def _path(self, value: Any) -> None:
            self._base._path = value

        def get(self, key: str) -> bytes | None:
            expected = verifier.expected(key)
            if expected is None:
                return verifier.missed(key, self._read_any)
            data = verifier.read_entry(key, expected, self._base.get)
            if data is None and expected != ANY_ENTRY:
                return verifier.missed(key, self._read_any)
            if data is None or expected == ANY_ENTRY:
                return data
            if hashlib.sha256(data).hexdigest() != expected:
                verifier.refused(key, "its sha256 differs from its verified record")
                return None
            return bytes(data)

        def _read_any(self, key: str) -> bytes | None:
            """What is stored at ``key`` now, read as JAX reads it (through a node tier): a
            waiter's read of the entry another process compiled; the waiter checks its sha256."""
            return verifier.read_entry(key, ANY_ENTRY, self._base.get)

        def put(self, key: str, value: bytes) -> None:
            self._base.put(key, value)
            local = str(self._base._path)
            if "://" not in local:  # JAX writes at the umask's mode: never world-writable
                for suffix in _ENTRY_SUFFIXES:
                    without_world_write(os.path.join(local, key + suffix))
            verifier.wrote(key, hashlib.sha256(value).hexdigest())

    def get_file_cache(path: str) -> tuple[CacheInterface, str] | None:
        made = original(path)
        if made is None or str(path).rstrip("/") != wanted:
            return made
        return VerifyingCache(made[0]), made[1]

    get_file_cache._cachectl_original = original  # type: ignore[attr-defined]
    compilation_cache.get_file_cache = get_file_cache
    opened = compilation_cache._cache
    if opened is not None and str(getattr(opened, "_path", "")).rstrip("/") == wanted:
        # Opened already (activate() again): wrap JAX's own cache in place.
        base = (
            getattr(opened, "_base", opened)
            if type(opened).__name__ == "VerifyingCache"
            else opened
        )
        compilation_cache._cache = VerifyingCache(base)


def uninstall_verifying_cache() -> None:
    """JAX's own get_file_cache again (a process that opts out of verification)."""
    from jax._src import compilation_cache

    original = getattr(compilation_cache.get_file_cache, "_cachectl_original", None)
    if original is not None:
        compilation_cache.get_file_cache = original


# -- what this process asked JAX's file cache to write ---------------------------------------

# key -> sha256 of every value this process handed JAX's file cache to write (record_puts()).
_PUTS: dict[str, set[str]] = {}
_PUT_LISTENERS: list[Callable[[str, str], None]] = []
_PUTS_LOCK = threading.Lock()


def record_puts(listener: Callable[[str, str], None] | None = None) -> None:
    """From now on remember the sha256 of every entry JAX's file cache is asked to write in this
    process (and hand ``(key, sha256)`` to ``listener``). JAX logs "Writing" and then its
    ``LRUCache.put`` returns without writing when a file is already at the key (jax 0.9 to
    0.12: tests/test_jax_seam.py), so a write is this process's only when the bytes on storage
    have a sha256 it recorded here: what warm and warm-run check before they index a file."""
    from jax._src import lru_cache

    with _PUTS_LOCK:
        if listener is not None:
            _PUT_LISTENERS.append(listener)
        cls = lru_cache.LRUCache
        if getattr(cls.put, "_cachectl_put", False):
            return
        original = cls.put

        def put(self: Any, key: str, value: bytes) -> None:
            original(self, key, value)
            digest = hashlib.sha256(value).hexdigest()
            with _PUTS_LOCK:
                _PUTS.setdefault(key, set()).add(digest)
                listeners = list(_PUT_LISTENERS)
            for on_put in listeners:
                on_put(key, digest)

        put._cachectl_put = True  # type: ignore[attr-defined]
        cls.put = put  # type: ignore[method-assign]


def put_sha256s(key: str) -> tuple[str, ...]:
    """The sha256s of what this process asked JAX to write at ``key`` (record_puts)."""
    with _PUTS_LOCK:
        return tuple(sorted(_PUTS.get(key, ())))


def remember_puts(key: str, sha256s: Any) -> None:
    """A worker process's puts at ``key``, told to the parent that indexes them."""
    with _PUTS_LOCK:
        _PUTS.setdefault(key, set()).update(sha256s)
