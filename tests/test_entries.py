"""The JAX entry format, checked against entries real JAX wrote."""

from __future__ import annotations

import zlib

import pytest

from cachectl.storage import entries
from cachectl.storage.entries import Kind


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


def test_entry_file_matcher_agrees_with_classify() -> None:
    """The one-match test sync's plan uses says ENTRY exactly where classify() does."""
    h = "0123456789abcdef" * 4
    names = [
        f"jit_f-{h}-cache",
        f"jit_f-{h}\n-cache",
        f"a-b-{h}-cache",
        f"--{h}-cache",
        f".tmpx-{h}-cache",
        f".tmp-x-{h}-cache",
        f"xla/x-{h}-cache",
        f"-{h}-cache",
        f"x\ny-{h}-cache",
        f"x-{h}\n\n-cache",
        f"x-{h[:-1]}-cache",
        f"x-{h}a-cache",
        f"x-{h.upper()}-cache",
        f"x-{h}-cache\n",
        f"x-{h}-aot",
        f"x-{h}",
        f"x-{h}-atime",
        "env.json",
        ".lockfile",
        "-cache",
    ]
    matches = entries.entry_file_matcher()
    kinds = {n: entries.classify(n) for n in names}
    assert {n for n in names if matches(n)} == {n for n, k in kinds.items() if k is Kind.ENTRY}
    assert sum(k is Kind.ENTRY for k in kinds.values()) == 5
    # entry_keys: the same names in one pass over the joined list, each as its key, in order
    for order in (names, names[::-1], [n for n in names if kinds[n] is Kind.ENTRY], names[:1], []):
        assert entries.entry_keys(order) == [
            n[: -len("-cache")] for n in order if kinds[n] is Kind.ENTRY
        ]


def test_all_keys_agrees_with_is_key() -> None:
    """The one-pass check bundle install runs over a bundle's keys says what a call of is_key
    per key says, on every way a key can fail (a newline that would join two keys, a long one
    counted in bytes, a key that is no str)."""
    h = "0123456789abcdef" * 4
    longest = "m" * (entries.MAX_KEY_LENGTH - 65) + "-" + h
    lists: list[list[object]] = [
        [],
        [f"jit_f-{h}"],
        [f"jit_f-{h}", f"jit_a.b-c-{h}", f"é-{h}", longest],
        [f"jit_f-{h}\njit_g-{h}"],
        [f"jit_f-{h}\n"],
        [f"jit_f-{h}", 3],
        [f"jit_f-{h}", None],
        ["m" + longest],
        ["é" * 200 + "-" + h],
        [f"-{h}"],
        [f".hidden-{h}"],
        [f"jit_f-{h.upper()}"],
        [f"jit_f-{h}-cache"],
        [f"\ud800-{h}"],
    ]
    for keys in lists:
        assert entries.all_keys(keys) == all(entries.is_key(k) for k in keys), keys


def test_keys_lacking_atime_only_where_jax_eviction_runs() -> None:
    """Doctor and verify share the rule: a .lockfile means every -cache entry needs its -atime."""
    a, b = "jit_a-" + "a" * 64, "jit_b-" + "b" * 64
    names = [f"{a}-cache", f"{a}-atime", f"{b}-cache", "env.json"]
    kinds = {n: entries.classify(n) for n in names}
    assert entries.keys_lacking_atime(kinds) is None
    kinds[".lockfile"] = Kind.LOCKFILE
    assert entries.keys_lacking_atime(kinds) == [b]
    del kinds[f"{b}-cache"]
    assert entries.keys_lacking_atime(kinds) == []


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
        assert header.payload_size == 500


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"garbage bytes that are not compressed",
        zlib.compress(b"\x00\x00"),
        zlib.compress(b"\xff\xff\xff\xff" + b"x" * 10),
    ],
)
def test_corrupt_entries_are_detected(data: bytes) -> None:
    with pytest.raises(entries.CorruptEntry):
        entries.read_header(data)


def test_truncated_real_entry(tmp_path) -> None:
    data = entries.make_entry(b"\x02" * 4000)
    with pytest.raises(entries.CorruptEntry):
        entries.read_header(data[: len(data) // 2])
