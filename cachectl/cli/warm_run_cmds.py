"""`cachectl warm-run`: warm what a library jits privately, by running the user's command."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from cachectl.cli.render import emit, key, size, stdout, table
from cachectl.core.errors import OperationFailed
from cachectl.core.jax_seam import host_callbacks_cause

if TYPE_CHECKING:
    from cachectl.context import Context
    from cachectl.warm.by_running import RunWarmReport


def _print_run(report: RunWarmReport) -> None:
    rows = [
        (
            e.module,
            key(e.key),
            e.status,
            size(e.bytes),
            e.error or "",
        )
        for e in report.entries
    ]
    if rows:
        stdout.print(
            table(
                f"programs written to {report.namespace}",
                ["program", "key", "status", "bytes", "error"],
                rows,
                justify_right=("bytes",),
            )
        )
    stdout.print(
        f"{report.written} program(s) written and indexed ({report.known_before} already in the "
        f"namespace); the command exited {report.exit_code} after {report.seconds:.1f}s "
        f"(warm run {report.run_id})",
        highlight=False,
    )
    if report.host_callbacks:
        stdout.print(f"not written: {host_callbacks_cause(report.host_callbacks)}", highlight=False)
    if report.unclaimed:
        stdout.print(
            f"not claimed: {len(report.unclaimed)} file(s) new to the namespace that no process "
            "of the command reported writing (another writer's, or a process without cachectl's "
            "hook) and nothing indexed; left as they are, `cachectl verify` names them "
            "unknown-writer",
            highlight=False,
        )


def _failure(report: RunWarmReport) -> OperationFailed:
    if report.exit_code != 0:
        return OperationFailed(f"the command exited {report.exit_code}; what it wrote is indexed")
    if report.unseen:
        return OperationFailed(
            f"{len(report.unclaimed)} file(s) appeared in the namespace and no process of the "
            "command reported to cachectl (not Python, or Python run with -I or -S): none is "
            "claimed or indexed; run the command's Python without -I/-S"
        )
    foreign = [e.key for e in report.entries if e.status == "foreign"]
    if foreign:
        return OperationFailed(
            f"{len(foreign)} file(s) at keys the command wrote hold other bytes than it wrote "
            f"(another writer's, e.g. {foreign[0]}): not indexed; `cachectl verify` names them"
        )
    refused = sum(e.status != "written" for e in report.entries)
    if refused:
        return OperationFailed(
            f"{refused} program(s) written by the command were refused and removed"
        )
    missed = report.requests - report.hits
    why = (
        host_callbacks_cause(report.host_callbacks)
        if report.host_callbacks
        else "see the warnings JAX printed"
    )
    return OperationFailed(
        f"nothing could be written: the command compiled {missed} program(s) and JAX wrote "
        f"none of them; {why}"
    )


@click.command(
    "warm-run",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option("--cache", "cache_name", metavar="NAME", help="Cache to fill (default: --cache).")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the report as JSON (the command's stdout goes to stderr).",
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_obj
def warm_run_cmd(
    ctx: Context, cache_name: str | None, as_json: bool, command: tuple[str, ...]
) -> None:
    """Run COMMAND with writes on into this environment's namespace, then index what it compiled.

    For programs no manifest can name: a library's private jit (Keras's
    model.predict, NumPyro's MCMC.run). Every program is written, whatever its
    compile time (a service writes none under JAX's one-second minimum).

    \b
    cachectl warm-run -- python warmup.py
    cachectl warm-run --json -- python -m mypkg.warmup > report.json
    """
    from cachectl.warm.by_running import warm_by_running

    report = warm_by_running(
        ctx, command, cache=cache_name, child_stdout=sys.stderr if as_json else None
    )
    emit(report, as_json, _print_run, failure=_failure)


def register(cli: click.Group) -> None:
    cli.add_command(warm_run_cmd)
