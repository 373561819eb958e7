"""Index writes for `cachectl sync`: many new entry rows in one transaction, at driver speed.

Sync's new rows differ only in key, module, size and sha256; the rest (origin, the time it saw
them) every row shares. They go through ``bulk_rows`` (one statement per 10,000 rows on SQLite,
the driver's executemany elsewhere). Keys that exist by the time the rows are written (a
concurrent warm or sync wrote them since planning) are left to ``upsert_entries``, so re-running
stays harmless and counts stay exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cachectl.index import Index, NewEntry, bulk_rows
from cachectl.index.models import utcnow

# A row sync observed: (key, module, size, sha256); a plain tuple, not a NewEntry per file.
ObservedRow = tuple[str, str, int, str]
_VARYING = ("key", "module", "size_bytes", "sha256")  # strings and integers: bound as they are


def observed_entry(row: Sequence[Any]) -> NewEntry:
    """The NewEntry of a row sync observed (for ``upsert_entries``)."""
    return NewEntry(key=row[0], module=row[1], size=row[2], sha256=row[3], origin="observed")


def insert_observed_entries(index: Index, env_id: int, rows: Sequence[NewEntry]) -> tuple[int, int]:
    """Record entries sync found in storage; returns (inserted, updated) like ``upsert_entries``.

    Every row gets the same ``created_at`` (now) and origin; other optional columns stay empty."""
    return insert_observed_rows(index, env_id, [(r.key, r.module, r.size, r.sha256) for r in rows])


def insert_observed_rows(index: Index, env_id: int, rows: Sequence[ObservedRow]) -> tuple[int, int]:
    """``insert_observed_entries`` for rows as sync reads them: plain tuples."""
    if not rows:
        return 0, 0
    if not bulk_rows.supported(index.engine.dialect):  # a driver not written for: the general path
        return index.upsert_entries(env_id, [observed_entry(r) for r in rows])
    shared = {
        "origin": "observed",
        "created_at": utcnow(),
        "hit_count": 0,
        "compile_time_ms": None,
        "function": None,
        "bucket": None,
        "warm_run_id": None,
        "aot_size_bytes": None,
        "aot_sha256": None,
    }
    with index.session() as s:
        inserted, existing = bulk_rows.insert_rows(s.connection(), env_id, _VARYING, shared, rows)
    if not existing:
        return inserted, 0
    # Written since sync planned: upserted, so counts stay exact.
    more, updated = index.upsert_entries(env_id, [observed_entry(r) for r in existing])
    return inserted + more, updated
