"""The one storage suite, run against local disk, memory://, S3 (moto) and GCS (emulator)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cachectl.core.errors import BadInput
from cachectl.storage.store import NotRegularFile, Store, normalize_url, ordered_map


def test_write_read_list_with_sizes_and_times(storage_root: str) -> None:
    store = Store(storage_root)
    store.write_bytes("ns/a/one-cache", b"x" * 10)
    store.write_bytes("ns/a/two-cache", b"y" * 20)
    store.write_bytes("ns/b/env.json", b"{}")
    listing = {f.path: f for f in store.list("ns")}
    assert set(listing) == {"ns/a/one-cache", "ns/a/two-cache", "ns/b/env.json"}
    assert listing["ns/a/one-cache"].size == 10
    assert listing["ns/a/two-cache"].size == 20
    assert all(f.mtime is not None for f in listing.values())
    assert store.read_bytes("ns/a/two-cache") == b"y" * 20
    assert store.exists("ns/a/one-cache")
    assert not store.exists("ns/a/missing-cache")
    assert store.list("nothing-here") == []


def test_paths_without_times_then_infos_of_a_few(storage_root: str) -> None:
    """list_paths gives list()'s paths in its order; infos gives list()'s size and time of the files
    asked for, and leaves out one deleted since."""
    store = Store(storage_root)
    for i, rel in enumerate(
        ["ns/b/z-cache", "ns/a/one-cache", "ns/a/sub/deep", "top", "ns/c/gone"]
    ):
        store.write_bytes(rel, b"x" * (i + 1))
    listing = store.list("")
    assert store.list_paths("") == [f.path for f in listing]
    assert (
        store.list_paths("ns/a")
        == [f.path for f in store.list("ns/a")]
        == ["ns/a/one-cache", "ns/a/sub/deep"]
    )
    assert store.list_paths("nothing-here") == []
    store.delete(["ns/c/gone"])
    infos = store.infos(["ns/a/sub/deep", "top", "ns/c/gone"], within="")
    assert infos == {f.path: f for f in listing if f.path in ("ns/a/sub/deep", "top")}
    assert store.infos([]) == {}


def _listed(store: Store, under: str) -> list[tuple[str, int | None, float | None]]:
    """``dir_stats(under)`` as one list of (path, size, mtime), in path order."""
    return sorted(
        (f"{d}/{name}" if d else name, size, mtime)
        for d, files in store.dir_stats(under)
        for name, size, mtime in files
    )


def test_stats_are_the_listing_as_numbers(storage_root: str) -> None:
    """dir_stats gives list()'s paths, sizes and times (POSIX seconds: datetime keeps microseconds), in
    its order."""
    store = Store(storage_root)
    for i, rel in enumerate(["ns/b/z-cache", "ns/a/one-cache", "ns/a/sub/deep", "top"]):
        store.write_bytes(rel, b"x" * (i + 3))
    for under in ("", "ns/a"):
        listing = store.list(under)
        stats = _listed(store, under)
        assert [s[:2] for s in stats] == [(f.path, f.size) for f in listing]
        assert [s[2] for s in stats] == pytest.approx(
            [f.mtime.timestamp() for f in listing], abs=1e-6
        )
    assert [s[:2] for s in _listed(store, "")] == [
        ("ns/a/one-cache", 4),
        ("ns/a/sub/deep", 5),
        ("ns/b/z-cache", 3),
        ("top", 6),
    ]
    assert _listed(store, "nothing-here") == []


def test_local_paths_list_links_as_files_and_never_descend_them(tmp_path) -> None:
    root = tmp_path / "cache"
    store = Store(str(root))
    store.write_bytes("ns/a/x-cache", b"x" * 7)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s" * 3)
    (root / "ns" / "linked").symlink_to(outside)
    (root / "ns" / "a" / "dangling").symlink_to(tmp_path / "nowhere")
    listing = store.list("")
    assert (
        store.list_paths("")
        == [f.path for f in listing]
        == ["ns/a/dangling", "ns/a/x-cache", "ns/linked"]
    )
    assert store.infos(store.list_paths("")) == {f.path: f for f in listing}
    assert (
        store.infos(["ns/linked"])["ns/linked"].size == outside.stat().st_size
    )  # the target's, as list()


def test_overwrite_is_whole(storage_root: str) -> None:
    store = Store(storage_root)
    store.write_bytes("f", b"old contents")
    store.write_bytes("f", b"new")
    assert store.read_bytes("f") == b"new"
    assert [f.path for f in store.list("")] == ["f"]  # no temp files left behind


@pytest.mark.parametrize("tail", [b"\r", b"\n", b"\r\n", b"\n--", b""], ids=repr)
def test_bytes_round_trip_whatever_they_end_with(storage_root: str, tail: bytes) -> None:
    """Entries are random bytes: one in 256 ends in \\r, which the GCS emulator's multipart
    parser used to drop (tests/infra.py _exact_multipart); every byte must come back."""
    store = Store(storage_root)
    data = bytes(range(256)) + tail
    store.write_bytes("ns/a/k-cache", data)
    assert store.read_bytes("ns/a/k-cache") == data
    assert store.size("ns/a/k-cache") == len(data)


def test_batched_delete_is_idempotent(storage_root: str) -> None:
    store = Store(storage_root)
    paths = [f"ns/e{i:03d}-cache" for i in range(25)]
    for p in paths:
        store.write_bytes(p, b"1")
    store.delete(paths[:10] + ["ns/never-existed-cache"], batch_size=4)
    assert {f.path for f in store.list("ns")} == set(paths[10:])
    store.delete(paths, batch_size=7)  # the first ten are gone already: fine
    assert store.list("ns") == []


def test_delete_tree_removes_a_namespace_only(storage_root: str) -> None:
    store = Store(storage_root)
    store.write_bytes("jax-1/cpu/aaa/k-cache", b"1")
    store.write_bytes("jax-1/cpu/aaa/env.json", b"{}")
    store.write_bytes("jax-1/cpu/bbb/k-cache", b"2")
    store.delete_tree("jax-1/cpu/aaa")
    assert [f.path for f in store.list("")] == ["jax-1/cpu/bbb/k-cache"]
    store.delete_tree("jax-1/cpu/aaa")  # again: nothing to do
    with pytest.raises(BadInput):
        store.delete_tree("")


def test_move(storage_root: str) -> None:
    store = Store(storage_root)
    store.write_bytes("ns/k-cache", b"data")
    store.move("ns/k-cache", ".quarantine/t/ns/k-cache")
    assert not store.exists("ns/k-cache")
    assert store.read_bytes(".quarantine/t/ns/k-cache") == b"data"


def test_paths_cannot_escape_the_root(storage_root: str) -> None:
    store = Store(storage_root)
    with pytest.raises(BadInput):
        store.write_bytes("../escape", b"x")


def test_url_for_round_trips(storage_root: str) -> None:
    store = Store(storage_root)
    store.write_bytes("ns/file", b"abc")
    again = Store(store.url_for("ns"))
    assert again.read_bytes("file") == b"abc"


def test_local_write_is_atomic_and_leaves_no_temp(tmp_path) -> None:
    store = Store(str(tmp_path / "root"))
    store.write_bytes("d/f", b"1" * 1000)
    assert os.listdir(tmp_path / "root" / "d") == ["f"]
    assert oct(os.stat(tmp_path / "root" / "d" / "f").st_mode & 0o777) == "0o644"


@pytest.mark.parametrize(
    "url",
    ["ftp://host/x", "hdfs://nn/cache", "", "s3://", "gs:///"],
)
def test_bad_urls_are_bad_input(url: str) -> None:
    with pytest.raises(BadInput) as info:
        normalize_url(url)
    assert "\n" not in str(info.value)


def test_url_normalization(tmp_path) -> None:
    assert normalize_url(f"file://{tmp_path}") == str(tmp_path)
    assert normalize_url("gcs://bucket/p/") == "gs://bucket/p"
    assert normalize_url("s3a://bucket/p") == "s3://bucket/p"


def _tree_with_links(tmp_path: Path) -> tuple[Path, Store]:
    """A root with ns/a/x-cache (100 bytes), top ("t"), a symlinked directory ns/linked and, in ns/a, a symlinked
    file link-cache and a FIFO fifo-cache (both links point outside the root)."""
    root = tmp_path / "cache"
    store = Store(str(root))
    store.write_bytes("ns/a/x-cache", b"x" * 100)
    store.write_bytes("top", b"t")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret-cache").write_bytes(b"secret")
    (root / "ns" / "linked").symlink_to(outside)
    (root / "ns" / "a" / "link-cache").symlink_to(outside / "secret-cache")
    os.mkfifo(root / "ns" / "a" / "fifo-cache")
    return root, store


def test_reader_reads_only_regular_files_through_real_directories(tmp_path) -> None:
    """The many-file reader opens each directory once without following links: a symlinked
    directory, a symlinked file and a FIFO are never read, missing files are missing."""
    root, store = _tree_with_links(tmp_path)
    (root / "ns" / "plainfile").write_bytes(b"f")
    with store.reader() as read:
        assert read("ns/a/x-cache") == b"x" * 100
        assert read("top") == b"t"
        for bad in (
            "ns/linked/secret-cache",
            "ns/a/link-cache",
            "ns/a/fifo-cache",
            "ns/plainfile/x",
        ):
            with pytest.raises(NotRegularFile):
                read(bad)
        with pytest.raises(FileNotFoundError):
            read("ns/a/gone-cache")
        with pytest.raises(FileNotFoundError):
            read("ns/nodir/gone-cache")
        with pytest.raises(BadInput):
            read("ns/../../outside/secret-cache")
        # From many threads at once, every read sees its own whole file.
        for i in range(50):
            store.write_bytes(f"ns/b{i % 5}/f{i}", bytes([i]) * (i + 1))
        items = [f"ns/b{i % 5}/f{i}" for i in range(50)]
        assert list(ordered_map(read, items, 8)) == [bytes([i]) * (i + 1) for i in range(50)]


def test_dir_reader_reads_names_in_one_real_directory(tmp_path) -> None:
    """A directory's reader by name has the many-file reader's checks: links and FIFOs are never
    read; a directory that is a link, or is missing, makes every read fail as the reader's would."""
    root, store = _tree_with_links(tmp_path)
    with store.dir_reader("ns/a") as read:
        assert read("x-cache") == b"x" * 100
        for bad in ("link-cache", "fifo-cache"):
            with pytest.raises(NotRegularFile, match=bad):
                read(bad)
        with pytest.raises(FileNotFoundError):
            read("gone-cache")
        assert list(ordered_map(read, ["x-cache"] * 20, 4)) == [b"x" * 100] * 20
    with store.dir_reader("ns/linked") as read, pytest.raises(NotRegularFile):
        read("secret-cache")
    with store.dir_reader(
        "ns"
    ) as read:  # a name through a linked directory: that link is not followed
        assert read("a/x-cache") == b"x" * 100
        with pytest.raises(NotRegularFile):
            read("linked/secret-cache")
    with store.dir_reader("ns/nodir") as read, pytest.raises(FileNotFoundError):
        read("x-cache")
    with store.dir_reader("ns/../..") as read, pytest.raises(BadInput):
        read("x-cache")


def test_reader_on_object_stores_is_read_bytes(storage_root: str) -> None:
    store = Store(storage_root)
    store.write_bytes("ns/k-cache", b"abc")
    with store.reader() as read:
        assert read("ns/k-cache") == b"abc"
        with pytest.raises(FileNotFoundError):
            read("ns/gone-cache")
    with store.dir_reader("ns") as read:
        assert read("k-cache") == b"abc"
        with pytest.raises(FileNotFoundError):
            read("gone-cache")


def test_batched_local_delete_in_threads_counts_what_it_removed(tmp_path) -> None:
    store = Store(str(tmp_path / "cache"))
    paths = [f"ns/f{i}" for i in range(300)]
    for p in paths:
        store.write_bytes(p, b"x")
    assert store.delete(paths[:200] + ["ns/never-there"]) == 200
    assert sorted(f.path for f in store.list("ns")) == sorted(paths[200:])
    assert store.delete(paths) == 100


def test_local_listings_never_import_fsspec(tmp_path: Path) -> None:
    """A read-only service lists its namespace on local disk: that must not import fsspec (whose
    filesystem lookup reads every installed package's entry points)."""
    import subprocess
    import sys

    (tmp_path / "ns").mkdir()
    (tmp_path / "ns" / "a-cache").write_bytes(b"x")
    code = (
        "import sys\n"
        "from cachectl.storage.store import Store\n"
        f"s = Store({str(tmp_path)!r})\n"
        "assert [f.path for f in s.list('ns')] == ['ns/a-cache']\n"
        "assert s.list_paths('ns') == ['ns/a-cache']\n"
        "assert list(s.dir_stats('ns'))\n"
        "print('fsspec' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
