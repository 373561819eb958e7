"""What one app instance holds: settings, the index, a store per cache root, metrics, jobs.

Nothing here is authoritative: caches, tokens, jobs and leases live in the
index, so replicas behind a load balancer agree without talking to each other.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cachectl.context import Context
from cachectl.core.config import load_settings
from cachectl.index import CacheInfo, EnvironmentInfo, Index
from cachectl.index import server_queries as sq
from cachectl.storage.store import Store

from .auth import TokenCache
from .config import ServerSettings
from .metrics import Metrics
from .recent import Recent


@dataclass
class ServerState:
    settings: ServerSettings
    index: Index
    metrics: Metrics
    ctx: Context = field(init=False)
    _stores: dict[str, Store] = field(default_factory=dict, init=False)
    _by_info: dict[int, tuple[CacheInfo, Store]] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    tokens: TokenCache = field(init=False)
    # (cache, digest prefix) -> its policy and environment, for the read routes (server/recent.py)
    _where: Recent[tuple[str, str], tuple[CacheInfo, EnvironmentInfo]] = field(init=False)
    # (environment id, key, executable?) -> the (size, sha256) recorded, or None: the byte routes'
    # one index query, remembered for the same bound
    _recorded: Recent[tuple[int, str, bool], tuple[tuple[int, str] | None]] = field(init=False)
    # (lease scope, key) -> how long the key took to compile, or None: every waiter of a cold key
    # asks at once (the lease's "recorded"), one index query answers them for the same bound
    _compile_ms: Recent[tuple[str, str], tuple[int | None]] = field(init=False)
    jobs: Any = None  # server.jobs.JobRunner, set by create_app
    maintenance: Any = None  # server.maintenance.Scheduler, set by create_app

    def __post_init__(self) -> None:
        # One Context shared by every request, so library functions that take a
        # Context use this app's index (engine and connection pool).
        # The server is direct mode, even with CACHECTL_SERVER set; it owns (and closes) the index.
        self.ctx = Context(load_settings(db=self.settings.db), index=self.index)
        self.tokens = TokenCache(self.settings.token_cache_s)
        self._where = Recent(self.settings.token_cache_s)
        self._recorded = Recent(self.settings.token_cache_s)
        self._compile_ms = Recent(self.settings.token_cache_s)

    def where(self, cache: str, digest: str) -> tuple[CacheInfo, EnvironmentInfo]:
        """A cache's policy and one environment by digest or unique prefix, as the read routes need
        them: remembered for ``token_cache_s`` (a pruned environment or a policy changed elsewhere
        reaches this replica that much later; writes always ask the index)."""
        key = (cache, digest.strip().lower())
        found = self._where.get(key)
        if found is None:
            located = sq.locate(self.index, cache, digest)
            found = (located.cache, located.environment)
            self._where.put(key, found)
        return found

    def recorded(self, env_id: int, key: str, executable: bool) -> tuple[int, str] | None:
        """The (size, sha256) the index recorded for an entry or its executable, remembered like
        ``where``: the headers of a download whose bytes storage gives (an entry deleted from
        storage is a 404 at once; a sha256 changed elsewhere reaches this replica ``token_cache_s``
        later, and is sent only while the recorded size matches the file's)."""
        item = (env_id, key, executable)
        found = self._recorded.get(item)
        if found is None:
            found = (sq.recorded_digest(self.index, env_id, key, executable=executable),)
            self._recorded.put(item, found)
        return found[0]

    def compile_ms(self, scope: str, key: str, ask: Callable[[], int | None]) -> int | None:
        """A key's recorded compile time (``ask`` queries the index), remembered like ``where``:
        a waiter's hedge bound, which a time recorded ``token_cache_s`` later barely moves."""
        found = self._compile_ms.get((scope, key))
        if found is None:
            found = (ask(),)
            self._compile_ms.put((scope, key), found)
        return found[0]

    def compile_ms_changed(self, scope: str, key: str) -> None:
        """A finish through this replica recorded the key's compile time: ask the index again."""
        self._compile_ms.forget((scope, key))

    def known(
        self, cache: str, digest: str, key: str, executable: bool
    ) -> tuple[CacheInfo, EnvironmentInfo, tuple[int, str] | None] | None:
        """What ``where`` and ``recorded`` remember now, without asking the index (None: not all of
        it): what server/fast_lane.py answers on the event loop with."""
        found = self._where.get((cache, digest.strip().lower()))
        if found is None:
            return None
        recorded = self._recorded.get((found[1].id, key, executable))
        if recorded is None:
            return None
        return found[0], found[1], recorded[0]

    def known_until(self, cache: str, digest: str, key: str, executable: bool) -> float | None:
        """Until when what ``known`` returns now stays remembered (``time.monotonic``), or None."""
        found = self._where.get((cache, digest.strip().lower()))
        if found is None:
            return None
        until = (
            self._where.expires((cache, digest.strip().lower())),
            self._recorded.expires((found[1].id, key, executable)),
        )
        return None if None in until else min(t for t in until if t is not None)

    def forget(self, bearer: str, cache: str, digest: str, key: str, executable: bool) -> None:
        """Ask the index again, on their next use, for what one download was answered from: the
        token, the environment and the entry's record."""
        where = (cache, digest.strip().lower())
        found = self._where.get(where)
        if found is not None:
            self._recorded.forget((found[1].id, key, executable))
        self._where.forget(where)
        self.tokens.forget(bearer)

    def changed(self) -> None:
        """Something this replica changed (a token, a policy, an entry): forget what it remembered."""
        self.tokens.clear()
        self._where.clear()
        self._recorded.clear()

    def entries_changed(self) -> None:
        """An upload through this replica: the recorded sha256s it remembered may be stale."""
        self._recorded.clear()

    def store(self, cache: CacheInfo) -> Store:
        """One Store per root and options: object-store clients are costly to build. The same
        CacheInfo (``where`` remembers it) finds its Store without building the key again."""
        hit = self._by_info.get(id(cache))
        if hit is not None and hit[0] is cache:
            return hit[1]
        store = self._store(cache)
        if len(self._by_info) >= Recent.MAX:
            self._by_info.clear()
        self._by_info[id(cache)] = (cache, store)
        return store

    def _store(self, cache: CacheInfo) -> Store:
        key = cache.root_url + "\0" + json.dumps(cache.storage_options, sort_keys=True, default=str)
        with self._lock:
            store = self._stores.get(key)
            if store is None:
                store = self._stores[key] = Store(cache.root_url, cache.storage_options)
            return store
