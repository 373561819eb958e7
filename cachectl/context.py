"""The resolved settings, index and stores one command works with."""

from __future__ import annotations

import logging
import sys
from dataclasses import replace
from functools import cached_property
from typing import TYPE_CHECKING

from cachectl.core.config import DEFAULT_CACHE, Settings, load_settings
from cachectl.core.errors import NotFound
from cachectl.core.fingerprint import Environment, current_environment
from cachectl.core.probe import (
    ProbedEnvironment,
    environment_in_child,
    forget,
    remembered_environment,
)
from cachectl.index import CacheInfo, EnvironmentInfo
from cachectl.index.open import open_index
from cachectl.storage.namespace import Namespace, ensure_namespace, namespace_of
from cachectl.storage.node_tier import server_root, via_server
from cachectl.storage.store import Store, normalize_url

if TYPE_CHECKING:
    from cachectl.index.protocol import IndexBackend


class Context:
    """Opens the index lazily, so commands that need none never touch it."""

    def __init__(
        self, settings: Settings | None = None, *, index: IndexBackend | None = None
    ) -> None:
        """``index``: a backend the caller owns (the server passes its own): never closed here."""
        self.settings = settings or load_settings()
        self._given = index

    @cached_property
    def index(self) -> IndexBackend:
        """The one index handle (cachectl.index.open): the server's in server mode; in direct
        mode the stdlib driver where it serves the file (the read commands then never import
        SQLAlchemy, which costs one more than its whole run), else the SQLAlchemy one."""
        if self._given is not None:
            return self._given
        return open_index(self.settings, "command")

    def cache(self, name: str | None = None) -> CacheInfo:
        """A cache by name; the embedded ``default`` is created on first use."""
        name = name or self.settings.cache
        if name == DEFAULT_CACHE:
            try:
                return self.index.get_cache(name)
            except NotFound:
                return self.index.ensure_cache(name, normalize_url(self.settings.default_root))
        return self.index.get_cache(name)

    def store(self, cache: CacheInfo) -> Store:
        """The cache's root; in server mode where the local-disk root is not on this machine,
        the node tier's directory that stands in for it (storage/node_tier.py ``server_root``):
        what a command writes lands on this node, and bytes from the root come over the server."""
        node = server_root(self.settings, cache.name, cache.root_url)
        if node is not None:
            return Store(node)
        return Store(cache.root_url, cache.storage_options)

    def reads_via_server(self, cache: CacheInfo) -> bool:
        """Whether this command reads the cache's bytes over the server's entry routes."""
        return via_server(self.settings, cache.root_url)

    def environment(self, *, registers: bool = True) -> Environment:
        """This machine's environment. A process that has not imported JAX (a CLI command that
        compiles nothing) takes the one remembered for this machine's state
        (:meth:`remembered_environment`), so it never imports JAX. One that has imported JAX,
        which may have configured it, reads its own. ``registers``: the caller may record it
        in the index (only then is a remembered one checked against the index)."""
        if "jax" in sys.modules:
            return current_environment()
        probed = self.remembered_environment(checked=registers)
        if probed.warning:
            logging.getLogger(__name__).warning("%s", probed.warning)
        return probed.environment

    def remembered_environment(
        self, *, fresh: bool = False, checked: bool = True
    ) -> ProbedEnvironment:
        """The environment a child read and remembered for this machine's state (the memo
        `cachectl exec` keeps, cachectl.core.probe), read by a child where none is. With
        ``checked``, a remembered one the index never recorded is forgotten and read afresh: a
        file edited by hand never registers a made-up environment."""
        probed = remembered_environment(fresh=fresh)
        if not (checked and probed.remembered and probed.memo) or self._recorded(
            probed.environment
        ):
            return probed
        forget(probed.memo)
        said = (
            f"cachectl: the remembered environment {probed.memo} names an environment the "
            "index never recorded; it is forgotten and read afresh"
        )
        again = remembered_environment(fresh=True)
        warning = "\n".join(w for w in (probed.warning, said, again.warning) if w)
        return replace(again, warning=warning)

    def _recorded(self, env: Environment) -> bool:
        """Whether the index knows ``env``; True where it cannot answer (nothing is recorded
        then). A cache that does not exist is the command's error, not the memo's."""
        try:
            cache = self.cache()
        except NotFound:
            raise
        except Exception:  # noqa: BLE001 - index down: the command falls back, records nothing
            return True
        try:
            self.index.find_environment(cache.name, env.digest)
        except NotFound:
            return False
        except Exception:  # noqa: BLE001 - index down: the command falls back, records nothing
            return True
        return True

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
        if "index" in self.__dict__ and self._given is None:
            self.index.close()
