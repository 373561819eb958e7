"""The CPU instruction set XLA:CPU compiles for on this host: part of a CPU environment.

XLA:CPU generates code for the host's own vector extensions (LLVM's host CPU features), capped
by ``--xla_cpu_max_isa``; JAX's cache key holds neither. An entry compiled on a host with
AVX-512 and read on one without is a cache hit that dies with an illegal instruction (jax-gcm
issue 631 met it with JAX's own cache). So a CPU environment names what the code may use: the
highest of XLA's ``--xla_cpu_max_isa`` levels the host has (capped by the flag when set), and a
digest of the host's vector-extension flags that level lets XLA use. Two hosts share a CPU
namespace only when both agree; a fleet of mixed CPUs that wants one namespace sets the same
``--xla_cpu_max_isa`` everywhere (then only the features of levels up to it count).

Read from ``/proc/cpuinfo`` (Linux: ``flags`` on x86-64, ``Features`` on Arm); where it cannot
be read the architecture alone is named, with ``unknown``, which no host that can read it shares.
"""

from __future__ import annotations

import hashlib
import platform
import re
from collections.abc import Iterable, Sequence

CPUINFO = "/proc/cpuinfo"

# XLA's --xla_cpu_max_isa values, oldest first, each with the /proc/cpuinfo flags it needs
# (jaxlib's own help text: "SSE4_2, AVX, AVX2, AVX512, AVX512_VNNI, AVX512_BF16, AMX, and
# AMX_FP16"). A host's level is the last one whose flags, and every earlier level's, it has.
X86_LEVELS: tuple[tuple[str, frozenset[str]], ...] = (
    ("SSE4_2", frozenset({"ssse3", "sse4_1", "sse4_2"})),
    ("AVX", frozenset({"avx"})),
    ("AVX2", frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2"})),
    ("AVX512", frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})),
    ("AVX512_VNNI", frozenset({"avx512_vnni"})),
    ("AVX512_BF16", frozenset({"avx512_bf16"})),
    ("AMX", frozenset({"amx_tile", "amx_bf16", "amx_int8"})),
    ("AMX_FP16", frozenset({"amx_fp16"})),
)
_LEVEL_NAMES = [name for name, _ in X86_LEVELS]

# The x86 flags that change what LLVM may emit for XLA: the vector and bit-manipulation
# extensions. Others (virtualisation, power management, bugs) say nothing about codegen.
_X86_CODEGEN = re.compile(
    r"^(sse\w*|ssse3|avx\w*|amx\w*|fma\w*|f16c|bmi\d|abm|lzcnt|popcnt|movbe|adx|aes|"
    r"pclmulqdq|vpclmulqdq|vaes|gfni|sha_ni|xop|tbm)$"
)
# The Arm features that do the same (NEON is every AArch64's baseline).
_ARM_CODEGEN = re.compile(r"^(asimd\w*|sve\w*|sme\w*|fphp|bf16|i8mm|dotprod|fcma|jscvt|lrcpc)$")


def max_isa_flag(xla_flags: Iterable[str]) -> str | None:
    """The ``--xla_cpu_max_isa`` value among normalized XLA flags, upper-cased; None if unset."""
    for flag in xla_flags:
        name, _, value = flag.partition("=")
        if name == "--xla_cpu_max_isa" and value:
            return value.strip().upper()
    return None


def x86_level(flags: set[str]) -> str:
    """The last of XLA's levels whose flags (and every earlier level's) ``flags`` hold."""
    level = "baseline"
    for name, needed in X86_LEVELS:
        if not needed <= flags:
            break
        level = name
    return level


# XLA's own rule (xla/backends/cpu/codegen/cpu_features.cc, ShouldEnableX86CpuFeature): under
# a cap at level i, a feature is turned off when any rule from i on matches it (the levels fall
# through to the newest); every other host feature stays on. In /proc/cpuinfo's spelling.
_NEWER_THAN_LEVEL = (
    lambda f: f.startswith("avx") or f in ("f16c", "vpclmulqdq", "vaes"),  # SSE4_2
    lambda f: f.startswith(("avx2", "fma")),  # AVX
    lambda f: f.startswith("avx512"),  # AVX2
    lambda f: f == "avx512_vnni",  # AVX512
    lambda f: f == "avx512_bf16",  # AVX512_VNNI
    lambda f: f.startswith("amx"),  # AVX512_BF16
    lambda f: f == "amx_fp16",  # AMX
    lambda f: f.startswith(("amx_fp8", "amx_tf32", "amx_avx512", "amx_movrs", "avx10_2")),
)


def _newer_than(feature: str, cut: int) -> bool:
    return any(rule(feature) for rule in _NEWER_THAN_LEVEL[cut:])


def _digest(features: Iterable[str]) -> str:
    return hashlib.sha256(" ".join(sorted(features)).encode()).hexdigest()[:8]


def describe(machine: str, cpuinfo: str | None, xla_flags: Sequence[str] = ()) -> str:
    """``ARCH:LEVEL:DIGEST`` for a CPU environment (see module); pure, for tests."""
    arch = machine.lower()
    if cpuinfo is None:
        return f"{arch}:unknown"
    cap = max_isa_flag(xla_flags)
    if arch in ("x86_64", "amd64"):
        flags = set(_first_field(cpuinfo, "flags").split())
        level = x86_level(flags)
        features = {f for f in flags if _X86_CODEGEN.match(f)}
        if cap in _LEVEL_NAMES:  # XLA turns off what is newer than the cap; the rest stays on
            cut = _LEVEL_NAMES.index(cap)
            if level != "baseline" and _LEVEL_NAMES.index(level) > cut:
                level = cap
            features = {f for f in features if not _newer_than(f, cut)}
        return f"x86_64:{level}:{_digest(features)}"
    if arch in ("aarch64", "arm64"):
        features = {f for f in _first_field(cpuinfo, "Features").split() if _ARM_CODEGEN.match(f)}
        level = "SVE2" if "sve2" in features else "SVE" if "sve" in features else "NEON"
        return f"aarch64:{level}:{_digest(features)}"
    return arch


def _first_field(cpuinfo: str, name: str) -> str:
    """The value of the first ``name : value`` line of /proc/cpuinfo ('' where there is none)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value.strip()
    return ""


def host_cpu_isa(xla_flags: Sequence[str] = ()) -> str:
    """This host's CPU instruction set as a CPU environment names it (see module)."""
    try:
        with open(CPUINFO, encoding="utf-8", errors="replace") as fh:
            cpuinfo: str | None = fh.read(1 << 20)
    except OSError:
        cpuinfo = None
    return describe(platform.machine() or "unknown", cpuinfo, xla_flags)
