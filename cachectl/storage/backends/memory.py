"""fsspec's in-process memory filesystem (``memory://``), for tests and dry runs: one process's,
so nothing to probe and nothing JAX could share."""

from __future__ import annotations

from typing import Any

FSSPEC = "memory"
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
