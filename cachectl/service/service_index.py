"""The index and storage options a service opens: quickly, and never fatally.

A service must start whatever is down: its index is opened with the ``service`` role (the
stdlib driver where it serves the file, so no SQLAlchemy import), a failure becomes one
problem line, and its stores probe with one attempt per request. activate(), serving's loader,
``env`` and ``doctor`` share these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cachectl.core.cache_info import CacheInfo
from cachectl.core.config import DEFAULT_CACHE, Settings
from cachectl.core.errors import CachectlError, NotFound, Unreachable
from cachectl.core.urls import normalize_url, url_kind
from cachectl.index.open import open_index
from cachectl.storage.backends import backend_for

if TYPE_CHECKING:
    from cachectl.index.protocol import IndexBackend


def fail_fast_options(root_url: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Storage options for a quick probe: one attempt per request where the store's client
    retries (its backend module's ``probe_options``; the bounds are the store's)."""
    if url_kind(root_url) is None:  # not a store (refused where it is opened)
        return dict(options or {})
    return backend_for(root_url).probe_options(dict(options or {}))


def _policy(index: IndexBackend, settings: Settings) -> CacheInfo:
    """This cache's policy; the embedded default is created on first use."""
    if settings.cache != DEFAULT_CACHE:
        return index.get_cache(settings.cache)
    try:
        return index.get_cache(settings.cache)
    except NotFound:
        return index.ensure_cache(settings.cache, normalize_url(settings.default_root))


def open_service_index(
    settings: Settings, problems: list[str]
) -> tuple[IndexBackend | None, CacheInfo | None]:
    """The index (cachectl.index.open, role "service": the stdlib driver where it serves the
    file, so no SQLAlchemy import) and this cache's policy; a failure becomes one problem line."""
    index = None
    try:
        index = open_index(settings, "service")
        return index, _policy(index, settings)
    except Unreachable as exc:
        problems.append(f"index unavailable ({exc.message})")
    except CachectlError as exc:
        problems.append(exc.message)
    except Exception as exc:  # noqa: BLE001 - a service must start anyway
        problems.append(f"index unavailable ({type(exc).__name__}: {exc})".splitlines()[0])
    if index is not None:
        index.close()
    return None, None
