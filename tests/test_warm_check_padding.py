"""warm-check --padding: padded answers through the stored executables against jax.jit at the
raw shapes.

Real warms in fresh processes, then `cachectl warm-check MANIFEST --padding` through the CLI in a
fresh process (its exit code and stderr as a user sees them): a mean over the padded sequence
axis lets the padded zeros in and is caught (exit 1, the function and the axis named); a sum,
a mean masked with a bool mask (padded with False, as serving pads it: ``cachectl.mask``'s
valid region) and a function whose only bucket axis is static pass (exit 0).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
from support.warming import invoke

from cachectl.dispatch import mask
from cachectl.manifest import expand, parse_manifest
from cachectl.warm.padding_check import compare, raw_sizes, tolerance

MODULE = """
import jax.numpy as jnp

def mean_seq(x):
    return jnp.mean(x, axis=1)

def sum_seq(x):
    return jnp.sum(x, axis=1)

def masked_mean(x, valid):
    return jnp.sum(jnp.where(valid, x, 0.0), axis=1) / jnp.sum(valid, axis=1)

def scaled(x, k):
    return x * k
"""

FUNCTIONS = {
    "mean_seq": """
  - name: mean_seq
    fn: wp_models:mean_seq
    args: [{shape: [2, seq], dtype: float32}]
    buckets: {seq: [4, 8]}
""",
    "sum_seq": """
  - name: sum_seq
    fn: wp_models:sum_seq
    args: [{shape: [2, seq], dtype: float32}]
    buckets: {seq: [4, 8]}
""",
    "masked_mean": """
  - name: masked_mean
    fn: wp_models:masked_mean
    args: [{shape: [2, seq], dtype: bfloat16}, {shape: [2, seq], dtype: bool}]
    outputs: [{shape: [2]}]
    buckets: {seq: [8]}
""",
    "scaled": """
  - name: scaled
    fn: wp_models:scaled
    jit: {static_argnames: [k]}
    args: [{shape: [2, 3], dtype: float32}]
    kwargs: {k: {axis: k}}
    buckets: {k: [2, 3]}
""",
}


def _manifest(tmp_path: Path, name: str, functions: list[str]) -> Path:
    (tmp_path / "wp_models.py").write_text(MODULE)
    path = tmp_path / name
    head = "version: 1\ntarget: {backend: cpu}\nfunctions:"
    path.write_text(head + "".join(FUNCTIONS[f] for f in functions))
    return path


def _cachectl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`cachectl ARGS` in a fresh process, as a user runs it; its output a log's (no COLUMNS)."""
    return subprocess.run(
        [sys.executable, "-m", "cachectl", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
        env={k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")},
    )


def test_padding_catches_a_mean_over_the_padded_axis_and_passes_a_sum(tmp_path: Path) -> None:
    both = _manifest(tmp_path, "both.yaml", ["mean_seq", "sum_seq"])
    safe = _manifest(tmp_path, "safe.yaml", ["sum_seq", "masked_mean", "scaled"])
    for manifest in (both, safe):
        warmed = _cachectl("warm", str(manifest), "--json", cwd=tmp_path)
        assert warmed.returncode == 0, warmed.stderr[-2000:]

    # The mean lets the padded zeros in: exit 1, naming the function and the axis.
    checked = _cachectl("warm-check", str(both), "--padding", "--json", cwd=tmp_path)
    assert checked.returncode == 1, (checked.stdout[-2000:], checked.stderr[-2000:])
    assert "padding changes the answer of mean_seq along axis seq" in checked.stderr
    assert "sum_seq" not in checked.stderr.split("padding changes the answer of", 1)[1]
    data = json.loads(checked.stdout)
    assert data["summary"]["hits"] == 4 and data["summary"]["aot_ran"] == 4
    verdicts = {f["function"]: f for f in data["padding"]["functions"]}
    mean, total = verdicts["mean_seq"], verdicts["sum_seq"]
    assert mean["status"] == "differs" and mean["axes"] == ["seq"]
    # seq 4: raw 1, 2, 3; seq 8: raw 5, 6, 7 (the previous bucket + 1, between, the bucket - 1)
    assert mean["samples"] == 6 and total["samples"] == 6
    (leaf,) = mean["leaves"]
    # uniform [0, 1) inputs: a mean over 1 of 4 padded positions is off by about 3/4 of it
    assert leaf["ok"] is False and leaf["max_abs"] > 0.05 > leaf["atol"] + leaf["rtol"]
    assert (leaf["rtol"], leaf["atol"]) == (1e-5, 1e-6)
    assert total["status"] == "equal" and total["leaves"][0]["max_abs"] <= 1e-5

    # Tolerances from the command line: a tolerance wider than the leak passes it.
    loose = _cachectl("warm-check", str(both), "--padding", "--atol", "10", "--json", cwd=tmp_path)
    assert loose.returncode == 0, loose.stderr[-2000:]
    (leaf,) = json.loads(loose.stdout)["padding"]["functions"][0]["leaves"]
    assert leaf["atol"] == 10.0 and leaf["max_abs"] > 0.05

    # A sum, a mask padded with False, a static-only function: exit 0, human output.
    passed = _cachectl("warm-check", str(safe), "--padding", cwd=tmp_path)
    assert passed.returncode == 0, (passed.stdout[-3000:], passed.stderr[-2000:])
    text = passed.stdout
    assert "padding: stored executables on padded inputs against jax.jit at the raw shape" in text
    assert "padding: 2 equal, 1 skipped of 3 function(s)" in text, text
    assert "no padded axis: its buckets are all static" in text
    assert "bfloat16" in text and "rtol 0.016, atol 0.01" in text


def test_padding_options_and_their_pieces(tmp_path: Path) -> None:
    manifest = _manifest(tmp_path, "both.yaml", ["mean_seq", "sum_seq"])
    # Bad input: one line, exit 2, before anything runs.
    said = invoke("warm-check", str(manifest), "--rtol", "1e-3", code=2).output
    assert "--rtol and --atol are --padding's tolerances: add --padding" in said
    said = invoke("warm-check", "--replay", "--padding", code=2).output
    assert "--padding checks a MANIFEST's buckets; it does not go with --replay" in said
    invoke("warm-check", str(manifest), "--padding", "--atol", "-1", code=2)

    # The raw sizes sampled: the previous bucket + 1, one between, the bucket - 1, per axis.
    spec = parse_manifest(
        "version: 1\nfunctions:\n  - fn: m:f\n    args: [{shape: [batch, seq], dtype: float32}]\n"
        "    buckets: {batch: [1, 8], seq: [32, 128]}\n"
    )
    buckets = expand(spec)
    at = {json.dumps(b.values, sort_keys=True): b for b in buckets}
    b = at[json.dumps({"batch": 8, "seq": 128}, sort_keys=True)]
    assert raw_sizes(buckets, b, "seq") == [33, 80, 127]
    assert raw_sizes(buckets, b, "batch") == [2, 4, 7]
    small = at[json.dumps({"batch": 1, "seq": 32}, sort_keys=True)]
    assert raw_sizes(buckets, small, "batch") == []  # nothing below 1

    # Tolerance per dtype; exact for integers and bools.
    assert tolerance("float32", None, None) == (1e-5, 1e-6)
    assert tolerance("bfloat16", None, 0.5) == (1.6e-2, 0.5)
    assert tolerance("int32", 1.0, 1.0) is None and tolerance("bool", None, None) is None
    assert tolerance("float8_e4m3fn", None, None) == (0.25, 0.125)
    bf16 = np.array([1.0, 2.0], ml_dtypes.bfloat16)
    leaves, why = compare([bf16], [bf16 + np.array([0.0078125], ml_dtypes.bfloat16)], None, None)
    assert why is None and leaves[0]["ok"] is True
    leaves, _ = compare([np.array([3], np.int32)], [np.array([4], np.int32)], 10.0, 10.0)
    assert leaves[0]["ok"] is False and leaves[0]["max_abs"] == 1.0
    # Outputs serving does not cut (no `outputs:`) are compared in the raw region.
    leaves, why = compare([np.zeros((2, 8))], [np.zeros((2, 5))], None, None)
    assert why is None and leaves[0]["uncut"] is True and leaves[0]["ok"] is True
    _, why = compare([np.zeros((2, 8))], [np.zeros((2, 9))], None, None)
    assert why == "output 0: float64[2, 8] served, float64[2, 9] by jit"

    # An all-True mask at the raw size, padded as serving pads a bool argument, is the mask
    # cachectl.mask gives for the raw lengths.
    from cachectl.dispatch.calls import arg_plans
    from cachectl.dispatch.padding import pad_to

    masked = parse_manifest(
        "version: 1\nfunctions:\n  - fn: m:f\n    args: [{shape: [2, seq], dtype: bool}]\n"
        "    buckets: {seq: [8]}\n"
    )
    (plan,) = arg_plans(masked.functions[0])
    padded = pad_to(np.ones((2, 5), np.bool_), (2, 8), plan.pad, plan.dtype)
    assert (padded == mask([5, 5], 8)).all()
