"""Which share of a manifest this process warms: ``--shard I/N`` or ``--shard auto``.

``auto`` is for Kubernetes Indexed Jobs: the control plane gives every pod
``JOB_COMPLETION_INDEX`` (0 .. completions-1); the shard count comes from
``--shards N``, else ``CACHECTL_SHARDS`` (set it to the Job's ``completions``).
The index is 0-based, shards are counted from 1: index 0 warms ``--shard 1/N``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from cachectl.core.errors import BadInput
from cachectl.manifest import parse_shard

INDEX_VAR = "JOB_COMPLETION_INDEX"
COUNT_VAR = "CACHECTL_SHARDS"


def _count(text: str, source: str) -> int:
    if not re.fullmatch(r"\s*\d+\s*", text) or int(text) < 1:
        raise BadInput(f"--shard auto: {source} must be a whole number >= 1, got {text!r}")
    return int(text)


def resolve_shard(
    text: str | None, shards: int | None = None, environ: Mapping[str, str] | None = None
) -> tuple[int, int] | None:
    """``--shard`` and ``--shards`` -> (I, N) with I from 1, or None for the whole manifest."""
    env = os.environ if environ is None else environ
    if text is None:
        if shards is not None:
            raise BadInput(
                "--shards N needs --shard auto (it gives the count of an Indexed Job's shards)"
            )
        return None
    if text.strip().lower() != "auto":
        if shards is not None:
            raise BadInput("--shards N goes with --shard auto; --shard I/N already names the count")
        return parse_shard(text)
    if shards is not None:
        n = _count(str(shards), "--shards")
    elif env.get(COUNT_VAR, "").strip():
        n = _count(env[COUNT_VAR], COUNT_VAR)
    else:
        raise BadInput(
            f"--shard auto: no shard count: pass --shards N or set {COUNT_VAR} "
            "(the Indexed Job's completions)"
        )
    raw = env.get(INDEX_VAR, "").strip()
    if not raw:
        raise BadInput(
            f"--shard auto: {INDEX_VAR} is not set (it is set in the pods of a "
            "Kubernetes Indexed Job); pass --shard I/N elsewhere"
        )
    if not re.fullmatch(r"\d+", raw):
        raise BadInput(f"--shard auto: {INDEX_VAR} must be a whole number, got {raw!r}")
    index = int(raw)
    if index >= n:
        raise BadInput(
            f"--shard auto: {INDEX_VAR}={index} is not below the shard count {n} "
            "(completions and --shards/CACHECTL_SHARDS must agree)"
        )
    return index + 1, n
