"""Google Cloud Storage (``gs://bucket/prefix``) through gcsfs."""

from __future__ import annotations

import copy
import os
from typing import Any

from cachectl.storage.backends.common import first_segment, given_options

FSSPEC = "gcs"
REQUIRES = ("gcsfs", "pip install gcsfs")
MTIME_KEYS: tuple[str, ...] = ()


def client_options(given: dict[str, Any]) -> dict[str, Any]:
    """The cache's options; anonymous against an emulator (STORAGE_EMULATOR_HOST) unless a token is
    given; never a cached instance (endpoints and credentials come from the environment)."""
    opts = copy.deepcopy(given)
    if os.environ.get("STORAGE_EMULATOR_HOST") and "token" not in opts:
        opts["token"] = "anon"
    opts["skip_instance_cache"] = True
    return opts


def jax_options(given: dict[str, Any]) -> dict[str, Any] | None:
    return client_options(given)


probe_options = given_options
bucket = first_segment
