"""The client's side of the wire format: records decoded with cachectl.core.jsonable, telemetry encoded.

``decode`` is the one way a server response becomes a library value (the server encodes
with ``jsonable.to_jsonable``; the CLI's --json prints the same), so there is no second decoder.
"""

from __future__ import annotations

from typing import Any

from cachectl.core.jsonable import REDACTED, from_jsonable


def decode(tp: Any, data: Any) -> Any:
    """A server response as the library's type ``tp``; withheld secrets dropped."""
    return from_jsonable(tp, _without_redacted(data))


def _without_redacted(value: Any) -> Any:
    """Drop the storage options the server withheld: this host uses its own credentials instead."""
    if isinstance(value, dict):
        return {k: _without_redacted(v) for k, v in value.items() if v != REDACTED}
    if isinstance(value, list):
        return [_without_redacted(v) for v in value]
    return value


def telemetry_wire(batch: Any) -> dict[str, Any]:
    """A cachectl.telemetry.TelemetryBatch as the server's /telemetry body expects it."""
    return {
        "process": batch.process,
        "cache": batch.cache,
        "environment_digest": batch.environment_digest,
        "started_at": batch.started_at.isoformat(),
        "ended_at": batch.ended_at.isoformat(),
        "functions": [
            {
                "function": fn,
                "requests": c.requests,
                "hits": c.hits,
                "writes": c.writes,
                "saved_seconds": float(c.saved_seconds),
                "retrieval_seconds": float(c.retrieval_seconds),
                "uncacheable": c.uncacheable,
                "loads": c.loads,
                "miss_seconds": float(c.miss_seconds),
                "hit_seconds": float(c.hit_seconds),
            }
            for fn, c in batch.functions.items()
        ],
        "hit_keys": [
            {"key": k, "count": n, "at": at.isoformat()} for k, (n, at) in batch.hit_keys.items()
        ],
        "dropped": batch.dropped,
        "serving": [c.row(fn) for fn, c in getattr(batch, "serving", {}).items()],
        "signatures": [
            {
                "function": ident[0],
                "key": c.key,
                "source": c.source,
                "leaves": [
                    [list(shape), dtype, bool(weak), sharding]
                    for shape, dtype, weak, sharding in c.leaves
                ],
                "statics": None if c.statics is None else [[str(k), v] for k, v in c.statics],
                "requests": c.requests,
                "hits": c.hits,
                "misses": c.misses,
                "uncacheable": c.uncacheable,
                "repeats": c.repeats,
                "first_seen": c.first_seen,
                "last_seen": c.last_seen,
            }
            for ident, c in getattr(batch, "signatures", {}).items()
        ],
        "signatures_dropped": getattr(batch, "signatures_dropped", 0),
    }
