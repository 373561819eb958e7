"""Why a service's namespace holds nothing: the cache's closest other environment, named.

A service that finds no stored executable is told to run ``cachectl warm``. When the cache holds
entries under an environment that differs from this process's only in its x64 mode, its CPU
instruction set, its XLA flags or its JAX and jaxlib versions (version skew: warmed with one
JAX, served with another), warming again is not the first fix: the process runs in another mode,
or with another JAX, than warm did. The index's environments of the same backend and device kind
are compared with this one (cachectl.service.env_differences' words for each differing field),
and the closest one that holds entries is named in one warning.
"""

from __future__ import annotations

import logging
from typing import Any

from cachectl.core.fingerprint import Environment
from cachectl.service.env_differences import compare

log = logging.getLogger("cachectl.dispatch")


def closest_environment_hint(
    activation: Any, here: Environment, who: str = "cachectl.serving"
) -> str | None:
    """One warning naming what differs from the closest environment with entries; None where the
    index is not at hand, holds no such environment, or cannot be read (a hint, never a failure).
    ``who`` starts the line (serving's warning, or warm-check's report)."""
    index = getattr(activation, "index", None)
    if index is None:
        return None
    try:
        candidates = []
        for info in index.environment_stats(activation.cache):
            there = info.environment
            # Any JAX and jaxlib: a version skew is named with the version warm had.
            same_hardware = (there.backend, there.device_kind) == (here.backend, here.device_kind)
            if info.digest == here.digest or not info.entries or not same_hardware:
                continue
            candidates.append((len(compare(here, there)), info.namespace, info, there))
    except Exception as exc:  # noqa: BLE001 - the hint is extra; serving goes on without it
        log.debug("cachectl.serving: no hint on the other environments: %s", exc)
        return None
    if not candidates:
        return None
    _, namespace, info, there = min(candidates, key=lambda c: (c[0], c[1]))
    differences = compare(here, there)
    return (
        f"{who}: this process's namespace holds no stored executable, while "
        f"{namespace} holds {info.entries} entries for an environment that differs in "
        + "; ".join(d.message for d in differences)
        + ": "
        + "; ".join(d.fix for d in differences)
    )
