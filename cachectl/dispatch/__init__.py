"""The serving runtime: a service calls the manifest's functions, cachectl dispatches each call
to the executable warm stored for its bucket — padded on the host, with no tracing, lowering
or compiling on the call path.

    rt = cachectl.serving("manifest.yaml")
    logits, cache = rt["prefill"](params, tokens)      # int32[3, 50] -> bucket [4, 64]

The manifest is the contract for both sides: warm compiles its buckets, and the
runtime refuses (or pads) what does not fit them. Whatever is wrong with a
stored executable (missing, corrupt, refused by the index, stale code), the
call still answers through ``jax.jit`` and the persistent cache, with one
warning per function: never worse off than plain JAX.

Six modules, one job each: ``calls.py`` fits a call to a bucket on the host (argument
plans, :func:`mask`); ``padding.py`` says what a pytree leaf may be padded with
(:class:`OutOfBucket`); ``loading.py`` chooses and loads each bucket's stored executable
(verified by ``trust/gate.py``); ``served_function.py`` is one function's call path
(:class:`ServedFunction`: fit, call the stored executable or ``jax.jit``, cut, count) and
the calls no request makes (warm-up, warm-check's); ``router.py`` is the :class:`Serving`
object (the functions by name, loading and warming up every bucket) and :func:`serving`;
``reports.py`` what they report. ``preload.py`` says when each bucket loads: in background
threads, behind the first calls.
"""

from __future__ import annotations

from cachectl.dispatch.calls import OutOfBucket, StructureMismatch, mask
from cachectl.dispatch.loading import namespace_reader
from cachectl.dispatch.reports import FunctionReport, ServingReport
from cachectl.dispatch.router import OVERFLOW_MODES, Serving, serving
from cachectl.dispatch.served_function import (
    MAX_SIZES_PER_AXIS,
    MAX_SIZES_PER_FLUSH,
    ServedFunction,
)

__all__ = [
    "MAX_SIZES_PER_AXIS",
    "MAX_SIZES_PER_FLUSH",
    "OVERFLOW_MODES",
    "FunctionReport",
    "OutOfBucket",
    "ServedFunction",
    "Serving",
    "ServingReport",
    "StructureMismatch",
    "namespace_reader",
    "mask",
    "serving",
]
