"""A cache's policy as a service reads it, and the clock every record uses.

Apart from records.py (which re-exports both) because activate() needs only these: records.py's
other dataclasses cost a service import time, and the objects they leave behind bring its
first full garbage collection closer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from cachectl.core.sqlite_file import from_json, when
from cachectl.core.urls import is_object_store

# The ``caches`` table's columns, in the order CacheInfo.from_row reads them.
CACHE_COLUMNS = (
    "name",
    "root_url",
    "max_size_bytes",
    "max_entry_size_bytes",
    "env_max_size_bytes",
    "retention_seconds",
    "keep_versions",
    "writers",
    "service_writes",
    "group_name",
    "storage_options",
    "created_at",
    "trusted_keys",
)


def utcnow() -> datetime:
    return datetime.now(UTC)


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

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> CacheInfo:
        """A ``caches`` row (CACHE_COLUMNS, in order), as any driver or the ORM returns it: the one
        mapping from the table to the record."""
        name, root, max_size, max_entry, env_max, retention, keep, writers = row[:8]
        service_writes, group, options, created, keys = row[8:13]
        return cls(
            name=name,
            root_url=root,
            max_size=max_size,
            max_entry_size=max_entry,
            env_max_size=env_max,
            retention_seconds=retention,
            keep_versions=keep,
            writers=tuple(from_json(writers) or ()),
            service_writes=service_writes,
            group=group,
            storage_options=dict(from_json(options) or {}),
            created_at=when(created),
            trusted_keys=tuple(from_json(keys) or ()),
        )

    @property
    def effective_service_writes(self) -> str:
        """allow/deny; object stores default to deny (services only read them)."""
        if self.service_writes:
            return self.service_writes
        return "deny" if is_object_store(self.root_url) else "allow"
