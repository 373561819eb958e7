"""fsspec's in-process memory filesystem (``memory://``), for tests and dry runs: one process's,
so nothing to probe and nothing JAX could share: a local store's options and checks."""

from __future__ import annotations

from cachectl.storage.backends.local import (
    MTIME_KEYS,
    REQUIRES,
    bucket,
    client_options,
    jax_options,
    probe_options,
)

FSSPEC = "memory"

__all__ = [
    "FSSPEC",
    "MTIME_KEYS",
    "REQUIRES",
    "bucket",
    "client_options",
    "jax_options",
    "probe_options",
]
