"""A cache's policy as a service reads it, and the clock every record uses.

Apart from records.py (which re-exports both) because activate() needs only these: records.py's
other dataclasses cost a service ~4 ms of import, and the objects they leave behind bring its
first full garbage collection closer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any


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

    @property
    def effective_service_writes(self) -> str:
        """allow/deny; object stores default to deny (services only read them)."""
        if self.service_writes:
            return self.service_writes
        return "deny" if self.root_url.startswith(("s3://", "gs://")) else "allow"
