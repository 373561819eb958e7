"""How this process's Environment differs from a warmed one, in the words a person would use.

JAX's key is an opaque hash: a field that differs (an XLA flag, jaxlib, the device count, the
compression library) gives every entry another key, silently. Each differing field is named
here with what differs and the fix, once, for every place that explains a miss: doctor's
report (service/doctor.py), misses' environment finding (usage/misses.py) and serving's note
on an empty namespace (dispatch/siblings.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from cachectl.core.fingerprint import Environment

if TYPE_CHECKING:
    from cachectl.index import EnvironmentInfo


@dataclass(frozen=True)
class Difference:
    """One key-affecting field that differs from the nearest warmed environment."""

    field: str
    here: Any
    warmed: Any
    message: str
    fix: str


def _flags_message(here: tuple[str, ...], warmed: tuple[str, ...]) -> str:
    """'+FLAG' for flags set only here; flags warm had that this process lacks are named after."""
    plus = " ".join(f"+{f}" for f in here if f not in warmed)
    minus = " ".join(f for f in warmed if f not in here)
    parts = [p for p in (plus, f"missing here (set at warm): {minus}" if minus else "") if p]
    return "XLA_FLAGS differ: " + "; ".join(parts)


# (message, fix) for a field that differs, from (field name, value here, value warmed).
_Words = Callable[[str, Any, Any], tuple[str, str]]


def _template(message: str, fix: str) -> _Words:
    """Words that only fill in the two values (``{here}``, ``{warmed}``)."""
    return lambda _name, here, warmed: (
        message.format(here=here, warmed=warmed),
        fix.format(here=here, warmed=warmed),
    )


def _compression_words(_name: str, here: Any, warmed: Any) -> tuple[str, str]:
    if here == "zlib" and warmed == "zstandard":
        return (
            "compression: zlib here, zstandard in the warmed namespace — install zstandard",
            "pip install zstandard (JAX hashes the compression library into every key)",
        )
    return (
        f"compression: {here} here, {warmed} in the warmed namespace",
        f"make both sides use {warmed} (JAX uses zstandard whenever it is importable), "
        "or warm again here",
    )


def _version_words(name: str, here: Any, warmed: Any) -> tuple[str, str]:
    pkg = name.split("_")[0]
    return (
        f"{pkg} {here} vs {warmed} (here vs warmed)",
        f"install {pkg}=={warmed}, or warm again with {pkg} {here}",
    )


def _count_words(name: str, here: Any, warmed: Any) -> tuple[str, str]:
    hint = (
        " (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)"
        if name == "device_count"
        else ""
    )
    return (
        f"{name} {here} vs {warmed} (here vs warmed)",
        f"run with {warmed} {name.split('_')[0]}s as warm did{hint}, or warm for {here}",
    )


def _metadata_words(_name: str, here: Any, warmed: Any) -> tuple[str, str]:
    return (
        f"include_metadata_in_key {here} vs {warmed} (here vs warmed)",
        f"set JAX_COMPILATION_CACHE_INCLUDE_METADATA_IN_KEY={str(warmed).lower()}",
    )


def _x64_words(_name: str, here: Any, warmed: Any) -> tuple[str, str]:
    mode = {True: "on", False: "off"}
    return (
        f"x64 (jax_enable_x64) {mode[bool(here)]} here, {mode[bool(warmed)]} when warmed: a "
        "stored executable refuses a process of the other mode",
        f"set JAX_ENABLE_X64={int(bool(warmed))}, or warm again with JAX_ENABLE_X64="
        f"{int(bool(here))}",
    )


_WORDS: dict[str, _Words] = {
    "compression": _compression_words,
    "jax_version": _version_words,
    "jaxlib_version": _version_words,
    "device_count": _count_words,
    "process_count": _count_words,
    "backend": _template(
        "backend {here} vs {warmed} (here vs warmed)",
        "run on {warmed}, or warm on this {here} machine",
    ),
    "device_kind": _template(
        "device kind {here!r} vs {warmed!r} (here vs warmed)",
        "warm on the hardware the service runs on",
    ),
    "platform_version": _template(
        "platform version {here!r} vs {warmed!r} (driver/runtime, here vs warmed)",
        "use the same CUDA/ROCm driver or libtpu as warm, or warm again here",
    ),
    "topology": _template(
        "device topology {here} vs {warmed} (here vs warmed)",
        "run on the same slice shape as warm, or warm for this topology",
    ),
    "enable_xla_caches": _template(
        "enable_xla_caches {here!r} vs {warmed!r} (here vs warmed)",
        "use cachectl.activate() or `cachectl exec` on both sides (they set 'none')",
    ),
    "include_metadata_in_key": _metadata_words,
    "enable_x64": _x64_words,
    "cpu_isa": _template(
        "CPU instruction set {here!r} vs {warmed!r} (here vs warmed): XLA:CPU code of one "
        "host can be an illegal instruction on another",
        "warm on a host of this CPU, or set the same XLA_FLAGS=--xla_cpu_max_isa=LEVEL on both",
    ),
}


def describe_difference(name: str, here: Any, warmed: Any) -> Difference:
    """A differing Environment field in the words a person would use."""
    if name == "xla_flags":
        wanted = " ".join(warmed) or "(none)"
        return Difference(
            name,
            list(here),
            list(warmed),
            _flags_message(tuple(here), tuple(warmed)),
            f"run with the XLA flags warm used ({wanted}), or warm again with this process' flags",
        )
    words = _WORDS.get(name)
    if words is None:
        return Difference(
            name, here, warmed, f"{name} {here} vs {warmed} (here vs warmed)", "warm again here"
        )
    message, fix = words(name, here, warmed)
    return Difference(name, here, warmed, message, fix)


def compare(here: Environment, warmed: Environment) -> list[Difference]:
    """Every key-affecting field in which ``here`` differs from ``warmed``."""
    out = []
    for f in fields(Environment):
        a, b = getattr(here, f.name), getattr(warmed, f.name)
        if a != b:
            out.append(describe_difference(f.name, a, b))
    return out


def nearest(
    here: Environment, candidates: list[EnvironmentInfo]
) -> tuple[EnvironmentInfo, list[Difference]] | None:
    """The warmed environment with the fewest differences (then the most entries)."""
    best = None
    for info in candidates:
        diffs = compare(here, info.environment)
        rank = (len(diffs), -info.entries)
        if best is None or rank < best[0]:
            best = (rank, info, diffs)
    return (best[1], best[2]) if best else None
