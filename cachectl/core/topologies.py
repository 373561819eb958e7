"""TPU topologies by the names users write, for compiling on a machine without that TPU.

``cachectl warm --topology v5e:2x2`` compiles for a TPU slice from a CPU machine: libtpu
describes the slice's devices (jax.experimental.topologies) and JAX compiles for them without
opening any accelerator. This module only turns a name into what libtpu needs and what the
slice's ``cachectl fingerprint`` will say; it imports no JAX.

Facts it relies on (tests/test_deviceless.py pins them against the installed libtpu):

- libtpu names slices ``<generation>:<dims>`` ("v5e:2x2", "v5p:2x2x1"); "v5litepod:1x1" is no
  valid name, so cloud names ("v5litepod-4", "v6e-8", "v5p-8") are translated here.
- A slice smaller than a host (v5e:1x1) needs ``chips_per_host_bounds`` of its own size, else
  libtpu refuses ("not divisible by ... 2x2x1"); a real single-host slice has its host's bounds.
- The topology fingerprint in JAX's cache key depends on ``wrap``: a real v5e 1x1 matched
  (False, False, False). Wraparound exists only on full v5p cubes, which span many hosts and
  which deviceless warm does not target.
- On a real TPU VM JAX's cloud_tpu_init (run when its TPU backend starts) appends
  ``--xla_tpu_use_enhanced_launch_barrier=true`` to ``LIBTPU_INIT_ARGS``, and JAX's key hashes
  that variable: a deviceless compile must set the same, or every key differs in its XLA flags.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cachectl.core import jax_seam
from cachectl.core.errors import BadInput

# What cloud_tpu_init adds to LIBTPU_INIT_ARGS on a real TPU VM (read in jax 0.10.2).
CLOUD_TPU_INIT_FLAGS: tuple[str, ...] = ("--xla_tpu_use_enhanced_launch_barrier=true",)


@dataclass(frozen=True)
class _Generation:
    libtpu: str  # the generation's name in libtpu's topology names
    device_kind: str  # what jax.devices()[0].device_kind says on that TPU
    dims: int  # 2 (a torus of chips in a plane) or 3
    host_bounds: tuple[int, int, int]  # chips per host of a multi-host slice
    single_host: tuple[tuple[int, ...], ...]  # slices that one host holds whole


_GENERATIONS: dict[str, _Generation] = {
    "v5e": _Generation("v5e", "TPU v5 lite", 2, (2, 2, 1), ((1, 1), (2, 2), (2, 4))),
    "v6e": _Generation("v6e", "TPU v6 lite", 2, (2, 2, 1), ((1, 1), (2, 2), (2, 4))),
    "v5p": _Generation("v5p", "TPU v5", 3, (2, 2, 1), ((2, 2, 1),)),
}
_ALIASES = {
    "v5e": "v5e",
    "v5litepod": "v5e",
    "v5lite": "v5e",
    "tpu v5 lite": "v5e",
    "v6e": "v6e",
    "tpu v6 lite": "v6e",
    "v5p": "v5p",
    "tpu v5": "v5p",
}
# Cloud accelerator types name a slice by its size: chips for v5e/v6e, TensorCores (2 a chip)
# for v5p. The shape is the one Google Cloud and GKE give that size.
_CLOUD_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16)}
_CLOUD_2D[256] = (16, 16)
_CLOUD_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4)}

KNOWN = "v5e:1x1, v5e:2x2, v5e:2x4, v5litepod-4, v6e:2x2, v6e-8, v5p:2x2x1, v5p-8"


@dataclass(frozen=True)
class TpuTopology:
    """One TPU slice: the name given, libtpu's name for it and what its devices look like."""

    name: str
    generation: str
    shape: tuple[int, ...]
    device_kind: str
    chips_per_host_bounds: tuple[int, int, int]
    wrap: tuple[bool, bool, bool]

    @property
    def libtpu_name(self) -> str:
        return f"{self.generation}:{'x'.join(str(d) for d in self.shape)}"

    @property
    def chips(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def accelerator_type(self) -> str:
        """The slice's cloud name, as a TPU VM's metadata gives it: chips for v5e/v6e,
        TensorCores (2 a chip) for v5p."""
        prefix = "v5litepod" if self.generation == "v5e" else self.generation
        return f"{prefix}-{self.chips * (2 if self.generation == 'v5p' else 1)}"

    @property
    def hosts(self) -> int:
        per_host = 1
        for d in self.chips_per_host_bounds:
            per_host *= d
        return max(1, self.chips // per_host)


def _refuse(name: str, why: str) -> BadInput:
    shown = name if len(name) <= 40 else name[:40] + "..."
    return BadInput(f"unknown TPU topology {shown!r}: {why}; use e.g. {KNOWN}")


def parse_topology(name: str) -> TpuTopology:
    """``v5e:2x2``, ``TPU v5 lite:1x1``, ``v5litepod-4``, ``v5p:2x2x1``, ``v6e-8`` -> a slice.

    BadInput (exit 2) for a name no TPU has, and for a slice over several hosts: deviceless
    warm compiles for one host's processes (a multi-host slice compiles collectively)."""
    text = name.strip()
    # No slice's size or dimension has more than a few digits: a longer number names none
    # (and int() of thousands of digits raises ValueError, not BadInput).
    cloud = re.fullmatch(r"(v5litepod|v5e|v6e|v5p)-(\d{1,6})", text.lower())
    if cloud:
        gen = _GENERATIONS[_ALIASES[cloud.group(1)]]
        size = int(cloud.group(2))
        table = _CLOUD_2D if gen.dims == 2 else _CLOUD_3D
        count = size if gen.dims == 2 else size // 2
        if gen.dims == 3 and size % 2:
            raise _refuse(name, f"{cloud.group(1)} sizes count TensorCores, 2 a chip")
        if count not in table:
            raise _refuse(name, f"no {cloud.group(1)} slice has {size}")
        shape: tuple[int, ...] = table[count]
    else:
        parts = re.fullmatch(r"([A-Za-z0-9 ]+?)\s*:\s*(\d{1,6}(?:x\d{1,6}){1,2})", text)
        if not parts or parts.group(1).lower() not in _ALIASES:
            raise _refuse(name, "write GENERATION:SHAPE (v5e, v6e, v5p) or a cloud type")
        gen = _GENERATIONS[_ALIASES[parts.group(1).lower()]]
        shape = tuple(int(d) for d in parts.group(2).split("x"))
        if len(shape) != gen.dims:
            raise _refuse(name, f"{gen.libtpu} slices have {gen.dims} dimensions")
        if any(d < 1 for d in shape):
            raise _refuse(name, "every dimension is at least 1")
    multi_host = set((_CLOUD_2D if gen.dims == 2 else _CLOUD_3D).values())
    if shape not in gen.single_host and shape not in multi_host:
        raise _refuse(name, f"no {gen.libtpu} slice has the shape {'x'.join(map(str, shape))}")
    if shape not in gen.single_host:
        hosts = ", ".join("x".join(map(str, s)) for s in gen.single_host)
        raise BadInput(
            f"TPU topology {name!r} spans several hosts: deviceless warm compiles for one host "
            f"({gen.libtpu}: {hosts}); warm a multi-host slice on the slice itself"
        )
    bounds = tuple(shape) + (1,) * (3 - len(shape))
    per_host = (bounds[0], bounds[1], bounds[2])
    return TpuTopology(
        name=text,
        generation=gen.libtpu,
        shape=shape,
        device_kind=gen.device_kind,
        chips_per_host_bounds=per_host,
        wrap=(False, False, False),
    )


def libtpu_init_args(current: str | None) -> str:
    """LIBTPU_INIT_ARGS as cloud_tpu_init leaves it on a TPU VM: ``current`` plus its flags."""
    flags = (current or "").split()
    for flag in CLOUD_TPU_INIT_FLAGS:
        if flag.split("=")[0] not in {f.split("=")[0] for f in flags}:
            flags.append(flag)
    return " ".join(flags)


def libtpu_startup_env(topology: TpuTopology) -> dict[str, str]:
    """What a TPU VM's metadata server tells libtpu when it starts. Elsewhere libtpu finds no
    metadata and prints warnings and an INVALID_ARGUMENT error to stderr before its logging is
    set up (no log-level variable silences them); the compile-only devices come out the same."""
    return {"TPU_ACCELERATOR_TYPE": topology.accelerator_type, "TPU_WORKER_HOSTNAMES": "localhost"}


INSTALL_HINT = "pip install 'cachectl-jax[tpu]' (it brings the jax[tpu] of the installed JAX)"


@dataclass(frozen=True)
class TpuCompiler:
    """Whether this machine can compile for TPU without one (``cachectl doctor``)."""

    libtpu_version: str | None
    detail: str

    @property
    def ok(self) -> bool:
        return self.libtpu_version is not None


def tpu_compiler() -> TpuCompiler:
    """libtpu's version, or why there is none; cheap (reads package metadata only)."""
    version = jax_seam.libtpu_version()
    if version is None:
        return TpuCompiler(None, f"libtpu is not installed: {INSTALL_HINT}")
    return TpuCompiler(version, f"libtpu {version}: warm --topology compiles for TPU here")
