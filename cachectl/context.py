"""The resolved settings, index and stores one command works with."""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, cast

from cachectl.backend import open_backend
from cachectl.client import client_from_settings
from cachectl.config import DEFAULT_CACHE, Settings, load_settings
from cachectl.fingerprint import Environment, current_environment
from cachectl.index import CacheInfo, EnvironmentInfo, Index
from cachectl.index.backend import IndexBackend
from cachectl.namespace import Namespace, ensure_namespace, namespace_of
from cachectl.store import Store, normalize_url

if TYPE_CHECKING:
    from cachectl.client import ServerClient


class Context:
    """Opens the index lazily, so commands that need none never touch it."""

    def __init__(
        self, settings: Settings | None = None, *, index: IndexBackend | None = None
    ) -> None:
        """``index``: a backend the caller owns (the server passes its own): direct mode, never closed here."""
        self.settings = settings or load_settings()
        self._given = index

    @cached_property
    def remote(self) -> ServerClient | None:
        """The cachectl server's client when CACHECTL_SERVER is set (server mode), else None."""
        if self._given is not None:
            return None
        return client_from_settings(self.settings)

    @cached_property
    def index(self) -> IndexBackend:
        """The SQL index, or in server mode the server's (cachectl.backend.open_backend)."""
        if self._given is not None:
            return self._given
        return open_backend(self.settings, client=self.remote)

    @property
    def sql_index(self) -> Index:
        """``index`` as the SQL Index, for what only direct mode runs (lifecycle, tokens,
        telemetry stats: server mode asks the server, cachectl.operations). Not checked here."""
        return cast(Index, self.index)

    def cache(self, name: str | None = None) -> CacheInfo:
        """A cache by name; the embedded ``default`` is created on first use."""
        name = name or self.settings.cache
        if name == DEFAULT_CACHE:
            return self.index.ensure_cache(name, normalize_url(self.settings.default_root))
        return self.index.get_cache(name)

    def store(self, cache: CacheInfo) -> Store:
        return Store(cache.root_url, cache.storage_options)

    def environment(self) -> Environment:
        return current_environment()

    def namespace(
        self, cache: CacheInfo, env: Environment | None = None, *, create: bool = True
    ) -> tuple[Namespace, EnvironmentInfo | None]:
        """This environment's namespace in ``cache``; created and recorded if asked."""
        env = env or self.environment()
        store = self.store(cache)
        ns = namespace_of(store, cache.name, env)
        info = None
        if create:
            ensure_namespace(store, env, group=cache.group)
            info = self.index.ensure_environment(cache.name, env)
        return ns, info

    def close(self) -> None:
        if "index" in self.__dict__ and self._given is None:
            self.index.close()
        remote = self.__dict__.get("remote")
        if remote is not None:
            remote.close()
