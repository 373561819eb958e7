"""Environments as some machine would report them: no JAX needed to build one."""

from __future__ import annotations

from cachectl.core.fingerprint import Environment

ENV = Environment(
    jax_version="0.10.2",
    jaxlib_version="0.10.2",
    backend="cpu",
    platform_version="cpu",
    device_kind="cpu",
    device_count=1,
    process_count=1,
    topology="abc",
    xla_flags=(),
    compression="zstandard",
    enable_xla_caches="none",
    include_metadata_in_key=False,
)


def fake_env(
    jax_version: str = "0.10.2",
    device_kind: str = "cpu",
    device_count: int = 1,
    *,
    backend: str = "cpu",
    xla_flags: tuple[str, ...] = (),
) -> Environment:
    return Environment(
        jax_version=jax_version,
        jaxlib_version=jax_version,
        backend=backend,
        platform_version=backend,
        device_kind=device_kind,
        device_count=device_count,
        process_count=1,
        topology=f"{device_kind}:{device_count}",
        xla_flags=xla_flags,
        compression="zstandard",
        enable_xla_caches="none",
        include_metadata_in_key=False,
    )
