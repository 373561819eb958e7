"""Google Cloud Storage (``gs://bucket/prefix``) through gcsfs.

gcsfs bounds nothing by default and tries a failed request six times, up to 32 s apart. So each
client gets the storage bounds (``requests_timeout``: aiohttp's connect, silence and whole-request
bounds) and the pause of ``s3://`` (storage/bounded_http.py ``bounded_trace``): after
``pause_after`` requests in a row that timed out or could not connect, the next ones there fail
at once, in one line.
"""

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
from cachectl.storage.backends.common import first_segment, given_options
from cachectl.storage.bounded_http import bounded_trace

FSSPEC = "gcs"
REQUIRES = ("gcsfs", "pip install gcsfs")
MTIME_KEYS: tuple[str, ...] = ()


def _bounded(opts: dict[str, Any], pause_after: int) -> dict[str, Any]:
    """The bounds where the cache's options set none (``requests_timeout`` a number: the whole
    request; a child process, which gets JSON, keeps that)."""
    import aiohttp

    bounds = storage_bounds()
    opts.setdefault(
        "requests_timeout",
        aiohttp.ClientTimeout(
            total=bounds.total_s, sock_connect=bounds.connect_s, sock_read=bounds.read_s
        ),
    )
    session = dict(opts.get("session_kwargs") or {})
    trace = bounded_trace(STORAGE_PAUSE_S, pause_after)
    session["trace_configs"] = [*list(session.get("trace_configs") or []), trace]
    opts["session_kwargs"] = session
    return opts


def client_options(
    given: dict[str, Any], *, pause_after: int = COMMAND_PAUSE_AFTER
) -> dict[str, Any]:
    """The cache's options, the bounds and the pause; anonymous against an emulator
    (STORAGE_EMULATOR_HOST) unless a token is given; never a cached instance (endpoints and
    credentials come from the environment)."""
    opts = copy.deepcopy(given)
    if os.environ.get("STORAGE_EMULATOR_HOST") and "token" not in opts:
        opts["token"] = "anon"
    opts["skip_instance_cache"] = True
    return _bounded(opts, pause_after)


def jax_options(given: dict[str, Any]) -> dict[str, Any] | None:
    """The client's options, with JAX's pause: its client pauses after one failure."""
    return client_options(given, pause_after=JAX_PAUSE_AFTER)


probe_options = given_options
bucket = first_segment
