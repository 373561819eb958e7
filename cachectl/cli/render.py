"""The one way cachectl prints results: rich tables for people, JSON for scripts."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import click

from cachectl.core.errors import CachectlError, ProblemsReported
from cachectl.core.units import format_size

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, RenderResult
    from rich.table import Table


class _LazyConsole:
    """A rich Console made on first use: importing rich is a visible part of a command's start, which ``--help`` and a
    command's option errors never need (issue: every command answers fast)."""

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._console: Console | None = None

    def real(self) -> Console:
        """The Console itself, for code that uses it as a context manager (rich's Progress and
        Live do ``with console:``): special methods are looked up on the type, never forwarded by
        ``__getattr__``, so the proxy itself would crash there."""
        if self._console is None:
            from rich.console import Console

            self._console = Console(**self._options)
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real(), name)


stdout: Console = _LazyConsole(soft_wrap=True)  # type: ignore[assignment]
stderr: Console = _LazyConsole(stderr=True, soft_wrap=True)  # type: ignore[assignment]

json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")


def real_console(console: Console) -> Console:
    """The rich Console behind ``stdout``/``stderr`` (made now if it was not yet)."""
    return console.real() if isinstance(console, _LazyConsole) else console


def print_json(obj: Any) -> None:
    """The wire format (cachectl.core.jsonable); a report with its own ``to_json`` (warm's) uses that."""
    from cachectl.core.jsonable import dumps_indented, to_jsonable

    data = obj.to_json() if callable(getattr(obj, "to_json", None)) else to_jsonable(obj)
    sys.stdout.write(dumps_indented(data) + "\n")


def table(
    title: str | None,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    justify_right: Sequence[str] = (),
) -> WholeCellTable:
    from rich.table import Table

    t = Table(title_justify="left", header_style="bold")
    for col in columns:
        t.add_column(col, justify="right" if col in justify_right else "left", overflow="fold")
    for row in rows:
        t.add_row(*("-" if v is None else str(v) for v in row))
    return WholeCellTable(title, t)


# Wide enough for any row a command prints; only a bound for measuring, never padded to.
_UNBOUNDED = 1_000_000


class WholeCellTable:
    """A rich table that, when stdout is not a terminal (a pipe, a log file), is as wide as its
    widest row: keys, digests, paths and bucket labels stay whole on one line, whatever
    COLUMNS says, so logs can be grepped. On a terminal it fits the window as rich does."""

    def __init__(self, title: str | None, table: Table) -> None:
        self.title = title
        self.table = table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if console.is_terminal:
            self.table.title = self.title
            yield self.table
            return
        self.table.title = None  # rich wraps a title to the table's width: print it on its own line
        title = (
            console.render_str(self.title, style="table.title", highlight=False)
            if self.title
            else None
        )
        from rich.measure import Measurement

        width = Measurement.get(console, options.update_width(_UNBOUNDED), self.table).maximum
        if title is not None:
            width = max(width, title.cell_len)
        wide = options.update(width=width, no_wrap=True, overflow="ignore")
        if title is not None:
            yield from console.render(title, wide)
        yield from console.render(self.table, wide)


def escape(text: str) -> str:
    """``text`` with rich markup escaped: printed as written, brackets and all."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def shortened(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters with an ellipsis on a terminal; whole in a pipe or log,
    where it must stay greppable (and copyable into the next command)."""
    if len(text) <= width or not stdout.is_terminal:
        return text
    return text[:width] + "…"


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
    return value.strftime("%Y-%m-%d %H:%M") if value else "-"


def size(value: int | None) -> str:
    return format_size(value)


def info(message: str) -> None:
    stderr.print(message, highlight=False)
