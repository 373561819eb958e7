"""The one way cachectl prints results: rich tables for people, JSON for scripts."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import click

from cachectl.core.errors import CachectlError, ProblemsReported
from cachectl.core.units import format_size

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, RenderResult
    from rich.table import Table

    from cachectl.core.records import Proof


def _fits(console: Console) -> bool:
    """Whether output on ``console`` has a width to fit: a terminal, or a pipe with COLUMNS set.
    A pipe or log with no COLUMNS has none: its lines stay whole, so they can be grepped."""
    return console.is_terminal or "COLUMNS" in os.environ


class _LazyConsole:
    """A rich Console made on first use: importing rich is a visible part of a command's start, which ``--help`` and a
    command's option errors never need (issue: every command answers fast).

    Its prose wraps at the width when there is one (``_fits``), and is never wrapped otherwise.
    """

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._console: Console | None = None

    def real(self) -> Console:
        """The Console itself, for code that uses it as a context manager (rich's Progress and
        Live do ``with console:``): special methods are looked up on the type, never forwarded by
        ``__getattr__``, so the proxy itself would crash there."""
        if self._console is None:
            from rich.console import Console

            class _Fitting(Console):
                @property
                def soft_wrap(self) -> bool:
                    return _wide[0] or not _fits(self)

                @soft_wrap.setter
                def soft_wrap(self, _value: bool) -> None:
                    pass

            self._console = _Fitting(**self._options)
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real(), name)


# Markup off: a message prints as written, brackets and all (``pip install 'cachectl-jax[tpu]'``);
# a print that means markup says so (markup=True, its values through ``escape``).
stdout: Console = _LazyConsole(markup=False, highlight=False)  # type: ignore[assignment]
stderr: Console = _LazyConsole(stderr=True, markup=False, highlight=False)  # type: ignore[assignment]

json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")

_wide = [False]  # --wide was given (one command per process)


def want_wide(_ctx: click.Context | None = None, _param: object = None, value: bool = True) -> bool:
    """``--wide``'s callback (a command's own option, or the global one); False: a new command."""
    _wide[0] = value or (_ctx is not None and _wide[0])
    return value


WIDE_HELP = "Whole digests, keys and paths: tables as wide as their widest row."
wide_option = click.option(
    "--wide", is_flag=True, expose_value=False, callback=want_wide, help=WIDE_HELP
)


def whole() -> bool:
    """Whether tables show whole values on one line each: with --wide, or on stdout with no
    width to fit (a pipe or log with no COLUMNS, read by grep). Else they fit the width, with
    digests and keys shortened (--json always has them whole)."""
    return _wide[0] or not _fits(stdout)


def digest(value: str | None) -> str:
    """An environment's digest: its 12-character prefix (what --env takes), or whole (``whole``)."""
    if not value:
        return "-"
    return value if whole() else value[:12]


def key(value: str | None) -> str:
    """A cache key (``jit_fn-<hash>``): the first 12 characters of its hash, or whole (``whole``)."""
    if not value:
        return "-"
    return value if whole() else value.rsplit("-", 1)[-1][:12]


def real_console(console: Console) -> Console:
    """The rich Console behind ``stdout``/``stderr`` (made now if it was not yet)."""
    return console.real() if isinstance(console, _LazyConsole) else console


def print_json(obj: Any) -> None:
    """The wire format (cachectl.core.jsonable); a report with its own ``to_json`` (warm's) uses that."""
    from cachectl.core.jsonable import dumps_indented, to_jsonable

    data = obj.to_json() if callable(getattr(obj, "to_json", None)) else to_jsonable(obj)
    sys.stdout.write(dumps_indented(data) + "\n")


@dataclass(frozen=True)
class Styled:
    """A table cell in a rich style (``"green"``); any other cell prints as written."""

    text: str
    style: str


def table(
    title: str | None,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    justify_right: Sequence[str] = (),
    keep: Sequence[str] = (),
    optional: Sequence[str] = (),
) -> WholeCellTable:
    """A table of ``rows`` under ``title``. Cells of the ``keep`` columns (digests, keys, dates)
    and the ``justify_right`` ones (numbers) are never broken; the others wrap when the table
    must fit a width. There, the ``optional`` columns are left out, in that order, while the
    table would not fit otherwise (--wide shows them), and so is a column with every cell empty."""
    return WholeCellTable(
        title,
        [
            _Column(c, right=c in justify_right, keep=c in keep or c in justify_right)
            for c in columns
        ],
        [
            ["-" if v is None else v if isinstance(v, Styled) else str(v) for v in row]
            for row in rows
        ],
        [c for c in optional if c in columns],
    )


@dataclass(frozen=True)
class _Column:
    name: str
    right: bool
    keep: bool


# Wide enough for any row a command prints; only a bound for measuring, never padded to.
_UNBOUNDED = 1_000_000
# The narrowest a wrapping column is made (fewer characters than this: a column of fragments).
_WRAP_FLOOR = 12


class WholeCellTable:
    """A table printed under its title. Where there is a width to fit (a terminal, or COLUMNS)
    and no --wide, it fits it: optional columns left out (said below it), wrapping columns
    narrowed, never a kept one. Else (--wide, or a pipe or log with no COLUMNS) it is as wide
    as its widest row: keys, digests, paths and bucket labels stay whole on one line, for grep."""

    def __init__(
        self,
        title: str | None,
        columns: list[_Column],
        rows: list[list[str | Styled]],
        optional: list[str],
    ) -> None:
        self.title = title
        self.columns = columns
        self.rows = rows
        self.optional = optional

    def _table(
        self, shown: Sequence[int], widths: dict[int, int] | None = None, rows: bool = True
    ) -> Table:
        from rich import box
        from rich.table import Table
        from rich.text import Text

        t = Table(
            box=box.SIMPLE_HEAD,
            pad_edge=False,
            show_edge=False,
            padding=(0, 1, 0, 0),
            header_style="bold",
        )
        for i in shown:
            c = self.columns[i]
            t.add_column(
                c.name,
                justify="right" if c.right else "left",
                overflow="fold",
                no_wrap=c.keep,
                width=(widths or {}).get(i),
            )
        for row in self.rows if rows else ():
            t.add_row(
                *(
                    Text(c.text, style=c.style) if isinstance(c, Styled) else Text(c)
                    for c in (row[i] for i in shown)
                )
            )
        return t

    def _fitted(self, console: Console, width: int) -> tuple[Table, list[str]]:
        """The table that fits ``width``, and the names of the columns left out of it."""
        from rich.cells import cell_len
        from rich.measure import Measurement

        def cells(cell: str | Styled) -> int:
            return cell_len(cell.text if isinstance(cell, Styled) else cell)

        shown = list(range(len(self.columns)))
        nat = {
            i: max(cells(c) for c in [self.columns[i].name, *(row[i] for row in self.rows)])
            for i in shown
        }
        unbounded = console.options.update_width(_UNBOUNDED)

        def overhead(cols: list[int]) -> int:  # the borders and padding: a header-only table's
            bare = Measurement.get(console, unbounded, self._table(cols, rows=False)).maximum
            return bare - sum(cells(self.columns[i].name) for i in cols)

        def floor(i: int) -> int:
            return nat[i] if self.columns[i].keep else min(nat[i], _WRAP_FLOOR)

        def need(cols: list[int], size: Callable[[int], int]) -> int:
            return sum(size(i) for i in cols) + overhead(cols)

        # A column with nothing in it (no bucket failed: the error column) says nothing.
        shown = [i for i in shown if any(cells(row[i]) for row in self.rows) or not self.rows]
        dropped: list[str] = []
        for name in self.optional:
            if need(shown, floor) <= width:
                break
            shown = [i for i in shown if self.columns[i].name != name]
            dropped.append(name)
        if need(shown, nat.__getitem__) <= width:
            return self._table(shown), dropped
        # Wrapping columns share what the kept ones leave, each at least its floor.
        wrapping = [i for i in shown if not self.columns[i].keep]
        widths = {i: floor(i) for i in wrapping}
        spare = width - need(shown, floor)
        while spare > 0:
            short = [i for i in wrapping if widths[i] < nat[i]]
            if not short:
                break
            for i in short[:spare]:
                widths[i] += 1
            spare -= len(short[:spare])
        return self._table(shown, widths), dropped

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        # The title on its own line: rich would wrap it to the table's width.
        title = (
            console.render_str(self.title, style="table.title", markup=False, highlight=False)
            if self.title
            else None
        )
        if not whole():
            table, dropped = self._fitted(console, options.max_width)
            if title is not None:
                yield title
            yield table
            if dropped:
                yield console.render_str(
                    f"(left out to fit {options.max_width} columns: {', '.join(dropped)};"
                    " --wide shows them)",
                    style="dim",
                    markup=False,
                    highlight=False,
                )
            return
        from rich.measure import Measurement

        table = self._table(range(len(self.columns)))
        width = Measurement.get(console, options.update_width(_UNBOUNDED), table).maximum
        if title is not None:
            width = max(width, title.cell_len)
        wide = options.update(width=width, no_wrap=True, overflow="ignore")
        if title is not None:
            yield from console.render(title, wide)
        yield from console.render(table, wide)


def escape(text: str) -> str:
    """``text`` with rich markup escaped: printed as written, brackets and all."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def emit(
    result: Any,
    as_json: bool,
    human: Callable[[Any], None],
    *,
    failure: Callable[[Any], CachectlError] | None = None,
) -> None:
    """Print ``result`` as JSON or through its human renderer; then a result that is not ``ok`` fails.

    Its error is ``failure(result)``, by default ProblemsReported (exit 1: the result has
    shown its problems); cachectl.cli.CachectlGroup turns it into the exit code.
    """
    if as_json:
        print_json(result)
    else:
        human(result)
    if not getattr(result, "ok", True):
        raise (failure or _reported)(result)


def _reported(_result: Any) -> CachectlError:
    return ProblemsReported()


def when(value: datetime | None) -> str:
    """A time to the minute; this year's without the year where tables fit a width (``whole``)."""
    if not value:
        return "-"
    if not whole() and value.year == datetime.now(value.tzinfo).year:
        return value.strftime("%m-%d %H:%M")
    return value.strftime("%Y-%m-%d %H:%M")


def size(value: int | None) -> str:
    return format_size(value)


def unproven_because(proof: Proof) -> list[str]:
    """Why a warm-check's proof is not proven: "10/11 hit", "canary not run (...)", ..."""
    why = []
    if proof.hits < proof.buckets:
        why.append(f"{proof.hits}/{proof.buckets} hit")
    if proof.executables_called < proof.buckets:
        why.append(f"{proof.executables_called}/{proof.buckets} executables ran")
    if proof.canary != "equal":
        why.append(f"canary {proof.canary}")
    return why


def info(message: str) -> None:
    stderr.print(message, highlight=False)
