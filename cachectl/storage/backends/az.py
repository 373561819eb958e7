"""Azure Blob Storage (``az://container/prefix``) through adlfs.

The storage account and its credentials come from the environment, as adlfs reads them:
``AZURE_STORAGE_CONNECTION_STRING``, or ``AZURE_STORAGE_ACCOUNT_NAME`` with
``AZURE_STORAGE_ACCOUNT_KEY`` or ``AZURE_STORAGE_SAS_TOKEN`` (or a service principal:
``AZURE_STORAGE_CLIENT_ID``/``_SECRET``/``TENANT_ID``; else azure-identity's default chain). The
cache's storage options may name the account and host (``account_name``, ``account_host``), never
a key (trust/caches.py refuses credentials in the index).
"""

from __future__ import annotations

import copy
from typing import Any

from cachectl.core.config import storage_bounds
from cachectl.storage.backends.common import first_segment, given_options

FSSPEC = "az"
REQUIRES = ("adlfs", "pip install 'cachectl-jax[azure]'")
# adlfs lists a blob's time as last_modified
MTIME_KEYS: tuple[str, ...] = ("last_modified",)


def client_options(given: dict[str, Any]) -> dict[str, Any]:
    """The cache's options, the connect and silence bounds where it sets none (adlfs hands them to
    every blob upload and download), never a cached instance (credentials come from the
    environment)."""
    opts = copy.deepcopy(given)
    bounds = storage_bounds()
    opts.setdefault("connection_timeout", bounds.connect_s)
    opts.setdefault("read_timeout", bounds.read_s)
    opts["skip_instance_cache"] = True
    return opts


def jax_options(given: dict[str, Any]) -> dict[str, Any] | None:
    """JAX's filesystem (etils.epath opens ``az://`` through fsspec's "az") gets the same."""
    return client_options(given)


probe_options = given_options
bucket = first_segment  # the container
