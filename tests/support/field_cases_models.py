"""The field suite's model services: a sharded restore, state, masks, loops, kernels and x64.

Each is a service as an ML engineer writes it on a real library (or JAX's own parts), served by
tests/field/test_field_models.py as support/field_cases.py's are (support/field_run.py).
``env`` is set in every process of a case: warm, warm-check, the services and misses alike.
"""

from __future__ import annotations

from support.field_cases import STARTUP, Case

# 8 CPU devices in every process of the case: the mesh the service and the manifest build.
EIGHT_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}

# A tensor-parallel MLP over a (data 2, model 4) mesh of 8 host devices, its params restored by
# orbax straight into their NamedShardings (the service's own placement), jitted with explicit
# in_shardings and out_shardings. The manifest is written as the docs' mesh example and names
# the jitted function: its out_shardings are part of the program (the result's sharding is in
# the HLO), which a manifest's `jit:` options cannot declare for a plain function.
ORBAX_SHARDED = Case(
    module="""
import os
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import orbax.checkpoint as ocp

MESH = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))

def _at(*spec):
    return NamedSharding(MESH, P(*spec))

PARAMS = {"w1": ((16, 32), _at(None, "model")), "b1": ((32,), _at("model")),
          "w2": ((32, 8), _at("model", None))}
CKPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ckpt")

def _forward(w1, b1, w2, x):
    return jax.nn.gelu(x @ w1 + b1) @ w2

forward = jax.jit(_forward, in_shardings=(*(s for _, s in PARAMS.values()), _at("data", None)),
                  out_shardings=_at("data", None))

def restore():
    # The first process saves the checkpoint (host arrays, as training left it); every process
    # restores it into the params' shardings.
    ckptr = ocp.StandardCheckpointer()
    if not os.path.exists(CKPT):
        rng = np.random.default_rng(0)
        ckptr.save(CKPT, {k: (rng.standard_normal(shape) / 4).astype(np.float32)
                          for k, (shape, _) in PARAMS.items()})
        ckptr.wait_until_finished()
    target = {k: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=s)
              for k, (shape, s) in PARAMS.items()}
    return ckptr.restore(CKPT, target)

def _pad(x, n):
    return np.concatenate([x, np.zeros((n - len(x),) + x.shape[1:], x.dtype)])

def calls():
    p = restore()
    params = (p["w1"], p["b1"], p["w2"])
    rng = np.random.default_rng(1)
    out = []
    for n, bucket in ((3, 4), (6, 8)):
        x = rng.standard_normal((n, 16)).astype(np.float32)
        out.append(("forward", (*params, x), (*params, _pad(x, bucket))))
    return out

def run():
    return [forward(*padded) for _, _, padded in calls()]
""",
    manifest="""
version: 1
target: {backend: cpu}
functions:
  - fn: case:forward
    mesh: {axes: {data: 2, model: 4}, axis_types: auto}
    args:
      - {shape: [16, 32], dtype: float32, sharding: [null, model]}
      - {shape: [32], dtype: float32, sharding: [model]}
      - {shape: [32, 8], dtype: float32, sharding: [model, null]}
      - {shape: [batch, 16], dtype: float32, sharding: [data, null]}
    buckets: {batch: [4, 8]}
""",
    env=EIGHT_DEVICES,
)

# dm-haiku's transform_with_state: BatchNorm's moving averages and a call counter are state,
# threaded through apply and returned updated. Params and state are made on the host (as
# restored): haiku's init would compile eagerly.
HAIKU_STATE = Case(
    module="""
import numpy as np
import jax, jax.numpy as jnp
import haiku as hk

def _net(x, is_training):
    h = hk.Linear(16)(x)
    h = hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)(h, is_training)
    served = hk.get_state("served", [], jnp.int32, init=jnp.zeros)
    hk.set_state("served", served + 1)
    return hk.Linear(4)(jax.nn.relu(h))

NET = hk.transform_with_state(_net)

def _specs():
    # the key made inside: an eager PRNGKey would compile JAX's seed program at start
    x = jax.ShapeDtypeStruct((1, 8), jnp.float32)
    return jax.eval_shape(lambda x: NET.init(jax.random.PRNGKey(0), x, is_training=True), x)

def param_specs():
    return _specs()[0]

def state_specs():
    return _specs()[1]

def apply(params, state, x):
    return NET.apply(params, state, None, x, is_training=False)

def _host(specs, rng, fill):
    return jax.tree_util.tree_map(lambda s: fill(s).astype(s.dtype), specs)

def calls():
    rng = np.random.default_rng(0)
    params = _host(param_specs(), rng, lambda s: rng.standard_normal(s.shape) / 3)
    state = _host(state_specs(), rng, lambda s: np.ones(s.shape))
    x = rng.standard_normal((3, 8)).astype(np.float32)
    padded = np.concatenate([x, np.zeros((1, 8), np.float32)])
    return [("apply", (params, state, x), (params, state, padded))]

def run():
    return [jax.jit(apply)(*padded) for _, _, padded in calls()]
""",
    manifest="""
version: 1
target: {backend: cpu}
functions:
  - fn: case:apply
    args:
      - {pytree: case:param_specs}
      - {pytree: case:state_specs}
      - {shape: [batch, 8], dtype: float32}
    buckets: {batch: [1, 4]}
""",
)

# A tiny random GPT-2 from transformers' Flax classes, with attention masks (a padded row).
# Transformers 5 removed its Flax models: the field extra pins the 4.x line, their last.
GPT2_FLAX = Case(
    module="""
import numpy as np
import jax, jax.numpy as jnp
from transformers import GPT2Config, FlaxGPT2LMHeadModel

CONFIG = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
MODEL = FlaxGPT2LMHeadModel(CONFIG, seed=0, _do_init=False)  # no eager init: params below

def param_specs():
    return jax.eval_shape(lambda: MODEL.init_weights(jax.random.PRNGKey(0), (1, 1)))

def forward(params, input_ids, attention_mask):
    return MODEL(input_ids=input_ids, attention_mask=attention_mask, params=params).logits

def calls():
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map(
        lambda s: (rng.standard_normal(s.shape) * 0.05).astype(s.dtype), param_specs())
    ids = rng.integers(0, 64, (2, 5)).astype(np.int32)
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], np.int32)  # the second row is shorter
    pad = lambda a: np.concatenate([a, np.zeros((2, 3), np.int32)], axis=1)
    return [("forward", (params, ids, mask), (params, pad(ids), pad(mask)))]

def run():
    return [jax.jit(forward)(*padded) for _, _, padded in calls()]
""",
    manifest="""
version: 1
target: {backend: cpu}
functions:
  - fn: case:forward
    args:
      - {pytree: case:param_specs}
      - {shape: [2, seq], dtype: int32}
      - {shape: [2, seq], dtype: int32}
    buckets: {seq: [8, 16]}
""",
    env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"},
    # the model's constructor makes its PRNGKey eagerly (JAX's seed program): warmed by running
    warmup=STARTUP,
)

# Greedy generation as a lax.scan over a fixed number of steps (a recurrent decoder).
SCAN_DECODER = Case(
    module="""
import numpy as np
import jax, jax.numpy as jnp

VOCAB, DIM, STEPS = 32, 16, 8

def param_specs():
    S = jax.ShapeDtypeStruct
    return {"embed": S((VOCAB, DIM), jnp.float32), "w": S((DIM, DIM), jnp.float32),
            "out": S((DIM, VOCAB), jnp.float32)}

def generate(params, tokens):
    def step(carry, _):
        h, tok = carry
        h = jnp.tanh(params["embed"][tok] + h @ params["w"])
        nxt = jnp.argmax(h @ params["out"], axis=-1).astype(jnp.int32)
        return (h, nxt), nxt
    h0 = jnp.zeros((tokens.shape[0], DIM), jnp.float32)
    _, out = jax.lax.scan(step, (h0, tokens), None, length=STEPS)
    return out.T

def calls():
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s.shape).astype(np.float32) for k, s in param_specs().items()}
    tokens = np.array([3, 17, 30], np.int32)
    return [("generate", (params, tokens), (params, np.concatenate([tokens, [0]]).astype(np.int32)))]

def run():
    return [jax.jit(generate)(*padded) for _, _, padded in calls()]
""",
    manifest="""
version: 1
target: {backend: cpu}
functions:
  - fn: case:generate
    args:
      - {pytree: case:param_specs}
      - {shape: [batch], dtype: int32}
    buckets: {batch: [1, 4]}
""",
)

# An int8 dequantize-and-matmul Pallas kernel (interpret mode: any backend) under a custom_vjp
# whose backward is plain jnp; served forward and as a value-and-grad training step.
PALLAS_VJP = Case(
    module="""
import numpy as np
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl

def _kernel(xq_ref, scale_ref, w_ref, o_ref):
    o_ref[...] = jnp.dot(xq_ref[...].astype(jnp.float32) * scale_ref[...], w_ref[...])

def _qmatmul(xq, scale, w):
    out = jax.ShapeDtypeStruct((xq.shape[0], w.shape[1]), jnp.float32)
    return pl.pallas_call(_kernel, out_shape=out, interpret=True)(xq, scale, w)

@jax.custom_vjp
def qmatmul(xq, scale, w):
    return _qmatmul(xq, scale, w)

def _fwd(xq, scale, w):
    return _qmatmul(xq, scale, w), (xq, scale)

def _bwd(res, g):
    xq, scale = res
    return None, None, (xq.astype(jnp.float32) * scale).T @ g  # int8 inputs: no tangent

qmatmul.defvjp(_fwd, _bwd)

def predict(w, xq, scale):
    return qmatmul(xq, scale, w)

def loss_and_grad(w, xq, scale, y):
    return jax.value_and_grad(lambda w: jnp.mean((qmatmul(xq, scale, w) - y) ** 2))(w)

def _pad(x, n):
    return np.concatenate([x, np.zeros((n - len(x),) + x.shape[1:], x.dtype)])

def calls():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((16, 4)) / 4).astype(np.float32)
    xq = rng.integers(-127, 128, (5, 16)).astype(np.int8)
    scale = rng.uniform(0.01, 0.02, (5, 1)).astype(np.float32)
    y = rng.standard_normal((5, 4)).astype(np.float32)
    return [("predict", (w, xq, scale), (w, _pad(xq, 8), _pad(scale, 8))),
            ("loss_and_grad", (w, xq, scale, y), (w, _pad(xq, 8), _pad(scale, 8), _pad(y, 8)))]

def run():
    return [jax.jit(globals()[name])(*padded) for name, _, padded in calls()]
""",
    manifest="""
version: 1
target: {backend: cpu}
functions:
  - fn: case:predict
    args:
      - {shape: [16, 4], dtype: float32}
      - {shape: [batch, 16], dtype: int8}
      - {shape: [batch, 1], dtype: float32}
    buckets: {batch: [8]}
  - fn: case:loss_and_grad
    args:
      - {shape: [16, 4], dtype: float32}
      - {shape: [batch, 16], dtype: int8}
      - {shape: [batch, 1], dtype: float32}
      - {shape: [batch, 4], dtype: float32}
    buckets: {batch: [8]}
""",
)

# A float64 conjugate-gradient solve of batched SPD systems: JAX_ENABLE_X64=1 in every process
# (warm included), the manifest's float64 taken as written.
X64_SOLVER = Case(
    module="""
import numpy as np
import jax, jax.numpy as jnp
from jax.scipy.sparse.linalg import cg

def solve(a, b):
    spd = a @ jnp.swapaxes(a, -1, -2) + a.shape[-1] * jnp.eye(a.shape[-1], dtype=a.dtype)
    one = lambda m, v: cg(lambda u: m @ u, v, tol=1e-14, maxiter=64)[0]
    x = jax.vmap(one)(spd, b)
    return x, jnp.max(jnp.abs(jnp.einsum("bij,bj->bi", spd, x) - b))

def calls():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 8, 8)), rng.standard_normal((3, 8))
    pad = lambda x: np.concatenate([x, np.zeros((1,) + x.shape[1:], x.dtype)])
    return [("solve", (a, b), (pad(a), pad(b)))]

def run():
    out = [jax.jit(solve)(*padded) for _, _, padded in calls()]
    assert out[0][0].dtype == jnp.float64 and float(out[0][1]) < 1e-12, out  # x64 is on
    return out
""",
    manifest="""
version: 1
target: {backend: cpu}
functions:
  - fn: case:solve
    args:
      - {shape: [batch, 8, 8], dtype: float64}
      - {shape: [batch, 8], dtype: float64}
    buckets: {batch: [4]}
""",
    env={"JAX_ENABLE_X64": "1"},
)

MODEL_CASES = {
    "orbax-sharded": ORBAX_SHARDED,
    "haiku-state": HAIKU_STATE,
    "gpt2-flax": GPT2_FLAX,
    "scan-decoder": SCAN_DECODER,
    "pallas-vjp": PALLAS_VJP,
    "x64-solver": X64_SOLVER,
}
MODEL_REQUIRES = {"orbax-sharded": "orbax", "haiku-state": "haiku", "gpt2-flax": "transformers"}
