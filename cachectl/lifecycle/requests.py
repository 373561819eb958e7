"""prune, gc and verify as a user asks for them: the flags, unparsed, in one record per command.

Both modes take them (cachectl.operations): direct mode parses them for the library, server mode
sends the same fields as the job's parameters (``job_params``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cachectl.lifecycle import prune as prune_lib
from cachectl.lifecycle.prune import PruneCriteria


@dataclass(frozen=True)
class PruneRequest:
    """prune's selectors as the user gave them (the server's job takes the same fields)."""

    older_than: str | None = None
    unused_for: str | None = None
    jax_version: str | None = None
    superseded: bool = False
    keep: int | None = None
    env: str | None = None
    function: str | None = None

    def criteria(self) -> PruneCriteria:
        """Parsed and checked: one-line BadInput for anything unusable, before any mode acts."""
        return prune_lib.criteria(**dataclasses.asdict(self))


@dataclass(frozen=True)
class GcRequest:
    policy: str = "lru"
    max_size: str | None = None
    protect_warm: bool = False


@dataclass(frozen=True)
class VerifyRequest:
    env: str | None = None
    quarantine: bool = False
    repair: bool = False
    min_age: str = "10m"
    deep: bool = False


def job_params(request: Any, dry_run: bool) -> dict[str, Any]:
    """A request as a server job's parameters; unset flags are left out, so the server applies
    its own defaults."""
    params = {**dataclasses.asdict(request), "dry_run": dry_run}
    return {k: v for k, v in params.items() if v is not None and v is not False}
