"""What most backends do the same way, for their modules to name instead of writing again."""

from __future__ import annotations

from typing import Any


def given_options(given: dict[str, Any]) -> dict[str, Any]:
    """The cache's options as given (a copy: callers may add to it)."""
    return dict(given)


def first_segment(root: str) -> str | None:
    """An object store's bucket or container: the root's first path segment."""
    return root.split("/", 1)[0]


def nothing_to_check(root: str) -> str | None:
    """A store with nothing that must exist before its root is reachable."""
    return None


def no_jax_options(given: dict[str, Any]) -> dict[str, Any] | None:
    """JAX opens the root as a local path: no filesystem options to hand it."""
    return None
