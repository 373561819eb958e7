"""The field suite: services built on real JAX libraries from the package index, each in fresh processes.

Per case: (a) no cache, (b) plain ``cachectl.activate()`` after the warm, (c) ``cachectl.serving``
where a manifest can name the program (a library's private jit is warmed with ``cachectl
warm-run`` instead). What is checked is what JAX itself counted in the same process
(``/jax/compilation_cache/*`` events, ``/jax/core/compile/*`` durations): no crash, zero compiles
in (c) and a hit for every program in (b), outputs equal to ``jax.jit``'s on the same padded
inputs, ``warm-check`` at 100% (for a warm-run, ``warm-check --replay`` of its command: every
compile request a hit), and ``cachectl misses`` naming nothing. The libraries are the ``field``
extra (scripts/test installs it). Wall times of (a)-(c) are printed for BENCHMARKS.md's "Field" section, never asserted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.infra import run_cachectl, run_py  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# JAX's own counters in a service process: compile requests that used the persistent cache,
# its hits, and the tracing / XLA compile durations (one event per traced or compiled program).
PROBE = """
import json, sys, time
t0 = time.perf_counter()
counts = dict(requests=0, hits=0, traces=0, compiles=0)
def _event(event, **kw):
    if event == "/jax/compilation_cache/compile_requests_use_cache":
        counts["requests"] += 1
    elif event == "/jax/compilation_cache/cache_hits":
        counts["hits"] += 1
def _duration(event, duration, **kw):
    if event == "/jax/core/compile/jaxpr_trace_duration":
        counts["traces"] += 1
    elif event == "/jax/core/compile/backend_compile_duration":
        counts["compiles"] += 1
import jax
jax.monitoring.register_event_listener(_event)
jax.monitoring.register_event_duration_secs_listener(_duration)
sys.path.insert(0, {dir!r})
"""

# (c): every call of the case through cachectl.serving; then jax.jit on the padded inputs.
SERVING = (
    PROBE
    + """
import numpy as np
import cachectl
rt = cachectl.serving({manifest!r})
import case
calls = case.calls()
start = dict(counts)
t1 = time.perf_counter()
served = [rt[name](*args) for name, args, _ in calls]
jax.block_until_ready(served)
first_calls = time.perf_counter() - t1
during = dict(counts)
flat = lambda tree: [np.asarray(leaf).tolist() for leaf in jax.tree_util.tree_leaves(tree)]
expected = [jax.jit(getattr(case, name))(*padded) for name, _, padded in calls]
close = all(
    all(np.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(flat(s), flat(e), strict=True))
    for s, e in zip(served, expected, strict=True)
)
report = rt.report().to_json()
print(json.dumps(dict(start=start, during=during, close=close, report=report,
                      ready_s=report["ready_seconds"], first_calls_s=first_calls,
                      wall_s=time.perf_counter() - t0)))
"""
)

# (a) and (b): the case's own calls through jax.jit, with no cache or under activate().
PLAIN = (
    PROBE
    + """
import numpy as np
if {activate}:
    import cachectl
    cachectl.activate(readonly=True)
import case
out = case.run()
jax.block_until_ready(out)
print(json.dumps(dict(counts=counts, calls=len(out), wall_s=time.perf_counter() - t0)))
"""
)


@dataclass(frozen=True)
class Case:
    module: str  # the service's code: calls() for (c), run() for (a)/(b)
    manifest: str | None  # None: a library-internal jit, warmed by running warmup
    # Run by `cachectl warm-run` (after the manifest's warm, if any): what only running warms.
    warmup: str | None = None
    # Why (c) cannot serve from stored executables, as warm reports it; None: it must.
    not_stored: str | None = None


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
    buckets: {batch: [1, 4], seq: [8, 16]}
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
    # An Equinox module's treedef (its static fields hold functions) does not survive pickling,
    # so a program that returns one is not stored; serving then goes through jax.jit, which
    # reads the persistent-cache entry warm wrote.
    not_stored="the outputs' pytree does not survive pickling",
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
      - {pytree: case:state_specs, leaf_axes: {0: n}}
      - {shape: [n, 1], dtype: float32}
    buckets: {n: [1, 4]}
""",
)

CASES = {
    "brax-mjx": BRAX_MJX,
    "linalg-fft": LINALG,
    "flax-nnx": FLAX_NNX,
    "equinox-optax": EQUINOX_OPTAX,
    "keras": KERAS,
    "numpyro": NUMPYRO,
}
REQUIRES = {
    "brax-mjx": "brax",
    "flax-nnx": "flax",
    "equinox-optax": "equinox",
    "keras": "keras",
    "numpyro": "numpyro",
}


def _cachectl(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # The case's directory first, then this checkout's own path (not another one installed)
    path = os.pathsep.join(p for p in (str(cwd), os.environ.get("PYTHONPATH")) if p)
    return run_cachectl(cwd, *args, env={"PYTHONPATH": path, "KERAS_BACKEND": "jax"})


def _run(code: str) -> dict[str, Any]:
    proc = run_py(code, {"KERAS_BACKEND": "jax"}, timeout=600, check=True)  # a crash fails here
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(CASES))
def test_field_service(tmp_path: Path, name: str) -> None:
    if name in REQUIRES and importlib.util.find_spec(REQUIRES[name]) is None:
        pytest.skip(
            f"{REQUIRES[name]} is not installed: the field extra, pip install -e '.[field]'"
        )
    case = CASES[name]
    (tmp_path / "case.py").write_text(textwrap.dedent(case.module))
    plain = PLAIN.format(dir=str(tmp_path), activate=False)
    cold = _run(plain)  # (a): no cache at all
    assert cold["counts"]["compiles"] > 0

    if case.manifest is not None:
        manifest = tmp_path / "field.yaml"
        manifest.write_text(textwrap.dedent(case.manifest))
        warm = _cachectl(tmp_path, "warm", str(manifest), "--json")
        assert warm.returncode == 0, warm.stderr
        report = json.loads(warm.stdout)
        assert report["summary"]["failed"] == 0
        aot_errors = {b["aot_error"] for b in report["buckets"]}
        if case.not_stored is None:
            assert aot_errors == {None}, aot_errors
        else:
            assert all(case.not_stored in (e or "") for e in aot_errors), aot_errors
        check = _cachectl(tmp_path, "warm-check", str(manifest))
        assert "coverage: " in check.stdout and "buckets hit (100.0%)" in check.stdout, (
            check.stdout + check.stderr
        )
        assert check.returncode == 0, check.stderr  # what is not stored is no failed call
        if case.not_stored is None:
            calls = len(report["buckets"])
            assert f"stored executables: {calls}/{calls} load and run (100.0%)" in check.stdout
    if case.warmup is not None:
        (tmp_path / "warmup.py").write_text(case.warmup)
        warm = _cachectl(tmp_path, "warm-run", "--json", "--", sys.executable, "warmup.py")
        assert warm.returncode == 0, warm.stderr
        assert json.loads(warm.stdout)["exit_code"] == 0

    activated = _run(PLAIN.format(dir=str(tmp_path), activate=True))  # (b)
    counts = activated["counts"]
    if case.warmup is not None:  # warm-run wrote every program its run compiled, eager ones too
        # (a backend_compile_duration event fires around a persistent-cache hit too: the hit
        # count against the requests is JAX's own word on what compiled)
        assert counts["requests"] > 0 and counts["hits"] == counts["requests"], counts
    else:  # warm wrote the manifest's programs: each call of one hits
        assert counts["hits"] >= activated["calls"] > 0, counts

    if case.manifest is None:  # warm-check replays the warm-run's command read-only: all hits
        replay = _cachectl(tmp_path, "warm-check", "--replay", "--json")
        assert replay.returncode == 0, replay.stdout + replay.stderr
        replayed = json.loads(replay.stdout)
        assert replayed["exit_code"] == 0 and replayed["processes"] == 1, replayed
        assert replayed["requests"] == replayed["hits"] > 0, replayed

    timings = {"a_no_cache_s": cold["wall_s"], "b_activate_s": activated["wall_s"]}
    if case.manifest is not None:  # (c)
        served = _run(SERVING.format(dir=str(tmp_path), manifest=str(tmp_path / "field.yaml")))
        assert served["close"], served
        if case.not_stored is None:
            assert served["during"]["traces"] == served["start"]["traces"], served
            assert served["during"]["compiles"] == served["start"]["compiles"], served
            for fn, rep in served["report"]["functions"].items():
                assert rep["fallback"] == 0 and rep["aot"] == rep["calls"] > 0, (
                    fn,
                    rep,
                )
        else:  # through jax.jit: traced, and its program read from the persistent cache
            assert served["during"]["hits"] - served["start"]["hits"] >= 1, served
            assert served["during"]["requests"] - served["start"]["requests"] == (
                served["during"]["hits"] - served["start"]["hits"]
            ), served
        timings |= {"c_serving_s": served["wall_s"], "c_ready_s": served["ready_s"]}

    # What (b) and (c) recorded (telemetry is on under activate() and serving): nothing missed.
    missed = _cachectl(tmp_path, "misses", "--json")
    assert missed.returncode == 0, missed.stdout + missed.stderr
    seen = json.loads(missed.stdout)
    assert seen["requests"] > 0, seen  # the services' signatures were recorded at all
    assert seen["misses"] == 0 and seen["missed"] == [] and seen["findings"] == [], seen
    print(json.dumps({"case": name, **{k: round(v, 3) for k, v in timings.items()}}))
