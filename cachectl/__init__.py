"""cachectl: managed JAX persistent compilation caches."""

from __future__ import annotations

__version__ = "0.1.0"

from cachectl.runtime import Activation, activate  # noqa: E402


def serving(*args, **kwargs):
    """:func:`cachectl.dispatch.serving` (imported on first use: a plain activate() never pays for it)."""
    from cachectl.dispatch import serving as _serving

    return _serving(*args, **kwargs)


def __getattr__(name: str):
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
