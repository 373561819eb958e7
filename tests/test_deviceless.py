"""TPU topology names for ``warm --topology``, and what warm says where it cannot compile for one.

Needs no libtpu: names are parsed before libtpu is asked. The compiles themselves are in
tests/test_deviceless_tpu.py, which runs in the libtpu virtualenv (scripts/test --deviceless).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.warming import TINY_MODULE, invoke, warm_json

from cachectl.core import jax_seam
from cachectl.core.errors import BadInput
from cachectl.core.topologies import libtpu_init_args, parse_topology

MANIFEST = """
version: 1
target: {backend: tpu}
functions:
  - fn: wm_tiny:affine
    jit: {static_argnames: [mode]}
    args:
      - {shape: [batch, 8], dtype: float32}
      - {shape: [8, 8], dtype: float32}
    kwargs: {mode: relu}
    buckets: {batch: [1, 2]}
"""


@pytest.mark.parametrize(
    ("name", "libtpu", "kind", "chips", "bounds"),
    [
        ("v5e:1x1", "v5e:1x1", "TPU v5 lite", 1, (1, 1, 1)),
        ("TPU v5 lite:1x1", "v5e:1x1", "TPU v5 lite", 1, (1, 1, 1)),
        ("v5e:2x2", "v5e:2x2", "TPU v5 lite", 4, (2, 2, 1)),
        ("v5litepod-4", "v5e:2x2", "TPU v5 lite", 4, (2, 2, 1)),
        ("v5litepod-1", "v5e:1x1", "TPU v5 lite", 1, (1, 1, 1)),
        ("v5e:2x4", "v5e:2x4", "TPU v5 lite", 8, (2, 4, 1)),
        ("v6e:2x2", "v6e:2x2", "TPU v6 lite", 4, (2, 2, 1)),
        ("v6e-8", "v6e:2x4", "TPU v6 lite", 8, (2, 4, 1)),
        ("v5p:2x2x1", "v5p:2x2x1", "TPU v5", 4, (2, 2, 1)),
        ("v5p-8", "v5p:2x2x1", "TPU v5", 4, (2, 2, 1)),
    ],
)
def test_names_as_users_write_them(
    name: str, libtpu: str, kind: str, chips: int, bounds: tuple[int, int, int]
) -> None:
    topology = parse_topology(name)
    assert topology.libtpu_name == libtpu
    assert topology.device_kind == kind
    assert topology.chips == chips and topology.hosts == 1
    assert topology.chips_per_host_bounds == bounds
    assert topology.wrap == (False, False, False)
    # The cloud name libtpu is told at start-up (TPU_ACCELERATOR_TYPE) names the same slice.
    assert parse_topology(topology.accelerator_type).libtpu_name == libtpu


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("v7x:2x2", "unknown TPU topology 'v7x:2x2'"),
        ("v5e", "unknown TPU topology 'v5e'"),
        ("v5e:2x2x1", "v5e slices have 2 dimensions"),
        ("v5p:2x2", "v5p slices have 3 dimensions"),
        ("v5litepod-3", "no v5litepod slice has 3"),
        ("v5e:3x3", "no v5e slice has the shape 3x3"),
        ("v5e:4x4", "spans several hosts"),
        ("v5litepod-16", "spans several hosts"),
        ("v5p-7", "2 a chip"),
    ],
)
def test_unknown_or_multi_host_names_are_refused(name: str, says: str) -> None:
    with pytest.raises(BadInput) as refused:
        parse_topology(name)
    assert says in refused.value.message
    assert "\n" not in refused.value.message


def test_cloud_tpu_init_flag_is_added_once_and_keeps_the_users() -> None:
    barrier = "--xla_tpu_use_enhanced_launch_barrier=true"
    assert libtpu_init_args(None) == barrier
    assert libtpu_init_args("--xla_foo=1") == f"--xla_foo=1 {barrier}"
    # The user's own value of the flag stays (cloud_tpu_init leaves it too).
    assert libtpu_init_args("--xla_tpu_use_enhanced_launch_barrier=false") == (
        "--xla_tpu_use_enhanced_launch_barrier=false"
    )


def _tiny(tmp_path: Path) -> Path:
    (tmp_path / "wm_tiny.py").write_text(TINY_MODULE)
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(MANIFEST)
    return manifest


def test_warm_refuses_an_unknown_topology_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    manifest = _tiny(tmp_path)
    result = invoke("warm", str(manifest), "--topology", "v9:2x2", code=2)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "unknown TPU topology 'v9:2x2'" in lines[0], result.output
    assert "Traceback" not in result.output
    assert not list(tmp_path.rglob("*-cache"))


def test_manifest_topology_is_checked_like_the_flag(tmp_path: Path) -> None:
    manifest = _tiny(tmp_path)
    manifest.write_text(MANIFEST.replace("{backend: tpu}", "{backend: tpu, topology: v5e:9x9}"))
    result = invoke("warm", str(manifest), code=2)
    assert "no v5e slice has the shape 9x9" in result.output


@pytest.mark.skipif(
    jax_seam.libtpu_version() is not None, reason="libtpu is installed in this virtualenv"
)
def test_without_libtpu_warm_says_how_to_get_it(tmp_path: Path) -> None:
    manifest = _tiny(tmp_path)
    result = invoke("warm", str(manifest), "--topology", "v5e:1x1", code=3)
    assert "libtpu is not installed" in result.output
    assert "pip install 'cachectl-jax[tpu]'" in result.output
    assert not list(tmp_path.rglob("*-cache"))


CPU_MANIFEST = """
version: 1
target: {backend: cpu}
functions:
  - fn: wm_tiny:affine
    jit: {static_argnames: [mode]}
    args:
      - {shape: [batch, 8], dtype: float32}
      - {shape: [8, 8], dtype: float32}
    kwargs: {mode: relu}
    buckets: {batch: [1, 2]}
"""

SERVE = """
import json, sys
import numpy as np
import cachectl
rt = cachectl.serving(sys.argv[1], telemetry=False)
for batch in (1, 2, 1, 2):
    np.asarray(rt["affine"](np.ones((batch, 8), np.float32), np.ones((8, 8), np.float32), mode="relu"))
report = rt.report()
f = report.functions["affine"]
print(json.dumps({"aot": f.aot, "fallback": f.fallback, "reason": f.fallback_reason,
                  "warnings": report.warnings}))
"""


def _serve(tmp_path: Path, manifest: Path) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", SERVE, str(manifest)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_stored_executables_record_the_backend_version_and_load_on_it(tmp_path: Path) -> None:
    from cachectl.storage import executables

    (tmp_path / "wm_tiny.py").write_text(TINY_MODULE)
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(CPU_MANIFEST)
    report = warm_json(str(manifest))
    files = sorted(Path(report["namespace"]).glob("*-aot"))
    assert len(files) == 2, report
    for path in files:
        header = executables.read_header(path.read_bytes())
        assert header.platform_version == jax_seam.default_backend().platform_version
    served = _serve(tmp_path, manifest)
    assert (served["aot"], served["fallback"]) == (4, 0), served


def test_an_executable_of_another_backend_version_is_refused_once_and_jit_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cachectl.storage import executables

    (tmp_path / "wm_tiny.py").write_text(TINY_MODULE)
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(CPU_MANIFEST)
    real_pack = executables.pack
    other = "PJRT C API\nTFRT TPU v9\nBuilt elsewhere"

    def pack(payload: bytes, **kw: object) -> bytes:
        return real_pack(payload, **{**kw, "platform_version": other})  # type: ignore[arg-type]

    monkeypatch.setattr(executables, "pack", pack)
    invoke("warm", str(manifest), "--json")
    served = _serve(tmp_path, manifest)
    assert (served["aot"], served["fallback"]) == (0, 4), served
    assert "compiled for backend version 'PJRT C API TFRT TPU v9 Built elsewhere'" in str(
        served["reason"]
    )
    said = [w for w in served["warnings"] if "compiled for backend version" in w]  # type: ignore[union-attr]
    assert len(said) == 1, served["warnings"]


def test_doctor_says_whether_this_machine_compiles_for_tpu() -> None:
    report = json.loads(invoke("doctor", "--json", code=None).stdout)
    (finding,) = [f for f in report["findings"] if f["check"] == "tpu-compile"]
    assert finding["severity"] == "info"
    version = jax_seam.libtpu_version()
    if version is None:
        assert "libtpu is not installed" in finding["message"]
        assert finding["fix"] == "pip install 'cachectl-jax[tpu]'"
    else:
        assert finding["message"].startswith(f"libtpu {version}: warm --topology compiles")


def test_topology_does_not_go_with_distributed(tmp_path: Path) -> None:
    manifest = _tiny(tmp_path)
    result = invoke("warm", str(manifest), "--topology", "v5e:1x1", "--distributed", code=2)
    assert "--topology compiles on one machine" in result.output
