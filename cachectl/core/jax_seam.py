"""Every JAX internal cachectl depends on, behind one seam: a JAX upgrade is checked here.

cachectl reads more from JAX than its public API offers: the persistent cache's
log calls (the only place that names a key), the lowering log (the only place that
names a program's input avals), a few private attributes and functions of
``jax._src``. All of it lives behind this module's small typed API, and
tests/test_jax_seam.py pins each fact against the installed JAX. The seam is this module (JAX's
logs, events and lowering frames, and what the key is made of) and the ones whose names it
re-exports, each with one job: jax_cache_io.py (the persistent cache as this process opens,
reads and writes it), jax_cache_key.py (the key a lowering looks up), jax_executables.py
(compile-only TPU devices, stored executables), jax_kernels.py (the kernels a stored executable
calls); and jax_platforms.py (which platform a program is for: deviceless warm's guard). No
other module imports ``jax._src`` or matches a JAX log message (tests/test_jax_seam.py greps).

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
import importlib
import inspect
import logging
import re
import sys
from collections.abc import Callable
from typing import Any

# The seam's other modules, re-exported: callers name every JAX internal as jax_seam.X.
from cachectl.core.jax_cache_io import (  # noqa: F401 - the seam's API
    ANY_ENTRY,
    EntryVerifier,
    cache_checked,
    cache_filesystem,
    entry_bytes,
    install_verifying_cache,
    opened_cache_dir,
    put_sha256s,
    record_puts,
    remember_puts,
    reset_persistent_cache,
    uninstall_verifying_cache,
    verifier_at,
    write_whatever_compile_time,
)
from cachectl.core.jax_cache_key import (  # noqa: F401 - the seam's API
    key_components,
    persistent_cache_key,
)
from cachectl.core.jax_executables import (  # noqa: F401 - the seam's API
    captures_constants,
    closes_over_mutable,
    default_device,
    device_client,
    device_list,
    distributed_client,
    executable_device_ids,
    libtpu_version,
    make_compiled,
    no_kwargs,
    pjrt_pickler_classes,
    tpu_chips_here,
    tpu_topology_devices,
    unloaded_executable,
    unloaded_executable_type,
)

# The kernels a stored executable calls: jax_kernels.py, another of the seam's modules.
from cachectl.core.jax_kernels import (  # noqa: F401 - the seam's API
    KERNEL_FAMILIES,
    custom_call_targets,
    prepare_custom_calls,
)

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
