"""First answer beside a heavy bucket: a forward call does not wait for a train step's load.

A Flax NNX model (scripts/tpu_train_step.py's: its train step with AdamW at three buckets) and
its ``forward`` at one bucket, in one manifest with the train step first, so that background
loads start with the train step. Warmed once; then fresh processes, two kinds alternating:

  lazy:  ``cachectl.serving(...)``, then the first ``forward`` call (the train step's buckets
         load in the background; the called bucket loads at once, ahead of them);
  eager: the same, but ``rt.wait_loaded()`` before the first call (what every service did
         before loads moved to the background: every bucket loaded before the first answer).

Each process builds the model's weights first (as a service restores them), then times from
``cachectl.serving(...)`` to the first forward answer on the host (and from its own start), and
reports ``ready_seconds``, ``loaded_seconds`` and the seconds the loads took in all.

    python bench/first_answer_mixed.py --work DIR [--rounds N] [--small] [--json]

Needs flax and optax. ``--small`` shrinks the model (a CPU smoke run). ``JAX_PLATFORMS`` is left
as the caller has it: on a TPU host, unset, the services run on the chip.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

FORWARD = """

def forward(params, tokens):
    return nnx.merge(GRAPHDEF, params)(tokens)
"""

# The train step's manifest (scripts/tpu_train_step.py), then its forward at one bucket.
FORWARD_ENTRY = """  - name: forward
    fn: nnx_train:forward
    args:
      - {pytree: nnx_train:params_specs}
      - {shape: [batch, seq], dtype: int32}
    buckets:
      batch: [1]
      seq: [128]
"""

SERVICE = r"""
import time
t0 = time.perf_counter()
import json, sys
import numpy as np
import cachectl
import nnx_train
from flax import nnx
mode = sys.argv[1]
params = nnx.split(nnx_train.make_model())[1]  # the service's weights, before serving starts
tokens = np.zeros((1, 100), np.int32)
t1 = time.perf_counter()
rt = cachectl.serving("manifest.yaml", telemetry=False)
built = time.perf_counter() - t1
if mode == "eager":
    rt.wait_loaded()
out = np.asarray(rt["forward"](params, tokens))
t2 = time.perf_counter()
report = rt.report().to_dict()
print(json.dumps(dict(first_answer_s=t2 - t0, serving_to_answer_s=t2 - t1, built_s=built,
                      ready_s=report["ready_seconds"], loaded_s=report.get("loaded_seconds"),
                      load_s=report.get("load_seconds"),
                      aot={n: f["aot"] for n, f in report["functions"].items()},
                      fallback={n: f["fallback"] for n, f in report["functions"].items()},
                      shape=list(out.shape))))
"""


def _train_step_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "tpu_train_step", REPO / "scripts" / "tpu_train_step.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model(small: bool) -> str:
    model = str(_train_step_module().MODEL)
    if small:
        model = model.replace(
            "WIDTH, LAYERS, VOCAB = 512, 4, 1024", "WIDTH, LAYERS, VOCAB = 64, 2, 128"
        )
    return model + FORWARD


def _run(work: Path, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=900)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--work", type=Path, required=True, help="a directory for the model and its cache"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a small model (a CPU smoke run)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON only")
    args = parser.parse_args(argv)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    (work / "nnx_train.py").write_text(_model(args.small))
    (work / "manifest.yaml").write_text(_train_step_module().MANIFEST + FORWARD_ENTRY)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(work), os.environ.get("PYTHONPATH")) if p),
    }
    for var, sub in (
        ("XDG_CACHE_HOME", "cache"),
        ("XDG_DATA_HOME", "data"),
        ("XDG_STATE_HOME", "state"),
        ("XDG_CONFIG_HOME", "config"),
    ):
        env[var] = str(work / "home" / sub)
    started = time.perf_counter()
    warm = _run(work, [sys.executable, "-m", "cachectl", "warm", "manifest.yaml", "--json"], env)
    if warm.returncode != 0:
        print(warm.stderr[-3000:], file=sys.stderr)
        return 1
    warmed = json.loads(warm.stdout)["summary"]
    runs: dict[str, list[dict[str, Any]]] = {"lazy": [], "eager": []}
    for _ in range(args.rounds):
        for kind in ("lazy", "eager"):
            proc = _run(work, [sys.executable, "-c", SERVICE, kind], env)
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            runs[kind].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    med = {k: statistics.median(r["serving_to_answer_s"] for r in v) for k, v in runs.items()}
    result = {
        "warm": {k: warmed.get(k) for k in ("compiled", "cached", "failed")},
        "warm_seconds": round(time.perf_counter() - started, 1),
        "rounds": args.rounds,
        "runs": runs,
        "serving_to_answer_median_s": med,
        "lazy_over_eager": med["lazy"] / med["eager"],
    }
    if args.json:
        print(json.dumps(result))
        return 0
    for kind, rows in runs.items():
        print(
            f"{kind}: serving() to the first answer "
            + ", ".join(f"{r['serving_to_answer_s']:.2f}s" for r in rows)
            + f"; loads {rows[-1]['load_s']}s in all; every bucket loaded at {rows[-1]['loaded_s']}s"
        )
    print(
        f"serving() to the first answer, lazy / eager (medians): {result['lazy_over_eager']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
