"""The JAX entry format, checked against entries real JAX wrote."""

from __future__ import annotations

import zlib

import pytest

from cachectl import entries
from cachectl.entries import Kind


def test_classify_names() -> None:
    key = "jit_decode_step-" + "a" * 64
    assert entries.classify(f"{key}-cache") is Kind.ENTRY
    assert entries.classify(f"{key}-atime") is Kind.ATIME
    assert entries.classify(".lockfile") is Kind.LOCKFILE
    assert entries.classify("env.json") is Kind.ENV
    assert entries.classify("xla_gpu_per_fusion_autotune_cache_dir/x") is Kind.XLA_SUBCACHE
    assert entries.classify(".tmp-123") is Kind.TEMP
    assert entries.classify("jit_f-1234-cache") is Kind.OTHER  # not 64 hex
    assert entries.classify("notes.txt") is Kind.OTHER
    parsed = entries.parse_entry_filename(f"{key}-cache")
    assert parsed is not None and parsed.module == "jit_decode_step" and parsed.key == key


def test_module_names_with_dashes() -> None:
    key = "jit_my-fn-" + "b" * 64
    parsed = entries.parse_key(key)
    assert parsed is not None and parsed.module == "jit_my-fn"


def test_header_of_both_compressions() -> None:
    for compression in ("zstandard", "zlib"):
        data = entries.make_entry(b"\x01" * 500, compile_seconds=3, compression=compression)
        header = entries.read_header(data)
        assert header.compression == compression
        assert header.compile_seconds == 3
        assert header.executable_bytes == 500


@pytest.mark.parametrize(
    "data",
    [b"", b"garbage bytes that are not compressed", zlib.compress(b"\x00\x00"),
     zlib.compress(b"\xff\xff\xff\xff" + b"x" * 10)],
)
def test_corrupt_entries_are_detected(data: bytes) -> None:
    with pytest.raises(entries.CorruptEntry):
        entries.read_header(data)


def test_truncated_real_entry(tmp_path) -> None:
    data = entries.make_entry(b"\x02" * 4000)
    with pytest.raises(entries.CorruptEntry):
        entries.read_header(data[: len(data) // 2])
