"""How `cachectl warm` and `cachectl warm-check` print: their tables, summaries and progress.

Apart from warm_cmds.py so that module holds the commands alone; like it, nothing here
imports the warm stack (the reports' types only when type checking).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from cachectl.cli.render import (
    Styled,
    escape,
    key,
    real_console,
    size,
    stderr,
    stdout,
    table,
    unproven_because,
)
from cachectl.core.jax_seam import host_callbacks_cause
from cachectl.core.units import format_size

if TYPE_CHECKING:
    from cachectl.warm import CheckReport, WarmReport

_STATUS_STYLE = {
    "compiled": "green",
    "cached": "cyan",
    "hit": "green",
    "equal": "green",
}  # cachectl.warm.reports


def plain(values: dict[str, Any]) -> str:
    """``batch=4,seq=64``: a bucket's values as the progress lines and errors name them."""
    return ",".join(f"{k}={v}" for k, v in values.items())


def named(bucket: Any) -> str:
    """``fn[batch=4]``: a bucket by name."""
    return f"{bucket.function}[{plain(bucket.bucket)}]"


def _bucket_text(values: dict[str, Any]) -> str:
    return plain(values) or "-"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _styled(status: str) -> Styled | str:
    style = _STATUS_STYLE.get(
        status, "red" if status in ("failed", "too-large", "miss", "differs", "not-run") else ""
    )
    return Styled(status, style) if style else status


def print_warm(report: WarmReport, logged: bool = False) -> None:
    """The human report of a warm: its buckets (or its plan, with --dry-run) and a summary.

    Each bucket is printed once: when ``Progress`` ``logged`` a line per bucket (not a
    terminal), the summary alone follows; after the terminal's transient bar, the table."""
    if report.dry_run:
        rows: list[tuple[str | Styled, ...]] = [
            (b.function, _bucket_text(b.bucket)) for b in report.buckets
        ]
        stdout.print(
            table(
                f"warm --dry-run: {len(rows)} bucket(s) for {report.namespace}",
                ["function", "bucket"],
                rows,
            )
        )
        if report.target_problems:
            stdout.print(
                "target: [red]does not match[/red]: " + escape("; ".join(report.target_problems)),
                markup=True,
            )
        else:
            stdout.print("target: matches this machine")
        return
    if not logged:
        _print_bucket_table(report)
    _print_summary(report)


def _print_bucket_table(report: WarmReport) -> None:
    rows = [
        (
            b.function,
            _bucket_text(b.bucket),
            _styled(b.status),
            key(b.key),
            _seconds(b.compile_seconds),
            size(b.bytes),
            size(b.aot_bytes),
            b.error or b.aot_error or "",
        )
        for b in report.buckets
    ]
    stdout.print(
        table(
            f"warm {report.manifest} -> {report.namespace}",
            ["function", "bucket", "status", "key", "compile s", "size", "aot", "error"],
            rows,
            justify_right=("compile s", "size", "aot"),
            keep=("bucket", "status", "key"),
            optional=("aot", "size", "compile s"),
        )
    )


def _print_summary(report: WarmReport) -> None:
    s = report.summary
    aot_bytes = sum(b.aot_bytes or 0 for b in report.buckets)
    stdout.print(
        f"{s.buckets} bucket(s): {s.compiled} compiled, {s.cached} cached, {s.failed} failed; "
        f"compile {s.compile_seconds:.1f}s, wall {s.wall_seconds:.1f}s "
        f"({report.jobs} {report.executor} job(s), warm run {report.run_id}{_retried(s)}); "
        f"{report.executables} stored executable(s), {format_size(aot_bytes)}; "
        f"{_mode(report.environment)}",
        highlight=False,
    )
    if report.side_programs:
        names = ", ".join(sorted(set(report.side_programs)))
        stdout.print(
            f"also indexed {len(report.side_programs)} program(s) JAX wrote while tracing, "
            f"run eagerly by the functions: {names}",
            highlight=False,
        )
    if s.buckets and s.cached == s.buckets:
        stdout.print(
            "every bucket was cached already: none was compiled or loaded, but each was lowered, "
            "since JAX's key is a hash of the lowered program and only lowering shows that "
            "nothing it depends on changed",
            highlight=False,
        )


def _mode(environment: dict[str, Any]) -> str:
    """The mode the programs were compiled in (a service of the other mode reads another
    namespace): x64, and on CPU the instruction set XLA targeted."""
    x64 = "x64 on" if environment.get("enable_x64") else "x64 off"
    isa = environment.get("cpu_isa")
    return f"{x64}, CPU {isa}" if isa else x64


def _retried(summary: Any) -> str:
    """', 2 retried alone after failing among threads', or nothing."""
    n = summary.retried_alone
    return f", {n} retried alone after failing among threads" if n else ""


def print_check(report: CheckReport, manifest: str = "MANIFEST") -> None:
    """The human report of warm-check: each bucket's hit or miss, the coverage, and the proof
    recorded (not proven: why, and the command that proves it)."""
    canary = any(b.canary is not None for b in report.buckets)
    rows = [
        (
            b.function,
            _bucket_text(b.bucket),
            _styled(b.status),
            key(b.key),
            _seconds(b.seconds),
            b.aot or "-",
            *((b.canary or "-",) if canary else ()),
            b.error or "",
        )
        for b in report.buckets
    ]
    columns = ["function", "bucket", "status", "key", "load s", "executable"]
    stdout.print(
        table(
            f"coverage of {report.namespace} (fresh read-only process)",
            [*columns, *(["canary"] if canary else []), "error"],
            rows,
            justify_right=("load s",),
            keep=("bucket", "status", "key"),
            optional=("load s", "executable"),
        )
    )
    s = report.summary
    failed = f"; {s.aot_failed} raised or crashed when called" if s.aot_failed else ""
    if report.not_called:
        failed += f"; {len(report.not_called)} loaded but not called"
    if report.refused:
        failed += f"; {len(report.refused)} stored but refused (a service would trace them)"
    stdout.print(
        f"coverage: {report.hits}/{len(report.buckets)} buckets hit ({report.coverage:.1f}%); "
        f"stored executables: {s.aot_ran}/{len(report.buckets)} load and run "
        f"({report.aot_coverage:.1f}%){failed}",
        highlight=False,
    )
    if report.closest:
        stdout.print(report.closest, highlight=False)
    if report.unusable:
        where = "marked unusable in the index" if report.mark_error is None else "NOT marked"
        note = "" if report.mark_error is None else f" ({report.mark_error})"
        stdout.print(
            f"{where}{note}: cachectl.serving serves "
            + ", ".join(named(b) for b in report.unusable)
            + " through jax.jit",
            highlight=False,
        )
    if canary:
        stdout.print(
            f"canary: {report.summary.canary_equal}/{len(report.buckets)} stored executables "
            "give the outputs of a compile here (exact equality: same backend)",
            highlight=False,
        )
    if report.padding is not None:
        print_padding(report.padding)
    if report.proof is not None and report.proof_error is None:
        proof = report.proof
        verdict = "proven" if proof.proven else "not proven"
        why = "" if proof.proven else ": " + "; ".join(unproven_because(proof))
        stdout.print(
            f"recorded in the index: {verdict} on {proof.devices} "
            f"({proof.host}, {proof.machine_digest[:16]}){why}",
        )
        if proof.hits < proof.buckets and not report.closest:  # else the fix is said above
            stdout.print(f"to prove it: cachectl warm {manifest}, then this check again")
        elif not proof.proven and proof.canary.startswith("not run (--canary"):
            stdout.print(
                f"to prove it: cachectl warm-check {manifest} --canary (compiles each bucket "
                "here once more and compares its outputs with the stored executable's)"
            )
    elif report.proof_error is not None:
        stdout.print(f"proof {report.proof_error}", highlight=False)


def _where(f: Any) -> str:
    """'seq 33 -> 64 (batch=2,seq=64)': the raw size and the bucket it was padded to."""
    if f.axis is None or f.bucket is None:
        return "-"
    return f"{f.axis} {f.raw} -> {f.bucket[f.axis]} ({plain(f.bucket)})"


def _tolerance(leaf: Any) -> str:
    return (
        "exact" if leaf.rtol == 0 and leaf.atol == 0 else f"rtol {leaf.rtol:g}, atol {leaf.atol:g}"
    )


def _leaf_note(f: Any, leaf: Any, n: int) -> str:
    said = [f.note] if n == 0 and f.note else []
    if not leaf.judged:
        said.append("outputs: null, not judged")
    if leaf.uncut:
        said.append("compared uncut")
    return "; ".join(said)


def print_padding(padding: Any) -> None:
    """warm-check --padding: each function's largest difference, per output leaf, where."""
    rows: list[tuple[str | Styled, ...]] = []
    for f in padding.functions:
        if not f.leaves:
            diff = "-" if f.max_abs is None else f"{f.max_abs:.3g}"
            rows.append(
                (
                    f.function,
                    _styled(f.status),
                    str(f.samples),
                    "-",
                    diff,
                    _where(f),
                    "-",
                    f.note or "",
                )
            )
            continue
        for n, leaf in enumerate(f.leaves):
            rows.append(
                (
                    f.function if n == 0 else "",
                    _styled(f.status) if n == 0 else "",
                    str(f.samples) if n == 0 else "",
                    f"{leaf.leaf} {leaf.dtype}",
                    f"{leaf.max_abs:.3g}" + ("" if leaf.ok else " > tol"),
                    _where(leaf),
                    _tolerance(leaf),
                    _leaf_note(f, leaf, n),
                )
            )
    stdout.print(
        table(
            "padding: stored executables on padded inputs against jax.jit at the raw shape",
            [
                "function",
                "padding",
                "sizes",
                "output",
                "largest diff",
                "where",
                "tolerance",
                "note",
            ],
            rows,
            justify_right=("sizes", "largest diff"),
            keep=("padding",),
            optional=("tolerance",),
        )
    )
    counts = {s: sum(f.status == s for f in padding.functions) for s in _PADDING_STATES}
    stdout.print(
        "padding: "
        + ", ".join(f"{n} {s}" for s, n in counts.items() if n or s == "equal")
        + f" of {len(padding.functions)} function(s)",
        highlight=False,
    )


_PADDING_STATES = ("equal", "differs", "not-run", "skipped")


def padding_failure(padding: Any) -> str:
    """Exit 1's line: the functions whose padded answers differ (by axis) or were not compared."""
    differ, unproven = [], []
    for f in padding.failed:
        axes = ", ".join(f.axes) or "?"
        if f.status == "differs":
            size = "" if f.max_abs is None else f" by up to {f.max_abs:.3g}"
            where = "" if f.bucket is None else f" (bucket {plain(f.bucket)}, {f.axis}={f.raw})"
            differ.append(f"{f.function} along axis {axes}{size}{where}")
        else:
            unproven.append(f"{f.function} along axis {axes}: {f.note}")
    said = ["padding changes the answer of " + "; ".join(differ)] if differ else []
    if unproven:
        said.append("padding not compared for " + "; ".join(unproven))
    return "; ".join(said)


class Progress:
    """Progress on stderr: a rich bar on a terminal; in a log (a pipe, a CI job) one line per bucket.

    A line names the bucket, its status and its seconds (lowering + compiling), and is
    flushed at once, so a CI log shows how far a long warm got; stdout (``--json``) is untouched.
    """

    def __init__(self, enabled: bool, terminal: bool) -> None:
        self.enabled = enabled
        self.logged = False  # a line per bucket was printed: the report leaves out its table
        self.bar: Any = None
        self.task: Any = None
        if enabled and terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self.bar = Progress(
                TextColumn("warm"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                console=real_console(stderr),
                transient=True,
            )

    def __enter__(self) -> Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def __call__(self, result: Any, done: int, total: int) -> None:
        if not self.enabled:
            return
        label = f"{result.function}[{plain(result.bucket)}] {result.status}"
        if self.bar is None:
            self.logged = True
            click.echo(
                f"warm {done}/{total} {label} {_bucket_seconds(result)}{_what(result)}", err=True
            )
            return
        if self.task is None:
            self.task = self.bar.add_task("", total=total)
        self.bar.update(self.task, completed=done, description=escape(label))


def _what(result: Any) -> str:
    """What the table's row would add to a progress line: key, sizes, error."""
    parts = []
    if result.key:
        parts.append(f"key {result.key.rsplit('-', 1)[-1][:12]}")
    if result.bytes is not None:
        parts.append(
            size(result.bytes) + (f" + {size(result.aot_bytes)} aot" if result.aot_bytes else "")
        )
    text = f" ({', '.join(parts)})" if parts else ""
    error = result.error or result.aot_error
    return f"{text}: {error}" if error else text


def _bucket_seconds(result: Any) -> str:
    """'1.23s' spent on one bucket (lowering + compiling), '-' when it never got that far."""
    if result.compile_seconds is None and result.lower_seconds is None:
        return "-"
    return f"{(result.lower_seconds or 0.0) + (result.compile_seconds or 0.0):.2f}s"


def print_replay(r: Any) -> None:
    """The human report of warm-check --replay: the command's exit and its cache hits."""
    rate = "-" if r.hit_rate is None else f"{r.hit_rate:.1%}"
    stdout.print(
        f"replayed warm run {r.run_id} read-only: {' '.join(r.command)} (in "
        f"{r.cwd}) exited {r.exit_code} after {r.seconds:.1f}s\n"
        f"cache hits: {r.hits}/{r.requests} compile requests ({rate}) in {r.processes} JAX "
        "process(es)",
        highlight=False,
    )
    if r.host_callbacks:
        stdout.print(f"not cacheable: {host_callbacks_cause(r.host_callbacks)}", highlight=False)
