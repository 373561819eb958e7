"""IndexBackend: what the library's operations need from an index, whichever one it is.

Two implementations: :class:`cachectl.index.Index` (SQLAlchemy, direct mode) and
:class:`cachectl.client.RemoteIndex` (the cachectl server's HTTP API, server mode).
:func:`cachectl.index_choice.open_backend` picks one from the settings; nothing else does.
A remote backend refuses what only the server may do (deleting, changing policy)
with BadInput naming the operation.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from cachectl.core.fingerprint import Environment
from cachectl.core.records import (
    CacheInfo,
    EntryInfo,
    EnvironmentInfo,
    NewEntry,
    Proof,
    WarmRunInfo,
)


@runtime_checkable
class IndexBackend(Protocol):
    """The calls listing, stats, warm registration, pull/push and activate() make."""

    @property
    def dialect(self) -> str: ...

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
