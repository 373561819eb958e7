"""Amazon S3 and S3-compatible stores (``s3://bucket/prefix``) through s3fs and botocore."""

from __future__ import annotations

import copy
import os
from typing import Any

from cachectl.core.config import (
    COMMAND_PAUSE_AFTER,
    JAX_PAUSE_AFTER,
    STORAGE_PAUSE_S,
    storage_bounds,
)
from cachectl.storage.backends.common import first_segment
from cachectl.storage.bounded_http import bounded_session

FSSPEC = "s3"
REQUIRES = ("s3fs", "pip install s3fs")
MTIME_KEYS: tuple[str, ...] = ()

# botocore's defaults (5 attempts with backoff, per operation) make an unreachable bucket cost
# ~25 s; a probe makes one attempt, within the storage bounds. s3fs keeps its own retries for
# throttling and dropped connections.
FAIL_FAST = {"retries": {"max_attempts": 1}}


def bounded_config(
    config_kwargs: dict[str, Any] | None, *, pause_after: int = COMMAND_PAUSE_AFTER
) -> dict[str, Any]:
    """botocore's config with this process's storage bounds (config.storage_bounds) where it sets
    none: connect, silence and, through the HTTP session, the whole request and the pause at an
    endpoint that timed out ``pause_after`` times in a row (storage/bounded_http.py)."""
    config = dict(config_kwargs or {})
    bounds = storage_bounds()
    config.setdefault("connect_timeout", bounds.connect_s)
    config.setdefault("read_timeout", bounds.read_s)
    session = bounded_session(bounds.total_s, STORAGE_PAUSE_S, pause_after)
    if session is not None:
        config.setdefault("http_session_cls", session)
    return config


def _endpoint_handed_to_fsspec() -> bool:
    """Whether fsspec's defaults for s3 name an endpoint (activate() handed JAX the cache's, or
    `cachectl exec` did through FSSPEC_S3): fsspec adds it to every client, so AWS_ENDPOINT_URL
    given too would reach botocore twice (a TypeError, nothing read)."""
    import fsspec.config

    conf = fsspec.config.conf.get("s3") or {}
    return "endpoint_url" in conf


def client_options(given: dict[str, Any]) -> dict[str, Any]:
    """The cache's options (nested ones stay the cache's), AWS_ENDPOINT_URL where none is given
    (by them or by fsspec's defaults), the bounds; never a cached instance, which could carry an
    endpoint from before the environment changed."""
    opts = copy.deepcopy(given)
    if (
        os.environ.get("AWS_ENDPOINT_URL")
        and "endpoint_url" not in opts
        and not _endpoint_handed_to_fsspec()
    ):
        opts.setdefault("client_kwargs", {}).setdefault(
            "endpoint_url", os.environ["AWS_ENDPOINT_URL"]
        )
    opts["config_kwargs"] = bounded_config(opts.get("config_kwargs"))
    opts["skip_instance_cache"] = True
    return opts


def jax_options(given: dict[str, Any]) -> dict[str, Any] | None:
    """The client's options, with JAX's pause: its client pauses after one timeout."""
    handed = client_options(given)
    own_config = dict(given.get("config_kwargs") or {})
    handed["config_kwargs"] = bounded_config(own_config, pause_after=JAX_PAUSE_AFTER)
    return handed


def probe_options(given: dict[str, Any]) -> dict[str, Any]:
    """One attempt per request (the bounds are the client's)."""
    opts = dict(given)
    opts["config_kwargs"] = {**FAIL_FAST, **dict(opts.get("config_kwargs") or {})}
    return opts


bucket = first_segment
