"""`cachectl misses` (and `advise`): what the service really called, against the manifest.

Exit codes: misses 1 when any signature missed (or was compiled again and again).
"""

from __future__ import annotations

import click

from cachectl import misses as misses_lib
from cachectl.cli.render import emit, json_option, stdout, table
from cachectl.context import Context
from cachectl.units import parse_duration

_SHOW = 50


def _print_misses(r: misses_lib.MissesReport) -> None:
    stdout.print(f"cache {r.cache}: {r.signatures} signatures, {r.requests} compile requests, {r.hits} hits, "
                 f"{r.misses} misses, {r.uncacheable} uncacheable since {r.since:%Y-%m-%d %H:%M} UTC"
                 + (f"; manifest {r.manifest}" if r.manifest else "; no manifest (warm one, or --manifest)"),
                 highlight=False)
    if r.coverage is not None:
        stdout.print(f"coverage of the observed calls by the manifest: {r.coverage:.1%}", highlight=False)
    by_fn: dict[str, list[misses_lib.MissFinding]] = {}
    for f in r.findings:
        by_fn.setdefault(f.name or f.function, []).append(f)
    for fn, items in by_fn.items():
        stdout.print(table(f"{fn}", ["bucket", "why", "misses"],
                           [(f.bucket, f.message, f.misses) for f in items[:_SHOW]], justify_right=["misses"]))
        if len(items) > _SHOW:
            stdout.print(f"... and {len(items) - _SHOW} more (--json lists all)")
    if r.uncacheable_functions:
        names = ", ".join(f"{k} ({v})" for k, v in sorted(r.uncacheable_functions.items()))
        stdout.print(f"uncacheable, counted apart (JAX never writes programs that compile in under a "
                     f"second or use host callbacks; jit_stage comes from jnp.asarray(numpy)): {names}",
                     highlight=False)
    if r.ok:
        stdout.print("nothing missed", highlight=False)


@click.command("misses")
@click.option("--since", default="1h", show_default=True, metavar="DUR", help="Telemetry window, e.g. 24h.")
@click.option("--function", metavar="F", help="One function: its manifest name or JAX module name.")
@click.option("--manifest", metavar="M", type=click.Path(dir_okay=False),
              help="Explain against this manifest (default: the latest warm run's manifest).")
@json_option
@click.pass_obj
def misses(ctx: Context, since: str, function: str | None, manifest: str | None, as_json: bool) -> None:
    """Every program signature services missed, each with the nearest warmed bucket and the fields
    that differ (exit 1 when something missed).

    \b
    cachectl misses --since 24h
    cachectl misses --manifest examples/manifest.yaml --json
    """
    report = misses_lib.misses(ctx, since=parse_duration(since), function=function, manifest=manifest)
    emit(report, as_json, _print_misses)
    if not report.ok:
        click.get_current_context().exit(1)


def register(cli: click.Group) -> None:
    cli.add_command(misses)
