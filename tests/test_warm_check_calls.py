"""warm-check calls every stored executable once, on zeros, in a child process that never lowers.

The kernels here are made ready only while their function is lowered, as JAX's LAPACK kernels
are: a process that never lowers (a service, the calling child) calls them unready. Then one
returns an XLA FFI error (the call raises) and the other sends its process SIGSEGV (a real
crash). Both are typed XLA FFI handlers built with ctypes: stored executables may call them
(Python host callbacks cannot be serialized), and ``jax.jit`` in a service makes them ready,
so serving through jit works where the stored executable does not.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

from click.testing import CliRunner
from support.infra import run_py  # noqa: E402

from cachectl.cli import cli

FAULTY_MODULE = """
import ctypes
import os
import signal

import jax
import jax.numpy as jnp

_READY = {"raises": False, "crashes": False}
_HANDLER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
_ERROR_CREATE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
_METADATA = 1  # XLA_FFI_Extension_Metadata


class _ErrorArgs(ctypes.Structure):  # XLA_FFI_Error_Create_Args
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("message", ctypes.c_char_p),
        ("errc", ctypes.c_int),
    ]


_ERROR = _ErrorArgs(ctypes.sizeof(_ErrorArgs), None, b"wc kernel used before it was ready", 13)


def _int(address):
    return ctypes.c_int.from_address(address)


def _pointer(address):
    return ctypes.c_void_p.from_address(address).value


def _handler(kind):
    def handler(frame):  # XLA_FFI_CallFrame*
        extension, api = _pointer(frame + 8), _pointer(frame + 16)
        if extension and _int(extension + 8).value == _METADATA:
            metadata = _pointer(extension + 24)  # the handler's API version: the caller's
            _int(metadata + 24).value = _int(api + 32).value
            _int(metadata + 28).value = _int(api + 36).value
            return None
        if _READY[kind]:
            return None
        if kind == "crashes":
            os.kill(os.getpid(), signal.SIGSEGV)
        return _ERROR_CREATE(_pointer(api + 48))(ctypes.addressof(_ERROR))

    return _HANDLER(handler)


_HANDLERS = {kind: _handler(kind) for kind in _READY}
for _kind, _h in _HANDLERS.items():
    jax.ffi.register_ffi_target(f"wc_{_kind}", jax.ffi.pycapsule(_h), platform="cpu")


def _kernel(kind, x):
    _READY[kind] = True  # readied while lowering, as JAX readies LAPACK
    jax.ffi.ffi_call(f"wc_{kind}", jax.ShapeDtypeStruct(x.shape, x.dtype), has_side_effect=True)(x)
    return x * 2


def raises(x):
    return _kernel("raises", x)


def crashes(x):
    return _kernel("crashes", x)


def fine(x):
    return jnp.tanh(x)
"""

MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: wc_faulty:crashes
    args: [{shape: [batch, 8], dtype: float32}]
    buckets: {batch: [2, 4]}
  - fn: wc_faulty:fine
    args: [{shape: [batch, 8], dtype: float32}]
    buckets: {batch: [2, 4]}
  - fn: wc_faulty:raises
    args: [{shape: [batch, 8], dtype: float32}]
    buckets: {batch: [2]}
"""

SERVICE = """
import json, sys
import numpy as np
sys.path.insert(0, {dir!r})
import jax
requests = dict(n=0, hits=0)
def _ev(e, **kw):
    if e == "/jax/compilation_cache/compile_requests_use_cache": requests["n"] += 1
    if e == "/jax/compilation_cache/cache_hits": requests["hits"] += 1
jax.monitoring.register_event_listener(_ev)
import cachectl
rt = cachectl.serving({manifest!r})
x = np.ones((2, 8), np.float32)
outs = {{name: np.asarray(rt[name](x)).tolist() for name in ("crashes", "raises", "fine")}}
print(json.dumps(dict(report=rt.report().to_dict(), outs=outs, requests=requests)))
"""

UNUSABLE = {("crashes", 2), ("crashes", 4), ("raises", 2)}


def _invoke(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args))


def _unusable_in_index() -> dict[str, str | None]:
    db = Path(os.environ["XDG_DATA_HOME"]) / "cachectl" / "index.db"
    with sqlite3.connect(db) as conn:
        return dict(conn.execute("SELECT key, aot_unusable FROM entries").fetchall())


def test_warm_check_calls_each_executable_and_marks_the_ones_that_raise_or_crash(
    tmp_path: Path,
) -> None:
    (tmp_path / "wc_faulty.py").write_text(FAULTY_MODULE)
    manifest = tmp_path / "faulty.yaml"
    manifest.write_text(MANIFEST)
    warmed = _invoke("warm", str(manifest), "--json")
    assert warmed.exit_code == 0, warmed.output
    report = json.loads(warmed.stdout)
    assert all(b["aot_bytes"] for b in report["buckets"]), report  # 5 stored executables

    result = _invoke("warm-check", str(manifest), "--json")
    assert result.exit_code == 1, result.output
    data = json.loads(result.stdout)
    by_name = {(b["function"], b["bucket"]["batch"]): b for b in data["buckets"]}
    assert {b["status"] for b in data["buckets"]} == {"hit"}  # the persistent cache covers all
    for name in UNUSABLE:
        bucket = by_name[name]
        assert bucket["aot_call"] == name[0].replace("es", "ed"), bucket  # crashed | raised
    assert (
        "SIGSEGV" in by_name[("crashes", 2)]["aot"] and "SIGSEGV" in by_name[("crashes", 4)]["aot"]
    )
    assert "wc kernel used before it was ready" in by_name[("raises", 2)]["aot"], by_name
    assert by_name[("fine", 2)]["aot"] == by_name[("fine", 4)]["aot"] == "loaded"
    summary = data["summary"]
    assert (summary["aot_loaded"], summary["aot_ran"], summary["aot_failed"]) == (5, 2, 3)
    assert summary["aot_coverage"] == 40.0
    keys = {name: by_name[name]["key"] for name in by_name}
    marks = _unusable_in_index()
    assert {name for name, key in keys.items() if marks[key]} == UNUSABLE, marks
    assert "crashed when called on zeros (killed by SIGSEGV)" in marks[keys[("crashes", 2)]]

    text = _invoke("warm-check", str(manifest))
    assert text.exit_code == 1
    assert "stored executables: 2/5 load and run (40.0%); 3 raised or crashed" in text.stdout
    for function, batch in UNUSABLE:
        assert f"{function}[batch={batch}]" in text.output, text.output

    # A fresh service: the marked buckets go through jax.jit (whose lowering readies the
    # kernels), from the persistent cache; the others from their stored executables.
    proc = run_py(SERVICE.format(dir=str(tmp_path), manifest=str(manifest)), check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    functions = out["report"]["functions"]
    for name in ("crashes", "raises"):
        assert functions[name]["aot"] == 0 and functions[name]["fallback"] == 1, functions
        assert (
            "warm-check found this stored executable unusable" in functions[name]["fallback_reason"]
        )
        assert out["outs"][name] == [[2.0] * 8] * 2
    assert functions["fine"]["aot"] == 1 and functions["fine"]["fallback"] == 0, functions
    assert out["requests"]["n"] == out["requests"]["hits"] == 2, out["requests"]


KEYS_MODULE = """
import jax, jax.numpy as jnp

def key_specs(n):
    return jax.eval_shape(lambda: jax.random.split(jax.random.key(0), n))

def draw(keys, x):
    return jax.vmap(lambda k, v: v + jax.random.normal(k, v.shape))(keys, x)
"""

KEYS_MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: wc_keys:draw
    args:
      - {pytree: wc_keys:key_specs, leaf_axes: {0: n}}
      - {shape: [n, 3], dtype: float32}
    buckets: {n: [2, 4]}
"""


def test_warm_check_calls_executables_that_take_typed_prng_keys(tmp_path: Path) -> None:
    """jax.random.key(...) keys have no numpy zeros: warm-check calls them on keys made of key
    data zeros, as it calls every stored executable, and says 100% only when all ran."""
    (tmp_path / "wc_keys.py").write_text(KEYS_MODULE)
    manifest = tmp_path / "keys.yaml"
    manifest.write_text(KEYS_MANIFEST)
    warmed = _invoke("warm", str(manifest), "--json")
    assert warmed.exit_code == 0, warmed.output
    result = _invoke("warm-check", str(manifest), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [(b["aot"], b["aot_call"]) for b in data["buckets"]] == [("loaded", "ok")] * 2, data
    assert data["summary"]["aot_ran"] == 2 and data["summary"]["aot_coverage"] == 100.0


def test_an_executable_warm_check_could_not_call_fails_the_check_by_name() -> None:
    """Loaded but not called (no value to call it with, or the calling process failed) is not
    proven to run: exit 1, the bucket named, never 100%."""
    from cachectl.cli.warm_cmds import _check_failure
    from cachectl.warm.reports import CALL_OK, CALL_SKIPPED, CheckBucket, CheckReport

    why = "loaded; not called: no zero value for an argument of dtype float0"
    report = CheckReport(
        {},
        "ns",
        "default",
        [
            CheckBucket("f", {"n": 2}, "hit", aot="loaded", aot_call=CALL_OK),
            CheckBucket("f", {"n": 4}, "hit", aot=why, aot_call=CALL_SKIPPED),
        ],
    )
    assert not report.ok and report.summary.aot_coverage == 50.0
    failure = _check_failure(report)
    assert failure.exit_code == 1
    assert f"1 stored executable(s) loaded but not called: f[n=4] ({why})" in failure.message
