"""`cachectl doctor`, `pull`, `push`: the service side of a managed cache.

Exit codes: doctor 1 when any finding is an error; pull 1 when an entry was
refused (not in the index, or its sha256 changed) or failed to copy; push 1
when an entry was refused or failed, 4 when this user is not a writer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from cachectl.cli.render import emit, escape, json_option, key, size, stdout, table
from cachectl.core.config import MIRROR_WORKERS, SIGNING_KEY_ENV

if TYPE_CHECKING:
    from cachectl.context import Context
    from cachectl.service import doctor as doctor_lib
    from cachectl.service import mirror as mirror_lib
    from cachectl.service import mirror_push

# cachectl.service.doctor, cachectl.service.mirror, cachectl.service.mirror_push and cachectl.trust.signing (the index,
# SQLAlchemy, the stores) are imported by the command bodies when they run, never at import:
# `cachectl pull --help` builds its options from cachectl.core.config alone.

_SHOW = 50
_STYLE = {"error": "bold red", "warning": "yellow", "info": "green"}


def _print_doctor(report: doctor_lib.DoctorReport) -> None:
    stdout.print(f"cache {report.cache} at {report.root or '-'}", highlight=False)
    stdout.print(
        f"this environment: {report.environment[:16]}  {report.namespace}", highlight=False
    )
    if report.nearest:
        stdout.print(
            f"nearest warmed:   {report.nearest[:16]}  {report.nearest_namespace}", highlight=False
        )
    for f in report.findings:
        style = _STYLE.get(f.severity, "")
        stdout.print(f"[{style}]{f.severity:<7}[/] {escape(f.message)}", markup=True)
        if f.fix:
            stdout.print(f"        fix: {f.fix}", highlight=False)
    stdout.print(f"{report.errors} error(s), {report.warnings} warning(s)", highlight=False)


@click.command("doctor")
@json_option
@click.pass_obj
def doctor(ctx: Context, as_json: bool) -> None:
    """Explain why this process would miss its warmed cache (exit 1 on any error).

    Compares this environment with those in the index and names the nearest
    and every differing field; checks key-affecting JAX config, JAX's own
    eviction, cache permissions, and that the index and bucket are reachable.
    """
    from cachectl.service import doctor as doctor_lib

    report = doctor_lib.diagnose(ctx)
    emit(report, as_json, _print_doctor)


def _problems_table(title: str, items: list[mirror_lib.EntryProblem]) -> None:
    if items:
        rows = [(key(p.key), p.reason) for p in items[:_SHOW]]
        stdout.print(table(title, ["key", "reason"], rows, keep=("key",)))
        if len(items) > _SHOW:
            stdout.print(f"... and {len(items) - _SHOW} more (--json lists all)")


def _print_pull(r: mirror_lib.PullResult) -> None:
    _problems_table("refused (not copied)", r.refused)
    _problems_table("failed", r.failed)
    if r.missing:
        stdout.print(
            f"{len(r.missing)} indexed entries are gone from storage (run `cachectl sync`)",
            highlight=False,
        )
    verb = "would copy" if r.dry_run else "copied"
    stdout.print(
        f"pull {r.source} -> {r.dest}: {verb} {r.copied} entries and {r.executables_copied} stored "
        f"executables ({size(r.bytes_copied)}), "
        f"{r.present} entries and {r.executables_present} executables already present, {len(r.refused)} refused, "
        f"{len(r.failed)} failed of {r.indexed} entries and {r.executables_indexed} executables indexed "
        f"({r.duration_s:.2f}s)",
        highlight=False,
    )


@click.command("pull")
@click.option(
    "--to",
    "dest",
    required=True,
    metavar="DIR",
    type=click.Path(file_okay=False),
    help="Local directory to mirror this environment's namespace into.",
)
@click.option(
    "--workers",
    type=click.IntRange(1, 64),
    default=MIRROR_WORKERS,
    show_default=True,
    help="Parallel downloads.",
)
@click.option(
    "--verify-existing", is_flag=True, help="Re-hash entries already in DIR (default: size check)."
)
@click.option("--dry-run", is_flag=True, help="Show what would be copied; copy nothing.")
@json_option
@click.pass_obj
def pull(
    ctx: Context, dest: str, workers: int, verify_existing: bool, dry_run: bool, as_json: bool
) -> None:
    """Copy this environment's verified entries to DIR (then point JAX at DIR).

    Only entries the index knows, with the sha256 the index recorded, are
    copied; anything else in the bucket is reported and left behind.

    A service then reads DIR with cachectl.activate(mirror=DIR), which also
    pulls; or with the variables `cachectl env` prints and
    JAX_COMPILATION_CACHE_DIR=DIR.

    \b
    cachectl pull --to /var/cache/jax-mirror
    """
    from cachectl.service import mirror as mirror_lib

    result = mirror_lib.pull(
        ctx, dest, workers=workers, dry_run=dry_run, verify_existing=verify_existing
    )
    emit(result, as_json, _print_pull)


def _print_push(r: mirror_push.PushResult) -> None:
    _problems_table("refused (not uploaded)", r.refused)
    _problems_table("conflicts (kept the shared copy)", r.conflicts)
    _problems_table("failed", r.failed)
    verb = "would upload" if r.dry_run else "uploaded"
    stdout.print(
        f"push {r.source} -> {r.dest}: {verb} {r.uploaded} entries and {r.executables_uploaded} stored "
        f"executables ({size(r.bytes_uploaded)}), "
        f"{r.already_shared} already shared, {len(r.conflicts)} conflicts, {len(r.refused)} refused "
        f"({r.duration_s:.2f}s)",
        highlight=False,
    )


@click.command("push")
@click.option(
    "--from",
    "src",
    required=True,
    metavar="DIR",
    type=click.Path(file_okay=False),
    help="Mirror directory a local run wrote new entries into.",
)
@click.option(
    "--workers",
    type=click.IntRange(1, 64),
    default=MIRROR_WORKERS,
    show_default=True,
    help="Parallel uploads.",
)
@click.option("--dry-run", is_flag=True, help="Show what would be uploaded; upload nothing.")
@click.option(
    "--sign-key",
    metavar="PATH",
    envvar=SIGNING_KEY_ENV,
    help="Sign the namespace's content list afterwards (required when the cache trusts keys). "
    f"[env: {SIGNING_KEY_ENV}]",
)
@json_option
@click.pass_obj
def push(
    ctx: Context, src: str, workers: int, dry_run: bool, sign_key: str | None, as_json: bool
) -> None:
    """Upload entries a local run wrote in DIR to the shared namespace (writers only).

    New entries are recorded in the index with origin "push".
    """
    from cachectl.service import mirror_push
    from cachectl.trust import signing

    key = signing.signing_key(sign_key)
    if not dry_run:
        signing.require_signer(ctx.cache(), key, "push")
    result = mirror_push.push(ctx, src, workers=workers, dry_run=dry_run)
    if not dry_run and key is not None:
        signing.report_resigned(
            signing.resign(ctx, result.cache, result.environment, key, result.written)
        )
    emit(result, as_json, _print_push)


def register(cli: click.Group) -> None:
    for cmd in (doctor, pull, push):
        cli.add_command(cmd)
