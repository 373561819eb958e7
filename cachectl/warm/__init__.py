"""Compile a manifest's buckets into a cache namespace, so a service starts with zero compiles.

``warm`` configures JAX exactly as :func:`cachectl.activate` does (same namespace,
same key-affecting config) plus ``min_compile_time_secs=0`` and
``min_entry_size_bytes=-1``, so every bucket is written under the key a service
will compute. Each bucket is ``jax.jit(fn, **jit).lower(*specs, **static).compile()``
on abstract shapes: no device memory for inputs.

The package: ``plan`` (validate before compiling), ``compiling`` (one bucket, warm's
JAX config), ``jaxlog`` (the JAX log records that name each key), ``executors``
(one by one, threads, processes), ``run`` (``warm()``: the run row, executors, report),
``settle`` (each bucket: status, storage, index),
``check`` (coverage in a fresh process), ``reports`` (what both return).
"""

from cachectl.core.config import default_jobs
from cachectl.warm.check import _call_main, _check_main, check
from cachectl.warm.compiling import (
    WARM_EXTRA_CONFIG,
    ErrorText,
    _clear_in_memory_executables,
    _compile_once,
    _error_text,
    _Outcome,
    _persistent_cache_off,
    compile_bucket,
    jax_configured,
    warm_jax_config,
)
from cachectl.warm.jaxlog import _CAPTURE
from cachectl.warm.plan import WarmPlan, _build_calls, _environment_json, plan_warm
from cachectl.warm.reports import (
    CACHED,
    COMPILED,
    DEFAULT_EXECUTOR,
    EXECUTORS,
    FAILED,
    HIT,
    MISS,
    PLANNED,
    SKIPPED,
    TOO_LARGE,
    BucketResult,
    CheckBucket,
    CheckReport,
    WarmReport,
    WarmSummary,
)
from cachectl.warm.run import ProgressFn, resign_written, signer_for, warm

__all__ = [
    "CACHED",
    "COMPILED",
    "DEFAULT_EXECUTOR",
    "EXECUTORS",
    "FAILED",
    "HIT",
    "MISS",
    "PLANNED",
    "SKIPPED",
    "TOO_LARGE",
    "WARM_EXTRA_CONFIG",
    "BucketResult",
    "CheckBucket",
    "CheckReport",
    "ErrorText",
    "ProgressFn",
    "WarmPlan",
    "WarmReport",
    "WarmSummary",
    "_CAPTURE",
    "_Outcome",
    "_build_calls",
    "_call_main",
    "_check_main",
    "_clear_in_memory_executables",
    "_compile_once",
    "_environment_json",
    "_error_text",
    "_persistent_cache_off",
    "check",
    "compile_bucket",
    "default_jobs",
    "jax_configured",
    "plan_warm",
    "resign_written",
    "signer_for",
    "warm",
    "warm_jax_config",
]
