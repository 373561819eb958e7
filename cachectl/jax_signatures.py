"""Every ``jax._src`` detail program signatures are read from, in one place (pinned by a test).

JAX 0.10.2 names what a compile request is for in two debug log calls:

- ``jax._src.interpreters.pxla`` logs, once per lowering, ``"Compiling %s with global
  shapes and types %s. Argument mapping: %s."`` with the module name, the flat input
  avals (shape, dtype, weak_type) and the input shardings (``UnspecifiedValue`` for
  uncommitted arrays). The call is guarded by ``logger.isEnabledFor``, so the tap
  answers True for DEBUG on that one logger object and passes the call on only when
  the logger really is enabled: no record is built, handlers see what they saw before.
- ``jax._src.compiler`` logs ``"Not writing persistent cache entry for '%s' because
  it uses host callbacks"`` or ``"... because it took < %.2f seconds to compile (%.2fs)"``
  after a miss JAX decided not to write: an uncacheable program.

The order on one thread is: lowering log, request event, hit/miss log (module, key),
then the hit event or the write event or the not-writing log.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

PXLA_LOGGER = "jax._src.interpreters.pxla"
LOWERING_PREFIX = "Compiling %s with global shapes and types"
NOT_WRITING_PREFIX = "Not writing persistent cache entry for"
HOST_CALLBACKS_MARK = "host callbacks"
# JAX's default jax_persistent_cache_min_compile_time_secs: a program compiled faster than
# this is never written by a service with default settings (read-only services raise it).
DEFAULT_MIN_COMPILE_TIME_S = 1.0

# One leaf of a signature: (shape, dtype, weak_type, sharding or None for uncommitted).
Leaf = tuple[tuple[int, ...], str, bool, "str | None"]

_SHARDING_TEXT: dict[Any, str | None] = {}


def pxla_logger() -> logging.Logger:
    """The logger object jax._src.interpreters.pxla logs lowerings through."""
    try:
        from jax._src.interpreters import pxla

        candidate = getattr(pxla, "logger", None)
        if isinstance(candidate, logging.Logger):
            return candidate
    except ImportError:
        pass
    return logging.getLogger(PXLA_LOGGER)


def sharding_text(sharding: Any) -> str | None:
    """A short, stable name for an input sharding; None when JAX left it unspecified."""
    try:
        cached = _SHARDING_TEXT.get(sharding)
    except TypeError:  # unhashable
        cached = None
    if cached is not None or sharding in _SHARDING_TEXT:
        return cached
    kind = type(sharding).__name__
    if kind == "UnspecifiedValue":
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
