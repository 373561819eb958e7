"""Library values as JSON and back: what the server sends and the client rebuilds.

``to_jsonable`` turns dataclasses, datetimes, enums and paths into plain JSON values (a
field with ``metadata={"json": False}`` is left out, ``{"round": n}`` rounds it);
``from_jsonable`` rebuilds a value of a given type from them, so a result read over HTTP
is the same type the library returns in direct mode.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

# What the server sends instead of a secret storage option; the client drops it.
REDACTED = "<redacted>"


def to_jsonable(obj: Any) -> Any:
    """Dataclasses, datetimes, enums and paths as plain JSON values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        data = {f.name: _field_value(f, getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if f.metadata.get("json", True)}
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


def _field_value(f: dataclasses.Field[Any], value: Any) -> Any:
    """A field's JSON value; ``metadata={"round": n}`` keeps n decimals (reports' seconds)."""
    digits = f.metadata.get("round")
    if digits is not None and isinstance(value, float):
        return round(value, digits)
    return to_jsonable(value)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_jsonable(tp: Any, data: Any) -> Any:
    """Rebuild a value of type ``tp`` from what ``render.to_jsonable`` made of it."""
    if data is None or tp is Any or tp is object:
        return data
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        for option in options:
            try:
                return from_jsonable(option, data)
            except (TypeError, ValueError, KeyError):
                continue
        return data
    if dataclasses.is_dataclass(tp):
        hints = _hints(tp)
        values = {f.name: from_jsonable(hints.get(f.name, Any), data[f.name])
                  for f in dataclasses.fields(tp) if f.init and f.name in data}
        return tp(**values)
    if origin in (list, typing.Sequence) or tp is list:
        (item,) = typing.get_args(tp) or (Any,)
        return [from_jsonable(item, v) for v in data]
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_jsonable(args[0], v) for v in data)
        return tuple(from_jsonable(a, v) for a, v in zip(args, data, strict=False))
    if origin is dict or tp is dict:
        key_t, value_t = typing.get_args(tp) or (Any, Any)
        return {from_jsonable(key_t, k): from_jsonable(value_t, v) for k, v in data.items()}
    if tp is datetime:
        if not isinstance(data, str):
            raise TypeError("datetime")
        return datetime.fromisoformat(data)
    if tp is timedelta:
        return timedelta(seconds=float(data))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(data)
    if tp is float and isinstance(data, int):
        return float(data)
    if isinstance(tp, type) and tp in (int, str, bool, float) and not isinstance(data, tp):
        raise TypeError(f"expected {tp.__name__}")
    return data
