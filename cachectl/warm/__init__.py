"""Compile a manifest's buckets into a cache namespace, so a service starts with zero compiles.

``warm`` configures JAX exactly as :func:`cachectl.activate` does (same namespace,
same key-affecting config) plus ``min_compile_time_secs=0`` and
``min_entry_size_bytes=-1``, so every bucket is written under the key a service
will compute. Each bucket is ``jax.jit(fn, **jit).lower(*specs, **static).compile()``
on abstract shapes: no device memory for inputs.

The package: ``plan`` (validate before compiling), ``compiling`` (one bucket, warm's
JAX config; the JAX log records that name each key are read by cachectl.core.jaxlog), ``executors``
(one by one, threads, processes), ``run`` (``warm()``: the run row, executors, report),
``settle`` (each bucket: status, storage, index; ``settle_peer`` for a distributed job's
processes other than 0), ``distributed`` (a multi-process JAX job),
``check`` (coverage in a fresh process), ``reports`` (what both return).
"""

from cachectl.core.config import default_jobs
from cachectl.core.jaxlog import CAPTURE
from cachectl.warm.check import call_main, check, check_main
from cachectl.warm.compiling import (
    WARM_EXTRA_CONFIG,
    ErrorText,
    Outcome,
    clear_in_memory_executables,
    compile_bucket,
    compile_once,
    error_text,
    jax_configured,
    persistent_cache_off,
    warm_jax_config,
)
from cachectl.warm.plan import WarmPlan, build_calls, environment_json, plan_warm
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
    "CAPTURE",
    "Outcome",
    "build_calls",
    "call_main",
    "check_main",
    "clear_in_memory_executables",
    "compile_once",
    "environment_json",
    "error_text",
    "persistent_cache_off",
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
