"""Every JAX fact cachectl.core.jax_seam relies on, one test each, against the installed JAX.

The log calls, events and private state are read from a real process that compiles for
real (a fresh cache directory: a miss and a write, then a hit, a program with host
callbacks, a program faster than a raised threshold). When a JAX upgrade breaks one of
these, the failing test names the fact and the seam function to change.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
from support.infra import run_py

from cachectl.core import jax_kernels, jax_seam
from cachectl.storage.entries import CACHE_SUFFIX, entry_payload, parse_key, read_header

ROOT = Path(__file__).resolve().parent.parent

# Runs with the seam's own functions where the seam has one, so the process sees what a
# service or warm sees; prints one JSON object.
PROBE = r"""
import json, logging, numpy as np, jax, jax.numpy as jnp
from cachectl.core import jax_seam

cache_dir = {cache!r}
calls = []
read = []
reader = jax_seam.compiler_call_reader(lambda *found: read.append(list(found)), lambda m: read.append([m]))
class Keep(logging.Handler):
    def emit(self, record):
        kind = jax_seam.classify_record(record)
        del read[:]
        reader(record.msg, tuple(record.args or ()))
        calls.append(dict(logger=record.name, msg=str(record.msg),
                          args=[type(a).__name__ for a in (record.args or ())],
                          text=record.getMessage(), kind=kind,
                          lookup=read[0] if read and len(read[0]) == 3 else None,
                          never=read[0][0] if read and len(read[0]) == 1 else None,
                          lowering=jax_seam.is_lowering(record.msg, tuple(record.args or ())),
                          uncacheable=jax_seam.uncacheable(tuple(record.args or ()), str(record.msg))))
keep = Keep()
for name in (*jax_seam.CACHE_LOGGERS, jax_seam.PXLA_LOGGER):
    logger = logging.getLogger(name)
    logger.setLevel(logging.DEBUG)
    logger.addHandler(keep)
events, durations = [], []
jax.monitoring.register_event_listener(lambda e, **kw: events.append(e))
jax.monitoring.register_event_duration_secs_listener(lambda e, d, **kw: durations.append(e))

out = dict(checked_before=jax_seam.cache_checked(), opened_before=jax_seam.opened_cache_dir())
jax.config.update("jax_compilation_cache_dir", cache_dir)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
jax_seam.reset_persistent_cache()

def program(x):
    return jnp.tanh(x) * 2
x = np.ones((4, 3), np.float32)
out["computed_key"] = jax_seam.persistent_cache_key(jax.jit(program).lower(x))
compiled = jax.jit(program).lower(x).compile()
out["checked_after"] = jax_seam.cache_checked()
out["opened_after"] = jax_seam.opened_cache_dir()
out["entry"] = jax_seam.entry_bytes(compiled, 0).hex()
jax_seam.reset_persistent_cache()
out["opened_after_reset"] = jax_seam.opened_cache_dir()
jax.clear_caches()
jax.jit(program).lower(x).compile()  # a hit: the cache reopens at the next compile
out["first_phase"] = len(calls)
jax.jit(lambda v: (jax.debug.callback(lambda a: None, v), v)[1]).lower(x).compile()
jax.config.update("jax_persistent_cache_min_compile_time_secs", 3600)
jax.jit(lambda v: v + 1).lower(x).compile()
out.update(calls=calls, events=events, durations=durations)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cache = tmp_path_factory.mktemp("jax-cache")
    proc = run_py(PROBE.format(cache=str(cache)), check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["cache"] = cache
    return out


def _calls(probe: dict[str, Any], kind: str, phase: slice = slice(None)) -> list[dict[str, Any]]:
    return [c for c in probe["calls"][phase] if c["kind"] and c["kind"][0] == kind]


# -- loggers -------------------------------------------------------------------------------


def test_the_compiler_logger_is_the_object_jax_logs_through() -> None:
    from jax._src import compiler

    assert jax_seam.compiler_logger() is compiler.logger
    assert compiler.logger.name == jax_seam.COMPILER_LOGGER


def test_the_pxla_logger_is_the_object_jax_logs_lowerings_through() -> None:
    from jax._src.interpreters import pxla

    assert jax_seam.pxla_logger() is pxla.logger
    assert pxla.logger.name == jax_seam.PXLA_LOGGER


def test_the_compilation_cache_logger_name() -> None:
    from jax._src import compilation_cache

    assert compilation_cache.logger.name == jax_seam.COMPILATION_CACHE_LOGGER


# -- log calls -----------------------------------------------------------------------------


def test_a_miss_is_logged_with_module_and_key(probe: dict[str, Any]) -> None:
    (miss,) = _calls(probe, "miss", slice(0, probe["first_phase"]))[:1]
    assert miss["logger"] == jax_seam.COMPILER_LOGGER and miss["args"] == ["str", "str"]
    module, key = miss["lookup"][1:]
    assert miss["lookup"][0] is False and module == "jit_program"
    assert parse_key(key) is not None and parse_key(key).module == "jit_program"
    assert miss["kind"] == ["miss", key, miss["text"]]


def test_a_write_is_logged_with_the_key_of_the_file_written(probe: dict[str, Any]) -> None:
    (write,) = _calls(probe, "write", slice(0, probe["first_phase"]))
    assert write["logger"] == jax_seam.COMPILATION_CACHE_LOGGER
    key = write["kind"][1]
    assert (Path(probe["cache"]) / (key + CACHE_SUFFIX)).is_file()
    assert key == _calls(probe, "miss")[0]["lookup"][2]


def test_the_computed_cache_key_is_the_key_jax_logs(probe: dict[str, Any]) -> None:
    """Re-warm's shortcut: the key computed after lowering is JAX's own, on every JAX the matrix
    runs (0.9, 0.10, 0.12: their compile-option arguments and callback mode differ)."""
    assert probe["computed_key"] == _calls(probe, "miss")[0]["lookup"][2]


def test_a_hit_is_logged_with_module_and_key(probe: dict[str, Any]) -> None:
    (hit,) = _calls(probe, "hit")
    assert hit["logger"] == jax_seam.COMPILER_LOGGER and hit["args"] == ["str", "str"]
    assert hit["lookup"] == [True, "jit_program", _calls(probe, "miss")[0]["lookup"][2]]
    assert hit["kind"][1] == hit["lookup"][2]


def test_host_callbacks_are_logged_as_never_written_or_written(probe: dict[str, Any]) -> None:
    """jax 0.10.2 never writes a program with host callbacks and says so; 0.12 writes it."""
    skips = [c for c in _calls(probe, "skip") if jax_seam.HOST_CALLBACKS_MARK in c["text"]]
    written = [c for c in _calls(probe, "write") if c["kind"][1].startswith("jit__lambda")]
    assert len(skips) + len(written) == 1
    if skips:
        assert skips[0]["logger"] == jax_seam.COMPILER_LOGGER
        assert skips[0]["args"] == ["str"] and skips[0]["uncacheable"] is True
        assert skips[0]["never"] == "jit__lambda"  # what the collector's tap is told


def test_whether_this_jax_writes_host_callbacks_is_read_from_its_compiler(
    probe: dict[str, Any],
) -> None:
    """misses and serving ask it before blaming host callbacks for a miss."""
    skips = [c for c in _calls(probe, "skip") if jax_seam.HOST_CALLBACKS_MARK in c["text"]]
    assert jax_seam.never_writes_host_callbacks() is bool(skips)


def test_a_fast_compile_under_a_raised_threshold_is_logged_with_both_times(
    probe: dict[str, Any],
) -> None:
    skips = [c for c in _calls(probe, "skip") if "seconds to compile" in c["text"]]
    assert len(skips) == 1 and skips[0]["logger"] == jax_seam.COMPILER_LOGGER
    assert skips[0]["args"][0] == "str" and len(skips[0]["args"]) == 3  # module, threshold, took
    assert {t in ("int", "float") for t in skips[0]["args"][1:]} == {True}
    # Faster than JAX's default threshold too: never written by a default service either.
    assert skips[0]["uncacheable"] is True and skips[0]["never"] == "jit__lambda"
    assert jax_seam.uncacheable(("m", 3600.0, 2.5), skips[0]["msg"]) is False


def test_each_lowering_is_logged_with_module_avals_and_shardings(probe: dict[str, Any]) -> None:
    lowerings = [c for c in probe["calls"] if c["lowering"]]
    assert len(lowerings) == 4  # program twice, the callback program, the fast one
    assert all(c["logger"] == jax_seam.PXLA_LOGGER for c in lowerings)
    assert lowerings[0]["args"][0] == "str"
    assert "jit(program)" in lowerings[0]["text"] and "float32[4,3]" in lowerings[0]["text"]


def test_the_lowering_call_is_guarded_and_names_its_frame() -> None:
    import inspect

    from jax._src.interpreters import pxla

    source = inspect.getsource(pxla)
    start = source.index(f"def {jax_seam.LOWERING_FRAME}(")
    lowering = source[start : source.index("\ndef ", start)]
    assert "logger.isEnabledFor(log_priority)" in lowering
    assert '"Compiling %s with global shapes and types %s. "' in lowering
    assert "module_name, in_avals, in_shardings)" in lowering and "closed_jaxpr" in lowering


def test_the_not_writing_calls_carry_module_and_times() -> None:
    import inspect

    from jax._src import compiler

    write = inspect.getsource(compiler._cache_write)
    # 2 in jax 0.10.2 (host callbacks, threshold); 1 in 0.12, which writes host-callback programs
    assert write.count(jax_seam.NOT_WRITING_PREFIX) in (1, 2)
    assert "module_name, min_compile_time," in write


def test_the_jit_call_frame_holds_args_kwargs_and_jit_info() -> None:
    import inspect

    from jax._src import pjit

    cpp = inspect.getsource(pjit._cpp_pjit)
    assert f"def {jax_seam.CALL_FRAME}(*args, **kwargs):" in cpp
    assert "_infer_params(fun, jit_info, args, kwargs)" in cpp
    assert pjit.__file__.endswith(jax_seam.CALL_FILE)


def test_call_context_reads_source_and_statics_of_a_real_jit_call() -> None:
    import jax
    import numpy as np

    from cachectl.telemetry import SignatureTap

    class Seen:
        def __init__(self) -> None:
            self.calls: list[Any] = []

        def _on_lowering(self, module: Any, avals: Any, shardings: Any) -> None:
            self.calls.append(
                (str(module), jax_seam.leaves_of(avals, shardings), jax_seam.call_context(3))
            )

    def scaled(x: Any, n: int) -> Any:
        return x * n

    seen = Seen()
    tap = SignatureTap(seen, jax_seam.pxla_logger())
    tap.install()
    try:
        jax.jit(scaled, static_argnums=1)(np.ones(3, np.float32), 7)
    finally:
        tap.uninstall()
    ((module, leaves, (source, statics)),) = seen.calls
    assert module == "jit(scaled)" and leaves == (((3,), "float32", False, None),)
    assert source is not None and source.startswith("scaled at ") and statics == ((1, "7"),)


# -- monitoring events ---------------------------------------------------------------------


def test_the_monitoring_events_fire_as_counted(probe: dict[str, Any]) -> None:
    events = probe["events"]
    assert events.count(jax_seam.EVENT_REQUESTS) == 4  # every compile that could use the cache
    assert events.count(jax_seam.EVENT_HITS) == 1
    written = [p for p in Path(probe["cache"]).iterdir() if p.name.endswith(CACHE_SUFFIX)]
    assert (
        events.count(jax_seam.EVENT_WRITES) == len(written) == len(_calls(probe, "write"))
    )  # only writes
    assert (
        jax_seam.EVENT_SAVED in probe["durations"]
        and jax_seam.EVENT_RETRIEVAL in probe["durations"]
    )


# -- the persistent cache's process state --------------------------------------------------


def test_the_opened_cache_and_the_first_compile_are_visible(probe: dict[str, Any]) -> None:
    assert probe["checked_before"] is False and probe["opened_before"] is None
    assert probe["checked_after"] is True
    assert probe["opened_after"].rstrip("/") == str(probe["cache"]).rstrip("/")
    assert probe["opened_after_reset"] is None


def _program_entry(probe: dict[str, Any]) -> Path:
    (written,) = Path(probe["cache"]).glob("jit_program-*" + CACHE_SUFFIX)
    return written


def test_entry_bytes_are_the_entry_jax_wrote(probe: dict[str, Any]) -> None:
    """Byte-identical in jax 0.10.2; 0.9.2's executables serialize slightly differently each time."""
    ours, theirs = bytes.fromhex(probe["entry"]), _program_entry(probe).read_bytes()
    assert read_header(ours).compression == read_header(theirs).compression
    assert read_header(ours).compile_seconds == read_header(theirs).compile_seconds == 0
    assert len(entry_payload(ours)) == len(entry_payload(theirs))


# -- what the key is made of ---------------------------------------------------------------


def test_the_key_names_the_file_module_dash_sha256(probe: dict[str, Any]) -> None:
    key = _program_entry(probe).name[: -len(CACHE_SUFFIX)]
    assert re.fullmatch(r"jit_program-[0-9a-f]{64}", key) and parse_key(key) is not None


def test_the_excluded_xla_flags_and_flag_prefixes() -> None:
    from jax._src import cache_key

    excluded = jax_seam.excluded_xla_flags()
    assert excluded == tuple(cache_key.xla_flags_to_exclude_from_cache_key)
    assert excluded and all(f.startswith("--xla") for f in excluded)
    assert all(isinstance(p, str) for p in jax_seam.extra_flag_prefixes())


def test_the_compression_is_zstandard_exactly_when_importable() -> None:
    try:
        import zstandard  # noqa: F401

        importable = True
    except ImportError:
        importable = False
    assert jax_seam.zstandard_compression() is importable


def test_the_topology_fingerprint_and_default_backend() -> None:
    import jax

    from cachectl.core.fingerprint import _topology

    devices = jax.devices()
    assert jax_seam.default_backend().platform == jax.default_backend()
    try:
        fingerprint = jax_seam.topology_fingerprint(devices)
    except Exception:  # noqa: BLE001 - jax 0.9.2 on CPU has none: the environment names the kinds
        assert _topology(devices) == "kinds:" + ",".join(d.device_kind for d in devices)
    else:
        assert fingerprint == jax_seam.topology_fingerprint(devices)
        assert _topology(devices) == f"{fingerprint:016x}"


# -- executables and jax.distributed -------------------------------------------------------


def test_the_executable_pickler_classes() -> None:
    pickler, unpickler, loaded = jax_seam.pjrt_pickler_classes()
    assert issubclass(pickler, pickle.Pickler) and issubclass(unpickler, pickle.Unpickler)
    assert isinstance(loaded, type)


def test_the_private_parts_of_a_compiled_program() -> None:
    import jax
    import numpy as np

    x = np.ones(2, np.float32)
    compiled = jax.jit(lambda v: v * 3).lower(x).compile()
    unloaded = jax_seam.unloaded_executable(compiled)
    assert unloaded is not None and hasattr(unloaded, "load")
    assert jax_seam.executable_device_ids(unloaded) == [jax.devices()[0].id]
    assert jax_seam.closes_over_mutable(unloaded) is False
    assert jax_seam.captures_constants(compiled) is False and jax_seam.no_kwargs(compiled) is False
    assert isinstance(compiled._params.const_args, (list, tuple))  # what captures_constants reads
    rebuilt = jax_seam.make_compiled(unloaded.load(), compiled.args_info, compiled.out_tree, False)
    assert np.asarray(rebuilt(x)).tolist() == [3.0, 3.0]


def test_a_device_list_loads_a_real_executable() -> None:
    import jax
    import numpy as np

    compiled = jax.jit(lambda v: v * 3).lower(np.ones(2, np.float32)).compile()
    backend = jax.devices()[0].client
    data = entry_payload(jax_seam.entry_bytes(compiled, 0))
    loaded = backend.deserialize_executable(
        data, executable_devices=jax_seam.device_list(jax.devices()[:1])
    )
    assert loaded is not None


def test_no_distributed_client_before_initialize() -> None:
    assert jax_seam.distributed_client() is None


def test_jax_opens_an_s3_cache_through_the_filesystem_the_seam_names() -> None:
    """jax._src.path.Path is etils' epath.Path; for s3:// its fsspec backend builds one filesystem
    per protocol and process with fsspec's defaults for the protocol, and JAX's cache reads through
    it: the only way a cache's storage options reach JAX (storage/jax_storage.py)."""
    code = """
    import json, fsspec.config
    fsspec.config.conf["s3"] = {"endpoint_url": "http://127.0.0.1:9", "anon": True}
    from jax._src import path
    from cachectl.core import jax_seam
    fs = jax_seam.cache_filesystem("s3://bkt/ns")
    again = jax_seam.cache_filesystem("s3://other/ns")
    print(json.dumps({"epath": path.Path.__module__, "same": fs is again,
                      "type": type(fs).__name__, "options": fs.storage_options}))
    """
    proc = run_py(code, {"EPATH_USE_TF": "false"}, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["epath"].startswith("etils.epath") and out["type"] == "S3FileSystem", out
    assert out["same"] is True  # one per protocol: built once, before activate() or never
    assert out["options"] == {"endpoint_url": "http://127.0.0.1:9", "anon": True}, out


def test_sharding_names() -> None:
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    dev = jax.devices()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecated constructor on any supported JAX
        single = jax_seam.single_device_sharding(dev)
    assert jax_seam.sharding_text(single) == f"SingleDeviceSharding({dev.platform}:{dev.id})"
    mesh = Mesh([dev], ("x",))
    assert (
        jax_seam.sharding_text(NamedSharding(mesh, PartitionSpec("x")))
        == "NamedSharding(mesh={'x': 1}, spec=('x',))"
    )
    assert jax_seam.sharding_text(None) is None


# -- kernels a stored executable calls -----------------------------------------------------


def test_custom_call_targets_name_the_lapack_kernels_of_a_compiled_program() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    a = np.eye(4, dtype=np.float32)
    compiled = jax.jit(lambda m: jnp.linalg.solve(jnp.linalg.cholesky(m), m)).lower(a).compile()
    targets = jax_seam.custom_call_targets(compiled)
    assert targets is not None and "lapack_spotrf_ffi" in targets, targets
    assert all(jax_kernels._is_lapack(t) for t in targets if t.startswith("lapack_"))
    plain = jax.jit(lambda v: jnp.abs(jnp.fft.fft(v))).lower(np.ones(8, np.float32)).compile()
    assert jax_seam.custom_call_targets(plain) == ()  # CPU FFT is XLA's own op, not a kernel


def test_lapack_targets_are_registered_at_import_and_initialized_only_by_a_lowering() -> None:
    # What _ready_lapack relies on: the registrations at import of jax._src.lax.linalg, and
    # lapack._lapack.initialize(), which the lowering rules (prepare_lapack_call) call.
    proc = run_py(
        """
        import inspect, json, sys, jax
        from jax._src.lib import lapack
        from jax._src.lax import linalg
        print(json.dumps(dict(
            imported="jax._src.lax.linalg" in sys.modules,
            initialize=callable(getattr(lapack._lapack, "initialize", None)),
            targets=sorted(lapack._lapack.registrations())[:3],
            lowering="_lapack.initialize()" in inspect.getsource(lapack.prepare_lapack_call),
            helper=callable(getattr(linalg, "initialize_lapack", None)),
        )))
        """,
        check=True,
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # linalg.initialize_lapack (the seam's first fallback) is newer than jax 0.9.2: not required.
    assert out["imported"] and out["initialize"] and out["lowering"], out
    assert all(t.startswith("lapack_") for t in out["targets"]), out


def test_cpu_sparse_targets_are_registered_by_importing_jax_experimental_sparse() -> None:
    from jax._src.lib import cpu_sparse

    names = jax_kernels._registered_names("cpu_sparse")
    assert names and names == frozenset(cpu_sparse._sparse.registrations())
    assert all(jax_kernels._is_cpu_sparse(n) and not jax_kernels._is_lapack(n) for n in names)
    root = Path(__import__("jax").__file__).parent
    lowerings = (root / "experimental" / "sparse" / "_lowerings.py").read_text()
    assert "cpu_sparse.registrations()" in lowerings  # at import, not in a lowering rule


def test_prepare_custom_calls_readies_every_family_in_a_fresh_process() -> None:
    proc = run_py(
        """
        import json
        from cachectl.core import jax_kernels, jax_seam
        problems = jax_seam.prepare_custom_calls(None)
        again = jax_seam.prepare_custom_calls(["lapack_spotrf_ffi", "cpu_csr_sparse_dense_ffi"])
        print(json.dumps(dict(problems=problems, again=again, ready=jax_kernels._READY)))
        """,
        check=True,
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["problems"] == [] and out["again"] == [], out
    assert set(out["ready"]) == {family for family, _, _ in jax_seam.KERNEL_FAMILIES}


def test_a_family_that_cannot_be_readied_is_reported_not_raised(monkeypatch) -> None:
    def broken() -> None:
        raise AttributeError("no initialize here")

    monkeypatch.setattr(
        jax_kernels, "KERNEL_FAMILIES", (("LAPACK", jax_kernels._is_lapack, broken),)
    )
    monkeypatch.setattr(jax_kernels, "_READY", {})
    assert jax_seam.prepare_custom_calls(["xla_builtin"]) == []  # not needed: not readied
    (problem,) = jax_seam.prepare_custom_calls(["lapack_spotrf_ffi"])
    assert "LAPACK" in problem and "no initialize here" in problem


# -- the seam is the only one --------------------------------------------------------------


# What only the seam may spell: JAX's private package, its loggers, its log messages, its events.
SEAM_ONLY = (
    "jax._src",
    "jax/_src",
    "Persistent compilation cache hit",
    "PERSISTENT COMPILATION CACHE MISS",
    "Not writing persistent cache entry",
    "to persistent compilation cache",
    "Compiling %s with global",
    "/jax/compilation_cache/",
)


def test_no_module_but_the_seam_names_a_jax_internal() -> None:
    seam = (
        ROOT / "cachectl" / "core" / "jax_seam.py",
        ROOT / "cachectl" / "core" / "jax_kernels.py",
        ROOT / "cachectl" / "core" / "jax_platforms.py",
        ROOT / "cachectl" / "core" / "jax_cache_io.py",
        ROOT / "cachectl" / "core" / "jax_cache_key.py",
        ROOT / "cachectl" / "core" / "jax_executables.py",
    )
    offenders = [
        f"{path.relative_to(ROOT)}: {text}"
        for pkg in ("cachectl", "server")
        for path in sorted((ROOT / pkg).rglob("*.py"))
        if path not in seam
        for text in SEAM_ONLY
        if text in path.read_text()
    ]
    assert offenders == []
    assert all(text in seam[0].read_text() for text in SEAM_ONLY[:1] + SEAM_ONLY[2:])


def test_importing_the_seam_imports_no_jax() -> None:
    proc = run_py(
        "import sys, cachectl.core.jax_seam, cachectl.core.jax_cache_io, cachectl.core.jax_cache_key, cachectl.core.jax_executables; print(sorted(m for m in sys.modules if m.split('.')[0] == 'jax'))",
        check=True,
    )
    assert proc.stdout.strip().splitlines()[-1] == "[]"


# -- facts without a seam function, pinned against the installed JAX (docs/jax-facts.md) -----

_SIZE_LIMIT_PROBE = """
import json, os
import jax, jax.numpy as jnp, numpy as np
cache_dir, limit = {cache!r}, {limit}
jax.config.update("jax_compilation_cache_dir", cache_dir)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
jax.config.update("jax_compilation_cache_max_size", limit)
jax.jit(lambda x: jnp.sin(x) * 3).lower(np.ones((3,), np.float32)).compile()
print(json.dumps(sorted(os.listdir(cache_dir))))
"""


def test_fact2_atime_files_and_the_lockfile_exist_only_under_a_size_limit(tmp_path: Path) -> None:
    """docs/jax-facts.md fact 2: JAX keeps ``-atime`` files and a ``.lockfile`` only when its
    own size limit is on; managed services run without it (cachectl enforces limits)."""
    found = {}
    for limit in (-1, 10**9):
        cache = tmp_path / f"c{limit}"
        cache.mkdir()
        proc = run_py(_SIZE_LIMIT_PROBE.format(cache=str(cache), limit=limit), check=True)
        found[limit] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [f for f in found[-1] if f.endswith("-cache")] and not [
        f for f in found[-1] if f.endswith("-atime") or f == ".lockfile"
    ], found[-1]
    assert [f for f in found[10**9] if f.endswith("-atime")] and ".lockfile" in found[10**9]


_PAD_PROBE = """
import json
import jax, jax.numpy as jnp, numpy as np
compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda e, d, **kw: compiles.append(e) if e == "/jax/core/compile/backend_compile_duration" else None)
f = jax.jit(lambda x: x * 2).lower(np.ones((4, 3), np.float32)).compile()
before = len(compiles)
np.asarray(f(np.pad(np.ones((3, 3), np.float32), ((0, 1), (0, 0)))))
host = len(compiles) - before
np.asarray(f(jnp.pad(np.ones((3, 3), np.float32), ((0, 1), (0, 0)))))
print(json.dumps(dict(host=host, device=len(compiles) - before - host)))
"""


def test_fact8_padding_with_jnp_compiles_and_with_numpy_does_not() -> None:
    """docs/jax-facts.md fact 8: a compiled program called with numpy inputs compiles nothing;
    a ``jnp.pad`` on the call path is a program of its own (serving pads on the host)."""
    proc = run_py(_PAD_PROBE, check=True)
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["host"] == 0 and counts["device"] >= 1, counts


VERIFYING = r"""
import hashlib, json, numpy as np, jax, jax.numpy as jnp
from cachectl.core import jax_seam

jax.config.update("jax_compilation_cache_dir", {cache!r})
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
seen = {{"expected": [], "refused": [], "wrote": []}}

class Verifier(jax_seam.EntryVerifier):
    def __init__(self, shas):
        self.shas = shas
    def get(self, key, base):
        seen["expected"].append(key)
        if self.shas.get(key) is None:
            return None
        data = base(key)
        if data is not None and hashlib.sha256(data).hexdigest() != self.shas[key]:
            seen["refused"].append(key)
            return None
        return data
    def put(self, key, value):
        seen["wrote"].append(key)
        self.shas[key] = hashlib.sha256(value).hexdigest()

shas = json.loads({shas!r})
jax_seam.install_verifying_cache({cache!r}, Verifier(shas))
hits = {{"n": 0}}
jax.monitoring.register_event_listener(
    lambda e, **kw: hits.__setitem__("n", hits["n"] + (e == "/jax/compilation_cache/cache_hits")))
out = float(jax.jit(lambda x: jnp.tanh(x) * 3.0)(np.float32(1.0)))
print(json.dumps(dict(seen, hits=hits["n"], out=out, opened=jax_seam.opened_cache_dir(),
                      shas=shas)))
"""


def test_a_verifying_cache_replaces_the_file_cache_jax_opens(tmp_path: Path) -> None:
    """JAX opens its persistent cache through ``compilation_cache.get_file_cache(path)`` at the
    first compile (``_initialize_cache``, jax 0.9 to 0.12), and reads entries only through the
    opened object's ``get`` and writes through its ``put``: install_verifying_cache wraps it, so
    an entry whose sha256 is not the expected one is a miss (compiled in memory), an expected one
    a hit, and what the process writes is reported."""
    from jax._src import compilation_cache

    assert "get_file_cache(path)" in inspect.getsource(compilation_cache._initialize_cache)
    cache = str(tmp_path / "jc")

    def run(shas: dict[str, str]) -> dict[str, Any]:
        proc = run_py(VERIFYING.format(cache=cache, shas=json.dumps(shas)), check=True)
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first = run({})  # nothing expected: a miss without a read, then JAX writes its entry
    assert first["hits"] == 0 and len(first["wrote"]) == 1 and first["opened"] == cache
    key = first["wrote"][0]
    entry = Path(cache) / f"{key}{CACHE_SUFFIX}"
    good = hashlib.sha256(entry.read_bytes()).hexdigest()
    assert first["shas"][key] == good

    assert run({key: good})["hits"] == 1
    refused = run({key: "0" * 64})  # bytes that are not the verified ones: a miss, never loaded
    assert (refused["hits"], refused["refused"]) == (0, [key])
    assert refused["out"] == first["out"]
    assert run({})["hits"] == 0


PUTS = """
import hashlib, json, pathlib, sys
import jax
from jax._src import lru_cache
from cachectl.core import jax_seam
jax_seam.record_puts(lambda k, s: print("put", k, s, file=sys.stderr))
cache = lru_cache.LRUCache({path!r}, max_size=-1)
cache.put("k", b"first")
cache.put("k", b"second")  # a file is at the key: JAX writes nothing
on_disk = (pathlib.Path({path!r}) / "k-cache").read_bytes()
print(json.dumps({{"disk": on_disk.decode(), "puts": list(jax_seam.put_sha256s("k")),
                  "second": hashlib.sha256(b"second").hexdigest()}}))
"""


def test_jax_writes_nothing_at_a_taken_key_and_record_puts_says_what_it_was_handed(
    tmp_path: Path,
) -> None:
    """The fact warm and warm-run rely on (issue 62): JAX's LRUCache.put leaves a file already
    at the key as it is, and record_puts remembers the sha256 of each value handed to it, so
    a file whose sha256 is not among them is another writer's."""
    proc = run_py(PUTS.format(path=str(tmp_path)), check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["disk"] == "first"
    assert out["second"] in out["puts"] and len(out["puts"]) == 2
    assert proc.stderr.count("put k ") == 2


FAST_WRITE = """
import json, os, threading, numpy as np, jax, jax.numpy as jnp
from cachectl.core import jax_seam
jax.config.update("jax_compilation_cache_dir", {cache!r})
jax.config.update("jax_persistent_cache_min_compile_time_secs", 3600)  # nothing is that slow
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
writes = []
jax.monitoring.register_event_listener(
    lambda e, **kw: writes.append(e) if e == "/jax/compilation_cache/cache_misses" else None)
x = np.float32(1.0)
out = {{}}
def holder():
    restore = jax_seam.write_whatever_compile_time()
    jax.jit(lambda v: v * 7.0)(x)  # while it holds: written, however fast
    out["held"] = len(writes)
    restore()
    jax.jit(lambda v: v * 8.0)(x)  # restored: JAX's threshold again
    out["restored"] = len(writes)
t = threading.Thread(target=holder)
t.start(); t.join()
jax.jit(lambda v: v * 9.0)(x)  # another thread never saw the change
out["other_thread"] = len(writes)
out["files"] = len([n for n in os.listdir({cache!r}) if n.endswith("-cache")])
print(json.dumps(out))
"""


def test_the_minimum_compile_time_is_read_per_thread_after_the_compile(tmp_path: Path) -> None:
    """The compile lease's fact (issue 68): JAX checks jax_persistent_cache_min_compile_time_secs
    in ``compiler._cache_write``, after the compile and on the compiling thread, through the
    option's ``.value``, a thread-local State: write_whatever_compile_time makes this thread's
    compiles written however fast, until restored, and no other thread's."""
    from jax._src import compiler

    assert "persistent_cache_min_compile_time_secs.value" in inspect.getsource(
        compiler._cache_write
    )
    cache = str(tmp_path / "jc")
    proc = run_py(FAST_WRITE.format(cache=cache), check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"held": 1, "restored": 1, "other_thread": 1, "files": 1}, out
