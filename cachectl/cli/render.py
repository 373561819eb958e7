"""The one way cachectl prints results: rich tables for people, JSON for scripts."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from cachectl.errors import CachectlError, ProblemsReported
from cachectl.jsonable import to_jsonable
from cachectl.units import format_size

stdout = Console(soft_wrap=True)
stderr = Console(stderr=True, soft_wrap=True)

json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")


def print_json(obj: Any) -> None:
    """The wire format (cachectl.jsonable); a report with its own ``to_json`` (warm's) uses that."""
    data = obj.to_json() if callable(getattr(obj, "to_json", None)) else to_jsonable(obj)
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")


def table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]],
          justify_right: Sequence[str] = ()) -> Table:
    t = Table(title=title, title_justify="left", header_style="bold")
    for col in columns:
        t.add_column(col, justify="right" if col in justify_right else "left", overflow="fold")
    for row in rows:
        t.add_row(*("-" if v is None else str(v) for v in row))
    return t


def emit(result: Any, as_json: bool, human: Callable[[Any], None], *,
         failure: Callable[[Any], CachectlError] | None = None) -> None:
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
