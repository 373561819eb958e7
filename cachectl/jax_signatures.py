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

Where JAX knows them, the frames of that same call say more: the lowering frame
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
import logging
import sys
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


LOWERING_FRAME = "_cached_lowering_to_hlo"
CALL_FRAME = "cache_miss"
CALL_FILE = "pjit.py"
_MAX_FRAMES = 40
_MAX_VALUE_TEXT = 80


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
            info, args, kwargs = local.get("jit_info"), local.get("args", ()), local.get("kwargs", {})
            if info is not None:
                values = [(i, _value_text(args[i])) for i in getattr(info, "static_argnums", ()) if i < len(args)]
                values += [(k, _value_text(kwargs[k])) for k in getattr(info, "static_argnames", ())
                           if k in kwargs]
                statics = tuple(values)
            break
        frame = frame.f_back
    return source, statics


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
