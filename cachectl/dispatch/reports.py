"""What a :class:`~cachectl.dispatch.router.Serving` reports: per function and in all.

Apart from runtime.py so that module holds the call path only; both records are re-exported
from cachectl.dispatch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class FunctionReport:
    calls: int
    aot: int
    fallback: int
    out_of_bucket: int
    padded: int
    buckets: int
    loaded: int
    fallback_reason: str | None = None
    raw_sizes: dict[str, dict[int, int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (what :meth:`to_json` writes)."""
        return {
            "calls": self.calls,
            "aot": self.aot,
            "fallback": self.fallback,
            "out_of_bucket": self.out_of_bucket,
            "padded": self.padded,
            "buckets": self.buckets,
            "loaded": self.loaded,
            "fallback_reason": self.fallback_reason,
            "raw_sizes": {
                a: {str(k): v for k, v in sorted(c.items())} for a, c in self.raw_sizes.items()
            },
        }

    def to_json(self) -> str:
        """JSON text, for a log line: ``print(report.to_json())`` prints JSON, not Python."""
        return json.dumps(self.to_dict())


@dataclass(frozen=True)
class ServingReport:
    """What the runtime loaded and how calls were served: ``to_dict`` for code, ``to_json`` (text)
    for logs and dashboards."""

    namespace: str
    functions: dict[str, FunctionReport]
    load_seconds: float  # sum of every bucket's load
    # construction to the first answer possible (the loads run behind it; with ``warmup=True``
    # every bucket loaded)
    ready_seconds: float
    warnings: list[str]
    # ``warmup=True``: the sum of every bucket's warm-up call, and construction to every bucket
    # loaded and warmed up (None: no warm-up).
    warmup_seconds: float = 0.0
    warm_ready_seconds: float | None = None
    # construction to every bucket's executable loaded or failed (None: still loading, or
    # ``preload=False``, where each loads at its bucket's first call)
    loaded_seconds: float | None = None

    @property
    def ok(self) -> bool:
        return all(f.fallback == 0 and f.loaded == f.buckets for f in self.functions.values())

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (what :meth:`to_json` writes)."""
        return {
            "namespace": self.namespace,
            "functions": {n: f.to_dict() for n, f in self.functions.items()},
            "load_seconds": round(self.load_seconds, 4),
            "ready_seconds": round(self.ready_seconds, 4),
            "loaded_seconds": None
            if self.loaded_seconds is None
            else round(self.loaded_seconds, 4),
            "warmup_seconds": round(self.warmup_seconds, 4),
            "warm_ready_seconds": None
            if self.warm_ready_seconds is None
            else round(self.warm_ready_seconds, 4),
            "warnings": list(self.warnings),
        }

    def to_json(self) -> str:
        """JSON text, for a log line: ``print(rt.report().to_json())`` prints JSON, not Python."""
        return json.dumps(self.to_dict())
