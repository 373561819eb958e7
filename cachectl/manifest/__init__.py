"""Manifests: the functions and shape buckets a service compiles, so ``warm`` can compile them first.

A manifest is YAML (see ``examples/manifest.yaml``)::

    version: 1
    target: {backend: cpu}
    functions:
      - fn: examples.lm:decode_step
        jit: {static_argnames: [sampling], donate_argnums: [1]}
        args:
          - {pytree: examples.lm:param_specs}
          - {shape: [2, 2, batch, 256, 4, 32], dtype: bfloat16}
        kwargs: {sampling: greedy}
        buckets: {batch: [1, 4, 8]}

The pipeline, in the order ``warm`` uses it, one module per step:

1. :func:`load_manifest` (``load.py``) parses (``source.py``: YAML with lines) and validates
   (``schema.py``, ``checks.py``; messages from ``problems.py``) without importing any user
   code or JAX; every problem is a one-line :class:`~cachectl.core.errors.BadInput` that names
   ``file:line: field: problem``.
2. :func:`check_imports` (``imports.py``) imports every ``module:attr`` the manifest names
   and checks the arguments bind to the function's signature.
3. :func:`expand` (``buckets.py``) lists the buckets (cartesian product of each function's
   axes, minus ``exclude``); :func:`select_shard` picks one machine's share.
4. :func:`jit_function` and :func:`build_call` (``lowering.py``, the only module that uses
   JAX) give what to ``.lower(*args, **kwargs)``.

Field paths in messages index lists from 0 (``functions[1]`` is the second function).
Importing this package imports no JAX (tests/test_manifest.py checks it with JAX made
unimportable): the CLI reads manifests cheaply.
"""

from __future__ import annotations

from cachectl.manifest.buckets import Bucket, expand, parse_shard, select_shard
from cachectl.manifest.imports import check_imports, is_jitted, resolve_callable
from cachectl.manifest.load import (
    DEFAULT_MAX_BUCKETS,
    MAX_BUCKETS_ENV,
    MAX_MANIFEST_NODES,
    LoadedManifest,
    as_loaded,
    load_manifest,
    manifest_digest,
    max_buckets,
    parse_manifest,
    read_manifest,
)
from cachectl.manifest.lowering import build_call, compiling_for, jit_function, lowering_scope
from cachectl.manifest.problems import MAX_PROBLEMS
from cachectl.manifest.schema import (
    MANIFEST_VERSION,
    ArgSpec,
    FunctionSpec,
    JitSpec,
    Manifest,
    MeshSpec,
    OutputSpec,
    Target,
    dtype_named,
    jit_options,
)

__all__ = [
    "DEFAULT_MAX_BUCKETS",
    "MANIFEST_VERSION",
    "MAX_BUCKETS_ENV",
    "MAX_MANIFEST_NODES",
    "MAX_PROBLEMS",
    "ArgSpec",
    "Bucket",
    "FunctionSpec",
    "JitSpec",
    "Manifest",
    "MeshSpec",
    "OutputSpec",
    "Target",
    "dtype_named",
    "build_call",
    "compiling_for",
    "lowering_scope",
    "check_imports",
    "expand",
    "is_jitted",
    "jit_function",
    "jit_options",
    "LoadedManifest",
    "as_loaded",
    "load_manifest",
    "manifest_digest",
    "read_manifest",
    "max_buckets",
    "parse_manifest",
    "parse_shard",
    "resolve_callable",
    "select_shard",
]
