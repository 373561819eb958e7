"""`cachectl prune`, `cachectl gc`, `cachectl verify`: plan, show, execute.

Each prints its plan (a table, or --json) and stops there on --dry-run.
Exit codes: 0 done; 1 verify found problems, gc could not get under the
limit (everything left is protected), or another prune/gc/verify --quarantine
holds the cache's lease (the message names the holder; nothing was done);
2 bad input, nothing deleted; 4 not a writer of the cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from cachectl.cli.render import digest, emit, json_option, key, size, stdout, table
from cachectl.core.config import DELETE_BATCH, GC_POLICIES
from cachectl.core.errors import ProblemsReported

if TYPE_CHECKING:
    from cachectl.context import Context
    from cachectl.lifecycle import gc as gc_lib
    from cachectl.lifecycle.plan import DeletionPlan, ExecutionResult, LifecycleResult
    from cachectl.lifecycle.verify_records import VerifyResult

# cachectl.operations (the lifecycle library, the index, SQLAlchemy) is imported by the command
# bodies when they run, never at import: `cachectl prune --help` builds its options from
# cachectl.core.config alone.

_SHOW = 50


def _print_plan(plan: DeletionPlan, dry_run: bool) -> None:
    if plan.namespaces:
        rows: list[tuple[object, ...]] = [
            (n.namespace, digest(n.digest), n.jax_version, n.entries, size(n.bytes), n.reason)
            for n in plan.namespaces[:_SHOW]
        ]
        stdout.print(
            table(
                f"{plan.operation} {plan.cache}: namespaces deleted whole",
                ["namespace", "environment", "jax", "entries", "bytes", "reason"],
                rows,
                justify_right=("entries", "bytes"),
                keep=("environment",),
            )
        )
        if len(plan.namespaces) > _SHOW:
            stdout.print(
                f"... and {len(plan.namespaces) - _SHOW} more namespaces (--json lists all)"
            )
    if plan.entries:
        rows = [
            (e.namespace, key(e.key), size(e.size), size(e.aot_size), e.reason)
            for e in plan.entries[:_SHOW]
        ]
        stdout.print(
            table(
                f"{plan.operation} {plan.cache}: entries (each with its -aot executable, if any)",
                ["namespace", "key", "bytes", "aot", "reason"],
                rows,
                justify_right=("bytes", "aot"),
                keep=("key",),
            )
        )
        if len(plan.entries) > _SHOW:
            stdout.print(f"... and {len(plan.entries) - _SHOW} more entries (--json lists all)")
    for p in plan.protected:
        stdout.print(f"protected: {p.namespace}: {p.reason}")
    for note in plan.notes:
        stdout.print(f"note: {note}")


def _summary(
    plan: DeletionPlan, execution: ExecutionResult | None, dry_run: bool, planning_s: float
) -> str:
    if dry_run or execution is None:
        return (
            f"{plan.operation} would delete {len(plan.namespaces)} namespace(s) and "
            f"{plan.entry_count} entries, freeing {size(plan.bytes_to_free)} "
            f"(planned in {planning_s:.2f}s; dry run, nothing deleted)"
        )
    return (
        f"{plan.operation} deleted {execution.namespaces_deleted} namespace(s) and "
        f"{execution.entries_deleted} entries, freed {size(execution.bytes_freed)} "
        f"in {execution.storage_calls} storage call(s) "
        f"(planned in {planning_s:.2f}s, executed in {execution.duration_s:.2f}s)"
    )


def _print_prune(result: LifecycleResult) -> None:
    _print_plan(result.plan, result.dry_run)
    stdout.print(_summary(result.plan, result.execution, result.dry_run, result.planning_s))


def _print_gc(result: gc_lib.GcResult) -> None:
    plan = result.plan
    _print_plan(plan.deletion, result.dry_run)
    limit = size(plan.max_size) if plan.max_size is not None else "-"
    stdout.print(
        f"cache {plan.deletion.cache}: {size(plan.bytes_before)} indexed, max size {limit}, "
        f"policy {plan.policy}; after gc: {size(plan.bytes_after)}"
    )
    stdout.print(_summary(plan.deletion, result.execution, result.dry_run, result.planning_s))


def _print_verify(result: VerifyResult) -> None:
    plan = result.plan
    if plan.findings:
        rows = [(f.kind, f.path, f.detail, f.action or "-") for f in plan.findings[:200]]
        stdout.print(
            table(
                f"verify {plan.cache} ({plan.root})", ["finding", "path", "detail", "action"], rows
            )
        )
        if len(plan.findings) > 200:
            stdout.print(f"... and {len(plan.findings) - 200} more (--json lists all)")
    counts = ", ".join(f"{n} {k}" for k, n in sorted(plan.counts.items())) or "no problems"
    stdout.print(
        f"verify checked {plan.entries_checked} entries and {plan.executables_checked} stored "
        f"executables ({size(plan.bytes_read)}) in "
        f"{plan.namespaces} namespace(s), {plan.files_listed} files listed: {counts} "
        f"({result.duration_s:.2f}s)"
    )
    if result.quarantined:
        stdout.print(
            f"quarantined {result.quarantined} file(s) under {plan.root}/{plan.quarantine_dir}"
        )
    if (
        result.atimes_deleted
        or result.atimes_written
        or result.rows_dropped
        or result.executables_cleared
    ):
        stdout.print(
            f"repaired: {result.atimes_deleted} orphan -atime deleted, {result.atimes_written} -atime "
            f"written, {result.rows_dropped} index row(s) dropped, {result.executables_cleared} "
            "entries' executable columns cleared"
        )
    if result.temps_removed:
        stdout.print(f"removed {result.temps_removed} unfinished file(s) of writers that are gone")
    if result.dry_run and any(f.action for f in plan.findings):
        stdout.print("dry run: nothing moved, deleted or written")


_batch_option = click.option(
    "--batch-size",
    type=click.IntRange(1, DELETE_BATCH),
    default=DELETE_BATCH,
    hidden=True,
    help="Paths per storage delete call (at most 1000).",
)


@click.command("prune")
@click.option("--older-than", metavar="DUR", help="Entries created longer ago than DUR (e.g. 30d).")
@click.option(
    "--unused-for",
    metavar="DUR",
    help="Entries not accessed for DUR (creation time if never accessed).",
)
@click.option(
    "--jax-version",
    metavar="SPEC",
    help="Environments whose JAX version matches a PEP 440 specifier, e.g. '<0.10'.",
)
@click.option(
    "--superseded",
    is_flag=True,
    help="Environments whose JAX version is older than the newest --keep of their hardware group "
    "(backend, device kind and count, XLA flags).",
)
@click.option(
    "--keep",
    type=int,
    metavar="N",
    help="With --superseded: JAX versions kept per group (default: the cache's keep_versions, else 1).",
)
@click.option("--env", "env_prefix", metavar="DIGEST-PREFIX", help="Only this environment.")
@click.option("--function", metavar="NAME", help="Only entries of this function.")
@click.option("--dry-run", is_flag=True, help="Print the plan and stop.")
@_batch_option
@json_option
@click.pass_obj
def prune_cmd(
    ctx: Context,
    older_than: str | None,
    unused_for: str | None,
    jax_version: str | None,
    superseded: bool,
    keep: int | None,
    env_prefix: str | None,
    function: str | None,
    dry_run: bool,
    batch_size: int,
    as_json: bool,
) -> None:
    """Delete entries and namespaces the selectors name (AND).

    A namespace whose every entry is selected goes as one unit. With no
    selector, the cache's retention is used (--older-than RETENTION); without
    one, prune refuses. Never asks for confirmation: safe for cron. Exit 1
    (nothing done) when another prune, gc or verify --quarantine holds the
    cache's lease.
    """
    from cachectl.lifecycle.requests import PruneRequest
    from cachectl.operations import operations

    request = PruneRequest(
        older_than=older_than,
        unused_for=unused_for,
        jax_version=jax_version,
        superseded=superseded,
        keep=keep,
        env=env_prefix,
        function=function,
    )
    result = operations(ctx).prune(request, dry_run=dry_run, batch_size=batch_size)
    emit(result, as_json, _print_prune)


@click.command("gc")
@click.option(
    "--policy",
    type=click.Choice(GC_POLICIES),
    default="lru",
    show_default=True,
    help="lru: least recently used first; cost: cheapest to recompile per byte first.",
)
@click.option(
    "--max-size", metavar="SIZE", help="Size limit for this run instead of the cache's max_size."
)
@click.option(
    "--protect-warm",
    is_flag=True,
    help="Never evict entries of each environment's newest finished warm run.",
)
@click.option("--dry-run", is_flag=True, help="Print the plan and stop.")
@_batch_option
@json_option
@click.pass_obj
def gc_cmd(
    ctx: Context,
    policy: str,
    max_size: str | None,
    protect_warm: bool,
    dry_run: bool,
    batch_size: int,
    as_json: bool,
) -> None:
    """Evict entries until the cache fits its max_size (and env_max_size).

    Exit 1 when another prune, gc or verify --quarantine holds the cache's
    lease (nothing done), or when the cache is still over its limit because
    everything left is protected.
    """
    from cachectl.lifecycle.requests import GcRequest
    from cachectl.operations import operations

    request = GcRequest(policy=policy, max_size=max_size, protect_warm=protect_warm)
    result = operations(ctx).gc(request, dry_run=dry_run, batch_size=batch_size)
    emit(
        result,
        as_json,
        _print_gc,
        failure=lambda r: ProblemsReported(
            f"cachectl: gc: cache is still {size(r.plan.over_limit_after)} over max_size; "
            "the rest is protected (warm in progress or --protect-warm)"
        ),
    )


@click.command("verify")
@click.option("--env", "env_prefix", metavar="DIGEST-PREFIX", help="Only this environment.")
@click.option(
    "--quarantine",
    is_flag=True,
    help="Move unknown, corrupt and mismatched files to <root>/.quarantine/<UTC time>/ (implies --repair).",
)
@click.option(
    "--repair",
    is_flag=True,
    help="Fix JAX sidecars (orphan -atime, missing -atime) and drop index rows of missing files.",
)
@click.option(
    "--min-age",
    metavar="DUR",
    default="10m",
    show_default=True,
    help="Unknown files younger than this (a writer may be about to index them) are not quarantined.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Check and show what --quarantine/--repair would do; change nothing.",
)
@click.option(
    "--deep",
    is_flag=True,
    help="Also load every entry of this machine's environment, as a cache hit would, in a subprocess.",
)
@json_option
@click.pass_obj
def verify_cmd(
    ctx: Context,
    env_prefix: str | None,
    quarantine: bool,
    repair: bool,
    min_age: str,
    dry_run: bool,
    deep: bool,
    as_json: bool,
) -> None:
    """Check every indexed entry: exists, sha256 matches, decompresses. Exit 1 on any finding.

    Run `cachectl sync` first where services write entries themselves: until
    synced, their entries are unknown to the index.
    """
    from cachectl.lifecycle.requests import VerifyRequest
    from cachectl.operations import operations

    request = VerifyRequest(
        env=env_prefix, quarantine=quarantine, repair=repair, min_age=min_age, deep=deep
    )
    result = operations(ctx).verify(request, dry_run=dry_run)
    emit(
        result,
        as_json,
        _print_verify,
        failure=lambda r: ProblemsReported(f"cachectl: verify: {len(r.plan.findings)} finding(s)"),
    )


def register(cli: click.Group) -> None:
    cli.add_command(prune_cmd)
    cli.add_command(gc_cmd)
    cli.add_command(verify_cmd)
