"""The SQL index side of activate() and cachectl.serving: opening it, the mirror pull, telemetry rows.

Everything here needs SQLAlchemy, so cachectl.service.activate and the telemetry sink import this
module only when a service actually talks to an SQL index: a plain activate() with a root
and a mode never pays for it, and server mode (CACHECTL_SERVER) goes through cachectl.client.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from cachectl.core.config import DEFAULT_CACHE, Settings
from cachectl.core.errors import CachectlError
from cachectl.core.fingerprint import Environment
from cachectl.index import CacheInfo, Index, open_index
from cachectl.index.db import make_engine
from cachectl.index.protocol import IndexBackend
from cachectl.index.telemetry_queries import record_telemetry
from cachectl.service.mirror import NOT_INDEXED, PullResult, prepare_mirror_dir, pull_namespace
from cachectl.storage.store import Store, normalize_url

log = logging.getLogger("cachectl.service.activate")
T = TypeVar("T")


def _quick_index(url: str) -> Index:
    """The index without Alembic's schema check (importing Alembic alone costs ~0.5 s at start)."""
    return Index(make_engine(url))


def _missing_schema(exc: Exception) -> bool:
    text = str(exc).lower()
    return (
        "no such table" in text
        or "undefinedtable" in text
        or ("does not exist" in text and "relation" in text)
    )


def index_with(url: str, first: Callable[[Index], T]) -> tuple[Index, T]:
    """Open the index cheaply and run ``first`` on it; migrate a schema-less SQLite file once.

    The caller owns (and closes) the returned index.
    """
    index = _quick_index(url)
    try:
        return index, first(index)
    except Exception as exc:
        index.close()
        if not _missing_schema(exc):
            raise
    index = open_index(url)  # a new SQLite file: create the schema, then retry
    try:
        return index, first(index)
    except Exception:
        index.close()
        raise


def open_for_service(settings: Settings) -> tuple[Index, CacheInfo]:
    """The SQL index and this cache's policy (the embedded default is created on first use).

    A service only reads its cache's row and records its environment, so the
    schema is checked (and an SQLite file migrated) only when a table is missing.
    """
    if settings.cache == DEFAULT_CACHE:
        root = normalize_url(settings.default_root)
        return index_with(settings.db, lambda i: i.ensure_cache(settings.cache, root))
    return index_with(settings.db, lambda i: i.get_cache(settings.cache))


def prepare_mirror(
    index: IndexBackend | None,
    cache_info: CacheInfo | None,
    env: Environment,
    store: Callable[[], Store],
    directory: str,
    problems: list[str],
) -> PullResult | None:
    """Pull verified entries into the mirror; on any failure keep what the mirror holds."""

    def keep_local(reason: str) -> None:
        problems.append(f"mirror {directory} not refreshed ({reason})")
        try:
            prepare_mirror_dir(directory, env)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"mirror {directory} unusable ({exc})")

    if index is None or cache_info is None:
        keep_local("the index is needed to verify entries")
        return None
    try:
        result = pull_namespace(
            index, cache_info, env, directory, store=store, skip_storage_if_complete=True
        )
    except CachectlError as exc:
        keep_local(exc.message)
        return None
    except Exception as exc:  # noqa: BLE001 - bucket down: serve from what is local
        keep_local(f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
        return None
    unindexed = [p for p in result.refused if p.reason.startswith(NOT_INDEXED)]
    if result.indexed == 0 and unindexed:
        problems.append(
            f"mirror {directory}: the index lists no entries for this environment, so nothing "
            f"was pulled and every program compiles; {result.source} holds {len(unindexed)} "
            "it has not recorded: run `cachectl sync` (it skips entries younger than --min-age)"
        )
    elif result.refused:
        problems.append(
            f"mirror {directory}: refused {len(result.refused)} entr"
            f"{'y' if len(result.refused) == 1 else 'ies'} (unknown to the index, changed, or unsigned) "
            f"(e.g. {result.refused[0].key}: {result.refused[0].reason}); see `cachectl pull`"
        )
    if result.failed:
        problems.append(
            f"mirror {directory}: {len(result.failed)} entries failed to copy "
            f"({result.failed[0].reason})"
        )
    return result


def record_environment(
    db_url: str, cache_name: str, env: Environment, create_cache_at: str | None
) -> None:
    """Record this environment in the index, off the start path; failures only logged."""

    def record(index: Index) -> None:
        if create_cache_at:
            index.ensure_cache(cache_name, create_cache_at)
        index.ensure_environment(cache_name, env)

    try:
        index, _ = index_with(db_url, record)
        index.close()
    except Exception as exc:  # noqa: BLE001 - best effort
        log.debug("cachectl: could not record environment %s: %s", env.digest[:16], exc)


__all__ = [
    "PullResult",
    "index_with",
    "open_for_service",
    "prepare_mirror",
    "record_environment",
    "record_telemetry",
]
