"""cachectl: managed JAX persistent compilation caches."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from cachectl.service.activate import Activation, activate


def serving(*args, **kwargs):
    """:func:`cachectl.dispatch.serving` (imported on first use: a plain activate() never pays for it)."""
    from cachectl.dispatch import serving as _serving

    return _serving(*args, **kwargs)


def __getattr__(name: str):
    """The runtime and serving names, imported on first use: ``cachectl --help`` loads neither."""
    if name in ("Activation", "activate"):
        import importlib

        return getattr(importlib.import_module("cachectl.service.activate"), name)
    if name in ("OutOfBucket", "StructureMismatch", "Serving", "mask"):
        import importlib

        return getattr(importlib.import_module("cachectl.dispatch"), name)
    raise AttributeError(f"module 'cachectl' has no attribute {name!r}")


__all__ = [
    "Activation",
    "OutOfBucket",
    "Serving",
    "StructureMismatch",
    "__version__",
    "activate",
    "mask",
    "serving",
]
