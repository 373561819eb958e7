"""A Flax NNX train step in fresh processes: plain JAX, activate(), cachectl.serving.

    python scripts/tpu_train_step.py --work DIR [--rounds N]

Needs flax and optax. Writes a model module and its manifest into DIR, warms it with
`cachectl warm` into DIR's own default cache, then starts fresh processes, the three kinds
alternating, each timing from its start until every bucket's train step has returned once:

  (a) plain ``jax.jit``, no cache: every bucket traces, lowers and compiles;
  (b) ``cachectl.activate()`` + ``jax.jit``: every bucket traces and lowers, then hits;
  (c) ``cachectl.serving``: every bucket calls its stored executable (no trace, no lowering).

Prints one JSON object: per kind the process times, the first calls' seconds and, for (b),
the seconds of those first calls spent in tracing and lowering (``.lower()`` of the same
jitted function, whose trace the call then reuses).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

MODEL = """
import jax
import jax.numpy as jnp
import optax
from flax import nnx

WIDTH, LAYERS, VOCAB = 512, 4, 1024


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.up = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
        self.down = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class Model(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        for i in range(LAYERS):
            setattr(self, f"block{i}", Block(rngs))
        self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for i in range(LAYERS):
            x = getattr(self, f"block{i}")(x)
        return self.head(x)


def make_model():
    return Model(nnx.Rngs(0))


GRAPHDEF, _ = nnx.split(nnx.eval_shape(make_model))
OPTIMIZER = optax.adamw(1e-3)


def params_specs():
    return nnx.split(nnx.eval_shape(make_model))[1]


def opt_specs():
    return jax.eval_shape(OPTIMIZER.init, params_specs())


def train_step(params, opt_state, tokens, targets):
    def loss_fn(p):
        logits = nnx.merge(GRAPHDEF, p)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def real_state():
    params = nnx.split(make_model())[1]
    return params, OPTIMIZER.init(params)
"""

BUCKETS = ((8, 128), (32, 128), (8, 512))

MANIFEST = """
version: 1
functions:
  - name: train_step
    fn: nnx_train:train_step
    args:
      - {pytree: nnx_train:params_specs}
      - {pytree: nnx_train:opt_specs}
      - {shape: [batch, seq], dtype: int32}
      - {shape: [batch, seq], dtype: int32}
    buckets:
      batch: [8, 32]
      seq: [128, 512]
    exclude:
      - {batch: 32, seq: 512}
"""

# The same step with its state donated, as trainers write it: the canary must give each call
# inputs of its own, or the first call deletes them (issue: "Array has been deleted").
MANIFEST_DONATED = MANIFEST.replace(
    "    fn: nnx_train:train_step\n",
    "    fn: nnx_train:train_step\n    jit: {donate_argnums: [0, 1]}\n",
)

SERVICE = """
import time
t0 = time.perf_counter()
import json, sys
import numpy as np
import jax
mode = sys.argv[1]
setup = lower = 0.0
if mode in ("activate", "serving"):
    import cachectl
t = time.perf_counter()
if mode == "activate":
    cachectl.activate(readonly=True, telemetry=False)
import nnx_train
if mode == "serving":
    rt = cachectl.serving("manifest.yaml", telemetry=False)
    step = rt["train_step"]
else:
    step = jax.jit(nnx_train.train_step)
setup = time.perf_counter() - t
params, opt_state = nnx_train.real_state()
jax.block_until_ready(params)
firsts = []
for batch, seq in BUCKETS:
    tokens = np.zeros((batch, seq), np.int32)
    t = time.perf_counter()
    if mode == "activate":  # tracing and lowering alone (the call below reuses them), then a hit
        step.lower(params, opt_state, tokens, tokens)
        lower += time.perf_counter() - t
    out = step(params, opt_state, tokens, tokens)
    jax.block_until_ready(out)
    firsts.append(time.perf_counter() - t)
print(json.dumps({"ready": time.perf_counter() - t0, "setup": setup, "firsts": firsts,
                  "lower": lower}))
"""


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    (work / "nnx_train.py").write_text(textwrap.dedent(MODEL))
    (work / "manifest.yaml").write_text(textwrap.dedent(MANIFEST))
    (work / "service.py").write_text(SERVICE.replace("BUCKETS", repr(BUCKETS)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHECTL_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(work), env.get("PYTHONPATH")) if p)
    for sub in ("data", "cache", "config", "state"):
        (work / "home" / sub).mkdir(parents=True, exist_ok=True)
        env[f"XDG_{sub.upper()}_HOME"] = str(work / "home" / sub)
    started = time.perf_counter()
    warm = _run([sys.executable, "-m", "cachectl", "warm", "manifest.yaml", "--json"], work, env)
    if warm.returncode != 0:
        print(json.dumps({"error": "warm failed", "stderr": warm.stderr[-3000:]}))
        return 1
    report = json.loads(warm.stdout)
    result: dict[str, object] = {
        "warm_seconds": time.perf_counter() - started,
        "warm_buckets": [
            {k: b.get(k) for k in ("bucket", "status", "compile_seconds", "bytes", "aot_bytes")}
            for b in report["buckets"]
        ],
        "warm_summary": report["summary"],
    }
    rewarm_started = time.perf_counter()
    rewarm = _run([sys.executable, "-m", "cachectl", "warm", "manifest.yaml", "--json"], work, env)
    result["rewarm_seconds"] = time.perf_counter() - rewarm_started
    if rewarm.returncode == 0:
        result["rewarm_summary"] = json.loads(rewarm.stdout)["summary"]
    alone_started = time.perf_counter()  # lowering one bucket at a time
    alone = _run(
        [sys.executable, "-m", "cachectl", "warm", "manifest.yaml", "--json", "-j", "1"], work, env
    )
    result["rewarm_jobs1_seconds"] = time.perf_counter() - alone_started
    if alone.returncode == 0:
        result["rewarm_jobs1_summary"] = json.loads(alone.stdout)["summary"]
    samples: dict[str, list[dict[str, object]]] = {"plain": [], "activate": [], "serving": []}
    errors: list[str] = []
    for _ in range(args.rounds):
        for mode in samples:
            run_env = dict(env)
            if mode == "plain":
                run_env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
            proc = _run([sys.executable, "service.py", mode], work, run_env)
            if proc.returncode != 0:
                errors.append(f"{mode}: {proc.stderr[-1500:]}")
                continue
            samples[mode].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    result["samples"] = samples
    result["medians"] = {
        mode: {
            "ready": statistics.median(float(r["ready"]) for r in rows),  # type: ignore[arg-type]
            "first_calls": statistics.median(sum(r["firsts"]) for r in rows),  # type: ignore[arg-type]
            "lower": statistics.median(float(r["lower"]) for r in rows),  # type: ignore[arg-type]
        }
        for mode, rows in samples.items()
        if rows
    }
    result["errors"] = errors
    print(json.dumps(result))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
