"""One module per store (sccache's ``src/cache/``): what differs between stores, behind one small
interface (``Backend``). The registry (``core/urls.py``, ``STORES``) names each module; ``backend``
imports it the first time a store of that kind is opened, so a store nobody uses costs nothing.

A backend module defines, at module level:

- ``FSSPEC``: fsspec's protocol for its filesystem (``fsspec.filesystem(FSSPEC, **options)``);
- ``REQUIRES``: the Python module that filesystem needs and the pip command that installs it
  (``None``: fsspec's own), checked before the filesystem is built, with a one-line error;
- ``MTIME_KEYS``: the keys of its listing that hold a file's modification time, tried before
  fsspec's common ones (``Store.list``);
- ``client_options(given)``: the fsspec options cachectl's own client gets: the cache's, the
  environment's endpoint, the storage bounds (``core/config.storage_bounds``);
- ``jax_options(given)``: the options JAX's own filesystem (etils.epath through fsspec) is handed,
  or ``None`` where JAX opens the root as a local path (``storage/jax_storage.py``);
- ``probe_options(given)``: the cache's options for a quick probe (one attempt per request);
- ``bucket(root)``: what must exist for the root to be reachable (``Store.check_reachable``), or
  ``None`` for nothing to check.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Protocol, cast

from cachectl.core.errors import BadInput
from cachectl.core.urls import STORES, url_kind


class Backend(Protocol):
    """What a backend module holds (see the module docstring)."""

    FSSPEC: str
    REQUIRES: tuple[str, str] | None
    MTIME_KEYS: tuple[str, ...]

    def client_options(self, given: dict[str, Any]) -> dict[str, Any]: ...

    def jax_options(self, given: dict[str, Any]) -> dict[str, Any] | None: ...

    def probe_options(self, given: dict[str, Any]) -> dict[str, Any]: ...

    def bucket(self, root: str) -> str | None: ...


class MissingPackage(BadInput):
    """A store's fsspec filesystem needs a package this environment lacks."""


def backend(kind: str) -> Backend:
    """The backend module of a store kind (a key of ``STORES``), imported on first use."""
    return cast(Backend, importlib.import_module(STORES[kind].module))


def backend_for(url: str) -> Backend:
    """The backend of the store a root URL names (``url_kind``); BadInput for an unmanaged one."""
    kind = url_kind(url)
    if kind is None:
        raise BadInput(f"unsupported storage URL {url!r}")
    return backend(kind)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: blocked (sys.modules[module] is None)
        return False


def require(kind: str) -> None:
    """Fail with one line, before fsspec's own ImportError, where the store's package is missing."""
    needs = backend(kind).REQUIRES
    if needs is not None and not _installed(needs[0]):
        scheme = STORES[kind].schemes[0]
        raise MissingPackage(
            f"{scheme}:// caches need the Python package {needs[0]}, which is not installed: {needs[1]}"
        )
