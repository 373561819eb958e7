"""A 2-layer MLP, the README's "your own model in 5 minutes" (examples/mlp.yaml warms it).

The weights are an argument, never a closure, so the program warm compiles is the one a
service calls; param_specs gives their shapes without allocating them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

IN, HIDDEN, OUT = 16, 64, 4


def param_specs() -> dict[str, jax.ShapeDtypeStruct]:
    """The weights' shapes and dtypes: what the manifest's pytree argument names."""
    shapes = {"w1": (IN, HIDDEN), "b1": (HIDDEN,), "w2": (HIDDEN, OUT), "b2": (OUT,)}
    return {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in shapes.items()}


def init_params(seed: int = 0) -> dict[str, np.ndarray]:
    """Host weights (a real service restores a checkpoint): numpy, so nothing compiles here."""
    rng = np.random.default_rng(seed)
    return {
        name: (rng.standard_normal(spec.shape) * 0.1).astype(np.float32)
        for name, spec in param_specs().items()
    }


def forward(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """x [batch, IN] -> logits [batch, OUT]."""
    hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
    return hidden @ params["w2"] + params["b2"]
