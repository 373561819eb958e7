"""pydantic errors -> one-line ``file:line: field: problem`` messages, all of a manifest's at once."""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any, Union, get_args, get_origin

from cachectl.core.errors import BadInput
from cachectl.manifest.schema import Manifest
from cachectl.manifest.source import Loc, Source, describe

if TYPE_CHECKING:
    from pydantic import ValidationError

MAX_PROBLEMS = 20  # listed per manifest; the rest are counted


def raise_problems(source: Source, problems: list[tuple[Loc, str]]) -> None:
    """Report every problem (up to MAX_PROBLEMS), one ``file:line: field: problem`` per line.

    One run shows everything to fix, not one at a time. Document order; a missing
    field goes last: it is usually the consequence of a misspelled one.
    """
    suggested = {
        loc[:-1] + (name,)
        for loc, problem in problems
        for name in re.findall(r"did you mean '([^']+)'", problem)
    }
    # "functons: unknown field (did you mean 'functions'?)" already says why functions is missing.
    problems = [(loc, p) for loc, p in problems if not (p == _MISSING and loc in suggested)]
    problems = sorted(problems, key=lambda p: (p[1] == _MISSING, source.line(p[0])))
    lines = list(dict.fromkeys(source.message(loc, problem) for loc, problem in problems))
    shown = lines[:MAX_PROBLEMS]
    more = len(lines) - len(shown)
    if more:
        shown.append(f"{source.name}: (and {more} more problem{'s' if more > 1 else ''})")
    raise BadInput("\n".join(shown))


_MISSING = "required field missing"
_FRIENDLY = {
    "dict_type": "expected a mapping",
    "dataclass_type": "expected a mapping",
    "list_type": "expected a list",
    "int_type": "expected an integer",
    "string_type": "expected a string",
    "bool_type": "expected true or false",
    "float_type": "expected a number",
}


def pydantic_problems(exc: ValidationError) -> Iterator[tuple[Loc, str]]:
    for err in exc.errors(include_url=False):
        loc: Loc = tuple(err["loc"])
        kind = err["type"]
        if kind in ("extra_forbidden", "unexpected_keyword_argument"):
            yield loc, _unknown_field(loc)
        elif kind == "missing":
            yield loc, _MISSING
        elif kind in ("value_error", "assertion_error"):
            yield loc, str(err["ctx"]["error"])
        elif kind == "too_short" and isinstance(err.get("input"), (list, dict)):
            yield loc, "must not be empty"
        elif kind in _FRIENDLY:
            yield loc, f"{_FRIENDLY[kind]}, got {describe(err.get('input'))}"
        else:
            msg = err["msg"]
            yield loc, f"{msg[:1].lower()}{msg[1:]}, got {describe(err.get('input'))}"


def _unknown_field(loc: Loc) -> str:
    model = _model_at(loc[:-1])
    key = str(loc[-1])
    if model is None:
        return f"unknown field {key!r}"
    allowed = [f.name for f in dataclasses.fields(model)]
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown field {key!r} ({hint}allowed: {', '.join(allowed)})"


def _model_at(loc: Loc) -> type | None:
    """The schema class that validates the mapping at ``loc`` (to list its fields)."""
    tp: Any = Manifest
    for part in loc:
        tp = _unwrap_optional(tp)
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            field = typing.get_type_hints(tp).get(str(part))
            if field is None or str(part).startswith("_"):
                return None
            tp = field
        elif get_origin(tp) in (list, dict):
            tp = get_args(tp)[-1]
        else:
            return None
    tp = _unwrap_optional(tp)
    return tp if dataclasses.is_dataclass(tp) and isinstance(tp, type) else None


def _unwrap_optional(tp: Any) -> Any:
    """``X | None`` -> ``X``; ``Annotated[X, ...]`` -> ``X``."""
    if get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp
