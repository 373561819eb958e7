"""Sizes and durations as people type them: ``50GiB``, ``500MB``, ``90m``, ``2w``."""

from __future__ import annotations

import re
from datetime import timedelta

from cachectl.core.errors import BadInput

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# Past these a value is a typo, and would overflow the index's 64-bit columns or timedelta.
MAX_SIZE = 2**62  # 4 EiB
MAX_DURATION_S = 100 * 365 * 86400  # a century


def parse_size(text: str | int) -> int:
    """Bytes from ``50GiB``, ``500MB``, ``1.5G`` or a plain number of bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and match[2].lower()
    if not match or unit not in _SIZE_UNITS:
        raise BadInput(f"bad size {text!r}: use bytes or a unit, e.g. 500MB, 50GiB, 1.5T")
    value = float(match[1]) * _SIZE_UNITS[unit]
    if value > MAX_SIZE:
        raise BadInput(f"size {text!r} is too large: at most {format_size(MAX_SIZE)}")
    return int(value)


def parse_duration(text: str) -> timedelta:
    """A duration from ``90m``, ``12h``, ``30d``, ``2w`` (combinations like ``1d12h`` too); ``0`` is none."""
    if str(text).strip() == "0":
        return timedelta(0)
    parts = re.findall(r"(\d+(?:\.\d+)?)([smhdw])", str(text).strip().lower())
    if not parts or "".join(n + u for n, u in parts) != str(text).strip().lower():
        raise BadInput(
            f"bad duration {text!r}: use a number and a unit s, m, h, d or w, e.g. 90m, 12h, 30d, 2w"
        )
    seconds = sum(float(n) * _DURATION_UNITS[u] for n, u in parts)
    if seconds > MAX_DURATION_S:
        raise BadInput(f"duration {text!r} is too long: at most 100 years")
    return timedelta(seconds=seconds)


def format_size(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def format_duration(delta: timedelta | None) -> str:
    if delta is None:
        return "-"
    seconds = int(delta.total_seconds())
    for unit, size in (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def parse_min_age(text: str) -> timedelta:
    """verify's --min-age: a duration, or 0/empty for none; bad text is BadInput before anything runs."""
    return parse_duration(text) if text.strip() not in ("0", "") else timedelta(0)
