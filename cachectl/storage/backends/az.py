"""Azure Blob Storage (``az://container/prefix``) through adlfs.

The storage account and its credentials come from the environment, as adlfs reads them:
``AZURE_STORAGE_CONNECTION_STRING``, or ``AZURE_STORAGE_ACCOUNT_NAME`` with
``AZURE_STORAGE_ACCOUNT_KEY`` or ``AZURE_STORAGE_SAS_TOKEN`` (or a service principal:
``AZURE_STORAGE_CLIENT_ID``/``_SECRET``/``TENANT_ID``; else azure-identity's default chain). The
cache's storage options may name the account and host (``account_name``, ``account_host``), never
a key (trust/caches.py refuses credentials in the index).

adlfs builds its Azure client itself, with azure's retries (three, 15 s and more apart, per
request) and no bound on a whole request: an endpoint that refuses connections held ``verify``
for minutes and ended in azure's traceback. So every client adlfs builds in this process gets the
bounds and the pause of ``s3://`` (``_bound_adlfs``): each request whole within the storage bound,
at most ``pause_after`` tries, and after ``pause_after`` requests in a row that timed out or could
not connect, the next ones there fail at once, in one line (storage/bounded_http.py).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import threading
from typing import Any

from cachectl.core.config import (
    COMMAND_PAUSE_AFTER,
    JAX_PAUSE_AFTER,
    STORAGE_PAUSE_S,
    storage_bounds,
)
from cachectl.storage.backends.common import first_segment, given_options
from cachectl.storage.bounded_http import answered, failed, refuse_if_paused

FSSPEC = "az"
REQUIRES = ("adlfs", "pip install 'cachectl-jax[azure]'")
# adlfs lists a blob's time as last_modified
MTIME_KEYS: tuple[str, ...] = ("last_modified",)
# The option that tells this process's adlfs clients their pause (adlfs keeps options it does
# not know, unused: a child process's adlfs ignores it).
PAUSE_OPTION = "cachectl_pause_after"

_building = threading.local()  # the pause of the client adlfs builds on this thread


def client_options(
    given: dict[str, Any], *, pause_after: int = COMMAND_PAUSE_AFTER
) -> dict[str, Any]:
    """The cache's options, the connect and silence bounds where it sets none (adlfs hands them to
    every blob upload and download), never a cached instance (credentials come from the
    environment); the client itself is bounded as it is built (``_bound_adlfs``)."""
    _bound_adlfs()
    opts = copy.deepcopy(given)
    bounds = storage_bounds()
    opts.setdefault("connection_timeout", bounds.connect_s)
    opts.setdefault("read_timeout", bounds.read_s)
    opts[PAUSE_OPTION] = pause_after
    opts["skip_instance_cache"] = True
    return opts


def jax_options(given: dict[str, Any]) -> dict[str, Any] | None:
    """JAX's filesystem (etils.epath opens ``az://`` through fsspec's "az") gets the same, with
    JAX's pause: after one failure."""
    return client_options(given, pause_after=JAX_PAUSE_AFTER)


def _endpoint(url: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


@functools.cache
def _bound_adlfs() -> None:
    """Once per process: adlfs's clients are built with the bounded transport and few, short
    retries. adlfs names azure's client class in its module; a client of that class built here
    takes both where the caller gave none."""
    try:
        import adlfs.spec as spec  # type: ignore[import-untyped]
        from azure.core.exceptions import ServiceRequestError, ServiceResponseError
        from azure.core.pipeline.transport import AioHttpTransport
        from azure.storage.blob.aio import ExponentialRetry
    except ImportError:  # no adlfs: require() says so first
        return
    client_cls = getattr(spec, "AIOBlobServiceClient", None)
    connect = getattr(spec.AzureBlobFileSystem, "do_connect", None)
    if client_cls is None or connect is None:
        return  # another adlfs: the connect and silence bounds only

    class BoundedTransport(AioHttpTransport):
        """azure's aiohttp transport, each request whole within the storage bound, counted
        towards the pause of its endpoint."""

        def __init__(self, total_s: float, after: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._total_s, self._after = total_s, after

        async def send(self, request: Any, **kwargs: Any) -> Any:
            endpoint = _endpoint(request.url)
            refuse_if_paused(endpoint, "failed to connect or answer")
            try:
                response = await asyncio.wait_for(super().send(request, **kwargs), self._total_s)
            except (ServiceRequestError, ServiceResponseError, TimeoutError) as exc:
                failed(endpoint, STORAGE_PAUSE_S, self._after, exc)
                if isinstance(exc, TimeoutError):
                    raise ServiceResponseError(
                        f"no whole answer within {self._total_s:g} s"
                    ) from exc
                raise
            answered(endpoint)
            return response

    class BoundedClient(client_cls):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            bounds = storage_bounds()
            after = int(getattr(_building, "after", COMMAND_PAUSE_AFTER))
            kwargs.setdefault(
                "transport",
                BoundedTransport(
                    bounds.total_s,
                    after,
                    connection_timeout=bounds.connect_s,
                    read_timeout=bounds.read_s,
                ),
            )
            # One try more than the pause needs: the try after the last failure is refused at
            # once, in one line, instead of azure's error.
            kwargs.setdefault(
                "retry_policy",
                ExponentialRetry(
                    initial_backoff=1, increment_base=1, retry_total=after, random_jitter_range=1
                ),
            )
            super().__init__(*args, **kwargs)

    def do_connect(self: Any) -> None:
        _building.after = getattr(self, "kwargs", {}).get(PAUSE_OPTION, COMMAND_PAUSE_AFTER)
        try:
            connect(self)
        finally:
            _building.after = COMMAND_PAUSE_AFTER

    spec.AIOBlobServiceClient = BoundedClient
    spec.AzureBlobFileSystem.do_connect = do_connect


probe_options = given_options
bucket = first_segment  # the container
