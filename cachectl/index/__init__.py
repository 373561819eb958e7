"""The index: the SQL index (cachectl.index.sql), its protocol, its queries and records.

The records are cheap and imported here; ``Index``, ``open_index`` and ``unit_size`` come from
cachectl.index.sql, which imports SQLAlchemy (~0.4 s), only when first asked for: the CLI's read
commands answer from the stdlib (cachectl.index.reads) and never load it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from cachectl.core.records import (
    AuditInfo,
    CacheInfo,
    EntryInfo,
    EnvironmentInfo,
    NewEntry,
    WarmRunInfo,
    actor,
)

if TYPE_CHECKING:
    from cachectl.index.sql import Index, open_index, unit_size

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

_FROM_SQL = frozenset({"Index", "open_index", "unit_size"})


def __getattr__(name: str) -> Any:
    if name in _FROM_SQL:
        return getattr(importlib.import_module("cachectl.index.sql"), name)
    raise AttributeError(f"module 'cachectl.index' has no attribute {name!r}")
