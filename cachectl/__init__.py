"""cachectl: managed JAX persistent compilation caches."""

from __future__ import annotations

__version__ = "0.1.0"

from cachectl.runtime import Activation, activate  # noqa: E402

__all__ = ["Activation", "__version__", "activate"]
