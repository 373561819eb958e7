"""The one way cachectl prints results: rich tables for people, JSON for scripts."""

from __future__ import annotations

import dataclasses
import enum
import json
import sys
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from cachectl.units import format_size

stdout = Console(soft_wrap=True)
stderr = Console(stderr=True, soft_wrap=True)

json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")


def to_jsonable(obj: Any) -> Any:
    """Dataclasses, datetimes, enums and paths as plain JSON values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        data = {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        for name in getattr(obj, "__json_extra__", ()):
            data[name] = to_jsonable(getattr(obj, name))
        return data
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, datetime):
        return obj.isoformat()
    if isinstance(obj, timedelta):
        return obj.total_seconds()
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, Path):
        return str(obj)
    return obj


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(to_jsonable(obj), indent=2, sort_keys=False) + "\n")


def table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]],
          justify_right: Sequence[str] = ()) -> Table:
    t = Table(title=title, title_justify="left", header_style="bold")
    for col in columns:
        t.add_column(col, justify="right" if col in justify_right else "left", overflow="fold")
    for row in rows:
        t.add_row(*("-" if v is None else str(v) for v in row))
    return t


def emit(result: Any, as_json: bool, human: Callable[[Any], None]) -> None:
    """Print ``result`` as JSON or through its human renderer."""
    if as_json:
        print_json(result)
    else:
        human(result)


def when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M") if value else "-"


def size(value: int | None) -> str:
    return format_size(value)


def info(message: str) -> None:
    stderr.print(message, highlight=False)
