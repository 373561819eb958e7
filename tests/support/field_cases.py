"""The field suite's services: real JAX libraries, each a module, its manifest and its warm-up.

Shared by tests/field/test_field_services.py (serving against no cache and activate()) and
tests/field/test_field_truth.py (cachectl's telemetry against JAX's own log).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Case:
    module: str  # the service's code: calls() for (c), run() for (a)/(b)
    manifest: str | None  # None: a library-internal jit, warmed by running warmup
    # Run by `cachectl warm-run` (after the manifest's warm, if any): what only running warms.
    warmup: str | None = None
    # Why (c) cannot serve from stored executables, as warm reports it; None: it must.
    not_stored: str | None = None
    # Its outputs' structure holds static callables pickle cannot store (an Equinox module's
    # activation, a flax TrainState's apply_fn and optax closures): stored all the same, and
    # the function is traced (never compiled) once per bucket at its first call to rebuild it.
    traced_at_first_call: bool = False
    # Set in every process of the case (warm, the services, misses): 8 host devices, x64.
    env: dict[str, str] = field(default_factory=dict)


# A service that builds its model at start (Flax's nnx.Rngs and initializers, Equinox's MLP,
# optax's init) runs JAX's own jitted random and arithmetic programs (jit__threefry_seed,
# jit__uniform, jit_multiply, ...) eagerly: no manifest names them, and `cachectl misses`
# names each one (library_internal) until the start is warmed by running it.
STARTUP = "import case\ncase.calls()\n"

LINALG = Case(
    module="""
import numpy as np
import jax, jax.numpy as jnp

def solve(a, b):
    l = jnp.linalg.cholesky(a @ jnp.swapaxes(a, -1, -2) + 4 * jnp.eye(a.shape[-1]))
    return jnp.linalg.solve(l, b[..., None])[..., 0]

def spectrum(x):
    return jnp.abs(jnp.fft.rfft(x, axis=-1))

def _pad(x, n):
    return np.concatenate([x, np.zeros((n - len(x),) + x.shape[1:], x.dtype)])

def calls():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 8, 8), np.float32), rng.standard_normal((3, 8), np.float32)
    x = rng.standard_normal((3, 64), np.float32)
    return [("solve", (a, b), (_pad(a, 4), _pad(b, 4))), ("spectrum", (x,), (_pad(x, 4),))]

def run():
    return [jax.jit(globals()[name])(*padded) for name, _, padded in calls()]
""",
    manifest="""
version: 1
target: {backend: cpu}
functions:
  - fn: case:solve
    args:
      - {shape: [batch, 8, 8], dtype: float32}
      - {shape: [batch, 8], dtype: float32}
    buckets: {batch: [1, 4]}
  - fn: case:spectrum
    args:
      - {shape: [batch, 64], dtype: float32}
    buckets: {batch: [1, 4]}
""",
)

FLAX_NNX = Case(
    module="""
import numpy as np
import jax, jax.numpy as jnp
from flax import nnx

class Decoder(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(64, 32, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=32, decode=False, rngs=rngs)
        self.out = nnx.Linear(32, 64, rngs=rngs)
    def __call__(self, tokens):
        h = self.embed(tokens)
        return self.out(self.attn(h, h))

def make_model():
    return Decoder(nnx.Rngs(0))

_graph, _ = nnx.split(nnx.eval_shape(make_model))

def state_specs():
    _, state = nnx.split(nnx.eval_shape(make_model))
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)

def forward(state, tokens):
    return nnx.merge(_graph, state)(tokens)

def calls():
    _, state = nnx.split(make_model())
    tokens = np.arange(3 * 5, dtype=np.int32).reshape(3, 5) % 64
    padded = np.zeros((4, 8), np.int32)
    padded[:3, :5] = tokens
    return [("forward", (state, tokens), (state, padded))]

def run():
    return [jax.jit(forward)(*padded) for _, _, padded in calls()]
""",
    manifest="""
version: 1
target: {backend: cpu}
functions:
  - fn: case:forward
    args:
      - {pytree: case:state_specs}
      - {shape: [batch, seq], dtype: int32}
    buckets: {batch: [1, 2, 4], seq: [8, 16, 32, 64]}
""",
    warmup=STARTUP,
)

EQUINOX_OPTAX = Case(
    module="""
import numpy as np
import jax, jax.numpy as jnp
import equinox as eqx
import optax

_model = eqx.nn.MLP(8, 1, 32, 2, key=jax.random.key(0))
_params, _static = eqx.partition(_model, eqx.is_array)
_opt = optax.adam(1e-2)

def param_specs():
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _params)

def opt_specs():
    state = jax.eval_shape(_opt.init, _params)
    return state

def train_step(params, opt_state, x, y):
    def loss(p):
        model = eqx.combine(p, _static)
        return jnp.mean((jax.vmap(model)(x)[:, 0] - y) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = _opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

def calls():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((10, 8), np.float32), rng.standard_normal((10,), np.float32)
    px = np.concatenate([x, np.zeros((6, 8), np.float32)])
    py = np.concatenate([y, np.zeros((6,), np.float32)])
    state = _opt.init(_params)
    return [("train_step", (_params, state, x, y), (_params, state, px, py))]

def run():
    return [jax.jit(train_step)(*padded) for _, _, padded in calls()]
""",
    manifest="""
version: 1
target: {backend: cpu}
functions:
  - fn: case:train_step
    args:
      - {pytree: case:param_specs}
      - {pytree: case:opt_specs}
      - {shape: [batch, 8], dtype: float32}
      - {shape: [batch], dtype: float32}
    buckets: {batch: [4, 16]}
""",
    # An Equinox module's treedef (its static fields hold functions) does not survive pickling:
    # the executable is stored without it, and serving rebuilds it by tracing the first call.
    traced_at_first_call=True,
    warmup=STARTUP,
)

KERAS = Case(
    module="""
import os
os.environ.setdefault("KERAS_BACKEND", "jax")
import numpy as np
import keras

def run():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)]
    )
    # model.predict jits a private predict_step closure: no manifest can name it.
    return [model.predict(np.ones((n, 16), np.float32), batch_size=8, verbose=0) for n in (8, 16)]
""",
    manifest=None,
    warmup="import case\ncase.run()\n",
)

NUMPYRO = Case(
    module="""
import numpy as np
import jax, jax.numpy as jnp
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS

def model(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    numpyro.sample("obs", dist.Normal(w * x + b, 0.5), obs=y)

def run():
    x = np.linspace(-1, 1, 32).astype(np.float32)
    y = (2.0 * x + 0.5).astype(np.float32)
    # jit_model_args: the data are arguments of MCMC.run's internal jit, not constants baked
    # into its program (otherwise every dataset is a new program and key).
    mcmc = MCMC(NUTS(model), num_warmup=20, num_samples=20, progress_bar=False, jit_model_args=True)
    mcmc.run(jax.random.key(0), x, y)
    return mcmc.get_samples()["w"]
""",
    manifest=None,
    warmup="import case\ncase.run()\n",
)

BRAX_MJX = Case(
    module="""
import numpy as np
import jax, jax.numpy as jnp
from brax.envs.base import PipelineEnv, State
from brax.io import mjcf

XML = \"\"\"
<mujoco model="pendulum">
  <option timestep="0.02"/>
  <worldbody>
    <body name="pole">
      <joint name="hinge" type="hinge" axis="0 1 0"/>
      <geom type="capsule" size="0.05" fromto="0 0 0 0 0 -0.5" mass="1"/>
    </body>
  </worldbody>
  <actuator><motor joint="hinge" gear="1"/></actuator>
</mujoco>
\"\"\"

class Pendulum(PipelineEnv):
    # reward and done are arrays after reset and after step alike. Brax's built-in
    # inverted_pendulum (brax 0.14.2) returns them, and info["time_out"], not weakly typed
    # from reset and weakly typed from step: jax.jit(step) compiles twice, once per State.
    def __init__(self):
        super().__init__(mjcf.loads(XML), backend="mjx", n_frames=2)

    def reset(self, rng):
        q = self.sys.init_q + jax.random.uniform(rng, (self.sys.q_size(),), minval=-0.1, maxval=0.1)
        ps = self.pipeline_init(q, jnp.zeros(self.sys.qd_size()))
        reward, done = jnp.zeros(2)
        return State(ps, self._obs(ps), reward, done, {})

    def step(self, state, action):
        ps = self.pipeline_step(state.pipeline_state, action)
        reward = -jnp.sum(ps.q ** 2) - 0.1 * jnp.sum(action ** 2)
        return state.replace(pipeline_state=ps, obs=self._obs(ps), reward=reward)

    def _obs(self, ps):
        return jnp.concatenate([jnp.cos(ps.q), jnp.sin(ps.q), ps.qd])

ENV = Pendulum()
reset = jax.vmap(ENV.reset)  # n parallel envs: every leaf of the State has dimension 0 = n
step = jax.vmap(ENV.step)

def state_specs(n):
    return jax.eval_shape(reset, jax.ShapeDtypeStruct((n, 2), jnp.uint32))

def _pad(tree, n):
    def pad(x):
        x = np.asarray(x)
        return np.concatenate([x, np.zeros((n - len(x),) + x.shape[1:], x.dtype)])
    return jax.tree_util.tree_map(pad, tree)

def calls():
    keys = np.random.default_rng(0).integers(0, 2**32, (3, 2), dtype=np.uint32)
    # 3 envs in the 4 bucket; the State to step is reset's at 4 (a bucket), cut to 3 on the host
    state = jax.tree_util.tree_map(lambda x: np.asarray(x)[:3], jax.jit(reset)(_pad(keys, 4)))
    action = np.full((3, 1), 0.5, np.float32)
    return [
        ("reset", (keys,), (_pad(keys, 4),)),
        ("step", (state, action), (_pad(state, 4), _pad(action, 4))),
    ]

def run():
    return [jax.jit(globals()[name])(*padded) for name, _, padded in calls()]
""",
    manifest="""
version: 1
target: {backend: cpu}
functions:
  - fn: case:reset
    args:
      - {shape: [n, 2], dtype: uint32}
    buckets: {n: [1, 4]}
  - fn: case:step
    args:
      # n independent envs: zero is a safe pad for every leaf, integers (the solver's
      # iteration counts) included; serving pads integer leaves only where told so.
      - {pytree: case:state_specs, leaf_axes: {0: n}, leaf_pad: 0}
      - {shape: [n, 1], dtype: float32}
    buckets: {n: [1, 4]}
""",
)

BLACKJAX = Case(
    module="""
import numpy as np
import jax, jax.numpy as jnp
import blackjax

def logdensity(x):
    return -0.5 * jnp.sum((x - 1.0) ** 2)

ALG = blackjax.mala(logdensity, 0.1)

def key_specs(n):  # typed keys (jax.random.key), one per chain
    return jax.eval_shape(lambda: jax.random.split(jax.random.key(0), n))

def state_specs(n):
    return jax.eval_shape(jax.vmap(ALG.init), jax.ShapeDtypeStruct((n, 2), jnp.float32))

def step(keys, state):  # one MALA step of n chains
    return jax.vmap(ALG.step)(keys, state)

def _pad(tree, n):
    def pad(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):  # serving pads keys as key data of 0
            data = np.asarray(jax.random.key_data(x))
            data = np.concatenate([data, np.zeros((n - len(data),) + data.shape[1:], data.dtype)])
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        x = np.asarray(x)
        return np.concatenate([x, np.zeros((n - len(x),) + x.shape[1:], x.dtype)])
    return jax.tree_util.tree_map(pad, tree)

def calls():
    keys = jax.random.split(jax.random.key(1), 3)  # 3 chains in the bucket of 4
    positions = np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2)
    state = jax.tree_util.tree_map(np.asarray, jax.jit(jax.vmap(ALG.init))(positions))
    return [("step", (keys, state), (_pad(keys, 4), _pad(state, 4)))]

def run():
    return [jax.jit(globals()[name])(*padded) for name, _, padded in calls()]
""",
    manifest="""
version: 1
target: {backend: cpu}
functions:
  - fn: case:step
    args:
      - {pytree: case:key_specs, leaf_axes: {0: n}}
      - {pytree: case:state_specs, leaf_axes: {0: n}}
    buckets: {n: [1, 4]}
""",
    warmup=STARTUP,
)

# A graph network on jraph's GraphsTuple, batches of 2 and 4 graphs. senders and receivers
# index the nodes: serving pads the batch with jraph's own pad_with_graphs (a padding graph
# that the padded nodes and edges belong to), named in the manifest; zeros would attach the
# padded edges to node 0 (tests/field/test_field_services.py: refused, then).
JRAPH = Case(
    module="""
import numpy as np
import jax, jax.numpy as jnp
import jraph

def graph_specs(n_node, n_edge, n_graph):
    S = jax.ShapeDtypeStruct
    return jraph.GraphsTuple(
        nodes=S((n_node, 4), jnp.float32), edges=S((n_edge, 1), jnp.float32),
        senders=S((n_edge,), jnp.int32), receivers=S((n_edge,), jnp.int32),
        globals=S((n_graph, 1), jnp.float32),
        n_node=S((n_graph,), jnp.int32), n_edge=S((n_graph,), jnp.int32))

def param_specs():
    return {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}

PARAMS = {"w": (np.arange(16, dtype=np.float32).reshape(4, 4) - 8) / 8}

def predict(params, graph):
    conv = jraph.GraphConvolution(lambda h: jnp.tanh(h @ params["w"] + 0.3))
    h = conv(graph).nodes
    n_graph = graph.n_node.shape[0]
    owner = jnp.repeat(jnp.arange(n_graph), graph.n_node, total_repeat_length=h.shape[0])
    return jraph.segment_sum(h, owner, n_graph).sum(-1)

def batch(sizes, seed):
    rng = np.random.default_rng(seed)
    graphs = []
    for n in sizes:
        senders = rng.integers(0, n, 2 * n).astype(np.int32)
        graphs.append(jraph.GraphsTuple(
            nodes=rng.standard_normal((n, 4)).astype(np.float32),
            edges=np.ones((2 * n, 1), np.float32), senders=senders,
            receivers=np.roll(senders, 1), globals=np.zeros((1, 1), np.float32),
            n_node=np.array([n], np.int32), n_edge=np.array([2 * n], np.int32)))
    return jraph.batch_np(graphs)

PAD = {4: (16, 32, 3), 8: (32, 64, 5)}  # the bucket each batch goes to

def calls():
    out = []
    for sizes, seed in (((3, 4), 0), ((2, 5, 3, 6), 1)):  # 2 graphs, then 4
        g = batch(sizes, seed)
        padded = jraph.pad_with_graphs(g, *PAD[4 if len(sizes) == 2 else 8])
        out.append(("predict", (PARAMS, g), (PARAMS, padded)))
    return out

def run():
    return [jax.jit(globals()[name])(*padded) for name, _, padded in calls()]
""",
    manifest="""
version: 1
target: {backend: cpu}
functions:
  - fn: case:predict
    args:
      - {pytree: case:param_specs}
      - pytree: case:graph_specs
        leaf_axes: {nodes: {0: n_node}, edges: {0: n_edge}, senders: {0: n_edge},
                    receivers: {0: n_edge}, globals: {0: n_graph}, n_node: {0: n_graph},
                    n_edge: {0: n_graph}}
        pad_fn: jraph:pad_with_graphs
    buckets: {n_node: [16, 32], n_edge: [32, 64], n_graph: [3, 5]}
    exclude: [{n_node: 16, n_graph: 5}, {n_node: 32, n_graph: 3}, {n_edge: 32, n_graph: 5},
              {n_edge: 64, n_graph: 3}]
""",
)

OPTAX_DONATION = Case(
    module="""
import numpy as np
import jax, jax.numpy as jnp
import optax

# AdamW with clipping; params and the optimizer's state are donated to each step.
_opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
JIT = dict(donate_argnums=(0, 1))

def param_specs():
    return {"w": jax.ShapeDtypeStruct((8, 1), jnp.float32), "b": jax.ShapeDtypeStruct((1,), jnp.float32)}

def opt_specs():
    return jax.eval_shape(_opt.init, param_specs())

def host_state(seed=0):
    # Made on the host, as restored from a checkpoint: optax's init would compile eagerly.
    rng = np.random.default_rng(seed)
    params = {"w": (rng.standard_normal((8, 1)) / 3).astype(np.float32), "b": np.zeros((1,), np.float32)}
    zeros = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), opt_specs())
    return params, zeros

def train_step(params, opt_state, x, y):
    def loss(p):
        return jnp.mean(((x @ p["w"])[:, 0] + p["b"][0] - y) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = _opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

def batches(n=5, seed=0):
    rng = np.random.default_rng(seed)
    for size in [10, 3, 16, 7, 12][:n]:
        x = rng.standard_normal((size, 8)).astype(np.float32)
        yield x, (x @ np.arange(8, dtype=np.float32) / 8).astype(np.float32)

def _pad(x, n):
    return np.concatenate([x, np.zeros((n - len(x),) + x.shape[1:], x.dtype)])

def calls():
    params, opt_state = host_state()
    out = []
    for x, y in batches(2):
        n = 4 if len(x) <= 4 else 16
        out.append(("train_step", (params, opt_state, x, y), (params, opt_state, _pad(x, n), _pad(y, n))))
    return out

def run():
    step = jax.jit(train_step, **JIT)
    params, opt_state = host_state()
    last = {}
    for x, y in batches():
        n = 4 if len(x) <= 4 else 16
        params, opt_state, last[n] = step(params, opt_state, _pad(x, n), _pad(y, n))
    return [last[n] for n in sorted(last)]  # one result per program (bucket) the loop ran
""",
    manifest="""
version: 1
target: {backend: cpu}
functions:
  - fn: case:train_step
    jit: {donate_argnums: [0, 1]}
    args:
      - {pytree: case:param_specs}
      - {pytree: case:opt_specs}
      - {shape: [batch, 8], dtype: float32}
      - {shape: [batch], dtype: float32}
    buckets: {batch: [4, 16]}
""",
)

# diffrax's defaults (throw=True: equinox's runtime checks) compile host callbacks, which JAX
# never writes: DIFFRAX_DEFAULTS is the case warm and serving must explain, not serve.
# With EQX_ON_ERROR=nan (read by equinox at import) the checks are NaNs: served.
_DIFFRAX = """
import numpy as np
import jax, jax.numpy as jnp
import diffrax

def _vf(t, y, k):
    return -k[:, None] * y

def solve(y0, k):
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(_vf), diffrax.Tsit5(), t0=0.0, t1=1.0, dt0=0.1, y0=y0, args=k,
        saveat=diffrax.SaveAt(t1=True),
    )
    return sol.ys[0]

def _pad(x, n):
    return np.concatenate([x, np.zeros((n - len(x),) + x.shape[1:], x.dtype)])

def calls():
    rng = np.random.default_rng(0)
    y0 = rng.standard_normal((3, 4)).astype(np.float32)
    k = rng.uniform(0.1, 1.0, (3,)).astype(np.float32)
    return [("solve", (y0, k), (_pad(y0, 4), _pad(k, 4)))]

def run():
    return [jax.jit(solve)(*padded) for _, _, padded in calls()]
"""
_DIFFRAX_MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: case:solve
    args:
      - {shape: [batch, 4], dtype: float32}
      - {shape: [batch], dtype: float32}
    buckets: {batch: [1, 4]}
"""
DIFFRAX_DEFAULTS = Case(module=_DIFFRAX, manifest=_DIFFRAX_MANIFEST)
DIFFRAX_NAN = Case(
    module='import os\nos.environ["EQX_ON_ERROR"] = "nan"\n' + _DIFFRAX, manifest=_DIFFRAX_MANIFEST
)

# A KV-cache decode loop: the cache is donated to each step, written at the step's position and
# read under a causal mask; the batch is padded to its bucket (the padded rows are their own).
KV_DECODE = Case(
    module="""
import numpy as np
import jax, jax.numpy as jnp

D, T = 16, 32
JIT = dict(donate_argnums=(1,))

def param_specs():
    return {"wq": jax.ShapeDtypeStruct((D, D), jnp.float32), "wo": jax.ShapeDtypeStruct((D, D), jnp.float32)}

def host_params(seed=0):
    rng = np.random.default_rng(seed)
    return {k: (rng.standard_normal((D, D)) / 4).astype(np.float32) for k in ("wq", "wo")}

def decode_step(params, cache, x, pos):
    q = jnp.tanh(x @ params["wq"])
    cache = jax.lax.dynamic_update_slice_in_dim(cache, q[:, None, :], pos, axis=1)
    seen = (jnp.arange(T) <= pos)[None, :, None]
    ctx = jnp.sum(jnp.where(seen, cache, 0.0), axis=1) / (pos + 1).astype(jnp.float32)
    return cache, ctx @ params["wo"]

def _pad(x, n):
    return np.concatenate([x, np.zeros((n - len(x),) + x.shape[1:], x.dtype)])

def calls():
    rng = np.random.default_rng(1)
    params, out = host_params(), []
    for batch, pos in ((3, 0), (3, 5), (7, 2)):
        n = 4 if batch <= 4 else 8
        cache = rng.standard_normal((batch, T, D)).astype(np.float32)
        x = rng.standard_normal((batch, D)).astype(np.float32)
        p = np.int32(pos)
        out.append(("decode_step", (params, cache, x, p), (params, _pad(cache, n), _pad(x, n), p)))
    return out

def run():
    step = jax.jit(decode_step, **JIT)
    params, last = host_params(), {}
    for n in (4, 8):  # a decode loop per bucket: the donated cache carried step to step
        cache = jnp.zeros((n, T, D), jnp.float32)
        x = np.ones((n, D), np.float32)
        for pos in range(3):
            cache, y = step(params, cache, x, np.int32(pos))
        last[n] = y
    return [last[n] for n in sorted(last)]
""",
    manifest="""
version: 1
target: {backend: cpu}
functions:
  - fn: case:decode_step
    jit: {donate_argnums: [1]}
    args:
      - {pytree: case:param_specs}
      - {shape: [batch, 32, 16], dtype: float32}
      - {shape: [batch, 16], dtype: float32}
      - {shape: [], dtype: int32}
    buckets: {batch: [4, 8]}
""",
)

# Low-precision weights, as quantized checkpoints hold them: bfloat16, int4 (with a float32
# scale) and float8_e4m3fn, each widened inside the program.
LOW_PRECISION = Case(
    module="""
import ml_dtypes
import numpy as np
import jax, jax.numpy as jnp

def param_specs():
    return {
        "w_bf16": jax.ShapeDtypeStruct((8, 16), jnp.bfloat16),
        "w_int4": jax.ShapeDtypeStruct((16, 16), jnp.int4),
        "scale": jax.ShapeDtypeStruct((16,), jnp.float32),
        "w_fp8": jax.ShapeDtypeStruct((16, 4), jnp.float8_e4m3fn),
    }

def host_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w_bf16": (rng.standard_normal((8, 16)) / 3).astype(ml_dtypes.bfloat16),
        "w_int4": rng.integers(-8, 8, (16, 16)).astype(ml_dtypes.int4),
        "scale": np.full((16,), 0.05, np.float32),
        "w_fp8": (rng.standard_normal((16, 4)) / 3).astype(ml_dtypes.float8_e4m3fn),
    }

def forward(params, x):
    h = jax.nn.relu(x @ params["w_bf16"].astype(jnp.float32))
    h = jax.nn.relu(h @ (params["w_int4"].astype(jnp.float32) * params["scale"]))
    return h @ params["w_fp8"].astype(jnp.float32)

def _pad(x, n):
    return np.concatenate([x, np.zeros((n - len(x),) + x.shape[1:], x.dtype)])

def calls():
    rng = np.random.default_rng(2)
    params, out = host_params(), []
    for batch in (3, 11):
        n = 4 if batch <= 4 else 16
        x = rng.standard_normal((batch, 8)).astype(np.float32)
        out.append(("forward", (params, x), (params, _pad(x, n))))
    return out

def run():
    params = host_params()
    return [jax.jit(forward)(params, np.ones((n, 8), np.float32)) for n in (4, 16)]
""",
    manifest="""
version: 1
target: {backend: cpu}
functions:
  - fn: case:forward
    args:
      - {pytree: case:param_specs}
      - {shape: [batch, 8], dtype: float32}
    buckets: {batch: [4, 16]}
""",
)

# shard_map with collectives over 8 host devices: a data-parallel mean (psum over data) and a
# model-parallel matmul whose partial sums meet in a psum over model.
SHARD_MAP = Case(
    module="""
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
try:
    from jax import shard_map
except ImportError:  # JAX before shard_map moved out of experimental
    from jax.experimental.shard_map import shard_map

MESH = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))

def _block(x, w):
    partial = x @ w                           # [batch/4, 8] from this shard's features
    y = jax.lax.psum(partial, "model")        # the model axis's partial sums
    return y - jax.lax.pmean(y.mean(0), "data")  # centred on the whole batch's mean

def layer(x, w):
    return shard_map(_block, mesh=MESH, in_specs=(P("data", "model"), P("model", None)),
                     out_specs=P("data", None))(x, w)

def _pad(x, n):
    return np.concatenate([x, np.zeros((n - len(x),) + x.shape[1:], x.dtype)])

def calls():
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((16, 8)) / 4).astype(np.float32)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    return [("layer", (x, w), (x, w))]

def run():
    w = np.ones((16, 8), np.float32) / 16
    return [jax.jit(layer)(np.ones((n, 16), np.float32), w) for n in (8, 16)]
""",
    manifest="""
version: 1
target: {backend: cpu}
functions:
  - fn: case:layer                 # its shard_map names the mesh; its inputs are the host's
    args:
      - {shape: [batch, 16], dtype: float32}
      - {shape: [16, 8], dtype: float32}
    buckets: {batch: [8, 16]}
""",
    env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
)

CASES = {
    "blackjax": BLACKJAX,
    "brax-mjx": BRAX_MJX,
    "jraph": JRAPH,
    "linalg-fft": LINALG,
    "flax-nnx": FLAX_NNX,
    "equinox-optax": EQUINOX_OPTAX,
    "keras": KERAS,
    "numpyro": NUMPYRO,
    "optax-donation": OPTAX_DONATION,
    "diffrax-nan": DIFFRAX_NAN,
    "kv-decode-donation": KV_DECODE,
    "low-precision-weights": LOW_PRECISION,
    "shard-map-collectives": SHARD_MAP,
}
REQUIRES = {
    "blackjax": "blackjax",
    "brax-mjx": "brax",
    "jraph": "jraph",
    "flax-nnx": "flax",
    "equinox-optax": "equinox",
    "keras": "keras",
    "numpyro": "numpyro",
    "optax-donation": "optax",
    "diffrax-nan": "diffrax",
}
