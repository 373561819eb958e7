"""Manifest schema, validation messages, bucket expansion, sharding and real compiles of the example."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.manifests import IMPORT_ERRORS, MALFORMED

from cachectl.core.errors import BadInput, EnvironmentMismatch
from cachectl.manifest import (
    Bucket,
    Target,
    build_call,
    check_imports,
    expand,
    is_jitted,
    jit_function,
    jit_options,
    load_manifest,
    manifest_digest,
    parse_manifest,
    parse_shard,
    resolve_callable,
    select_shard,
)
from examples import lm

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "manifest.yaml"


def write(tmp_path: Path, text: str, name: str = "manifest.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def run_python(code: str, env_extra: dict[str, str], cwd: Path) -> str:
    """Run code in a fresh interpreter: JAX's device count and cache are fixed per process."""
    env = {**os.environ, **env_extra, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


# --------------------------------------------------------------------------- the example


def test_example_expands_to_eleven_buckets_in_declared_order() -> None:
    manifest = load_manifest(EXAMPLE)
    buckets = expand(manifest)
    assert [str(b) for b in buckets] == [
        "prefill[batch=1,seq=32]",
        "prefill[batch=1,seq=64]",
        "prefill[batch=1,seq=128]",
        "prefill[batch=4,seq=32]",
        "prefill[batch=4,seq=64]",
        "prefill[batch=4,seq=128]",
        "prefill[batch=8,seq=32]",
        "prefill[batch=8,seq=64]",  # {batch: 8, seq: 128} is excluded
        "decode_step[batch=1]",
        "decode_step[batch=4]",
        "decode_step[batch=8]",
    ]
    assert [b.index for b in buckets] == list(range(11))
    assert len({b.id for b in buckets}) == 11
    assert manifest.target == Target(backend="cpu")
    assert manifest.names == ["prefill", "decode_step"]


def test_bucket_id_is_stable_and_ignores_axis_order() -> None:
    a = Bucket("prefill", {"batch": 4, "seq": 128}, 5)
    b = Bucket("prefill", {"seq": 128, "batch": 4}, 0)
    assert a.id == b.id
    # Pinned: the id is recorded in indexes, so it must not drift between releases.
    canon = json.dumps(["prefill", [["batch", 4], ["seq", 128]]], separators=(",", ":"))
    assert a.id == hashlib.sha256(canon.encode()).hexdigest()[:16]
    assert a.label == "batch=4,seq=128" and b.label == "seq=128,batch=4"
    assert Bucket("f", {"sampling": "greedy", "on": True}, 0).label == "sampling=greedy,on=true"
    assert Bucket("f", {}, 0).label == "" and str(Bucket("f", {}, 0)) == "f[]"


def test_build_call_matches_the_model(tmp_path: Path) -> None:
    manifest = load_manifest(EXAMPLE)
    check_imports(manifest)
    by_name = {str(b): b for b in expand(manifest)}

    prefill = manifest.function("prefill")
    args, kwargs = build_call(prefill, by_name["prefill[batch=4,seq=64]"])
    assert kwargs == {}
    params, tokens = args
    assert tokens == jax.ShapeDtypeStruct((4, 64), jnp.int32)
    assert jax.tree.structure(params) == jax.tree.structure(lm.param_specs())
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(params))
    assert jit_options(prefill) == {}

    decode = manifest.function("decode_step")
    assert jit_options(decode) == {"static_argnames": ("sampling",), "donate_argnums": (1,)}
    args, kwargs = build_call(decode, by_name["decode_step[batch=8]"])
    assert kwargs == {"sampling": "greedy"}
    _, kv, token, pos, key = args
    # The manifest repeats the model's numbers; keep them in step.
    assert kv == jax.ShapeDtypeStruct(lm.kv_cache_shape(8), lm.KV_DTYPE)
    assert token.shape == (8, 1) and pos.shape == () and pos.dtype == jnp.int32
    assert key == jax.ShapeDtypeStruct((2,), jnp.uint32)
    with pytest.raises(ValueError, match="belongs to"):
        build_call(prefill, by_name["decode_step[batch=8]"])


def test_compile_one_example_bucket_and_run_it() -> None:
    manifest = load_manifest(EXAMPLE)
    decode = manifest.function("decode_step")
    bucket = next(b for b in expand(manifest) if str(b) == "decode_step[batch=1]")
    args, kwargs = build_call(decode, bucket)
    fn = jit_function(decode)
    assert is_jitted(fn) and not is_jitted(lm.decode_step)
    compiled = fn.lower(*args, **kwargs).compile()

    params = lm.init_params(jax.random.key(0))
    cache = lm.init_kv_cache(1)
    token, cache = compiled(
        params, cache, jnp.array([[7]], jnp.int32), jnp.int32(0), jax.random.PRNGKey(0)
    )
    assert token.shape == (1, 1) and token.dtype == jnp.int32
    assert 0 <= int(token[0, 0]) < lm.CONFIG.vocab
    assert cache.shape == lm.kv_cache_shape(1)


def test_warmed_programs_are_the_ones_a_service_compiles(tmp_path: Path) -> None:
    """The point of a manifest: a service calling the real functions hits what warm wrote."""
    cache_env = {
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
        "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "none",
        "JAX_PLATFORMS": "cpu",
    }
    warm = f"""
        from cachectl.manifest import load_manifest, expand, build_call, check_imports, jit_function
        m = load_manifest({str(EXAMPLE)!r})
        check_imports(m)
        for b in expand(m):
            if str(b) in ("prefill[batch=1,seq=32]", "decode_step[batch=4]"):
                spec = m.function(b.function)
                args, kwargs = build_call(spec, b)
                jit_function(spec).lower(*args, **kwargs).compile()
    """
    run_python(warm, cache_env, tmp_path)
    written = sorted(p.name.split("-")[0] for p in (tmp_path / "cache").glob("*-cache"))
    assert written == ["jit_decode_step", "jit_prefill"]  # and nothing else compiled

    serve = """
        import jax, jax.numpy as jnp
        from examples import lm
        counts = {}
        jax.monitoring.register_event_listener(lambda e, **kw: counts.__setitem__(e, counts.get(e, 0) + 1))
        params = lm.init_params(jax.random.key(0))
        prefill = jax.jit(lm.prefill)
        decode = jax.jit(lm.decode_step, static_argnames=["sampling"], donate_argnums=[1])
        logits, _ = prefill(params, jnp.zeros((1, 32), jnp.int32))
        token, _ = decode(params, lm.init_kv_cache(4), jnp.zeros((4, 1), jnp.int32),
                          jnp.int32(32), jax.random.PRNGKey(0))
        token.block_until_ready()
        print(counts.get("/jax/compilation_cache/cache_hits", 0))
    """
    # Only the two warmed programs are in the cache, so two hits means both were found.
    assert run_python(serve, cache_env, tmp_path).strip() == "2"


def test_lm_prefill_then_decode_is_consistent() -> None:
    """The kv cache is right: decoding one token equals prefilling one token more."""
    params = lm.init_params(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, lm.CONFIG.vocab, jnp.int32)
    prefill = jax.jit(lm.prefill)
    decode = jax.jit(lm.decode_step, static_argnames=["sampling"], donate_argnums=[1])

    full_logits, _ = prefill(params, tokens)
    logits, cache = prefill(params, tokens[:, :16])
    assert (
        logits.shape == (2, 16, lm.CONFIG.vocab) and logits.dtype == jnp.float32
    )  # every position
    assert cache.shape == lm.kv_cache_shape(2) and cache.dtype == lm.KV_DTYPE
    step_logits, _ = jax.jit(lm.decode_logits)(params, cache, tokens[:, 16:17], jnp.int32(16))
    np.testing.assert_allclose(step_logits, full_logits[:, -1], atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(logits, full_logits[:, :16], atol=2e-3, rtol=2e-3)  # causal

    token = tokens[:, 16:17]
    key = jax.random.PRNGKey(0)
    for pos in range(16, 20):
        sampling = "greedy" if pos % 2 else "sample"
        token, cache = decode(params, cache, token, jnp.int32(pos), key, sampling=sampling)
        key = jax.random.fold_in(key, pos)
        assert token.shape == (2, 1) and token.dtype == jnp.int32
        assert bool(((token >= 0) & (token < lm.CONFIG.vocab)).all())
    with pytest.raises(ValueError, match="sampling"):
        lm.decode_step(params, cache, token, jnp.int32(0), key, sampling="beam")


# --------------------------------------------------------------------------- buckets and shards

SMALL = """
version: 1
functions:
  - fn: m:f
    args: [{shape: [batch, seq], dtype: float32}]
    buckets:
      batch: [1, 2, 4]
      seq: [8, 16]
    exclude:
      - {batch: 4, seq: 16}
      - {batch: 2}
"""


def test_exclude_drops_every_matching_combination(tmp_path: Path) -> None:
    buckets = expand(load_manifest(write(tmp_path, SMALL)))
    assert [b.label for b in buckets] == [
        "batch=1,seq=8",
        "batch=1,seq=16",
        "batch=4,seq=8",
    ]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 11, 12])
def test_shards_partition_the_buckets(n: int) -> None:
    buckets = expand(load_manifest(EXAMPLE))
    shards = [select_shard(buckets, i, n) for i in range(1, n + 1)]
    ids = [b.id for shard in shards for b in shard]
    assert sorted(ids) == sorted(b.id for b in buckets)  # union is everything, nothing twice
    assert len(set(ids)) == len(ids)
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    assert select_shard(buckets, 1, n) == select_shard(list(buckets), 1, n)  # deterministic


@pytest.mark.parametrize(
    ("text", "expected"), [("1/1", (1, 1)), ("2/4", (2, 4)), (" 4 / 4 ", (4, 4))]
)
def test_parse_shard(text: str, expected: tuple[int, int]) -> None:
    assert parse_shard(text) == expected


@pytest.mark.parametrize("text", ["0/4", "5/4", "1/0", "2", "a/b", "-1/4", "1/2/3", ""])
def test_parse_shard_rejects(text: str) -> None:
    with pytest.raises(BadInput, match="--shard"):
        parse_shard(text)


def test_select_shard_rejects_out_of_range() -> None:
    with pytest.raises(BadInput):
        select_shard([], 0, 2)


def test_function_without_axes_is_one_bucket(tmp_path: Path) -> None:
    path = write(tmp_path, "version: 1\nfunctions:\n  - fn: m:f\n    args: [{value: 3}]\n")
    assert [str(b) for b in expand(load_manifest(path))] == ["f[]"]


def test_weak_type_and_static_values(tmp_path: Path) -> None:
    """A service passing a Python int gets a weakly typed scalar: weak_type: true matches it."""
    path = write(
        tmp_path,
        """
        version: 1
        functions:
          - fn: m:f
            jit: {static_argnums: [1]}
            args:
              - {shape: [], dtype: int32, weak_type: true}
              - {value: [1, [2, 3]]}
            kwargs: {opts: [a, b], none: null}
        """,
    )
    manifest = load_manifest(path)
    args, kwargs = build_call(manifest.functions[0], expand(manifest)[0])
    assert args[0] == jax.ShapeDtypeStruct((), jnp.int32, weak_type=True)
    assert args[1] == (1, (2, 3))  # hashable, as jax.jit needs for static values
    assert kwargs == {"opts": ("a", "b"), "none": None}


def test_anchors_and_merge_keys_keep_lines(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        version: 1
        functions:
          - &base
            fn: m:f
            args: [{shape: [batch], dtype: int8}]
            buckets: {batch: [1, 2]}
          - <<: *base
            name: g
            buckets: {batch: [4, 8]}
          - <<: *base
            name: h
            buckets: {batch: [3], size: [1]}
            args: [{shape: [batch, sizes], dtype: int8}]
        """,
    )
    with pytest.raises(
        BadInput, match=r"manifest.yaml:13: functions\[2\].args\[0\].shape\[1\]: unknown axis"
    ):
        load_manifest(path)
    path.write_text(path.read_text().replace("sizes", "size"))
    assert [str(b) for b in expand(load_manifest(path))] == [
        "f[batch=1]",
        "f[batch=2]",
        "g[batch=4]",
        "g[batch=8]",
        "h[batch=3,size=1]",
    ]


def test_example_resolves_from_any_directory(tmp_path: Path) -> None:
    """examples/ is a package: its root is searched, so cwd and PYTHONPATH need not hold it."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "cachectl").symlink_to(REPO / "cachectl")
    code = f"""
        import sys
        from cachectl.manifest import load_manifest, check_imports
        assert not any(p.rstrip("/") == {str(REPO)!r} for p in sys.path)
        print(sorted(check_imports(load_manifest({str(EXAMPLE)!r}))))
    """
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip() == "['decode_step', 'prefill']"


def test_kwargs_axis_takes_the_bucket_value(tmp_path: Path) -> None:
    (tmp_path / "cm_kwaxis.py").write_text(
        "import jax.numpy as jnp\n"
        "def f(x, scale=1.0, mode='a'):\n"
        "    return x * scale if mode == 'a' else x\n"
    )
    path = write(
        tmp_path,
        """
        version: 1
        functions:
          - fn: cm_kwaxis:f
            jit: {static_argnames: mode}
            args: [{shape: [4], dtype: float32}]
            kwargs: {mode: {axis: mode}, scale: 2.5}
            buckets: {mode: [a, b]}
        """,
    )
    manifest = load_manifest(path)
    check_imports(manifest)
    spec = manifest.functions[0]
    assert jit_options(spec) == {"static_argnames": ("mode",)}
    calls = [build_call(spec, b) for b in expand(manifest)]
    assert [kw for _, kw in calls] == [{"mode": "a", "scale": 2.5}, {"mode": "b", "scale": 2.5}]
    for args, kwargs in calls:
        jit_function(spec).lower(*args, **kwargs).compile()


def test_pytree_function_gets_the_bucket_values_it_names(tmp_path: Path) -> None:
    (tmp_path / "cm_pytree_args.py").write_text(
        "import jax, jax.numpy as jnp, numpy as np\n"
        "def cache(batch):\n"
        "    return [(jax.ShapeDtypeStruct((batch, 8), jnp.bfloat16), np.zeros((batch,), np.float64))]\n"
        "def step(c, scale):\n"
        "    return [(k * scale, v) for k, v in c]\n"
    )
    path = write(
        tmp_path,
        """
        version: 1
        functions:
          - fn: cm_pytree_args:step
            args:
              - {pytree: cm_pytree_args:cache}
              - {value: 2}
            buckets: {batch: [2, 3]}
        """,
    )
    manifest = load_manifest(path)
    spec = manifest.functions[0]
    (args, _), _ = [build_call(spec, b) for b in expand(manifest)]
    k, v = args[0][0]
    assert k == jax.ShapeDtypeStruct((2, 8), jnp.bfloat16)
    assert v == jax.ShapeDtypeStruct((2,), jnp.float32)  # canonicalized, as jit would
    assert args[1] == 2
    jit_function(spec).lower(*args).compile()


def test_already_jitted_function_is_lowered_as_is(tmp_path: Path) -> None:
    (tmp_path / "cm_prejitted.py").write_text(
        "import functools, jax, jax.numpy as jnp\n"
        "class Model:\n"
        "    @staticmethod\n"
        "    @functools.partial(jax.jit, static_argnames=['n'])\n"
        "    def step(x, n=1):\n"
        "        return x * n\n"
    )
    path = write(
        tmp_path,
        """
        version: 1
        functions:
          - fn: cm_prejitted:Model.step
            args: [{shape: [3], dtype: float32}]
            kwargs: {n: 2}
        """,
    )
    manifest = load_manifest(path)
    resolved = check_imports(manifest)
    spec = manifest.functions[0]
    assert spec.name == "step"
    assert is_jitted(resolved["step"])
    assert jit_function(spec) is resolved["step"]
    args, kwargs = build_call(spec, expand(manifest)[0])
    jit_function(spec).lower(*args, **kwargs).compile()


def test_modules_resolve_from_path_dirs_and_the_manifest_dir(tmp_path: Path) -> None:
    libdir = tmp_path / "lib"
    libdir.mkdir()
    (libdir / "cm_on_path.py").write_text("def f(x):\n    return x\n")
    (tmp_path / "cm_beside.py").write_text("def g(x):\n    return x\n")
    path = write(
        tmp_path,
        """
        version: 1
        functions:
          - {fn: cm_on_path:f, args: [{value: 1}]}
          - {fn: cm_beside:g, args: [{value: 1}]}
        """,
    )
    manifest = load_manifest(path)
    with pytest.raises(BadInput, match=r"manifest.yaml:3: functions\[0\].fn: cannot import"):
        check_imports(manifest)
    assert set(check_imports(manifest, [libdir])) == {"f", "g"}
    assert resolve_callable("cm_on_path:f", [libdir])(5) == 5
    with pytest.raises(BadInput, match="no attribute 'ff'; did you mean 'f'"):
        resolve_callable("cm_on_path:ff", [libdir])


def test_manifest_digest_and_missing_file(tmp_path: Path) -> None:
    assert manifest_digest(EXAMPLE) == hashlib.sha256(EXAMPLE.read_bytes()).hexdigest()
    with pytest.raises(BadInput, match="nope.yaml: cannot read manifest"):
        load_manifest(tmp_path / "nope.yaml")


def test_a_relative_manifest_path_is_named_absolute_with_the_working_directory(
    tmp_path: Path,
) -> None:
    """serving("mlp.yaml") from another directory: the error names the file it looked for and
    the working directory it was relative to, not the bare name."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = (
        "import cachectl\n"
        "from cachectl.core.errors import BadInput\n"
        "try:\n"
        "    cachectl.serving('mlp.yaml')\n"
        "except BadInput as exc:\n"
        "    print(exc.message)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=elsewhere, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (
        f"{elsewhere}/mlp.yaml (relative to the working directory {elsewhere}): "
        "cannot read manifest: No such file or directory"
    )


def test_target_mismatches() -> None:
    target = Target(backend="gpu", device_kind="NVIDIA H100*", device_count=8)
    assert target.mismatches("gpu", "NVIDIA H100 80GB HBM3", 8) == []
    problems = target.mismatches("cpu", "cpu", 1)
    assert len(problems) == 3 and "backend is cpu" in problems[0]


def test_parse_manifest_from_text() -> None:
    manifest = parse_manifest("version: 1\nfunctions: [{fn: 'a.b:c', args: []}]\n", name="inline")
    assert manifest.path == "inline" and manifest.functions[0].name == "c"
    with pytest.raises(BadInput, match=r"^inline:2: functions\[0\]\.fn: "):
        parse_manifest("version: 1\nfunctions: [{fn: 'abc'}]\n", name="inline")


# --------------------------------------------------------------------------- malformed manifests

# (id, manifest text, line the message must name, text it must contain)


@pytest.mark.parametrize(
    ("text", "line", "needle"),
    [pytest.param(t, ln, n, id=i) for i, t, ln, n in MALFORMED],
)
def test_malformed_manifest_names_file_line_and_field(
    tmp_path: Path, text: str, line: int, needle: str
) -> None:
    path = write(tmp_path, text, name="bad-manifest.yaml")
    with pytest.raises(BadInput) as info:
        load_manifest(path)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: "), message
    assert needle in message, message
    assert "\n" not in message
    assert info.value.exit_code == 2


def test_several_problems_are_all_reported_one_per_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        version: 1
        functions:
          - fn: m:f
            args:
              - {shape: [nope], dtype: int8}
              - {shape: [1], dtype: bfloat61}
              - {shape: [1], dtype: float33}
        """,
    )
    with pytest.raises(BadInput) as info:
        load_manifest(path)  # schema and cross-field problems together, in line order
    first, second, third = str(info.value).splitlines()
    assert first.startswith(f"{path}:5: ") and "unknown axis 'nope'" in first
    assert second.startswith(f"{path}:6: ") and "bfloat61" in second
    assert third.startswith(f"{path}:7: ") and "float33" in third


EVERY_KIND = """
version: 1
functions:
  - fn: cm_every:mlp_los
    args:
      - {shape: [batch, seq], dtype: float23}
      - {pytree: cm_every:params}
    jit: {donate_argnums: [5]}
    buckets:
      batch: [1, 2]
  - fn: cm_every:mlp_loss
    args:
      - {shape: [batch, 4], dtype: float32}
      - {pytree: cm_every:params}
    buckets:
      batch: [1, 2]
"""


def _every_kind(tmp_path: Path) -> Path:
    (tmp_path / "cm_every.py").write_text(
        "def mlp_loss(x, p):\n    return x\ndef params():\n    return {}\n"
    )
    return write(tmp_path, EVERY_KIND)


def test_every_kind_of_problem_is_reported_in_one_load(tmp_path: Path) -> None:
    path = _every_kind(tmp_path)
    expected = [
        f"{path}:3: functions[0].fn: 'cm_every' has no attribute 'mlp_los'; "
        "did you mean 'mlp_loss'?",
        f"{path}:5: functions[0].args[0].dtype: unknown dtype 'float23' "
        "(use a numpy/jax dtype name such as bfloat16, float32, int32)",
        f"{path}:5: functions[0].args[0].shape[1]: unknown axis 'seq' (declared axes: batch)",
        f"{path}:7: functions[0].jit.donate_argnums[0]: 5 is out of range: "
        "the manifest lists 2 positional args",
    ]
    with pytest.raises(BadInput) as info:
        load_manifest(path, import_paths=[])
    assert str(info.value).splitlines() == expected
    assert info.value.exit_code == 2
    with pytest.raises(BadInput) as info:
        load_manifest(path)  # without import_paths: nothing imported
    assert str(info.value).splitlines() == expected[1:]


def test_a_bad_entry_still_has_its_references_imported(tmp_path: Path) -> None:
    (tmp_path / "cm_ref.py").write_text("def f(x):\n    return x\n")
    path = write(
        tmp_path,
        """
        version: 1
        functions:
          - fn: cm_ref:g
            args:
              - {shape: [1], dtype: int8}
            exclude: not-a-list
          - name: "bad name"
            fn: cm_ref:h
            args:
              - {shape: [1], dtype: int8, pytree: 3}
        """,
    )
    with pytest.raises(BadInput) as info:
        load_manifest(path, import_paths=[])
    lines = str(info.value).splitlines()
    assert [line.split(": ", 2)[:2] for line in lines] == [
        [f"{path}:3", "functions[0].fn"],
        [f"{path}:6", "functions[0].exclude"],
        [f"{path}:7", "functions[1].name"],
        [f"{path}:8", "functions[1].fn"],
        [f"{path}:10", "functions[1].args[0].pytree"],
    ], lines


# Problems only visible once user code is imported: check_imports reports them, same format.


@pytest.mark.parametrize(
    ("files", "text", "line", "needle"),
    [pytest.param(f, t, ln, n, id=i) for i, f, t, ln, n in IMPORT_ERRORS],
)
def test_import_problems_name_file_line_and_field(
    tmp_path: Path, files: dict[str, str], text: str, line: int, needle: str
) -> None:
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    path = write(tmp_path, text)
    manifest = load_manifest(path)  # loading imports nothing
    with pytest.raises(BadInput) as info:
        check_imports(manifest)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: "), message
    assert needle in message, message
    assert info.value.exit_code == 2


def test_pytree_function_that_raises(tmp_path: Path) -> None:
    (tmp_path / "cm_pt_raises.py").write_text(
        "def f(p):\n    return p\ndef params():\n    raise OSError('no checkpoint')\n"
    )
    path = write(
        tmp_path,
        "version: 1\nfunctions:\n  - fn: cm_pt_raises:f\n    args:\n      - {pytree: cm_pt_raises:params}\n",
    )
    manifest = load_manifest(path)
    with pytest.raises(
        BadInput, match=r"manifest.yaml:5: .*params\(\) raised OSError: no checkpoint"
    ):
        build_call(manifest.functions[0], expand(manifest)[0])


# --------------------------------------------------------------------------- several devices

MESH_MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: cm_sharded:step
    mesh: {axes: {data: 4}}
    args:
      - {shape: [batch, 16], dtype: float32, sharding: [data, null]}
      - {pytree: cm_sharded:weights}
    buckets: {batch: [4, 8]}
  - name: big
    fn: cm_sharded:step
    mesh: {axes: {data: 2, model: 4}}
    args:
      - {shape: [8, 16], dtype: float32, sharding: [[data, model]]}
      - {pytree: cm_sharded:weights}
"""

MESH_MODULE = """
import jax, jax.numpy as jnp
def weights():
    return {"w": jax.ShapeDtypeStruct((16, 4), jnp.float32), "b": jnp.zeros((4,))}
def step(x, p):
    return jnp.tanh(x @ p["w"] + p["b"]).sum(0)
"""


def test_mesh_and_sharding_on_four_cpu_devices(tmp_path: Path) -> None:
    (tmp_path / "cm_sharded.py").write_text(MESH_MODULE)
    write(tmp_path, MESH_MANIFEST)
    code = """
        import jax
        from jax.sharding import NamedSharding, PartitionSpec as P
        from cachectl.core.errors import EnvironmentMismatch
        from cachectl.manifest import load_manifest, expand, build_call, check_imports, jit_function
        assert jax.device_count() == 4
        m = load_manifest("manifest.yaml")
        check_imports(m)
        buckets = expand(m)
        spec = m.function("step")
        for b in buckets:
            if b.function != "step":
                continue
            (x, params), kwargs = build_call(spec, b)
            assert isinstance(x.sharding, NamedSharding), x
            assert x.sharding.spec == P("data", None) and dict(x.sharding.mesh.shape) == {"data": 4}
            assert all(leaf.sharding.spec == P() for leaf in jax.tree.leaves(params))
            compiled = jit_function(spec).lower(x, params, **kwargs).compile()
            assert compiled.input_shardings[0][0].spec == P("data", None)
            print("compiled", b, x.shape)
        try:
            build_call(m.function("big"), buckets[-1])
        except EnvironmentMismatch as exc:
            print("mismatch", exc.exit_code, exc)
    """
    out = run_python(code, {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}, tmp_path)
    assert "compiled step[batch=4] (4, 16)" in out
    assert "compiled step[batch=8] (8, 16)" in out
    assert "mismatch 3 manifest.yaml:12: functions[1].mesh.axes: the mesh needs 8 devices" in out


def test_mesh_needs_enough_devices_here(tmp_path: Path) -> None:
    (tmp_path / "cm_sharded_one.py").write_text(MESH_MODULE)
    path = write(tmp_path, MESH_MANIFEST.replace("cm_sharded", "cm_sharded_one"))
    manifest = load_manifest(path)
    if jax.device_count() >= 4:
        pytest.skip("this process already has 4 devices")
    with pytest.raises(EnvironmentMismatch, match="the mesh needs 4 devices"):
        build_call(manifest.function("step"), expand(manifest)[0])


# --------------------------------------------------------------------------- validation without JAX

# Installed first in a fresh interpreter: any import of jax or jaxlib fails, as on a machine
# (or in a CLI process) without them.
_NO_JAX = """
import sys

class _NoJax:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("jax", "jaxlib"):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, _NoJax())
"""


def _jax_dtype_names() -> list[str]:
    """Every dtype name JAX accepts for an array argument (numeric or bool), as jnp resolves it."""
    import ml_dtypes

    names = {str(n) for n in np.sctypeDict} | {n for n in dir(ml_dtypes) if not n.startswith("_")}
    accepted = []
    for name in sorted(names):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # numpy 2's alias "a"
                dtype = jnp.dtype(name)
        except TypeError:
            continue
        if jnp.issubdtype(dtype, jnp.number) or dtype == jnp.bool_:
            accepted.append(name)
    return accepted


def _messages(texts: list[str]) -> list[str]:
    out = []
    for text in texts:
        try:
            parse_manifest(text, name="bad.yaml")
            out.append("")
        except BadInput as exc:
            out.append(str(exc))
    return out


def test_validation_imports_no_jax_and_gives_the_same_messages(tmp_path: Path) -> None:
    dtypes = _jax_dtype_names()
    assert {"bfloat16", "float8_e4m3fn", "int4", "bool", "float32", "complex64"} <= set(dtypes)
    every_dtype = "version: 1\nfunctions:\n  - fn: m:f\n    args:\n" + "".join(
        f"      - {{shape: [2], dtype: {json.dumps(d)}}}\n" for d in dtypes
    )
    rejected = ["str", "object", "datetime64", "void", "bfloat61", "float8"]
    texts = [t for _, t, _, _ in MALFORMED] + [
        f"version: 1\nfunctions: [{{fn: m:f, args: [{{shape: [1], dtype: {d}}}]}}]\n"
        for d in rejected
    ]
    expected = _messages(texts)
    assert all(m and "\n" not in m for m in expected)
    (tmp_path / "every_dtype.yaml").write_text(every_dtype)
    (tmp_path / "texts.json").write_text(json.dumps({"texts": texts, "dtypes": dtypes}))
    out = run_python(
        _NO_JAX
        + f"""
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from cachectl.core.errors import BadInput
from cachectl.manifest import dtype_named, expand, load_manifest, parse_manifest

try:
    import jax
except ImportError:
    pass
else:
    raise SystemExit("jax was importable")
example = load_manifest({str(EXAMPLE)!r})
every = load_manifest("every_dtype.yaml")
given = json.loads(Path("texts.json").read_text())
messages = []
for text in given["texts"]:
    try:
        parse_manifest(text, name="bad.yaml")
        messages.append("")
    except BadInput as exc:
        messages.append(str(exc))
print(json.dumps({{"example": [str(b) for b in expand(example)],
                  "dtypes": [str(dtype_named(a.dtype)) for a in every.functions[0].args],
                  "messages": messages,
                  "jax_loaded": [m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib")]}}))
""",
        {},
        tmp_path,
    )
    result = json.loads(out.strip().splitlines()[-1])
    assert result["jax_loaded"] == []
    assert result["example"] == [str(b) for b in expand(load_manifest(EXAMPLE))]
    assert result["dtypes"] == [str(jnp.dtype(d)) for d in dtypes]
    assert result["messages"] == expected


def test_common_dtypes_are_names_dtype_accepts() -> None:
    """The names validation takes without importing numpy/ml_dtypes are ones dtype_named accepts."""
    from cachectl.manifest.schema import COMMON_DTYPES, dtype_named

    assert {str(dtype_named(name)) for name in COMMON_DTYPES} == set(COMMON_DTYPES)
    assert set(COMMON_DTYPES) <= set(_jax_dtype_names())


# --- the schema's builder and pydantic: one verdict, one result --------------------------------

RICH = """
version: 1
cache: default
target: {backend: cpu, device_kind: "cpu*", device_count: 1}
functions:
  - fn: mod:f
    jit: {static_argnums: 2, donate_argnames: x, keep_unused: true, compiler_options: {xla_cpu_enable_fast_math: false}}
    args:
      - {shape: [batch, 8], dtype: float32, weak_type: true, pad: -1.5}
      - {pytree: mod:tree, leaf_axes: {0: batch, "a.b": {1: batch}}, leaf_pad: {a.c: 7}, pad_fn: "mod:pad"}
      - {value: null}
      - {value: [1, "two", 3.25, {k: v}]}
      - {shape: [batch], dtype: bfloat16, sharding: single_device}
    kwargs: {mode: fast, n: {axis: batch}}
    buckets: {batch: [1, 2, 4]}
    exclude: [{batch: 2}]
    outputs: [{shape: [batch, 8]}, null]
    depends_on: [model.bin, conf/x.json]
  - name: g.v-2
    fn: mod.sub:g
    mesh: {axes: {data: 1}, axis_types: explicit}
    args:
      - {shape: [4, 4], dtype: int32, sharding: [data, null]}
    buckets: {}
"""

# What each field's value is replaced with, in turn: every type YAML gives, and near misses.
_SUBSTITUTES: list[Any] = [
    None,
    True,
    False,
    0,
    1,
    -1,
    2.5,
    "",
    "x",
    "mod:f",
    "int32",
    "cpu",
    [],
    [1],
    ["a"],
    {},
    {"a": 1},
    {0: "batch"},
    {"shape": [1]},
]


def _variants(data: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """(path, the document with the value at path replaced / removed / joined by an unknown key)."""
    import copy

    def replaced(new: Any, drop: bool = False) -> Any:
        doc = copy.deepcopy(RICH_DATA)
        node = doc
        for part in path[:-1]:
            node = node[part]
        if drop:
            del node[path[-1]]
        else:
            node[path[-1]] = new
        return doc

    if path:
        for new in _SUBSTITUTES:
            yield path + ("=", repr(new)), replaced(new)
        if isinstance(path[-1], str):
            yield path + ("removed",), replaced(None, drop=True)
    if isinstance(data, dict):
        if path:
            yield path + ("+bogus",), replaced({**data, "bogus": 1})
        for key, value in data.items():
            yield from _variants(value, path + (key,))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from _variants(value, path + (i,))


def _verdict(tp: Any, data: Any) -> tuple[bool, Any]:
    from cachectl.core.jsonable import type_adapter
    from cachectl.manifest.schema import Unchecked, as_data, build

    try:
        built = (True, as_data(build(tp, data)))
    except Unchecked:
        built = (False, None)
    from pydantic import ValidationError

    try:
        validated = (True, as_data(type_adapter(tp).validate_python(data)))
    except ValidationError:
        validated = (False, None)
    return built, validated


import yaml  # noqa: E402

RICH_DATA = yaml.safe_load(RICH)


def test_builder_and_pydantic_agree_on_every_variant_of_a_rich_manifest() -> None:
    """load.py takes a manifest through the schema's builder, without pydantic, and asks
    pydantic only about one it cannot build. For every field of a manifest that uses every
    field, replaced by each kind of YAML value, removed, or joined by an unknown key, both take
    it or both refuse it, and what they take is the same data."""
    from cachectl.manifest.schema import Manifest

    seen = {True: 0, False: 0}
    for where, doc in _variants(RICH_DATA):
        built, validated = _verdict(Manifest, doc)
        assert built == validated, (where, built, validated)
        seen[built[0]] += 1
    assert seen[True] > 50 and seen[False] > 200, seen  # both verdicts, many times


@pytest.mark.parametrize("name,text,line,fragment", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_builder_refuses_every_malformed_manifest_pydantic_refuses(
    name: str, text: str, line: int, fragment: str
) -> None:
    from cachectl.manifest.schema import Manifest

    try:
        data = yaml.safe_load(textwrap.dedent(text))
    except yaml.YAMLError:
        return  # refused before either sees it
    built, validated = _verdict(Manifest, data)
    assert built == validated, (built, validated)


def test_spec_digests_are_the_bytes_pydantic_dumped() -> None:
    """Stored executables record their function entry's digest (spec_digest); these are the
    digests the pydantic models' model_dump_json gave for these entries, before the schema
    became dataclasses: executables stored then still match. ``depends_on`` (f names two files)
    is bound by the files' sha256, not in this digest."""
    from cachectl.storage.executables import spec_digest

    rich = parse_manifest(RICH, name="rich.yaml")
    example = load_manifest(EXAMPLE)
    assert {s.name: spec_digest(s) for s in [*rich.functions, *example.functions]} == {
        "f": "42fbe52224744e71cf1b4f03025a97cabb6b33425604ffabd94bf669fa956810",
        # A mesh's entry changed with its device_order (a TPU slice's mesh in jax.devices()
        # order since): executables stored over the old mesh are stale, as they should be.
        "g.v-2": "05e1512086ba7efe25d43a0a60b251c86f16b200e71e27b46525dbbe90e065ab",
        "prefill": "ce9f55a42e597a4cd97876b6774350aa018272552ec69d4b4ca2580c94ae50ed",
        "decode_step": "dde899b2f05c2f76fa421387a41c7a29a2f00d38d52c757c0c6b2e59cffe2c21",
    }


def test_a_valid_manifest_loads_without_pydantic_and_a_bad_one_with_its_messages(
    tmp_path: Path,
) -> None:
    bad = write(
        tmp_path, "version: 1\nfunctions:\n  - fn: m:f\n    args: [{shape: 4}]\n", "bad.yaml"
    )
    out = run_python(
        f"""
        import sys
        from cachectl.core.errors import BadInput
        from cachectl.manifest import load_manifest
        load_manifest({str(EXAMPLE)!r})
        print("after-valid", "pydantic" in sys.modules)
        try:
            load_manifest({str(bad)!r})
        except BadInput as exc:
            print("bad:", exc)
        print("after-bad", "pydantic" in sys.modules)
        """,
        {},
        tmp_path,
    )
    assert "after-valid False" in out, out
    assert "bad.yaml:4: functions[0].args[0].shape: expected a list, got int 4" in out, out
    assert "after-bad True" in out, out


def test_leaf_pad_and_pad_fn_are_checked_and_leave_the_program_digest_alone() -> None:
    """leaf_pad / pad_fn only on a pytree with leaf_axes, leaf_pad a number (by path or for
    every leaf); neither changes spec_digest (they are serving's, not the program's)."""
    from cachectl.manifest import parse_manifest
    from cachectl.storage.executables import spec_digest

    def entry(arg: str) -> str:
        return (
            "version: 1\nfunctions:\n  - fn: m:f\n    args:\n      - " + arg + "\n"
            "    buckets: {n: [1, 2]}\n"
        )

    plain = parse_manifest(entry("{pytree: m:t, leaf_axes: {0: n}}"), name="a.yaml")
    declared = parse_manifest(
        entry("{pytree: m:t, leaf_axes: {0: n}, leaf_pad: {a.b: 3}, pad_fn: 'm:pad'}"),
        name="b.yaml",
    )
    assert declared.functions[0].args[0].leaf_pad == {"a.b": 3}
    assert spec_digest(plain.functions[0]) == spec_digest(declared.functions[0])
    for arg, problem in (
        ("{pytree: m:t, leaf_pad: 0}", "only a pytree argument with leaf_axes takes leaf_pad"),
        ("{shape: [n], dtype: int32, pad_fn: 'm:p'}", "only a pytree argument with leaf_axes"),
        ("{pytree: m:t, leaf_axes: {0: n}, leaf_pad: {a: x}}", "leaf_pad is a number"),
        ("{pytree: m:t, leaf_axes: {0: n}, pad_fn: nope}", "not of the form module:attribute"),
    ):
        with pytest.raises(BadInput) as info:
            parse_manifest(entry(arg), name="bad.yaml")
        assert problem in str(info.value), (arg, str(info.value))
