"""`cachectl verify`'s execution: what a plan's findings say, done to storage, then the index.

Quarantined files move first (a quarantined entry takes its ``-aot`` along, and its ``-atime``
goes), then index rows are dropped and executable columns cleared, then debris and sidecars
are fixed; one audit row records it all.
"""

from __future__ import annotations

import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from cachectl.context import Context
from cachectl.core import temps
from cachectl.index import CacheInfo
from cachectl.index.lifecycle_queries import delete_entry_rows
from cachectl.lifecycle import sweep
from cachectl.lifecycle.checks import check_entry
from cachectl.lifecycle.verify_records import (
    CLEAR_AOT,
    CORRUPT,
    DELETE_ATIME,
    DELETE_TEMP,
    DROP_ROW,
    MISMATCH,
    QUARANTINE,
    UNKNOWN,
    WRITE_ATIME,
    VerifyFinding,
    VerifyPlan,
    VerifyResult,
    is_executable,
)
from cachectl.storage.entries import ATIME_SUFFIX, EXECUTABLE_SUFFIX
from cachectl.storage.store import Store, read_workers


@dataclass
class _IndexChanges:
    """What the moves and the repairs leave for the index: entry rows to drop and entries whose
    executable columns are cleared, by environment id."""

    rows: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))
    cleared: dict[int, dict[str, tuple[int, str] | None]] = field(
        default_factory=lambda: defaultdict(dict)
    )


def audit(
    ctx: Context, cache: CacheInfo, plan: VerifyPlan, duration: float, **details: Any
) -> None:
    """The audit row of one verify (``details`` beyond the findings' counts: what it changed)."""
    ctx.index.audit(
        "verify",
        cache=cache.name,
        entries=plan.entries_checked,
        nbytes=plan.bytes_read,
        duration_ms=int(duration * 1000),
        details={"findings": plan.counts, **details},
    )


def _still_bad(ctx: Context, store: Store, f: VerifyFinding) -> bool:
    """Re-read an indexed entry right before moving it: a write that finished since the
    check (or a row corrected meanwhile) is not moved away."""
    if (
        f.kind not in (CORRUPT, MISMATCH)
        or not f.key
        or f.environment_id is None
        or is_executable(f)
    ):
        return True
    row = ctx.index.get_entry(f.environment_id, f.key)
    if row is None:
        return True
    return check_entry(store.read_bytes, f.path, row.size, row.sha256).kind is not None


def _with_executables(to_move: list[VerifyFinding]) -> list[VerifyFinding]:
    """``to_move`` and, after it, the executable of each entry in it that is not already there:
    a quarantined entry's executable is unusable without it, so it goes along."""
    moving = {f.path for f in to_move}
    out = list(to_move)
    for f in to_move:
        aot_path = f"{f.namespace}/{f.key}{EXECUTABLE_SUFFIX}"
        if (
            f.key
            and not is_executable(f)
            and f.kind in (CORRUPT, MISMATCH, UNKNOWN)
            and aot_path not in moving
        ):
            out.append(
                VerifyFinding(
                    f.kind,
                    f.namespace,
                    aot_path,
                    "with its entry",
                    QUARANTINE,
                    f.environment_id,
                    f.key,
                )
            )
            moving.add(aot_path)
    return out


def _quarantine(
    store: Store, plan: VerifyPlan, to_move: list[VerifyFinding], changes: _IndexChanges
) -> list[str]:
    """Move the files into the plan's quarantine directory; the paths moved (one gone since the
    plan is no move). Bad indexed files' rows (or executable columns) go into ``changes``."""
    if not to_move:
        return []
    assert plan.quarantine_dir is not None

    def move(f: VerifyFinding) -> str | None:
        try:
            store.move(f.path, f"{plan.quarantine_dir}/{f.path}")
            return f.path
        except FileNotFoundError:
            return None

    with ThreadPoolExecutor(max_workers=read_workers(store)) as pool:
        moved = [p for p in pool.map(move, to_move) if p]
    for f in to_move:
        if f.kind in (CORRUPT, MISMATCH) and f.environment_id is not None and f.key:
            if is_executable(f):
                changes.cleared[f.environment_id][f.key] = None
            else:
                changes.rows[f.environment_id].append(f.key)
    # A moved entry's -atime would be an orphan: remove it with the entry.
    store.delete(
        f"{f.namespace}/{f.key}{ATIME_SUFFIX}" for f in to_move if f.key and not is_executable(f)
    )
    return moved


def _write_atimes(store: Store, findings: list[VerifyFinding]) -> int:
    """A fresh -atime for each -cache JAX's eviction needs one for; how many were written."""
    for f in findings:
        store.write_bytes(f.path, time.time_ns().to_bytes(8, "little"))
    return len(findings)


def execute_verify(
    ctx: Context, cache: CacheInfo, plan: VerifyPlan, *, started: float, store: Store | None = None
) -> VerifyResult:
    """Move, delete, write and drop what the findings say; then audit."""
    store = store or ctx.store(cache)
    by_action: dict[str, list[VerifyFinding]] = defaultdict(list)
    for f in plan.findings:
        if f.action:
            by_action[f.action].append(f)
    changes = _IndexChanges()
    to_move = _with_executables([f for f in by_action[QUARANTINE] if _still_bad(ctx, store, f)])
    moved = _quarantine(store, plan, to_move, changes)
    for f in by_action[DROP_ROW]:
        if f.environment_id is not None and f.key:
            changes.rows[f.environment_id].append(f.key)
    for f in by_action[CLEAR_AOT]:
        if f.environment_id is not None and f.key:
            changes.cleared[f.environment_id][f.key] = None
    dropped = delete_entry_rows(ctx.index.sql, changes.rows) if changes.rows else 0
    aot_cleared = sum(
        ctx.index.set_executables(env_id, keys) for env_id, keys in changes.cleared.items()
    )
    temps_removed = sweep.remove(
        store,
        [
            sweep.Debris(f.path, f.detail, f.path.startswith(temps.STAGING_DIR + "/"))
            for f in by_action[DELETE_TEMP]
        ],
    )
    orphans = [f.path for f in by_action[DELETE_ATIME]]
    if orphans:
        store.delete(orphans)
    written = _write_atimes(store, by_action[WRITE_ATIME])
    duration = time.monotonic() - started
    audit(
        ctx,
        cache,
        plan,
        duration,
        quarantined=len(moved),
        quarantine_dir=plan.quarantine_dir,
        moved=moved[:200],
        atimes_deleted=len(orphans),
        atimes_written=written,
        rows_dropped=dropped,
        executables_cleared=aot_cleared,
        temps_removed=temps_removed,
    )
    return VerifyResult(
        plan,
        quarantined=len(moved),
        atimes_deleted=len(orphans),
        atimes_written=written,
        rows_dropped=dropped,
        dry_run=False,
        duration_s=duration,
        executables_cleared=aot_cleared,
        temps_removed=temps_removed,
    )
