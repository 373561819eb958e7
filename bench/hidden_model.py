"""Serving on CPU against the hand-rolled floor, for a model like the ones users hide in a service:
a Flax NNX decoder (its forward and an optax train step over its NNX state pytree) and an Equinox CNN.

    python bench/hidden_model.py [--quick] [--rounds=N] [--no-write]

The same measurement as bench/field.py (its ``_one_case``: fresh processes, (a) no cache, (b)
``activate()``, (c) ``cachectl.serving``, (c+w) with warm-up, (d) ``serialize`` /
``deserialize_and_load`` in a 2-thread pool, alternating round by round) on this module's case.
Writes the ``## Serving a hidden-style model`` section of BENCHMARKS.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine, machine_line, write_section  # noqa: E402
from bench.field import MODES, _ms, _one_case, _x  # noqa: E402

SECTION = "## Serving a hidden-style model"

MODULE = """
import numpy as np
import jax, jax.numpy as jnp
import equinox as eqx
import optax
from flax import nnx

class Decoder(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(64, 32, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=32, decode=False, rngs=rngs)
        self.norm = nnx.LayerNorm(32, rngs=rngs)
        self.out = nnx.Linear(32, 64, rngs=rngs)
    def __call__(self, tokens):
        h = self.embed(tokens)
        return self.out(self.norm(h + self.attn(h, h)))

def make_model():
    return Decoder(nnx.Rngs(0))

_graph, _ = nnx.split(nnx.eval_shape(make_model))
_opt = optax.adam(1e-3)

def _specs(tree):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)

def state_specs():
    return _specs(nnx.split(nnx.eval_shape(make_model))[1])

def opt_specs():
    return _specs(jax.eval_shape(_opt.init, state_specs()))

def forward(state, tokens):
    return nnx.merge(_graph, state)(tokens)

def train_step(state, opt_state, tokens, targets):
    def loss(s):
        logits = nnx.merge(_graph, s)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    value, grads = jax.value_and_grad(loss)(state)
    updates, opt_state = _opt.update(grads, opt_state, state)
    return optax.apply_updates(state, updates), opt_state, value

_k1, _k2 = jax.random.split(jax.random.key(1))
_cnn = eqx.nn.Sequential([
    eqx.nn.Conv2d(1, 4, 3, key=_k1), eqx.nn.Lambda(jax.nn.relu), eqx.nn.Conv2d(4, 4, 3, key=_k2),
])
_cnn_arrays, _cnn_static = eqx.partition(_cnn, eqx.is_array)
# Its arrays as a list: the floor's deserialize_and_load cannot rebuild an argument that is an
# Equinox module (its treedef's unflatten fails there), so the argument is the module's leaves.
_cnn_params, _cnn_tree = jax.tree_util.tree_flatten(_cnn_arrays)

def cnn_specs():
    return _specs(_cnn_params)

def classify(params, images):
    model = eqx.combine(jax.tree_util.tree_unflatten(_cnn_tree, params), _cnn_static)
    return jax.vmap(model)(images).mean(axis=(1, 2, 3))

def calls():
    state = nnx.split(make_model())[1]
    opt_state = _opt.init(state)
    tokens = (np.arange(4 * 16, dtype=np.int32).reshape(4, 16) * 7) % 64
    targets = (tokens + 1) % 64
    images = np.linspace(0, 1, 4 * 256, dtype=np.float32).reshape(4, 1, 16, 16)
    return [
        ("forward", (state, tokens[:1]), (state, tokens[:1])),
        ("forward", (state, tokens), (state, tokens)),
        ("train_step", (state, opt_state, tokens, targets), (state, opt_state, tokens, targets)),
        ("classify", (_cnn_params, images[:1]), (_cnn_params, images[:1])),
        ("classify", (_cnn_params, images), (_cnn_params, images)),
    ]

def run():
    return [jax.jit(globals()[name])(*padded) for name, _, padded in calls()]
"""

MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: case:forward
    args:
      - {pytree: case:state_specs}
      - {shape: [batch, 16], dtype: int32}
    buckets: {batch: [1, 4]}
  - fn: case:train_step
    args:
      - {pytree: case:state_specs}
      - {pytree: case:opt_specs}
      - {shape: [batch, 16], dtype: int32}
      - {shape: [batch, 16], dtype: int32}
    buckets: {batch: [4]}
  - fn: case:classify
    args:
      - {pytree: case:cnn_specs}
      - {shape: [batch, 1, 16, 16], dtype: float32}
    buckets: {batch: [1, 4]}
"""

CASE = SimpleNamespace(
    module=MODULE, manifest=MANIFEST, warmup="import case\ncase.calls()\n", not_stored=None
)


def run(quick: bool = False, rounds: int | None = None) -> dict[str, Any]:
    rounds = rounds or (2 if quick else 3)
    return {"rounds": rounds, "machine": machine(), "case": _one_case(CASE, rounds)}


LABELS = {
    "none": "(a) no cache, `jax.jit`",
    "activate": "(b) `activate()` + `jax.jit`",
    "serving": "(c) `cachectl.serving`",
    "serving_warmup": "(c+w) `cachectl.serving(warmup=True)`",
    "floor": "(d) `serialize` / `deserialize_and_load`, 2 threads",
}


def markdown(result: dict[str, Any]) -> str:
    c = result["case"]
    flag = "" if result["rounds"] == 3 else f" --rounds={result['rounds']}"
    lines = [
        SECTION,
        "",
        f"`python bench/hidden_model.py{flag}` (bench/hidden_model.py; bench/field.py's measurement, "
        f"{result['rounds']} rounds, fresh processes, the five kinds alternating). "
        f"{machine_line(result['machine'])} A Flax NNX decoder (forward at batch 1 and 4, and an "
        "optax train step over its NNX state) and an Equinox CNN (batch 1 and 4; its arrays passed "
        "as a list: (d)'s `deserialize_and_load` failed to rebuild an Equinox module argument, "
        "`'_Missing' object is not subscriptable` in its treedef's unflatten): "
        f"{', '.join(c['labels'])}.",
        "",
        "| service | loaded | ready | overhead | of which setup | of which loading executables |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        s = c[mode]
        loaded = _ms(s["loaded"]) if mode in ("serving", "serving_warmup", "floor") else "–"
        lines.append(
            f"| {LABELS[mode]} | {loaded} | {_ms(s['ready'])} | {_ms(s['overhead'])} | "
            f"{_ms(s['load'])} | {_ms(s['loads'])} |"
        )
    lines += [
        "",
        f"Against the floor (d): loaded (c)/(d) **{_x(c['serving/floor']['loaded'])}**, ready "
        f"(c)/(d) {_x(c['serving/floor']['ready'])}, overhead (c)/(d) "
        f"{_x(c['serving/floor']['overhead'])}; overhead (a)/(c) {_x(c['none/serving']['overhead'])}.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    given = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--rounds=")]
    out = run(quick="--quick" in sys.argv, rounds=int(given[0]) if given else None)
    text = markdown(out)
    print(json.dumps(out, default=str))
    print(text)
    if "--no-write" not in sys.argv:
        write_section(SECTION, text)
