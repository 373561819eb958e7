"""The index: its drivers (cachectl.index.open), its protocol, its queries and records.

Every name here is imported when first asked for: the records (cachectl.core.records), so that
a service's activate(), which imports cachectl.index.open, loads none before it opens an index;
``open_index`` (cachectl.index.open); ``Index`` and ``unit_size`` (cachectl.index.sql, which
imports SQLAlchemy, ~0.4 s): the CLI's read commands answer from the stdlib driver
(cachectl.index.stdlib) and never load it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cachectl.core.records import (
        AuditInfo,
        CacheInfo,
        EntryInfo,
        EnvironmentInfo,
        NewEntry,
        WarmRunInfo,
        actor,
    )
    from cachectl.index.open import open_index
    from cachectl.index.sql import Index, unit_size

__all__ = [
    "AuditInfo",
    "CacheInfo",
    "EntryInfo",
    "EnvironmentInfo",
    "Index",
    "NewEntry",
    "WarmRunInfo",
    "actor",
    "open_index",
    "unit_size",
]

_RECORDS = "cachectl.core.records"
_LAZY = {
    **dict.fromkeys(
        ("AuditInfo", "CacheInfo", "EntryInfo", "EnvironmentInfo", "NewEntry", "WarmRunInfo"),
        _RECORDS,
    ),
    "actor": _RECORDS,
    "Index": "cachectl.index.sql",
    "unit_size": "cachectl.index.sql",
    "open_index": "cachectl.index.open",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cachectl.index' has no attribute {name!r}")
