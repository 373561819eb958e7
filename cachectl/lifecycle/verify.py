"""`cachectl verify`: every indexed entry exists, matches its checksum and decompresses.

One recursive listing of the root's paths (no stat per local file: only
unknown files get one, for --min-age), then every indexed entry is read, hashed
and its header checked (a bounded decompression): through ``Store.reader``
(on local disk each namespace directory is opened once, files relative to
it), on threads for object stores and for big local files
(``store.read_workers``). Files in a namespace the index does not know are "unknown
writer" findings. With --quarantine, unknown, corrupt and mismatched files
move to ``<root>/.quarantine/<UTC timestamp>/<namespace>/<file>`` (outside
every namespace, so JAX never reads them) and their index rows go; with
--repair (implied by --quarantine) JAX's sidecars are fixed: an ``-atime``
without its ``-cache`` is deleted, a ``-cache`` without its ``-atime`` in a
namespace where JAX's own eviction runs (a ``.lockfile`` exists) gets a
fresh one, and rows of missing files are dropped. Any finding means exit 1.

Stored executables (``<key>-aot``) are checked like entries: size and sha256
against the index, and their header (``aot.read_header``: magic, format,
payload checksum; the key and entry sha256 it names must be its entry's).
A bad one is quarantined and its entry's executable columns cleared (the
entry stays); an indexed one that is gone has its columns cleared (repair);
an ``-aot`` without its ``-cache`` is an orphan (quarantined); one the index
does not know is an unknown writer. A quarantined entry takes its ``-aot``
into quarantine with it.

Files a writer killed mid-write left (``.tmp-*`` beside their target, a bundle install's
``.staging/bundle-*`` directory) are ``stale-temp`` findings once their writer is gone
(``lifecycle/sweep.py``: its host and pid are in the name, else 24 h untouched); repair removes
them. A live writer's are no finding.
"""

from __future__ import annotations

import time
from datetime import datetime

from cachectl.context import Context
from cachectl.core.bulk_pass import bulk_pass
from cachectl.index import CacheInfo
from cachectl.index.lifecycle_queries import entry_digests
from cachectl.lifecycle import lease as leases
from cachectl.lifecycle.deep import load_all
from cachectl.lifecycle.verify_execute import audit, execute_verify
from cachectl.lifecycle.verify_plan import plan_verify
from cachectl.lifecycle.verify_records import (
    NOT_LOADABLE,
    VerifyFinding,
    VerifyOptions,
    VerifyPlan,
    VerifyResult,
)
from cachectl.storage.entries import CACHE_SUFFIX
from cachectl.storage.store import Store
from cachectl.trust.permissions import check_writer


def deep_findings(
    ctx: Context, cache: CacheInfo, plan: VerifyPlan, store: Store
) -> list[VerifyFinding]:
    """Load every indexed entry of this machine's environment that passed the checks (--deep)."""

    env = ctx.environment_for_children  # the loading child needs the accelerator
    try:
        info = ctx.index.find_environment(cache.name, env.digest)
    except Exception:  # noqa: BLE001 - this machine's environment is not in this cache
        return []
    bad = {f.path for f in plan.findings}
    rows = entry_digests(ctx.index.sql, info.id)
    paths = {
        p: sha
        for p, sha in (
            (f"{info.namespace}/{key}{CACHE_SUFFIX}", rows[key][1]) for key in sorted(rows)
        )
        if p not in bad
    }
    return [
        VerifyFinding(
            NOT_LOADABLE,
            info.namespace,
            p.path,
            p.detail,
            environment_id=info.id,
            key=p.path.rsplit("/", 1)[-1][: -len(CACHE_SUFFIX)],
        )
        for p in load_all(store, paths)
    ]


def verify(
    ctx: Context,
    cache: CacheInfo,
    options: VerifyOptions = VerifyOptions(),  # noqa: B008 - frozen: one shared default is safe
    *,
    now: datetime | None = None,
) -> VerifyResult:
    """Check; with quarantine/repair (and not a dry run) fix, under the cache's lifecycle lease.

    ``options.deep`` also loads every entry of this machine's environment in a subprocess
    (reported, never moved: another machine of this kind may load it)."""
    started = time.monotonic()
    store = ctx.store(cache)
    if not options.mutating:
        with bulk_pass():
            plan = plan_verify(ctx, cache, options, now=now, store=store)
        if options.deep:
            plan.findings.extend(deep_findings(ctx, cache, plan, store))
        if options.dry_run:
            return VerifyResult(plan, 0, 0, 0, 0, True, time.monotonic() - started)
        duration = time.monotonic() - started
        audit(ctx, cache, plan, duration)
        return VerifyResult(plan, 0, 0, 0, 0, False, duration)
    check_writer(cache, "quarantine or repair")
    with leases.held(ctx.index.sql, cache.name, "verify") as lease:
        with bulk_pass():
            plan = plan_verify(ctx, cache, options, now=now, lease=lease, store=store)
        if options.deep:
            plan.findings.extend(deep_findings(ctx, cache, plan, store))
        return execute_verify(ctx, cache, plan, started=started, store=store)
