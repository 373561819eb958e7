"""Local disk (a path or ``file://``): the options as given; nothing to probe; JAX opens the
directory itself."""

from __future__ import annotations

from typing import Any

FSSPEC = "file"
REQUIRES = None
MTIME_KEYS: tuple[str, ...] = ()


def client_options(given: dict[str, Any]) -> dict[str, Any]:
    return dict(given)


def jax_options(given: dict[str, Any]) -> dict[str, Any] | None:
    return None


def probe_options(given: dict[str, Any]) -> dict[str, Any]:
    return dict(given)


def bucket(root: str) -> str | None:
    return None
