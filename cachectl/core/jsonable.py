"""Library values as JSON and back: what the server sends and the client rebuilds.

``to_jsonable`` turns dataclasses, datetimes, enums and paths into plain JSON values (the
server's responses, the CLI's --json; a field with ``metadata={"json": False}`` is left out,
``{"round": n}`` rounds it); ``from_jsonable`` rebuilds a value of a given type from them with
pydantic's TypeAdapter, so a result read over HTTP is the same type the library returns in
direct mode. There is no other decoder.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

# What the server sends instead of a secret storage option; the client drops it.
REDACTED = "<redacted>"


_SCALARS = frozenset({str, int, float, bool, type(None)})
# How deep a stored free-form value (an entry's bucket, an audit record's details) is read back:
# one stored deeper (before the server refused such bodies, limits.MAX_JSON_DEPTH) is cut there,
# or every listing of it, on the server and in --json, recursed past Python's limit.
MAX_STORED_DEPTH = 32
TOO_DEEP = "<nested too deep>"
# What a stored number JSON cannot carry (1e999 read back as inf, NaN) is read back as: one
# stored before the server refused such bodies would make every listing of it a 500.
NOT_FINITE = "<not a finite number>"


def _within(value: Any, depth: int) -> bool:
    if isinstance(value, dict):
        return depth > 0 and all(_within(v, depth - 1) for v in value.values())
    if isinstance(value, list):
        return depth > 0 and all(_within(v, depth - 1) for v in value)
    return not (isinstance(value, float) and not math.isfinite(value))


def _cut(value: Any, depth: int) -> Any:
    if isinstance(value, (dict, list)) and depth <= 0:
        return TOO_DEEP
    if isinstance(value, dict):
        return {k: _cut(v, depth - 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_cut(v, depth - 1) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return NOT_FINITE
    return value


def bounded(value: Any, depth: int = MAX_STORED_DEPTH) -> Any:
    """A JSON value read from the index, its dicts and lists at most ``depth`` deep and its
    numbers finite (the same object when it already is; deeper parts become TOO_DEEP, a number
    JSON cannot carry NOT_FINITE)."""
    return value if _within(value, depth) else _cut(value, depth)


def to_jsonable(obj: Any) -> Any:
    """Dataclasses, datetimes, enums and paths as plain JSON values."""
    if type(obj) in _SCALARS:  # exact types: an enum that is also a str still goes below
        return obj
    layout = (
        _layout(type(obj)) if dataclasses.is_dataclass(obj) and not isinstance(obj, type) else None
    )
    if layout is not None:
        fields, extra = layout
        data = {
            name: _rounded(value, digits)
            if digits is not None
            else (value if type(value) in _SCALARS else to_jsonable(value))
            for name, digits, value in ((n, d, getattr(obj, n)) for n, d in fields)
        }
        for name in extra:
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
    if isinstance(obj, Sequence) and not isinstance(obj, (str, bytes)):
        return [to_jsonable(v) for v in obj]  # a sequence built on read (a plan's PlannedEntries)
    return obj


@functools.lru_cache(maxsize=512)
def _layout(cls: type) -> tuple[tuple[tuple[str, int | None], ...], tuple[str, ...]]:
    """A dataclass's JSON fields (name, decimals to round to) and extra properties, read once per
    class: a plan of 100k entries asks 100k times."""
    fields = tuple(
        (f.name, f.metadata.get("round"))
        for f in dataclasses.fields(cls)
        if f.metadata.get("json", True)
    )
    return fields, tuple(getattr(cls, "__json_extra__", ()))


def _rounded(value: Any, digits: int) -> Any:
    """A field's JSON value; ``metadata={"round": n}`` keeps n decimals (reports' seconds)."""
    if isinstance(value, float):
        return round(value, digits)
    return to_jsonable(value)


def dumps_indented(data: Any) -> str:
    """``json.dumps(data, indent=2)``, byte for byte (tests/test_jsonable.py), faster: ``indent``
    rules out json's C encoder, and the pure-Python one's generator per value made --json of a
    large plan slower (BENCHMARKS.md). Containers are laid out here; scalars are the C encoder's.
    Takes what ``to_jsonable`` returns."""
    parts: list[str] = []
    _write(data, "\n", parts)
    return "".join(parts)


_ascii = json.encoder.encode_basestring_ascii
# The C encoder for one value: NaN and Infinity, str and int subclasses, and its TypeError.
_encode = json.JSONEncoder().encode
_INF = float("inf")
# The scalars of exactly these types, written without a call into the encoder.
_FAST: dict[type, Callable[[Any], str]] = {
    str: _ascii,
    int: int.__repr__,
    float: lambda f: float.__repr__(f) if -_INF < f < _INF else _encode(f),
    bool: lambda b: "true" if b else "false",
    type(None): lambda _: "null",
}


def _key(key: Any) -> str:
    """A dict key as json.dumps writes it: a string, or a scalar's JSON text quoted."""
    if isinstance(key, str):
        return _ascii(key)
    if key is None or isinstance(key, (int, float)):
        return _ascii(_encode(key))
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")


def _write(value: Any, newline: str, parts: list[str]) -> None:
    """Append ``value`` at the indentation ``newline`` ends with."""
    fast = _FAST.get(type(value))
    if fast is not None:
        parts.append(fast(value))
    elif not isinstance(value, (dict, list, tuple)) or not value:
        parts.append(_encode(value))  # an empty container, a subclass, what JSON cannot hold
    else:
        inner = newline + "  "
        is_dict = isinstance(value, dict)
        head = ("{" if is_dict else "[") + inner
        for item in value:
            if is_dict:
                parts.append(head + (_ascii(item) if type(item) is str else _key(item)) + ": ")
                item = value[item]
            else:
                parts.append(head)
            head = "," + inner
            fast = _FAST.get(type(item))
            if fast is not None:  # inline: most values are scalars
                parts.append(fast(item))
            else:
                _write(item, inner, parts)
        parts.append(newline + ("}" if is_dict else "]"))


@functools.lru_cache(maxsize=256)
def type_adapter(tp: Any) -> Any:
    """pydantic's validator for ``tp``, built once per type; pydantic is imported only here,
    so activate() in server mode pays for it only when it decodes a response, and a valid
    manifest never (manifest/load.py asks pydantic only about one it cannot build)."""
    from pydantic import TypeAdapter

    return TypeAdapter(tp)


def from_jsonable(tp: Any, data: Any) -> Any:
    """Rebuild a value of type ``tp`` (a dataclass, a list of them...) from what ``to_jsonable``
    made of it; keys ``tp`` does not have (``__json_extra__``'s) are ignored."""
    if data is None or tp is Any or tp is object:
        return data
    return type_adapter(tp).validate_python(data)
