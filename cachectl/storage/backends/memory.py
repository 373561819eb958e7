"""fsspec's in-process memory filesystem (``memory://``), for tests and dry runs: one process's,
so nothing to probe and nothing JAX could share."""

from __future__ import annotations

from cachectl.storage.backends.common import (
    given_options,
    no_jax_options,
    nothing_to_check,
)

FSSPEC = "memory"
REQUIRES = None
MTIME_KEYS: tuple[str, ...] = ()


client_options = given_options
jax_options = no_jax_options
probe_options = given_options
bucket = nothing_to_check
