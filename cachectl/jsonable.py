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



@functools.lru_cache(maxsize=256)
def _adapter(tp: Any) -> Any:
    """pydantic's validator for ``tp``, built once per type; pydantic is imported only here,
    so activate() in server mode pays for it only when it decodes a response."""
    from pydantic import TypeAdapter

    return TypeAdapter(tp)


def from_jsonable(tp: Any, data: Any) -> Any:
    """Rebuild a value of type ``tp`` (a dataclass, a list of them...) from what ``to_jsonable``
    made of it; keys ``tp`` does not have (``__json_extra__``'s) are ignored."""
    if data is None or tp is Any or tp is object:
        return data
    return _adapter(tp).validate_python(data)
