"""Hostile bundles and pushes: every one refused before anything is visible, in bounded disk and
memory; a killed install leaves nothing a sweep does not remove; signed metadata stays signed.

Real bundles (a real warm, `bundle create`), real `cachectl` processes where limits or a kill
-9 matter (RLIMIT_FSIZE on the install, the push's peak RSS from wait4).
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import zstandard
from support.bundles import (
    assert_nothing_installed,
    default_root,
    environments,
    members,
    write_members,
)
from support.warming import invoke

from cachectl.core import temps
from cachectl.storage.entries import make_entry

Items = list[tuple[str, bytes]]


@pytest.fixture
def bundles(made: dict[str, Any]) -> dict[str, Any]:  # noqa: F811 - test_bundle's fixture
    """test_bundle's: a real warm, bundled unsigned and signed; the test runs on a fresh HOME."""
    return made


BIG = 64 << 20


def _items(bundle: Path) -> Items:
    return [(m.name, data) for m, data in members(bundle)]


def _meta(items: Items) -> dict[str, Any]:
    assert items[0][0] == "bundle.json"
    return json.loads(items[0][1])


def _set_meta(items: Items, meta: dict[str, Any]) -> None:
    items[0] = ("bundle.json", json.dumps(meta).encode())


def _relist(items: Items, name: str, data: bytes) -> None:
    """Replace member files/<name> with ``data`` and make bundle.json agree (content list and
    entry rows): the bundle is consistent, only its bytes are hostile."""
    sha, size = hashlib.sha256(data).hexdigest(), len(data)
    i = next(i for i, (n, _) in enumerate(items) if n == "files/" + name)
    items[i] = (items[i][0], data)
    meta = _meta(items)
    for f in meta["content"]["files"]:
        if f["name"] == name:
            f["size"], f["sha256"] = size, sha
    for e in meta["entries"]:
        if name == e["key"] + "-cache":
            e["size"], e["sha256"] = size, sha
        elif name == e["key"] + "-aot":
            e["aot_size"], e["aot_sha256"] = size, sha
    _set_meta(items, meta)


def _names(items: Items, suffix: str) -> list[str]:
    return [n[len("files/") :] for n, _ in items if n.endswith(suffix)]


def _bomb(expands_to: int) -> bytes:
    """A zstd JAX-format entry (a 1 s compile time header) of zeros: a few KiB that expand far."""
    cobj = zstandard.ZstdCompressor().compressobj()
    out = [cobj.compress((1).to_bytes(4, "big"))]
    zeros = bytes(1 << 20)
    for _ in range(expands_to >> 20):
        out.append(cobj.compress(zeros))
    out.append(cobj.flush())
    return b"".join(out)


def _limits(fsize: int | None) -> Any:
    def limits() -> None:
        if fsize is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return limits


def _cachectl(*args: str, fsize: int | None = None, **kw: Any) -> subprocess.Popen[str]:
    limits = _limits(fsize)
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(
        [sys.executable, "-m", "cachectl", *args], text=True, preexec_fn=limits, **kw
    )


# The child's own peak: VmHWM of its image, written at exit. (wait4's ru_maxrss is no good: exec
# carries the forking parent's high-water mark into it, and a pytest worker that ran JAX tests
# is bigger than the bound.)
_PEAK_WRAPPER = """
import atexit, runpy, sys
peak_file = sys.argv.pop(1)
def _write_peak():
    with open("/proc/self/status") as status, open(peak_file, "w") as out:
        out.write(next(line for line in status if line.startswith("VmHWM:")).split()[1])
atexit.register(_write_peak)
sys.argv[0] = "cachectl"
runpy.run_module("cachectl", run_name="__main__", alter_sys=True)
"""


def _run(*args: str, fsize: int | None = None) -> tuple[int, str, str, int]:
    """(exit code, stdout, stderr, peak RSS in bytes) of a fresh `cachectl` process."""
    state = Path(os.environ["XDG_STATE_HOME"])
    out_path, err_path, peak_path = state / "out", state / "err", state / "peak"
    peak_path.unlink(missing_ok=True)
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", _PEAK_WRAPPER, str(peak_path), *args],
            text=True,
            stdout=out,
            stderr=err,
            preexec_fn=_limits(fsize),
        )
        proc.wait()
    return (
        proc.returncode,
        out_path.read_text(),
        err_path.read_text(),
        int(peak_path.read_text()) * 1024,
    )


def _one_line(err: str) -> None:
    assert err.count("\n") == 1 and "Traceback" not in err, err


# --------------------------------------------------------------------------- item 4


def test_a_member_bigger_than_listed_is_refused_before_a_byte_is_staged(
    tmp_path: Path, bundles: dict[str, Any]
) -> None:
    """A signed bundle (its signature valid: the content list is untouched) whose first entry's tar
    header says 64 MiB of zeros: a few KiB of bundle. The install may write at most 8 MiB per file
    (RLIMIT_FSIZE) and still refuses it with one line, exit 2: nothing is staged past the list."""
    invoke("cache", "set", "default", "--trust", str(bundles["pub"]))
    items = _items(bundles["signed"])
    i = next(i for i, (n, _) in enumerate(items) if n.endswith("-cache"))
    items[i] = (items[i][0], bytes(BIG))
    bad = tmp_path / "inflated.tar.zst"
    write_members(bad, items)
    assert bad.stat().st_size < 1 << 20
    code, _, err, _ = _run("bundle", "install", str(bad), fsize=8 << 20)
    assert code == 2 and "bytes in the tar stream but" in err, (code, err)
    _one_line(err)
    assert_nothing_installed_but_root()


def test_a_bundle_declaring_far_more_than_it_holds_is_refused_before_staging(
    tmp_path: Path, bundles: dict[str, Any]
) -> None:
    """The same 64 MiB of zeros, listed consistently (size and sha256 in the content list): the
    declared total is far above what a bundle of this size can hold; refused before staging."""
    items = _items(bundles["bundle"])
    _relist(items, _names(items, "-cache")[0], bytes(BIG))
    bad = tmp_path / "declared.tar.zst"
    write_members(bad, items)
    code, _, err, _ = _run("bundle", "install", str(bad), fsize=8 << 20)
    assert code == 2 and "decompression bomb" in err, (code, err)
    _one_line(err)
    assert_nothing_installed_but_root()


def test_an_entry_above_the_caches_max_entry_size_is_refused_before_staging(
    bundles: dict[str, Any],
) -> None:
    """A cache with a max entry size below the bundle's entries: refused from the content list,
    one line, nothing installed (install checks the listed sizes only where a limit is set)."""
    invoke("cache", "set", "default", "--max-entry-size", "100B")
    result = invoke("bundle", "install", str(bundles["bundle"]), code=2)
    # Refused from the content list (its message), not by staging's own check of each member.
    assert "max entry size" in result.stderr and "files/" not in result.stderr, result.stderr
    assert "nothing installed" in result.stderr, result.stderr
    _one_line(result.stderr)
    assert_nothing_installed_but_root()


def test_a_metadata_member_far_bigger_than_the_bundle_is_refused_unread(
    tmp_path: Path, bundles: dict[str, Any]
) -> None:
    """bundle.json padded with 64 MiB of JSON whitespace (a few KiB of bundle): refused before it
    is read into memory, by install and by `bundle ls`."""
    items = _items(bundles["bundle"])
    items[0] = ("bundle.json", items[0][1] + b" " * BIG)
    bad = tmp_path / "padded.tar.zst"
    write_members(bad, items)
    for command in ("install", "ls"):
        result = invoke("bundle", command, str(bad), code=2)
        assert "more than a bundle of this size can hold" in result.stderr, result.stderr
        _one_line(result.stderr)
    assert_nothing_installed_but_root()


def assert_nothing_installed_but_root() -> None:
    root = default_root()
    assert not root.exists() or [p for p in root.rglob("*")] == []
    assert environments() == []


# --------------------------------------------------------------------------- item 5


def _junk(items: Items) -> str:
    _relist(items, _names(items, "-cache")[0], b"junk, not a JAX entry" * 50)
    return "not a JAX cache entry"


def _swapped_executable(items: Items) -> str:
    first, second = _names(items, "-aot")[:2]
    _relist(items, first, dict(items)["files/" + second])
    return "names another key"


def _bombed(items: Items) -> str:
    _relist(items, _names(items, "-cache")[0], _bomb(256 << 20))
    return "expands to more than"


def _declares(frame: bytes, declared: int) -> bytes:
    """A zstd frame written without its content size (``_bomb``'s) that now declares ``declared``
    bytes (256 to 65,791: the 2-byte field), whatever it holds."""
    fhd = frame[4]
    assert fhd >> 6 == 0 and not fhd & 0x20, "a frame with no content size and a window"
    at = 6 + (0, 1, 2, 4)[fhd & 3]  # past the descriptor, the window and the dictionary id
    return (
        frame[:4]
        + bytes([fhd | 0x40])
        + frame[5:at]
        + (declared - 256).to_bytes(2, "little")
        + frame[at:]
    )


def _lying_bomb(items: Items) -> str:
    """A 256 MiB bomb whose frame declares 8 KiB: the size ingest's one-call decompression of a
    small entry trusts for its output (it fails when the frame holds more)."""
    _relist(items, _names(items, "-cache")[0], _declares(_bomb(256 << 20), 8 << 10))
    return "not a JAX cache entry"


@pytest.mark.parametrize("change", [_junk, _swapped_executable, _bombed, _lying_bomb])
def test_a_bundle_goes_through_ingests_entry_checks(
    tmp_path: Path, bundles: dict[str, Any], change: Any
) -> None:
    """Consistent bundles (every size and sha256 listed right) whose bytes ingest refuses: junk, an
    executable of another key, a 256 MiB zstd bomb, one that declares 8 KiB. Refused with one line,
    nothing installed."""
    items = _items(bundles["bundle"])
    message = change(items)
    bad = tmp_path / "bad.tar.zst"
    write_members(bad, items)
    result = invoke("bundle", "install", str(bad), code=2)
    assert message in result.stderr and "nothing installed" in result.stderr, result.stderr
    _one_line(result.stderr)
    assert_nothing_installed_but_root()


def test_push_of_a_decompression_bomb_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    """A 1 GiB zstd bomb of a few KiB in a mirror directory: push refuses it without decompressing
    it into memory (its peak RSS stays far below the expansion)."""
    from support.lifecycle import fake_env

    db = f"sqlite:///{tmp_path}/index.db"
    root = tmp_path / "root"
    invoke("--db", db, "cache", "add", "loc", str(root))
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    env = fake_env("0.10.2")
    (mirror / "env.json").write_text(env.env_json())
    bomb = _bomb(1 << 30)
    assert len(bomb) < 64 << 10
    key = "jit_bomb-" + "b" * 64
    (mirror / f"{key}-cache").write_bytes(bomb)
    good = "jit_good-" + "c" * 64
    (mirror / f"{good}-cache").write_bytes(make_entry(b"a real executable" * 100))
    code, out, err, peak = _run(
        "--db", db, "--cache", "loc", "push", "--from", str(mirror), "--json"
    )
    result = json.loads(out)
    assert code == 1 and [p["key"] for p in result["refused"]] == [key], (code, out, err)
    assert "expands to more than" in result["refused"][0]["reason"]
    assert result["uploaded"] == 1
    assert peak < 400 << 20, f"push peaked at {peak >> 20} MiB"
    assert not (root / env.namespace / f"{key}-cache").exists()


# --------------------------------------------------------------------------- item 6


def _other_env_json(items: Items) -> None:
    from cachectl.core.fingerprint import Environment

    data = json.loads(dict(items)["files/env.json"])
    data.pop("digest", None)
    data["device_count"] = 8
    _relist(items, "env.json", Environment.from_dict(data).env_json().encode())


def _corrupt_env_json(items: Items) -> None:
    _relist(items, "env.json", b"{not json")


@pytest.mark.parametrize("change", [_other_env_json, _corrupt_env_json])
def test_a_bundle_whose_env_json_is_not_its_environment_installs_nothing(
    tmp_path: Path, bundles: dict[str, Any], change: Any
) -> None:
    """env.json is checked in staging: nothing reaches the namespace, nothing the index."""
    items = _items(bundles["bundle"])
    change(items)
    bad = tmp_path / "env.tar.zst"
    write_members(bad, items)
    result = invoke("bundle", "install", str(bad), code=2)
    assert "env.json" in result.stderr and "nothing installed" in result.stderr, result.stderr
    _one_line(result.stderr)
    assert_nothing_installed()
    # And the real bundle installs afterwards, whole.
    done = json.loads(invoke("bundle", "install", str(bundles["bundle"]), "--json").stdout)
    assert done["installed"] == 5


# --------------------------------------------------------------------------- item 7


def _kill_mid_install(
    bundle: Path, *args: str, staging: Path | None = None, pattern: str = "*/*", **kw: Any
) -> None:
    """Start `cachectl bundle install`, kill -9 it once its staging directory holds bytes."""
    staging = staging or default_root() / temps.STAGING_DIR
    proc = _cachectl("bundle", "install", str(bundle), *args, **kw)
    deadline = time.monotonic() + 120
    try:
        while True:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the install never staged"
            staged = (
                [p for p in staging.glob(pattern) if p.stat().st_size > 0]
                if staging.is_dir()
                else []
            )
            if staged:
                break
            time.sleep(0.002)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL


def _big_bundle(tmp_path: Path, bundles: dict[str, Any]) -> Path:
    """The real bundle plus one 96 MiB listed file (random: it stays 96 MiB in the bundle), so an
    install spends a while staging it."""
    items = _items(bundles["bundle"])
    name = "jit_big-" + "d" * 64 + "-cache"
    items.append(("files/" + name, b""))
    data = os.urandom(96 << 20)
    meta = _meta(items)
    meta["content"]["files"].append({"name": name, "size": 0, "sha256": ""})
    _set_meta(items, meta)
    _relist(items, name, data)
    path = tmp_path / "big.tar.zst"
    write_members(path, items)
    return path


@pytest.mark.timeout(600)
def test_a_killed_install_leaves_nothing_that_outlives_the_next_install_or_verify(
    tmp_path: Path, bundles: dict[str, Any]
) -> None:
    big = _big_bundle(tmp_path, bundles)
    staging = default_root() / temps.STAGING_DIR
    _kill_mid_install(big)
    dead = list(staging.iterdir())
    assert len(dead) == 1 and dead[0].name.startswith(temps.STAGING_PREFIX)
    # The next install removes the dead install's staging directory first.
    done = json.loads(invoke("bundle", "install", str(bundles["bundle"]), "--json").stdout)
    assert done["installed"] == 5 and not staging.exists()

    # verify reports another one, --quarantine (its repair) removes it, and verify is clean again.
    _kill_mid_install(big)
    assert staging.is_dir()
    found = invoke("verify", "--json", code=1)
    kinds = [(f["kind"], f["path"]) for f in json.loads(found.stdout)["plan"]["findings"]]
    assert [k for k, _ in kinds] == ["stale-temp"], kinds
    assert kinds[0][1].startswith(temps.STAGING_DIR + "/")
    # A live install's staging directory (this process's tag) is never a finding, nor removed.
    live = staging / (temps.prefix(temps.STAGING_PREFIX) + "live")
    live.mkdir()
    (live / "env.json").write_bytes(b"{}")
    fixed = json.loads(invoke("verify", "--quarantine", "--json", code=1).stdout)
    assert fixed["temps_removed"] == 1
    assert [p.name for p in staging.iterdir()] == [live.name]
    clean = json.loads(invoke("verify", "--json").stdout)
    assert clean["plan"]["findings"] == []


@pytest.mark.timeout(600)
def test_a_killed_install_into_an_object_store_leaves_no_local_staging_behind(
    tmp_path: Path, bundles: dict[str, Any], s3_bucket: str
) -> None:
    """Into an object store a bundle stages in the system temporary directory: the next install
    removes a killed one's staging directory there, and never a live install's."""
    invoke("cache", "add", "s3c", s3_bucket + "/cache")
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    big = _big_bundle(tmp_path, bundles)
    pattern = temps.LOCAL_STAGING_PREFIX + "*/*"
    _kill_mid_install(big, "--cache", "s3c", staging=tmp, pattern=pattern, env=env)
    (dead,) = tmp.glob(temps.LOCAL_STAGING_PREFIX + "*")
    live = tmp / (temps.prefix(temps.LOCAL_STAGING_PREFIX) + "live")
    live.mkdir()
    proc = _cachectl(
        "bundle", "install", str(bundles["bundle"]), "--cache", "s3c", "--json", env=env
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and json.loads(out)["installed"] == 5, err
    assert not dead.exists() and [p.name for p in tmp.iterdir()] == [live.name]


# --------------------------------------------------------------------------- item 12


def test_entry_metadata_changed_after_signing_is_refused(
    tmp_path: Path, bundles: dict[str, Any]
) -> None:
    """Function, compile time and bucket changed in a signed bundle (the content list untouched, so
    its signature still verifies): refused, exit 2, nothing installed."""
    invoke("cache", "set", "default", "--trust", str(bundles["pub"]))
    for field, value in (
        ("function", "evil"),
        ("compile_time_ms", 10**12),
        ("bucket", {"batch": 999}),
    ):
        items = _items(bundles["signed"])
        meta = _meta(items)
        meta["entries"][0][field] = value
        _set_meta(items, meta)
        bad = tmp_path / f"{field}.tar.zst"
        write_members(bad, items)
        result = invoke("bundle", "install", str(bad), code=2)
        assert "altered after signing" in result.stderr, (field, result.stderr)
        _one_line(result.stderr)
        assert_nothing_installed_but_root()


def test_a_signed_bundle_without_an_entries_signature_installs_without_its_metadata(
    tmp_path: Path, bundles: dict[str, Any]
) -> None:
    """Stripping the entries signature does not make the metadata trusted: the install writes no
    function or bucket, and the compile time it reads from each entry's own header."""
    invoke("cache", "set", "default", "--trust", str(bundles["pub"]))
    items = _items(bundles["signed"])
    sig = json.loads(items[1][1])
    assert items[1][0] == "signature.json" and sig.pop("entries_signature")
    items[1] = ("signature.json", json.dumps(sig).encode())
    meta = _meta(items)
    meta["entries"][0]["compile_time_ms"] = 10**12
    meta["entries"][0]["function"] = "evil"
    _set_meta(items, meta)
    stripped = tmp_path / "stripped.tar.zst"
    write_members(stripped, items)
    done = json.loads(invoke("bundle", "install", str(stripped), "--json").stdout)
    assert (
        done["installed"] == 5
        and done["signed_by"]
        and "installed without them" in str(done["notes"])
    )
    (env,) = environments()
    rows = json.loads(invoke("ls", "--env", env["digest"][:8], "--json").stdout)["entries"]
    assert all(r["function"] is None and r["bucket"] is None for r in rows), rows
    assert all(r["compile_time_ms"] < 7 * 24 * 3600 * 1000 for r in rows), rows


def test_a_signed_bundle_installs_its_signed_metadata(
    tmp_path: Path, bundles: dict[str, Any]
) -> None:
    invoke("cache", "set", "default", "--trust", str(bundles["pub"]))
    done = json.loads(invoke("bundle", "install", str(bundles["signed"]), "--json").stdout)
    assert done["installed"] == 5 and done["notes"] == []
    (env,) = environments()
    rows = json.loads(invoke("ls", "--env", env["digest"][:8], "--json").stdout)["entries"]
    listed = {e["key"]: e for e in _meta(_items(bundles["signed"]))["entries"]}
    for r in rows:
        want = listed[r["key"]]
        assert (r["function"], r["bucket"], r["compile_time_ms"]) == (
            want["function"],
            want["bucket"],
            want["compile_time_ms"],
        )


def test_the_bundle_stream_goes_forward_only_and_a_header_pointing_back_is_damage() -> None:
    """tarfile reads a bundle in its random-access mode over the zstd stream (no copies of its
    stream mode); the stream can only go forward, and asking to go back is a damaged bundle."""
    import io
    import tarfile

    from cachectl.bundle.format import ForwardOnly

    data = bytes(range(256)) * 16
    reader = zstandard.ZstdDecompressor().stream_reader(
        io.BytesIO(zstandard.ZstdCompressor().compress(data))
    )
    stream = ForwardOnly(reader)
    assert stream.read(10) == data[:10]
    assert stream.seek(10) == 10  # where it is: nothing to do
    assert stream.seek(100) == 100 and stream.read(4) == data[100:104]
    assert stream.seek(6, os.SEEK_CUR) == 110 and stream.tell() == 110
    with pytest.raises(tarfile.ReadError, match="points back"):
        stream.seek(50)
    with pytest.raises(tarfile.ReadError, match="points back"):
        stream.seek(-1, os.SEEK_CUR)
    with pytest.raises(tarfile.ReadError):
        stream.seek(0, os.SEEK_END)  # the end of a stream is not known before it is read
    assert stream.read(2) == data[110:112]
    # Bytes put back (a header install does not parse) are read again where they stood.
    block = stream.read(20)
    stream.unread(block)
    assert stream.tell() == 112
    with pytest.raises(tarfile.ReadError, match="points back"):
        stream.seek(111)
    assert stream.read(5) == data[112:117] and stream.tell() == 117
    assert stream.seek(120) == 120 and stream.read(20) == data[120:140]  # past some, then on
    stream.unread(stream.read(8))
    assert stream.seek(150) == 150 and stream.read(3) == data[150:153]  # past all of them
