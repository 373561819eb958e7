"""`cachectl misses` and `cachectl advise`: what the service really called, against the manifest.

Exit codes: misses 1 when any compile request missed, 0 when none did (the text then says
"nothing missed"); advise 0 (2 on bad input, nothing written).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from cachectl.cli.render import emit, json_option, stdout, table, whole
from cachectl.core.units import parse_duration

if TYPE_CHECKING:
    from cachectl.context import Context
    from cachectl.usage import advise as advise_lib
    from cachectl.usage import misses as misses_lib

# cachectl.usage.misses and cachectl.usage.advise (NumPy, pydantic, the index) are imported by the command
# bodies when they run, never at import: `cachectl misses --help` stays cheap.

_SHOW = 50


def _print_misses(r: misses_lib.MissesReport) -> None:
    stdout.print(
        f"cache {r.cache}: {r.signatures} signatures, {r.requests} compile requests, {r.hits} hits, "
        f"{r.misses} misses, {r.uncacheable} not cacheable since {r.since:%Y-%m-%d %H:%M} UTC"
        + (
            f"; manifests {', '.join(r.manifests)} (each function against the one that warmed it)"
            if len(r.manifests) > 1
            else f"; manifest {r.manifest}"
            if r.manifest
            else "; no manifest (warm one, or --manifest)"
        ),
        highlight=False,
    )
    if r.coverage is not None:
        stdout.print(
            f"coverage of the observed calls by the manifest: {r.coverage:.1%}", highlight=False
        )
    by_fn: dict[str, list[misses_lib.MissFinding]] = {}
    for f in r.findings:
        by_fn.setdefault(f.name or f.function, []).append(f)
    width = None if whole() else stdout.width
    for fn, items in by_fn.items():
        stdout.print(f"{fn}:", highlight=False)
        # One line per missed signature (its findings, one per argument and field, together);
        # the same line for several signatures is said once, with its total.
        grouped: dict[str, list[list[misses_lib.MissFinding]]] = {}
        for same_signature in _by_signature(items):
            grouped.setdefault(_signature_text(same_signature), []).append(same_signature)
        for text, signatures in list(grouped.items())[:_SHOW]:
            buckets = sorted({f.bucket for s in signatures for f in s if f.bucket})
            near = f" (nearest bucket [{buckets[0]}])" if len(buckets) == 1 else ""
            times = f", {len(signatures)} signatures" if len(signatures) > 1 else ""
            missed = sum(s[0].misses for s in signatures)
            clauses = f"{text}{near}".split("; ") + [f"{missed} missed{times}"]
            for line in _wrapped(clauses, width):
                stdout.print(line, highlight=False, markup=False, soft_wrap=True)
        if len(grouped) > _SHOW:
            stdout.print(f"... and {len(grouped) - _SHOW} more (--json lists all)")
    if r.uncacheable_functions:
        names = ", ".join(f"{k} ({v})" for k, v in sorted(r.uncacheable_functions.items()))
        stdout.print(
            "not cacheable, counted apart (JAX-internal staging programs: the eager dispatch of "
            f"one primitive, e.g. jit_stage from jnp.asarray(numpy)): {names}",
            highlight=False,
        )
    if r.host_callback_functions:
        names = ", ".join(f"{k} ({v})" for k, v in sorted(r.host_callback_functions.items()))
        stdout.print(
            f"not cacheable, counted apart ({r.host_callbacks_cause}): {names}", highlight=False
        )
    if r.ok:
        stdout.print("nothing missed", highlight=False)


def _by_signature(
    items: list[misses_lib.MissFinding],
) -> list[list[misses_lib.MissFinding]]:
    """A function's findings, those of one missed signature together (in order); a finding of
    no one signature (a whole function's) alone."""
    out: dict[object, list[misses_lib.MissFinding]] = {}
    for i, f in enumerate(items):
        out.setdefault(f.signature if f.signature is not None else i, []).append(f)
    return list(out.values())


def _signature_text(findings: list[misses_lib.MissFinding]) -> str:
    """One signature's findings as one text: arguments that differ the same way named together
    (``jit_f arg 0 (x), arg 1 (y): batch 3 not a bucket ...``), the function named once."""
    module = findings[0].function
    heads: dict[str, list[str]] = {}  # what differs -> the arguments it differs in
    for f in findings:
        head, sep, rest = f.message.partition(": ")
        if f.signature is None or not sep or not head.startswith(module):
            heads.setdefault(f.message, [])
            continue
        heads.setdefault(rest, []).append(head)
    parts = []
    for rest, where in heads.items():
        if not where:
            parts.append(rest)
            continue
        named = [where[0], *(w.removeprefix(f"{module} ") for w in where[1:])]
        parts.append(f"{', '.join(dict.fromkeys(named))}: {rest}")
    first, *others = parts
    return "; ".join([first, *(p.removeprefix(f"{module} ") for p in others)])


def _wrapped(clauses: list[str], width: int | None) -> list[str]:
    """``  a; b; c`` as lines that break only between clauses (never mid-phrase), continued
    with a deeper indent; one line where the output has no width."""
    lines: list[str] = []
    current = ""
    for clause in clauses:
        joined = f"{current}; {clause}" if current else clause
        indent = 2 if not lines else 4
        if current and width is not None and indent + len(joined) > width:
            lines.append(current)
            current = clause
        else:
            current = joined
    lines.append(current)
    return [("  " if i == 0 else "    ") + line for i, line in enumerate(lines)]


@click.command("misses")
@click.option(
    "--since", default="1h", show_default=True, metavar="DUR", help="Telemetry window, e.g. 24h."
)
@click.option("--function", metavar="F", help="One function: its manifest name or JAX module name.")
@click.option(
    "--manifest",
    metavar="M",
    type=click.Path(dir_okay=False),
    help="Explain against this manifest (default: each function against the manifest of the "
    "warm run that stored it; the latest warm run's for the rest).",
)
@json_option
@click.pass_obj
def misses(
    ctx: Context, since: str, function: str | None, manifest: str | None, as_json: bool
) -> None:
    """Every program signature services missed, each with the nearest warmed bucket and the fields
    that differ (exit 1 when something missed).

    \b
    cachectl misses --since 24h
    cachectl misses --manifest examples/manifest.yaml --json
    """
    from cachectl.usage import misses as misses_lib

    report = misses_lib.misses(
        ctx, since=parse_duration(since), function=function, manifest=manifest
    )
    emit(report, as_json, _print_misses)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _print_advise(r: advise_lib.AdviseReport) -> None:
    for f in r.functions:
        rows = [
            (
                a.axis,
                a.calls,
                a.source,
                _fmt(a.current.values),
                _pct(a.current.coverage),
                _pct(a.current.waste),
                _fmt(a.proposed.values),
                _pct(a.proposed.coverage),
                _pct(a.proposed.waste),
            )
            for a in f.axes
        ]
        stdout.print(
            table(
                f.function,
                [
                    "axis",
                    "calls",
                    "sizes from",
                    "current",
                    "coverage",
                    "waste",
                    "proposed",
                    "coverage",
                    "waste",
                ],
                rows,
                justify_right=["calls", "coverage", "waste"],
            )
        )
        cost = ""
        if f.compile_ms_per_program is not None:
            cost = (
                f", warm cost {f.warm_seconds_current:.1f}s -> {f.warm_seconds_proposed:.1f}s "
                f"({f.compile_ms_per_program:.0f} ms per program, measured at warm)"
            )
        stdout.print(
            f"programs to warm: {f.programs_current} -> {f.programs_proposed}{cost}",
            highlight=False,
        )
    for note in r.notes:
        stdout.print(f"note: {note}", highlight=False)
    if r.diff:
        stdout.print(r.diff, highlight=False, markup=False)
        stdout.print(
            f"{'wrote' if r.written else 'would write (--write)'} {r.manifest}", highlight=False
        )
    elif r.functions:
        stdout.print("the manifest's buckets are already the proposal", highlight=False)


def _fmt(values: list) -> str:
    return ", ".join(str(v) for v in values)


def _waste(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise click.BadParameter(f"expected a share such as 0.1 or 10%, got {text!r}") from None


@click.command("advise")
@click.argument("manifest", type=click.Path(dir_okay=False))
@click.option("--function", metavar="F", help="One function of the manifest.")
@click.option("--axis", metavar="A", help="One bucket axis.")
@click.option(
    "--max-buckets", type=int, metavar="N", help="Buckets per axis (default: as many as now)."
)
@click.option(
    "--max-waste",
    metavar="P",
    help="Fewest buckets whose mean padding waste is at most P (10%, 0.1).",
)
@click.option("--since", default="7d", show_default=True, metavar="DUR", help="Telemetry window.")
@click.option(
    "--write", is_flag=True, help="Rewrite the manifest's axis values in place (comments kept)."
)
@json_option
@click.pass_obj
def advise(
    ctx: Context,
    manifest: str,
    function: str | None,
    axis: str | None,
    max_buckets: int | None,
    max_waste: str | None,
    since: str,
    write: bool,
    as_json: bool,
) -> None:
    """Choose bucket values from the sizes services really called with: the least padding waste
    for N buckets (an exact dynamic program), or the fewest buckets within a waste bound.

    \b
    cachectl advise examples/manifest.yaml --max-buckets 4
    cachectl advise examples/manifest.yaml --axis seq --max-waste 10% --write
    """
    from cachectl.usage import advise as advise_lib

    report = advise_lib.advise(
        ctx,
        manifest,
        function=function,
        axis=axis,
        max_buckets=max_buckets,
        max_waste=_waste(max_waste),
        since=parse_duration(since),
        write=write,
    )
    emit(report, as_json, _print_advise)


def register(cli: click.Group) -> None:
    cli.add_command(misses)
    cli.add_command(advise)
