"""Local disk (a path or ``file://``): the options as given; nothing to probe; JAX opens the
directory itself."""

from __future__ import annotations

from cachectl.storage.backends.common import (
    given_options,
    no_jax_options,
    nothing_to_check,
)

FSSPEC = "file"
REQUIRES = None
MTIME_KEYS: tuple[str, ...] = ()


client_options = given_options
jax_options = no_jax_options
probe_options = given_options
bucket = nothing_to_check
