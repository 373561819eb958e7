"""Bundles: create, install on a fresh HOME, serve from it; every tampering refused, nothing installed."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support.bundles import (
    assert_nothing_installed,
    default_root,
    environments,
    fresh_home,
    members,
    write_members,
)
from support.infra import run_cachectl
from support.warming import invoke, service


def test_bundle_round_trip_on_a_fresh_home(tmp_path: Path, made: dict[str, Any]) -> None:
    created, report = made["created"], made["report"]
    assert (
        created["files"] == 1 + 5 + 5
        and len(created["entries"]) == 5
        and created["signed_by"] is None
    )
    listed = json.loads(invoke("bundle", "ls", str(made["bundle"]), "--json").stdout)
    assert {e["key"] for e in listed["entries"]} == {b["key"] for b in report["buckets"]}
    assert all(
        e["aot_sha256"] and e["compile_time_ms"] is not None and e["function"]
        for e in listed["entries"]
    )
    assert "holds 5 entries, 11 files" in invoke("bundle", "ls", str(made["bundle"])).stdout

    dry = json.loads(invoke("bundle", "install", str(made["bundle"]), "--dry-run", "--json").stdout)
    assert dry["dry_run"] and dry["installed"] == 5
    assert_nothing_installed()

    done = json.loads(invoke("bundle", "install", str(made["bundle"]), "--json").stdout)
    assert (done["installed"], done["already_present"], done["conflicts"]) == (5, 0, [])
    ns = Path(done["dest"])
    assert ns.is_relative_to(default_root()) and not (default_root() / ".staging").exists()
    assert sorted(p.name for p in ns.iterdir()) == sorted(
        ["env.json"] + [b["key"] + s for b in report["buckets"] for s in ("-cache", "-aot")]
    )
    (env,) = environments()
    assert env["entries"] == 5 and env["executables"] == 5
    rows = json.loads(invoke("ls", "--env", env["digest"][:8], "--json").stdout)["entries"]
    assert {r["origin"] for r in rows} == {"bundle"} and all(r["function"] for r in rows)

    # A fresh service hits every bucket, and every stored executable loads.
    check = json.loads(invoke("warm-check", str(made["manifest"]), "--json").stdout)
    assert check["summary"]["coverage"] == 100.0 and check["summary"]["aot_coverage"] == 100.0, (
        check["summary"]
    )
    result = service(tmp_path)
    assert result["requests"] == 5 and result["hits"] == 5, result

    again = json.loads(invoke("bundle", "install", str(made["bundle"]), "--json").stdout)
    assert (again["installed"], again["already_present"]) == (0, 5)


def test_install_into_a_namespace_compares_each_key_with_its_row(
    tmp_path: Path, made: dict[str, Any]
) -> None:
    """An install reads the rows of the bundle's keys (``held_entries``) and sorts each entry: one
    whose row has another sha256 is a conflict (not written), one held without its stored
    executable gets the bundle's, the others are already present."""
    from cachectl.context import Context
    from cachectl.core.config import load_settings
    from cachectl.index import NewEntry

    first = json.loads(invoke("bundle", "install", str(made["bundle"]), "--json").stdout)
    ns = Path(first["dest"])
    keys = sorted(b["key"] for b in made["report"]["buckets"])
    bare, other = keys[0], keys[1]
    ctx = Context(load_settings())
    try:
        env = ctx.index.get_environment(first["cache"], first["digest"])
        ctx.index.set_executables(env.id, {bare: None})
        (ns / f"{bare}-aot").unlink()
        row = ctx.index.get_entry(env.id, other)
        assert row is not None
        ctx.index.upsert_entries(
            env.id, [NewEntry(other, row.module, row.size, "f" * 64, row.origin)]
        )
    finally:
        ctx.close()
    assert environments()[0]["executables"] == 4

    again = json.loads(invoke("bundle", "install", str(made["bundle"]), "--json").stdout)
    assert (again["installed"], again["already_present"], again["conflicts"]) == (0, 4, [other])
    assert (ns / f"{bare}-aot").is_file()
    (env_row,) = environments()
    assert (env_row["entries"], env_row["executables"]) == (5, 5)


def test_an_install_whose_new_namespace_appears_before_its_rename_writes_into_it(
    made: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two installs of one bundle at once (two pulls on a node): both find no namespace and
    stage it whole; the first rename makes it. The second's rename then meets a directory that
    is not empty, and its files go into that namespace one by one: both succeed, one intact
    copy. Here the other install is a real process run to its end in that window."""
    from cachectl.storage import ingest

    rename = ingest._rename_staging
    others: list[dict[str, Any]] = []

    def other_install_lands_first(*args: Any, **kwargs: Any) -> bool:
        bundle = made["bundle"]
        other = run_cachectl(bundle.parent, "bundle", "install", str(bundle), "--json", timeout=300)
        assert other.returncode == 0, other.stderr
        others.append(json.loads(other.stdout))
        return rename(*args, **kwargs)

    monkeypatch.setattr(ingest, "_rename_staging", other_install_lands_first)
    done = json.loads(invoke("bundle", "install", str(made["bundle"]), "--json").stdout)
    assert [o["installed"] for o in others] == [5] and done["installed"] == 5, (others, done)
    (env,) = environments()
    assert (env["entries"], env["executables"]) == (5, 5)
    ns = Path(done["dest"])
    assert len([p for p in ns.iterdir() if p.name != "env.json"]) == 10
    assert not (default_root() / ".staging").exists()
    # verify reads every file against its index row: one intact copy, no debris.
    assert json.loads(invoke("verify", "--json").stdout)["plan"]["findings"] == []


def test_bundle_stores_entries_raw_and_stays_a_standard_zstd_tar(
    tmp_path: Path, made: dict[str, Any]
) -> None:
    """Entries (zstd already) are stored as raw zstd blocks: their bytes appear verbatim in the file,
    which GNU tar with the zstd tool reads, and a bundle written by tarfile and one compressor (as
    earlier versions did) still installs."""
    bundle, items = made["bundle"], members(made["bundle"])
    raw = made["bundle"].read_bytes()
    entries = [(m.name, data) for m, data in items if m.name.endswith("-cache")]
    assert len(entries) == 5 and all(data in raw for _, data in entries)
    if shutil.which("tar") and shutil.which("zstd"):
        listed = subprocess.run(
            ["tar", "--zstd", "-tf", str(bundle)], capture_output=True, text=True, check=True
        )
        assert listed.stdout.split() == [m.name for m, _ in items]
    old_style = tmp_path / "old.tar.zst"
    write_members(old_style, [(m.name, data) for m, data in items])
    done = json.loads(invoke("bundle", "install", str(old_style), "--json").stdout)
    assert (done["installed"], done["conflicts"]) == (5, [])


def _tamper(path: Path, out: Path, fn) -> Path:
    items = [(m.name, data) for m, data in members(path)]
    write_members(out, fn(items))
    return out


def _first_entry(items: list[tuple[str, bytes]]) -> int:
    return next(i for i, (n, _) in enumerate(items) if n.endswith("-cache"))


def _flip(items):
    i = _first_entry(items)
    name, data = items[i]
    items[i] = (name, data[:-1] + bytes([data[-1] ^ 1]))
    return items


def _add(items):
    return items + [("files/jit_affine-" + "0" * 64 + "-cache", b"\x28\xb5\x2f\xfd evil")]


def _remove(items):
    del items[_first_entry(items)]
    return items


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_flip, "does not match its sha256"),
        (_add, "is not in the bundle's content list"),
        (_remove, "missing"),
    ],
)
def test_tampered_bundle_installs_nothing(
    tmp_path: Path, made: dict[str, Any], change, message: str
) -> None:
    bad = _tamper(made["bundle"], tmp_path / "bad.tar.zst", change)
    result = invoke("bundle", "install", str(bad), code=2)
    assert (
        message in result.stderr
        and result.stderr.count("\n") == 1
        and "Traceback" not in result.output
    )
    assert_nothing_installed()


def test_bundle_of_another_environment_exits_3_with_the_field_diff(
    tmp_path: Path, made: dict[str, Any]
) -> None:
    from cachectl.core.fingerprint import Environment

    def other_env(items):
        meta = json.loads(items[0][1])
        meta["environment"]["device_count"] = 8
        env = Environment.from_dict(meta["environment"])
        meta["digest"] = meta["content"]["environment"] = env.digest
        meta["namespace"] = env.namespace
        items[0] = ("bundle.json", json.dumps(meta).encode())
        return items

    bad = _tamper(made["bundle"], tmp_path / "other.tar.zst", other_env)
    result = invoke("bundle", "install", str(bad), code=3)
    assert (
        "device_count: 1 here, 8 in the bundle" in result.stderr and result.stderr.count("\n") == 1
    )
    assert_nothing_installed()


def test_not_a_bundle_is_bad_input(tmp_path: Path, made: dict[str, Any]) -> None:
    junk = tmp_path / "junk.tar.zst"
    junk.write_bytes(b"hello")
    assert "not a cachectl bundle" in invoke("bundle", "install", str(junk), code=2).stderr
    assert_nothing_installed()


def test_signed_bundle_into_a_cache_that_trusts_its_key(
    tmp_path: Path, made: dict[str, Any]
) -> None:
    invoke("cache", "set", "default", "--trust", str(made["pub"]))
    # Unsigned: refused.
    assert "is not signed" in invoke("bundle", "install", str(made["bundle"]), code=2).stderr
    assert environments() == []
    listed = json.loads(invoke("bundle", "ls", str(made["signed"]), "--json").stdout)
    assert listed["signed_by"]
    done = json.loads(invoke("bundle", "install", str(made["signed"]), "--json").stdout)
    assert done["installed"] == 5 and done["signed_by"] == listed["signed_by"]


def test_bad_signature_is_refused(tmp_path: Path, made: dict[str, Any]) -> None:
    invoke("cache", "set", "default", "--trust", str(made["pub"]))

    def forge(items):
        sig = json.loads(items[1][1])
        assert items[1][0] == "signature.json"
        raw = bytearray(__import__("base64").b64decode(sig["signature"]))
        raw[0] ^= 1
        sig["signature"] = __import__("base64").b64encode(bytes(raw)).decode()
        items[1] = ("signature.json", json.dumps(sig).encode())
        return items

    bad = _tamper(made["signed"], tmp_path / "forged.tar.zst", forge)
    assert "does not match its content list" in invoke("bundle", "install", str(bad), code=2).stderr
    assert_nothing_installed_keep_root()


def assert_nothing_installed_keep_root() -> None:
    root = default_root()
    assert not root.exists() or [p for p in root.rglob("*")] == []
    assert environments() == []


def test_bundle_signed_by_an_untrusted_key_is_refused(tmp_path: Path, made: dict[str, Any]) -> None:
    other = tmp_path / "other.key"
    invoke("key", "generate", str(other))
    invoke("cache", "set", "default", "--trust", str(other) + ".pub")
    assert (
        "which the cache does not trust"
        in invoke("bundle", "install", str(made["signed"]), code=2).stderr
    )
    assert_nothing_installed_keep_root()


def _rekey(new_key: str):
    """A bundle whose first entry is renamed to ``new_key`` everywhere (entry list, content list,
    members): consistent, so only the key check can refuse it."""

    def change(items):
        meta = json.loads(items[0][1])
        old = meta["entries"][0]["key"]
        text = items[0][1].decode().replace(old, json.dumps(new_key)[1:-1])
        items[0] = ("bundle.json", text.encode())
        return [(n.replace(old, new_key), d) for n, d in items]

    return change


@pytest.mark.parametrize(
    "new_key",
    ["not-a-jax-key", "m" * 200 + "-" + "a" * 64, ".hidden-" + "a" * 64, "line\n-" + "a" * 64],
    ids=["no-hash", "too-long", "dot", "newline"],
)
def test_a_bundle_with_a_key_jax_cannot_make_installs_nothing(
    tmp_path: Path, made: dict[str, Any], new_key: str
) -> None:
    bad = _tamper(made["bundle"], tmp_path / "rekeyed.tar.zst", _rekey(new_key))
    result = invoke("bundle", "install", str(bad), code=2)
    assert "is not a JAX cache key" in result.stderr and result.stderr.count("\n") == 1, (
        result.output
    )
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
    assert_nothing_installed()


@pytest.mark.parametrize(
    "name",
    [
        "bundle.json",
        "files/jit_affine-" + "0" * 64 + "-cache",  # 88 bytes: a plain USTAR header
        "files/" + "b" * 94,  # exactly 100 bytes
        "files/jit_" + "long_function_name_" * 5 + "-" + "0" * 64 + "-cache",  # over 100: PAX
        "files/jit_fonction_é-" + "0" * 64 + "-cache",  # not ASCII: PAX
    ],
)
def test_bundle_member_headers_are_what_tarfile_writes(name: str) -> None:
    """The writer's own header builder gives tarfile's bytes for every name (short ASCII names
    built directly, the rest by tarfile), and tarfile reads each back with its name, size and
    data. Without the fallback a long name would be cut at 100 bytes."""
    import io
    import tarfile

    from cachectl.bundle.format import MemberInfo, _tarinfo, member_header

    data = b"x" * 700
    want = _tarinfo(name, len(data), 1764000000).tobuf(
        tarfile.PAX_FORMAT, "utf-8", "surrogateescape"
    )
    got = member_header(name, len(data), 1764000000)
    assert got == want
    stream = got + data + b"\0" * (-len(data) % 512) + b"\0" * 1024
    with tarfile.open(fileobj=io.BytesIO(stream), mode="r|") as tar:
        member = tar.next()
        assert member is not None and (member.name, member.size) == (name, len(data))
        fh = tar.extractfile(member)
        assert fh is not None and fh.read() == data
    # install's reader (MemberInfo: its own parse of exactly these headers) reads what tarfile reads
    for info in (tarfile.TarInfo, MemberInfo):
        with tarfile.open(fileobj=io.BytesIO(stream), mode="r:", tarinfo=info) as tar:
            member = tar.next()
            assert member is not None and isinstance(member, info)
            written = _tarinfo(name, len(data), 1764000000).get_info()
            assert {**member.get_info(), "chksum": 0} == {**written, "chksum": 0}
            assert (member.offset, member.offset_data) == (0, len(got))


def test_install_reads_the_members_tarfile_reads_parsing_plain_headers_itself() -> None:
    """install's member loop parses plain headers off the stream and puts any other block back
    for tarfile (a PAX name, a symlink, a global PAX header and every member after it): the
    members, their kinds, sizes and bytes are tarfile's own."""
    import io
    import tarfile

    import zstandard

    from cachectl.bundle import extract
    from cachectl.bundle.format import ForwardOnly, MemberInfo, _tarinfo, member_header

    def pad(data: bytes) -> bytes:
        return data + b"\0" * (-len(data) % 512)

    def other(info: tarfile.TarInfo, data: bytes = b"") -> bytes:
        return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape") + pad(data)

    link = tarfile.TarInfo("files/link")
    link.type, link.linkname = tarfile.SYMTYPE, "files/a"
    long = "files/jit_" + "long_function_name_" * 5 + "-" + "0" * 64 + "-cache"
    members = [
        ("bundle.json", b"{}"),
        ("files/a", b"a" * 700),
        ("files/c", b""),
        ("files/d", b"d" * 512),
    ]
    plain = [member_header(n, len(d), 1764000000) + pad(d) for n, d in members]
    raw = b"".join(
        [
            *plain[:2],
            other(_tarinfo(long, 5, 1764000000), b"b" * 5),
            plain[2],
            other(link),
            plain[3],
            tarfile.TarInfo.create_pax_global_header({"comment": "after this, tarfile reads"}),
            member_header("files/e", 3, 1764000000) + pad(b"eee"),
            b"\0" * 1024,
        ]
    )
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
        want = [
            (
                m.name,
                m.isfile(),
                m.size,
                (tar.extractfile(m) or io.BytesIO()).read() if m.isfile() else b"",
            )
            for m in tar.getmembers()[1:]
        ]
    assert [w[0] for w in want] == ["files/a", long, "files/c", "files/link", "files/d", "files/e"]
    reader = zstandard.ZstdDecompressor().stream_reader(
        io.BytesIO(zstandard.ZstdCompressor().compress(raw))
    )
    stream = ForwardOnly(reader)
    got, parsed_here = [], []
    with tarfile.open(fileobj=stream, mode="r:", tarinfo=MemberInfo) as tar:  # type: ignore[arg-type]
        first = tar.next()
        assert first is not None and first.name == "bundle.json"
        stream.seek(first.offset_data)
        stream.read(first.size)  # install reads bundle.json before the files
        for name, is_file, size, at, member in extract.members(tar, first):
            if name == "bundle.json":
                continue
            stream.seek(at)
            got.append((name, is_file, size, stream.read(size) if is_file else b""))
            parsed_here.append(member is None)
    assert got == want
    # Plain headers before the global PAX header parsed here; after it, tarfile's.
    assert parsed_here == [True, False, True, False, True, False]


def _damaged(header: bytes, at: int, value: bytes, *, fix_chksum: bool) -> bytes:
    """``header`` with ``value`` written at ``at`` (its checksum recomputed, or left as it was)."""
    head = bytearray(header[:at] + value + header[at + len(value) :])
    if fix_chksum:
        head[148:156] = b" " * 8
        head[148:156] = b"%06o\0 " % sum(head)
    return bytes(head)


@pytest.mark.parametrize(
    ("at", "value", "fix_chksum"),
    [
        (0, b"Z", False),  # a name changed, checksum left: damaged
        (124, b"0000000001", True),  # the size (the checksum fixed)
        (126, b"9", True),  # not octal
        (126, b" ", True),  # a space inside a number (tarfile reads what it can)
        (135, b"7", True),  # no NUL after the digits
        (108, b"0000001", True),  # an owner
        (156, b"2", True),  # a symlink
        (156, b"5", True),  # a directory
        (157, b"target", True),  # a link name
        (265, b"root", True),  # an owner's name
        (345, b"prefix", True),  # a USTAR prefix
        (257, b"ustar  \0", True),  # GNU's magic
        (148, b"000000\0 ", False),  # a wrong checksum
        (155, b"\0", False),  # the checksum's last byte
    ],
)
def test_install_reads_every_other_header_as_tarfile_does(
    at: int, value: bytes, fix_chksum: bool
) -> None:
    """A header that is not exactly what member_header writes is tarfile's to read or refuse:
    MemberInfo gives the same member, or the same error, as tarfile's own TarInfo."""
    import tarfile

    from cachectl.bundle.format import MemberInfo, member_header

    header = _damaged(
        member_header("files/jit_f-" + "0" * 64 + "-cache", 700, 1764000000),
        at,
        value,
        fix_chksum=fix_chksum,
    )
    outcomes = []
    for info in (tarfile.TarInfo, MemberInfo):
        try:
            member = info.frombuf(header, "utf-8", "surrogateescape")
        except tarfile.HeaderError as exc:
            outcomes.append(type(exc))
        else:
            outcomes.append((member.get_info(), member.chksum))
    assert outcomes[0] == outcomes[1]


def _synthetic_namespace(tmp_path: Path, monkeypatch, count: int) -> tuple[Any, Path]:
    """A fresh home whose namespace indexes ``count`` small entries, as bench/fleet.py builds it."""
    import os

    from cachectl.context import Context
    from cachectl.core.config import load_settings
    from cachectl.index import NewEntry
    from cachectl.storage.entries import make_entry, sha256

    fresh_home(tmp_path, monkeypatch, "src")
    ctx = Context(load_settings())
    cache = ctx.cache()
    ns, info = ctx.namespace(cache)
    store = ctx.store(cache)
    rows = []
    for i in range(count):
        data = make_entry(os.urandom(2048), 1)
        key = f"jit_small-{i:064x}"
        store.write_bytes(f"{ns.relpath}/{key}-cache", data)
        rows.append(NewEntry(key, "jit_small", len(data), sha256(data), "warm", 1000))
    ctx.index.upsert_entries(info.id, rows)
    return ctx, Path(ns.url)


@pytest.mark.parametrize(
    ("damage", "message"),
    [("remove", "is in the index but not in storage"), ("alter", "differs from the index")],
)
def test_bundle_create_refuses_a_file_storage_lost_or_changed_in_a_later_read_batch(
    tmp_path: Path, monkeypatch, damage: str, message: str
) -> None:
    """Files are read in batches of up to 64: a missing or changed file deep in a later batch
    still stops the bundle, names that file, and leaves no bundle (nor its temporary file)."""
    from cachectl import bundle
    from cachectl.core.errors import OperationFailed

    ctx, ns_dir = _synthetic_namespace(tmp_path, monkeypatch, 150)
    victim = ns_dir / f"jit_small-{130:064x}-cache"
    if damage == "remove":
        victim.unlink()
    else:
        victim.write_bytes(victim.read_bytes()[:-1] + b"!")
    out = tmp_path / "out" / "ns.tar.zst"
    out.parent.mkdir()
    with pytest.raises(OperationFailed, match=message) as err:
        bundle.create(ctx, out)
    assert victim.name in str(err.value)
    assert list(out.parent.iterdir()) == []
    ctx.close()


def test_install_of_many_entries_runs_without_collections(tmp_path: Path, monkeypatch) -> None:
    """bundle install is a bulk pass (core/bulk_pass.py): under the default thresholds a 400-entry
    install ran 7 collections (a full one scans everything JAX made); inside it, none."""
    import gc

    from cachectl import bundle
    from cachectl.context import Context
    from cachectl.core.config import load_settings

    ctx, _ = _synthetic_namespace(tmp_path, monkeypatch, 400)
    out = tmp_path / "ns.tar.zst"
    bundle.create(ctx, out)
    ctx.close()
    fresh_home(tmp_path, monkeypatch, "dst")
    ctx = Context(load_settings())
    ctx.cache()
    collections: list[int] = []

    def seen(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    gc.callbacks.append(seen)
    try:
        result = bundle.install(ctx, out)
    finally:
        gc.callbacks.remove(seen)
        gc.set_threshold(*before)
        ctx.close()
    assert result.installed == 400
    assert len(collections) <= 1  # at most the young one due when the thresholds are put back


def test_bundle_entries_are_the_dataclass_s_own_and_a_missing_field_is_refused() -> None:
    """bundle.json's entries read without the frozen dataclass's __init__ when a line holds
    exactly its fields: equal, hashable, frozen and signed as ones built by __init__; a newer
    cachectl's extra field is dropped, a missing one refused (install's BadBundle)."""
    import dataclasses

    from cachectl.bundle.format import BundleEntry, bundle_entries, entries_document

    line = {
        "key": "jit_f-" + "0" * 64,
        "function": "f",
        "bucket": {"batch": 8},
        "size": 8192,
        "sha256": "1" * 64,
        "compile_time_ms": 5,
        "aot_size": None,
        "aot_sha256": None,
    }
    built = BundleEntry(**line)
    (fast,) = bundle_entries({"entries": [dict(reversed(line.items()))]})
    assert fast == built and dataclasses.asdict(fast) == dataclasses.asdict(built) == line
    assert hash(dataclasses.replace(fast, bucket=None)) == hash(
        dataclasses.replace(built, bucket=None)
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.size = 1  # type: ignore[misc]
    assert entries_document({"content": {}, "entries": [line]}) == entries_document(
        {"content": {}, "entries": [dict(reversed(line.items()))]}
    )
    (newer,) = bundle_entries({"entries": [{**line, "added_later": 1}]})
    assert newer == built
    with pytest.raises(TypeError):
        bundle_entries({"entries": [{k: v for k, v in line.items() if k != "sha256"}]})
