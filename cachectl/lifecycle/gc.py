"""`cachectl gc`: keep a cache under its size limits, evicting by policy.

JAX's own limit costs O(entries) per write and does not work on object
stores (docs/jax-facts.md, fact 2), so managed services run without it and gc
enforces ``max_size`` (and ``env_max_size`` per environment) from the index.
Policies: ``lru`` evicts the least recently used first; ``cost`` evicts what
is cheapest to recompile per byte first (GreedyDual-Size style, decayed by
time since last use). Environments with a warm in progress, and with
--protect-warm the entries of each environment's newest finished warm run,
are never evicted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from cachectl.context import Context
from cachectl.core.config import DELETE_BATCH
from cachectl.core.config import GC_POLICIES as POLICIES
from cachectl.core.errors import BadInput
from cachectl.core.units import format_size, parse_size
from cachectl.index import CacheInfo
from cachectl.index.eviction_queries import Cuts, eviction_cuts
from cachectl.index.lifecycle_queries import (
    environments,
    newest_finished_warm_runs,
    warms_in_progress,
)
from cachectl.index.models import utcnow
from cachectl.lifecycle import lease as leases
from cachectl.lifecycle.execute import execute_plan
from cachectl.lifecycle.plan import (
    DeletionPlan,
    ExecutionResult,
    PlannedEntries,
    PlannedEntry,
    Protected,
)
from cachectl.storage.store import Store
from cachectl.trust.permissions import check_writer


@dataclass
class GcPlan:
    """The deletion plan plus the sizes it is measured against."""

    deletion: DeletionPlan
    policy: str
    max_size: int | None
    env_max_size: int | None
    bytes_before: int
    bytes_after: int
    over_limit_after: int  # bytes still over max_size after the plan: all of it protected


@dataclass(frozen=True)
class GcResult:
    plan: GcPlan
    execution: ExecutionResult | None
    dry_run: bool
    planning_s: float

    @property
    def ok(self) -> bool:
        """False when a run left the cache over its limit (everything left is protected)."""
        return self.dry_run or not self.plan.over_limit_after


def _limits(cache: CacheInfo, max_size: str | int | None) -> tuple[int | None, int | None]:
    limit = cache.max_size
    if max_size is not None:
        limit = parse_size(max_size)
        if limit <= 0:
            raise BadInput(f"--max-size must be positive, got {max_size!r}")
    if limit is None and cache.env_max_size is None:
        raise BadInput(
            f"cache {cache.name!r} has no size limit: set one with "
            f"`cachectl cache set {cache.name} --max-size 50GiB`, or pass --max-size for this run"
        )
    return limit, cache.env_max_size


def plan_gc(
    ctx: Context,
    cache: CacheInfo,
    *,
    policy: str = "lru",
    max_size: str | int | None = None,
    protect_warm: bool = False,
    now: datetime | None = None,
    store: Store | None = None,
) -> GcPlan:
    """Build the eviction plan from the index alone."""
    if policy not in POLICIES:
        raise BadInput(f"bad --policy {policy!r}: use lru or cost")
    limit, env_limit = _limits(cache, max_size)
    now = now or utcnow()
    store = store or ctx.store(cache)
    envs = environments(ctx.index.sql, cache.name)
    by_id = {e.id: e for e in envs}
    criteria: dict[str, object] = {
        "policy": policy,
        "max_size": limit,
        "env_max_size": env_limit,
        "protect_warm": protect_warm,
    }
    deletion = DeletionPlan("gc", cache.name, store.url, criteria)
    warming = warms_in_progress(ctx.index.sql, list(by_id), now=now)
    for env_id, w in warming.items():
        e = by_id[env_id]
        deletion.protected.append(
            Protected(
                e.namespace,
                f"warm run {w.run_id} in progress on {w.user}@{w.host}",
                e.entries,
                e.bytes,
            )
        )
    runs = newest_finished_warm_runs(ctx.index.sql, list(by_id)) if protect_warm else {}
    for env_id, run_id in sorted(runs.items()):
        if env_id not in warming:
            deletion.protected.append(
                Protected(by_id[env_id].namespace, f"newest warm run {run_id}")
            )
    cuts = eviction_cuts(
        ctx.index.sql,
        cache.name,
        policy=policy,
        max_bytes=limit,
        env_max_bytes=env_limit,
        exclude_env_ids=sorted(warming),
        protect_warm_runs=sorted(runs.values()),
        now=now,
        bytes_total=sum(e.bytes for e in envs),
        env_bytes={e.id: e.bytes for e in envs},
        rows_total=sum(e.entries for e in envs),
    )
    freed_by_env: dict[int, int] = dict.fromkeys(by_id, 0)
    for row in cuts.rows:
        freed_by_env[row[2]] += row[4]
    freed = sum(freed_by_env.values())
    deletion.entries = _planned(cuts, {e.id: e.namespace for e in envs}, freed)
    before = cuts.bytes_before
    after = before - freed
    over = max(0, after - limit) if limit is not None else 0
    if over:
        deletion.notes.append(
            f"still {format_size(over)} over max_size after evicting every unprotected entry"
        )
    if env_limit is not None:
        for e in envs:
            left = e.bytes - freed_by_env.get(e.id, 0)
            if left > env_limit:
                deletion.notes.append(
                    f"{e.namespace}: still {format_size(left - env_limit)} over env_max_size "
                    "(the rest is protected)"
                )
    return GcPlan(deletion, policy, limit, env_limit, before, after, over)


def _planned(cuts: Cuts, namespace: dict[int, str], freed: int) -> PlannedEntries:
    """The cut rows as the plan's entries, each ``PlannedEntry`` (its reason naming the cut and the
    score) built only when read: planning 200k evictions builds no object per row."""
    taken = cuts.env_taken
    one_cut = "max-size" if not taken else "env-max-size" if len(taken) == len(cuts.rows) else None

    def cut(id_: int) -> str:
        return one_cut or ("env-max-size" if id_ in taken else "max-size")

    # The last use to the minute comes as text from the database (the rows' 7th column).
    why: Callable[[tuple[Any, ...]], str] = (
        (lambda r: f"last used {r[6]}") if cuts.lru else (lambda r: f"cost score {r[0]:.4g}")
    )

    def make(r: tuple[Any, ...]) -> PlannedEntry:
        return PlannedEntry(
            r[2], namespace[r[2]], r[3], r[4] - (r[5] or 0), f"{cut(r[1])}; {why(r)}", r[5]
        )

    return PlannedEntries(cuts.rows, make, freed)


def gc(
    ctx: Context,
    cache: CacheInfo,
    *,
    policy: str = "lru",
    max_size: str | int | None = None,
    protect_warm: bool = False,
    dry_run: bool = False,
    batch_size: int = DELETE_BATCH,
    now: datetime | None = None,
) -> GcResult:
    """Plan, and unless ``dry_run``, execute under the cache's lifecycle lease."""
    if dry_run:
        started = time.monotonic()
        plan = plan_gc(
            ctx, cache, policy=policy, max_size=max_size, protect_warm=protect_warm, now=now
        )
        return GcResult(plan, None, True, time.monotonic() - started)
    # Bad input fails before the lease is taken or anything is touched.
    if policy not in POLICIES:
        raise BadInput(f"bad --policy {policy!r}: use lru or cost")
    _limits(cache, max_size)
    check_writer(cache, "gc")
    store = ctx.store(cache)
    with leases.held(ctx.index.sql, cache.name, "gc") as lease:
        started = time.monotonic()
        plan = plan_gc(
            ctx,
            cache,
            policy=policy,
            max_size=max_size,
            protect_warm=protect_warm,
            now=now,
            store=store,
        )
        planning = time.monotonic() - started
        execution = execute_plan(
            ctx.index.sql, store, plan.deletion, lease=lease, batch_size=batch_size
        )
    return GcResult(plan, execution, False, planning)
