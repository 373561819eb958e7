"""The resolved settings, index and stores one command works with."""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, cast

from cachectl.core.config import DEFAULT_CACHE, Settings, load_settings
from cachectl.core.errors import NotFound
from cachectl.core.fingerprint import Environment, current_environment
from cachectl.core.probe import environment_in_child
from cachectl.index import CacheInfo, EnvironmentInfo
from cachectl.index.reads import HasReader, IndexReads, StdlibReads
from cachectl.storage.namespace import Namespace, ensure_namespace, namespace_of
from cachectl.storage.store import Store, normalize_url

if TYPE_CHECKING:
    from cachectl.client import ServerClient
    from cachectl.index import Index
    from cachectl.index.protocol import IndexBackend


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
        if self._given is not None or not self.settings.server:
            return None
        # Imported here: the client costs ~0.1 s that direct mode never needs.
        from cachectl.client import client_from_settings

        return client_from_settings(self.settings)

    @cached_property
    def index(self) -> IndexBackend:
        """The SQL index, or in server mode the server's (cachectl.index_choice.open_backend)."""
        if self._given is not None:
            return self._given
        # Imported here: SQLAlchemy costs a read command more than its whole run (see ``reads``).
        from cachectl.index_choice import open_backend

        return open_backend(self.settings, client=self.remote)

    @cached_property
    def reads(self) -> IndexReads:
        """Where read-only questions go: in direct mode on a plain SQLite index at the current
        schema, the stdlib driver (cachectl.index.reads: no SQLAlchemy); else ``index``."""
        if "index" not in self.__dict__ and self._given is None and not self.settings.server:
            fast = StdlibReads.open(self.settings.db)
            if fast is not None:
                return fast
        return self.index

    @property
    def direct_reads(self) -> HasReader:
        """What direct mode plans from (cachectl.index.plan_reads): the stdlib reader where
        ``reads`` is one, else the SQL index. Server mode plans on the server."""
        reads = self.reads
        return reads if isinstance(reads, StdlibReads) else self.sql_index

    @property
    def sql_index(self) -> Index:
        """``index`` as the SQL Index, for what only direct mode runs (lifecycle, tokens,
        telemetry stats: server mode asks the server, cachectl.operations). Not checked here."""
        return cast("Index", self.index)

    def cache(self, name: str | None = None) -> CacheInfo:
        """A cache by name; the embedded ``default`` is created on first use."""
        name = name or self.settings.cache
        if name == DEFAULT_CACHE:
            try:
                return self.reads.get_cache(name)
            except NotFound:
                return self.index.ensure_cache(name, normalize_url(self.settings.default_root))
        return self.reads.get_cache(name)

    def store(self, cache: CacheInfo) -> Store:
        return Store(cache.root_url, cache.storage_options)

    def environment(self) -> Environment:
        """This machine's environment, read in this process (which opens JAX's backend)."""
        return current_environment()

    @cached_property
    def environment_for_children(self) -> Environment:
        """This machine's environment, read by a child process, for commands that start JAX
        children: an accelerator held here would refuse them (cachectl.core.probe)."""
        return environment_in_child()

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
        reads = self.__dict__.get("reads")
        if isinstance(reads, StdlibReads):
            reads.close()
        if "index" in self.__dict__ and self._given is None:
            self.index.close()
        remote = self.__dict__.get("remote")
        if remote is not None:
            remote.close()
