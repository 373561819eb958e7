"""Where a service's telemetry batches go: the index (IndexSink) or the server (ServerSink).

(MemorySink, which needs neither, is in cachectl.telemetry.batch.)

A sink's ``write`` runs in the collector's flusher thread, never on the compile path;
a failure there is counted by the collector and the batch's counts are dropped.
"""

from __future__ import annotations

import re
import sqlite3
from typing import TYPE_CHECKING, Any

from cachectl.core.cache_info import utcnow
from cachectl.service import sqlite_index as service_sqlite
from cachectl.telemetry.batch import TelemetryBatch

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Protocol, TypeVar

    from cachectl.index.sql import Index

    T = TypeVar("T")

    class SqlTelemetry(Protocol):
        """What a sink needs of ``service/index_access.py`` (mypy checks the module against it)."""

        def index_with(self, url: str, first: Callable[[Index], T]) -> tuple[Index, T]: ...

        def record_telemetry(self, index: Index, env_id: int, batch: TelemetryBatch) -> int: ...


def _index_side() -> SqlTelemetry:
    """cachectl.service.index_access, imported in the flusher thread: a service never pays for
    SQLAlchemy at start."""
    from cachectl.service import index_access

    return index_access


class IndexSink:
    """Writes batches to the index: telemetry rows plus entry hit counts.

    The index is opened lazily, in the flusher thread, and re-opened after a
    failure, so an index that comes back later gets the counts again.
    """

    def __init__(
        self, db_url: str, cache: str, environment: Any, *, create_cache_at: str | None = None
    ) -> None:
        self.db_url = db_url
        self.cache = cache
        self.environment = environment
        self.create_cache_at = create_cache_at  # the embedded default is created on first use
        self._index: Any = None
        self._env_id: int | None = None

    def describe(self) -> str:
        # Without SQLAlchemy: the service must not pay for its import at start.
        return "index " + re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", self.db_url)

    def _open(self) -> tuple[Any, int]:
        if self._index is None or self._env_id is None:

            def record(index: Any) -> int:
                if self.create_cache_at:
                    index.ensure_cache(self.cache, self.create_cache_at)
                return int(index.ensure_environment(self.cache, self.environment).id)

            self._index, env_id = _index_side().index_with(self.db_url, record)
            self._env_id = env_id
            return self._index, env_id
        return self._index, self._env_id

    def _write_fast(self, batch: TelemetryBatch) -> bool:
        """Write through the stdlib driver when the index allows it (no SQLAlchemy import)."""
        if self._index is not None:
            return False  # the SQLAlchemy index is open already: keep using it
        fast = service_sqlite.open_service_sqlite(self.db_url)
        if fast is None:
            return False
        try:
            return fast.flush(self.cache, self.environment.digest, batch, utcnow()) is not None
        except sqlite3.Error:
            return False
        finally:
            fast.close()

    def write(self, batch: TelemetryBatch) -> None:
        if self._write_fast(batch):
            return
        try:
            index, env_id = self._open()
            _index_side().record_telemetry(index, env_id, batch)
        except Exception:
            if self._index is not None:
                self._index.close()
            self._index = self._env_id = None
            raise

    def close(self) -> None:
        if self._index is not None:
            self._index.close()
            self._index = None


class ServerSink:
    """Telemetry sink for activate() in server mode: batches go to POST /api/v1/telemetry."""

    def __init__(self, client: Any) -> None:
        self.client = client  # a cachectl.client.ServerClient

    def describe(self) -> str:
        return f"server {self.client.url}"

    def write(self, batch: TelemetryBatch) -> None:
        self.client.send_telemetry([batch])
