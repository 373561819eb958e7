"""IndexBackend: what the library's operations need from an index, whichever driver it is.

Three drivers implement it (cachectl.index.open, ``DRIVERS``): ``stdlib``
(:class:`cachectl.index.stdlib.StdlibReads`), ``sqlalchemy`` (:class:`cachectl.index.sql.Index`)
and ``http`` (:class:`cachectl.client.remote.RemoteIndex`). :func:`cachectl.index.open.open_index`
picks one from the settings; nothing else does. The http driver refuses what only the server
may do (deleting, changing policy, ``reader`` and ``sql``) with BadInput naming the operation.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from cachectl.core.fingerprint import Environment
from cachectl.core.records import (
    CacheInfo,
    EntryInfo,
    EnvironmentInfo,
    HeldEntry,
    NewEntry,
    Proof,
    WarmRunInfo,
)

if TYPE_CHECKING:
    from cachectl.index.reads import Reader
    from cachectl.index.sql import Index


@runtime_checkable
class IndexBackend(Protocol):
    """The calls listing, stats, warm registration, pull/push and activate() make."""

    @property
    def dialect(self) -> str: ...

    @property
    def reader(self) -> Reader:
        """The portable read queries' runner (cachectl.index.reads); direct mode only."""
        ...

    @property
    def sql(self) -> Index:
        """The SQL index, for what only direct mode runs (leases, deletions, tokens)."""
        ...

    def close(self) -> None: ...

    # caches
    def list_caches(self) -> list[CacheInfo]: ...

    def get_cache(self, name: str) -> CacheInfo: ...

    def ensure_cache(self, name: str, root_url: str) -> CacheInfo: ...

    def add_cache(self, name: str, root_url: str, **policy: Any) -> CacheInfo: ...

    def update_cache(self, name: str, **policy: Any) -> CacheInfo: ...

    def remove_cache(self, name: str) -> None: ...

    # environments
    def environment_stats(
        self, cache: str, *, include_deleted: bool = False
    ) -> list[EnvironmentInfo]: ...

    def find_environment(
        self, cache: str, prefix: str, *, include_deleted: bool = False
    ) -> EnvironmentInfo: ...

    def get_environment(self, cache: str, digest: str) -> EnvironmentInfo: ...

    def ensure_environment(self, cache: str, env: Environment) -> EnvironmentInfo: ...

    def mark_environment_deleted(self, env_id: int) -> None: ...

    def record_proof(self, env_id: int, proof: Proof) -> None: ...

    # entries
    def list_entries(self, env_id: int) -> list[EntryInfo]: ...

    def entry_keys(self, env_id: int) -> dict[str, tuple[int, str]]: ...

    def aot_keys(self, env_id: int) -> dict[str, tuple[int, str]]: ...

    def held_entries(self, env_id: int, keys: Iterable[str]) -> dict[str, HeldEntry]:
        """The rows of ``keys`` (those the environment holds), without reading its other rows."""
        ...

    def set_executables(
        self, env_id: int, executables: dict[str, tuple[int, str] | None]
    ) -> int: ...

    def mark_executables(self, env_id: int, verdicts: dict[str, str | None]) -> int: ...

    def get_entry(self, env_id: int, key: str) -> EntryInfo | None: ...

    def upsert_entries(self, env_id: int, entries: Iterable[NewEntry]) -> tuple[int, int]: ...

    def delete_entries(self, env_id: int, keys: Iterable[str]) -> int: ...

    # warm runs
    def start_warm_run(
        self, environment_id: int, *, manifest_digest: str, manifest_path: str | None, buckets: int
    ) -> WarmRunInfo: ...

    def heartbeat_warm_run(
        self,
        run_id: int,
        *,
        compiled: int | None = None,
        cached: int | None = None,
        failed: int | None = None,
    ) -> None: ...

    def finish_warm_run(
        self, run_id: int, status: str, *, compiled: int, cached: int, failed: int
    ) -> WarmRunInfo: ...

    # audit
    def audit(
        self,
        operation: str,
        *,
        cache: str | None,
        entries: int = 0,
        nbytes: int = 0,
        duration_ms: int | None = None,
        details: dict[str, Any] | None = None,
        who: str | None = None,
    ) -> None: ...
