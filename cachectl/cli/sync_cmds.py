"""`cachectl sync`: reconcile storage and index."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from cachectl.cli.render import emit, json_option, stdout, table
from cachectl.core.units import parse_duration

if TYPE_CHECKING:
    from cachectl.lifecycle.sync import SyncResult

# cachectl.lifecycle.sync (the index, SQLAlchemy, the stores) is imported by the command body when
# it runs, never at import: `cachectl sync --help` stays cheap.


# An action's files are listed one a row up to this many in a namespace, else counted in one row:
# rendering a table costs about 0.35 ms a row, as much as indexing 10 entries (BENCHMARKS.md).
LISTED = 20


def _print(result: SyncResult) -> None:
    plan = result.plan
    verb = "would" if result.dry_run else "did"
    rows = []
    for ns in plan.namespaces:
        if ns.problem:
            rows.append((ns.namespace, "skipped", ns.problem))
            continue
        if ns.new_environment:
            rows.append((ns.namespace, "add environment", ns.digest[:16] if ns.digest else "-"))
        for label, items in (
            ("index entry", ns.add),
            ("update entry", ns.update),
            ("drop row", ns.drop),
            ("record executable", ns.record_aot),
            ("clear executable", ns.clear_aot),
            ("orphan executable (no -cache; not indexed)", ns.orphan_aot),
            ("skipped: younger than --min-age", ns.too_young),
        ):
            if len(items) > LISTED:  # a first sync's thousands of keys: counted, listed by --json
                rows.append((ns.namespace, label, f"{len(items)} files (--json lists each)"))
                continue
            for e in items:
                rows.append((ns.namespace, label, e.key))
    for gone in plan.environments_gone:
        rows.append((gone, "mark environment deleted", "namespace gone from storage"))
    for path in result.broken:
        rows.append((path.split(": ", 1)[0].rsplit("/", 1)[0], "skipped: not a valid entry", path))
    for path in result.unsigned:
        where, name = path.rsplit("/", 1)
        rows.append((where, "indexed unsigned: readers refuse it", name))
    if rows:
        stdout.print(
            table(f"sync {plan.cache} ({plan.root})", ["namespace", "action", "detail"], rows[:200])
        )
        if len(rows) > 200:
            stdout.print(f"... and {len(rows) - 200} more")
    stdout.print(
        f"sync {verb}: {result.environments_added} environment(s) added, {result.entries_added} entries indexed, "
        f"{result.entries_updated} updated, {result.rows_dropped} rows dropped, "
        f"{result.environments_marked_deleted} environment(s) marked deleted, "
        f"{result.executables_recorded} executable(s) recorded, {result.executables_cleared} cleared, "
        f"{len(plan.orphan_executables)} orphan executable(s) ({result.duration_s:.2f}s)"
    )
    if result.unsigned:
        stdout.print(
            f"{len(result.unsigned)} indexed file(s) no trusted key signed: readers refuse them; "
            "a signed warm compiles and signs its own in their place, never these"
        )


@click.command("sync")
@click.option("--dry-run", is_flag=True, help="Show what would change without changing anything.")
@click.option(
    "--min-age",
    metavar="DUR",
    default="5m",
    show_default=True,
    help="Leave new files younger than this for a later sync (they may be half-written); 0 for none.",
)
@json_option
@click.pass_obj
def sync_cmd(ctx, dry_run: bool, as_json: bool, min_age: str) -> None:
    """Reconcile storage and index.

    Indexes entries any JAX process wrote into a namespace, drops index rows
    whose files are gone, and rebuilds environments from their env.json.
    """
    from cachectl.lifecycle.sync import sync

    result = sync(ctx, ctx.cache(), dry_run=dry_run, min_age=parse_duration(min_age))
    emit(result, as_json, _print)


def register(cli: click.Group) -> None:
    cli.add_command(sync_cmd)
