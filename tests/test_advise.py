"""`cachectl advise`: exact bucket choice from observed sizes, and a written manifest that serves."""

from __future__ import annotations

import itertools
import json
import textwrap

import numpy as np
import pytest
from click.testing import CliRunner
from support.infra import run_py

from cachectl.cli import cli
from cachectl.usage.advise import optimal_buckets, score


def _brute(sizes: dict[int, int], k: int) -> float:
    """The least waste over every choice of at most k buckets that covers all sizes."""
    vs = sorted(sizes)
    return min(
        score([*c, vs[-1]], sizes).waste
        for r in range(min(k, len(vs)))
        for c in itertools.combinations(vs[:-1], r)
    )


def _distributions() -> dict[str, dict[int, int]]:
    rng = np.random.default_rng(7)
    uniform = rng.integers(1, 40, 400)
    tail = np.minimum(rng.pareto(1.5, 400) * 4 + 1, 300).astype(int)
    bimodal = np.concatenate([rng.normal(12, 2, 200), rng.normal(90, 6, 200)]).clip(1).astype(int)
    return {
        name: dict(zip(*np.unique(x, return_counts=True), strict=True))
        for name, x in (("uniform", uniform), ("long-tailed", tail), ("bimodal", bimodal))
    }


@pytest.mark.parametrize("name", ["uniform", "long-tailed", "bimodal"])
def test_the_proposal_is_optimal_against_brute_force(name: str) -> None:
    full = _distributions()[name]
    small = dict(sorted(full.items())[:: max(1, len(full) // 12)])  # brute force stays small
    for k in range(1, 5):
        got = optimal_buckets(small, max_buckets=k)
        assert len(got) <= k and score(got, small).coverage == 1.0
        assert abs(score(got, small).waste - _brute(small, k)) < 1e-12, (name, k, got)


def test_max_waste_gives_the_fewest_buckets_within_the_bound() -> None:
    sizes = _distributions()["bimodal"]
    small = dict(sorted(sizes.items())[::3])
    for bound in (0.3, 0.1, 0.05, 0.01):
        got = optimal_buckets(small, max_waste=bound)
        assert score(got, small).waste <= bound + 1e-12
        if len(got) > 1:
            assert _brute(small, len(got) - 1) > bound  # one fewer bucket cannot meet the bound


def test_raw_sizes_and_a_histogram_give_the_same_answer() -> None:
    raw = np.random.default_rng(1).integers(1, 500, 20_000)
    hist = dict(zip(*np.unique(raw, return_counts=True), strict=True))
    assert optimal_buckets(raw, max_buckets=5) == optimal_buckets(hist, max_buckets=5)


MODEL = """
import jax.numpy as jnp

def embed(tokens):
    return (tokens * 2).astype(jnp.float32)
"""

MANIFEST = """\
# tiny service: one function, one bucketed axis
version: 1
functions:
  - fn: tiny_model:embed   # doubles the tokens
    args:
      - {shape: [1, seq], dtype: int32}
    buckets:
      seq: [8, 64]    # the lengths we guessed
    outputs:
      - {shape: [1, seq]}
"""

SERVE = """
import json, sys, numpy as np
sys.path.insert(0, {dir!r})
import cachectl
rt = cachectl.serving({manifest!r})
embed = rt["embed"]
for n in {sizes!r}:
    out = embed(np.ones((1, n), np.int32))
    assert np.asarray(out).shape == (1, n)
print(json.dumps(rt.report().to_dict()["functions"]["embed"]))
"""

SIZES = [3, 3, 3, 4, 5, 5, 6, 20, 21, 21, 22, 22, 40, 41, 41, 41, 60]


def _cli(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.stdout


def test_advise_from_served_sizes_writes_a_manifest_that_warms_and_serves(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("CACHECTL_TELEMETRY_INTERVAL", "3600")
    (tmp_path / "tiny_model.py").write_text(MODEL)
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(MANIFEST)
    assert json.loads(_cli("warm", str(manifest), "--json"))["summary"]["failed"] == 0
    serve = textwrap.dedent(SERVE).format(dir=str(tmp_path), manifest=str(manifest), sizes=SIZES)
    first = json.loads(run_py(serve, check=True).stdout.strip().splitlines()[-1])
    assert first["out_of_bucket"] == 0 and first["aot"] == len(SIZES)

    report = json.loads(_cli("advise", str(manifest), "--max-buckets", "4", "--json"))
    (fn,) = report["functions"]
    (axis,) = fn["axes"]
    expected = optimal_buckets(
        dict(zip(*np.unique(SIZES, return_counts=True), strict=True)), max_buckets=4
    )
    assert axis["source"] == "serving" and axis["calls"] == len(SIZES)
    assert axis["proposed"]["values"] == expected == [6, 22, 41, 60]
    assert axis["current"]["values"] == [8, 64] and axis["current"]["coverage"] == 1.0
    assert axis["proposed"]["waste"] < axis["current"]["waste"]
    assert fn["programs_current"] == 2 and fn["programs_proposed"] == 4
    assert fn["compile_ms_per_program"] is not None and fn["warm_seconds_proposed"] >= 0
    assert not report["written"] and manifest.read_text() == MANIFEST

    out = _cli("advise", str(manifest), "--max-buckets", "4", "--write")
    assert "-      seq: [8, 64]    # the lengths we guessed" in out
    assert "+      seq: [6, 22, 41, 60]    # the lengths we guessed" in out
    assert manifest.read_text() == MANIFEST.replace("[8, 64]", "[6, 22, 41, 60]")

    assert json.loads(_cli("warm", str(manifest), "--json"))["summary"]["failed"] == 0
    second = json.loads(run_py(serve, check=True).stdout.strip().splitlines()[-1])
    assert second["out_of_bucket"] == 0 and second["aot"] == len(SIZES) and second["fallback"] == 0


def test_advise_bad_input_is_one_line_exit_2(tmp_path) -> None:
    manifest = tmp_path / "m.yaml"
    manifest.write_text(MANIFEST)
    _cli("cache", "list")
    for args in (
        ["--max-buckets", "0"],
        ["--max-waste", "150%"],
        ["--max-buckets", "2", "--max-waste", "0.1"],
        ["--function", "nope"],
    ):
        result = CliRunner().invoke(cli, ["advise", str(manifest), *args])
        assert result.exit_code == 2, (args, result.output)
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    result = CliRunner().invoke(cli, ["advise", str(tmp_path / "missing.yaml")])
    assert result.exit_code == 2


def test_block_style_axis_values_are_rewritten_in_place(tmp_path) -> None:
    from cachectl.manifest import parse_manifest
    from cachectl.usage.advise import rewrite_axes

    text = MANIFEST.replace(
        "      seq: [8, 64]    # the lengths we guessed\n",
        "      seq:   # the lengths we guessed\n        - 8\n        - 64  # max\n",
    )
    m = parse_manifest(text, "m.yaml", tmp_path)
    new = rewrite_axes(text, m, {("embed", "seq"): [6, 22]})
    assert "      seq:   # the lengths we guessed\n        - 6\n        - 22\n    outputs:" in new
    assert parse_manifest(new, "m.yaml", tmp_path).functions[0].buckets == {"seq": [6, 22]}


def test_flow_mapping_buckets_are_rewritten_in_place(tmp_path) -> None:
    """`buckets: {batch: [1, 4], seq: [8, 16]}` on one line (as the field manifests write them):
    advise rewrote nothing and exited 2 ("cannot rewrite axis"), even without --write."""
    from cachectl.manifest import parse_manifest
    from cachectl.usage.advise import rewrite_axes

    text = (
        "version: 1\n"
        "functions:\n"
        "  - fn: m:f\n"
        "    args:\n"
        "      - {shape: [batch, seq], dtype: float32}\n"
        "    buckets: {batch: [1, 4], seq: [8, 16]}  # seq: [99] in a comment stays\n"
    )
    m = parse_manifest(text, "m.yaml", tmp_path)
    new = rewrite_axes(text, m, {("f", "batch"): [3, 4], ("f", "seq"): [5, 8]})
    assert new.endswith(
        "    buckets: {batch: [3, 4], seq: [5, 8]}  # seq: [99] in a comment stays\n"
    )
    assert parse_manifest(new, "m.yaml", tmp_path).functions[0].buckets == {
        "batch": [3, 4],
        "seq": [5, 8],
    }


def test_an_axis_with_one_bucket_value_is_found_by_the_shape_that_names_it(tmp_path) -> None:
    """`seq: [32]` next to `batch: [1, 4]`: no dimension varies with seq across the buckets, so
    advise said "no observed sizes" for it although every call had one; the array argument's
    shape `[batch, seq]` places it."""
    from cachectl.usage.advise import axis_positions
    from cachectl.usage.misses_expected import expected_signatures

    (tmp_path / "onevalue.py").write_text("def f(p, x):\n    return x.sum() + p\n")
    (tmp_path / "m.yaml").write_text(
        "version: 1\n"
        "functions:\n"
        "  - fn: onevalue:f\n"
        "    args:\n"
        "      - {shape: [], dtype: float32}\n"
        "      - {shape: [batch, seq], dtype: int32}\n"
        "    buckets: {batch: [1, 4], seq: [32]}\n"
    )
    expected = expected_signatures(tmp_path / "m.yaml")
    assert len(expected) == 2
    assert axis_positions(expected, ["batch", "seq"]) == {"batch": [(1, 0)], "seq": [(1, 1)]}
