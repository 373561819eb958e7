"""Typed, session-free views of index rows: what the library returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from cachectl.fingerprint import Environment


@dataclass(frozen=True)
class CacheInfo:
    name: str
    root_url: str
    max_size: int | None = None
    max_entry_size: int | None = None
    env_max_size: int | None = None
    retention_seconds: int | None = None
    keep_versions: int | None = None
    writers: tuple[str, ...] = ()
    service_writes: str | None = None
    group: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    created_at: datetime | None = None
    # Public keys readers accept signatures from; empty: signatures are not required.
    trusted_keys: tuple[str, ...] = ()

    @property
    def effective_service_writes(self) -> str:
        """allow/deny; object stores default to deny (services only read them)."""
        if self.service_writes:
            return self.service_writes
        return "deny" if self.root_url.startswith(("s3://", "gs://")) else "allow"


@dataclass(frozen=True)
class EnvironmentInfo:
    id: int
    cache: str
    digest: str
    namespace: str
    environment: Environment
    created_at: datetime | None
    last_seen_at: datetime | None
    deleted_at: datetime | None
    entries: int = 0
    # Entries and their stored executables together: what size limits and gc count.
    bytes: int = 0
    last_access_at: datetime | None = None
    # Entries with a stored executable (``<key>-aot``), and those executables' bytes (within ``bytes``).
    executables: int = 0
    aot_bytes: int = 0


@dataclass(frozen=True)
class EntryInfo:
    key: str
    module: str
    size: int
    sha256: str
    compile_time_ms: int | None
    origin: str
    function: str | None
    bucket: dict[str, Any] | None
    created_at: datetime | None
    last_access_at: datetime | None
    hit_count: int
    environment_id: int
    aot_size: int | None = None
    aot_sha256: str | None = None


@dataclass(frozen=True)
class NewEntry:
    """What a writer knows about an entry it just stored or found."""

    key: str
    module: str
    size: int
    sha256: str
    origin: str
    compile_time_ms: int | None = None
    function: str | None = None
    bucket: dict[str, Any] | None = None
    warm_run_id: int | None = None
    created_at: datetime | None = None
    # The stored executable beside the entry, when the writer stored one.
    aot_size: int | None = None
    aot_sha256: str | None = None


@dataclass(frozen=True)
class AuditInfo:
    at: datetime
    actor: str
    operation: str
    cache: str | None
    entries: int
    bytes: int
    duration_ms: int | None
    details: dict[str, Any]
