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
from cachectl.index.open import driver
from cachectl.telemetry.batch import TelemetryBatch

if TYPE_CHECKING:
    from cachectl.core.config import Settings


class IndexSink:
    """Writes batches to the index: telemetry rows plus entry hit counts.

    The index is opened lazily, in the flusher thread, and re-opened after a
    failure, so an index that comes back later gets the counts again.
    """

    def __init__(
        self, settings: Settings, environment: Any, *, create_cache_at: str | None = None
    ) -> None:
        self.settings = settings
        self.db_url = settings.db
        self.cache = settings.cache
        self.environment = environment
        self.create_cache_at = create_cache_at  # the embedded default is created on first use
        self._index: Any = None
        self._env_id: int | None = None

    def describe(self) -> str:
        # Without SQLAlchemy: the service must not pay for its import at start.
        return "index " + re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", self.db_url)

    def _open(self) -> tuple[Any, int]:
        if self._index is None or self._env_id is None:
            # Opened in the flusher thread: a service never pays for SQLAlchemy at start.
            index = driver("sqlalchemy")(self.settings, "service")
            assert index is not None  # the sqlalchemy driver always opens
            try:
                if self.create_cache_at:
                    index.ensure_cache(self.cache, self.create_cache_at)
                env_id = int(index.ensure_environment(self.cache, self.environment).id)
            except Exception:
                index.close()
                raise
            self._index, self._env_id = index, env_id
            return index, env_id
        return self._index, self._env_id

    def _write_fast(self, batch: TelemetryBatch) -> bool:
        """Write through the stdlib driver when the index allows it (no SQLAlchemy import)."""
        if self._index is not None:
            return False  # the SQLAlchemy index is open already: keep using it
        # Imported in the flusher thread: the records it reads cost a service's start.
        from cachectl.index.stdlib import StdlibReads

        fast = StdlibReads.open_for(self.settings, "service")
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
            from cachectl.index.telemetry_queries import record_telemetry

            index, env_id = self._open()
            record_telemetry(index, env_id, batch)
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

    def __init__(self, index: Any) -> None:
        """``index``: the http index driver's (cachectl.client.remote.RemoteIndex), a service's."""
        self.client = index.client  # a cachectl.client.ServerClient

    def describe(self) -> str:
        return f"server {self.client.url}"

    def write(self, batch: TelemetryBatch) -> None:
        self.client.send_telemetry([batch])
