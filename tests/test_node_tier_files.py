"""The node tier's own files (cachectl/storage/node_tier.py): who may have written the directory,
and what a link, a FIFO or a damaged record in it costs.

Mostly the library on real files in this process; one FIFO case in a child (a hang there must
not hang the suite), co-tenant cases as a second uid (root only), and one service run with the
server down (a real JAX process through `activate()`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support import infra
from support.warming import TINY_SERVICE, tiny

from cachectl.storage import node_tier
from cachectl.storage.node_tier import LOCKS, RECORD, NodeFiles, NodeTier

REPO = Path(__file__).resolve().parent.parent
SOURCE = "s3://bucket/root"
NAMESPACE = "jax-x/cpu/abc"
KEY = "jit_f-" + "a" * 64
BLOB = b"an entry's bytes" * 64
SHA = hashlib.sha256(BLOB).hexdigest()
COTENANT = "cotenant"

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="a second uid: needs root")


def _tier(root: Path) -> tuple[NodeTier, NodeFiles, list[str]]:
    warnings: list[str] = []
    tier = NodeTier(str(root), warn=warnings.append)
    return tier, tier.files(SOURCE, "main", NAMESPACE), warnings


def _read(files: NodeFiles, fetched: list[str]) -> bytes:
    return files.read(KEY + "-cache", SHA, lambda: fetched.append(KEY) or BLOB)


def _kept(root: Path) -> NodeFiles:
    """A tier this user made: one entry kept, and the record naming it."""
    _tier_, files, warnings = _tier(root)
    assert _read(files, []) == BLOB
    files.keep_record({KEY: [SHA, None, None]})
    assert files.record() == {KEY: [SHA, None, None]} and warnings == []
    return files


def _cotenant() -> pwd.struct_passwd:
    """The second uid of this machine, added where missing."""
    with contextlib.suppress(KeyError):
        return pwd.getpwnam(COTENANT)
    subprocess.run(["useradd", "-m", COTENANT], check=True, capture_output=True)
    return pwd.getpwnam(COTENANT)


def test_a_tier_cachectl_makes_is_0700_whatever_the_umask(tmp_path) -> None:
    """Made 0700 under umask 000, and made so again when deleted while a process uses it."""
    old = os.umask(0)
    try:
        files = _kept(tmp_path / "node")
        modes = _modes(tmp_path / "node", files)
        shutil.rmtree(tmp_path / "node")
        fetched: list[str] = []
        assert _read(files, fetched) == BLOB and fetched == [KEY]
        assert os.path.isfile(files.path(KEY + "-cache"))
        again = _modes(tmp_path / "node", files)
    finally:
        os.umask(old)
    assert set(modes.values()) == {"0o700"}, modes
    assert set(again.values()) == {"0o700"}, again


def _modes(root: Path, files: NodeFiles) -> dict[str, str]:
    """Each directory of the tier (from the namespace's up to the root, and .locks): its mode."""
    made = [root / LOCKS]
    here = Path(files.directory)
    while here != root.parent:
        made.append(here)
        here = here.parent
    return {str(p): oct(p.stat().st_mode & 0o777) for p in made if p.exists()}


def test_a_symlink_in_the_tier_is_never_followed(tmp_path) -> None:
    """A `.locks` that is a link: the tier is refused in one line, and nothing is created where
    it points; a lock file or an entry that is a link: not opened through it."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root = tmp_path / "node"
    root.mkdir(mode=0o700)
    (root / LOCKS).symlink_to(elsewhere)
    tier, files, warnings = _tier(root)
    fetched: list[str] = []
    assert _read(files, fetched) == BLOB and _read(files, fetched) == BLOB
    assert list(elsewhere.iterdir()) == [], "a file was created through the .locks link"
    assert not os.path.exists(files.path(KEY + "-cache")), "kept in a refused tier"
    assert fetched == [KEY, KEY] and tier.counts.hits == 0
    assert len(warnings) == 1 and f"{root / LOCKS} is a symbolic link" in warnings[0], warnings
    assert "(remove it: cachectl makes the directory again)" in warnings[0]

    # a tier of this user's: a lock file planted as a link to a file that does not exist yet
    good = tmp_path / "good"
    _tier_, files, warnings = _tier(good)
    assert files.usable()
    victim = tmp_path / "victim"
    lock = good / LOCKS / hashlib.sha256(files.path("x-cache").encode()).hexdigest()[:32]
    lock.symlink_to(victim)
    assert files._lock_file("x-cache") is None and not victim.exists()

    # an entry that is a link to a file holding the right bytes: not read, replaced by a fetch
    outside = tmp_path / "outside-entry"
    outside.write_bytes(BLOB)
    os.symlink(outside, files.path(KEY + "-cache"))
    fetched = []
    assert _read(files, fetched) == BLOB and fetched == [KEY]
    assert not os.path.islink(files.path(KEY + "-cache")) and outside.read_bytes() == BLOB
    assert any("is damaged (a symbolic link)" in w for w in warnings), warnings

    # the tier's root itself a link: refused too
    linked = tmp_path / "linked"
    linked.symlink_to(good)
    tier, files, warnings = _tier(linked)
    assert files.record() is None and not files.usable()
    assert len(warnings) == 1 and f"{linked} is a symbolic link" in warnings[0], warnings
    assert "set CACHECTL_NODE_CACHE to a directory of your own" in warnings[0]


_FIFO_CHILD = """
import json, os, sys, time
from cachectl.storage.node_tier import RECORD, NodeTier
warnings = []
files = NodeTier(sys.argv[1], warn=warnings.append).files("s3://bucket/root", "main", "jax-x/cpu/abc")
assert files.usable()
os.makedirs(files.directory, exist_ok=True)
os.mkfifo(files.path(RECORD))
os.mkfifo(files.path("k-cache"))
start = time.monotonic()
record = files.record()
entry = files.read("k-cache", None, lambda: b"fetched")
files.keep_record({})
kept = os.path.isfile(files.path(RECORD))
print(json.dumps({"record": record, "entry": entry.decode(), "kept": kept,
                  "seconds": time.monotonic() - start, "warnings": warnings}))
"""


def test_a_fifo_in_the_tier_is_refused_at_once(tmp_path) -> None:
    """A FIFO as the record, as an entry: refused in one line each, within 5 s (a child: without
    O_NONBLOCK its open() would wait for a writer forever)."""
    proc = subprocess.run(
        [sys.executable, "-c", _FIFO_CHILD, str(tmp_path / "node")],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout)
    assert got["seconds"] < 5 and got["record"] is None and got["entry"] == "fetched", got
    assert got["kept"], "keep_record did not replace the FIFO with a record"
    record, entry = got["warnings"]
    assert "node cache record" in record and "is damaged (not a regular file)" in record
    assert "k-cache is damaged (not a regular file)" in entry


@pytest.mark.parametrize("where", ["root", "source", "namespace", "locks"])
def test_a_group_writable_tier_is_not_read(tmp_path, where: str) -> None:
    """Any directory of the tier writable by group or others: one line naming it and `chmod
    go-w`; its record is not used and its entries are fetched from the remote, never read."""
    root = tmp_path / "node"
    files = _kept(root)
    namespace = Path(files.directory)
    target = {
        "root": root,
        "source": namespace.parents[2],
        "namespace": namespace,
        "locks": root / LOCKS,
    }[where]
    target.chmod(0o770 if where != "namespace" else 0o757)
    tier, files, warnings = _tier(root)  # a new process
    fetched: list[str] = []
    assert files.record() is None
    assert _read(files, fetched) == BLOB and _read(files, fetched) == BLOB
    assert fetched == [KEY, KEY] and tier.counts.hits == 0
    assert len(warnings) == 1, warnings
    assert f"{target} is writable by group or others" in warnings[0], warnings
    assert f"chmod go-w {target}" in warnings[0] and "reading from the remote" in warnings[0]


@pytest.mark.parametrize(
    "damage",
    ["not json", "a list", "a bad entry", "not a key", "a bad sha256", "too big", "a directory"],
)
def test_a_damaged_record_costs_one_warning(tmp_path, monkeypatch, damage: str) -> None:
    files = _kept(tmp_path / "node")
    path = Path(files.path(RECORD))
    content = {
        "not json": b"{not json",
        "a list": b"[]",
        "a bad entry": json.dumps({KEY: 5}).encode(),
        "not a key": json.dumps({"../../x": [SHA, None, None]}).encode(),
        "a bad sha256": json.dumps({KEY: ["zz", None, None]}).encode(),
        "too big": json.dumps({KEY: [SHA, None, None]}).encode(),
    }.get(damage)
    if damage == "too big":
        monkeypatch.setattr(node_tier, "RECORD_MAX_BYTES", 16)
    path.unlink()
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    _tier_, files, warnings = _tier(tmp_path / "node")
    assert files.record() is None and files.record() is None
    assert len(warnings) == 1 and f"node cache record {path} is damaged" in warnings[0], warnings
    if damage not in ("a directory", "too big"):  # the next record the index gives replaces it
        files.keep_record({KEY: [SHA, None, None]})
        assert files.record() == {KEY: [SHA, None, None]}


@as_root
def test_a_co_tenant_can_neither_edit_the_record_nor_plant_the_tier(tmp_path) -> None:
    """Case 3: the co-tenant (another uid) cannot write into the tier this user made (0700);
    a tier directory the co-tenant made first, or any directory of it the co-tenant owns, is
    refused in one line, its record unused."""
    other = _cotenant()
    base = Path(tempfile.mkdtemp(prefix="cachectl-node-tier-", dir="/tmp"))
    try:
        base.chmod(0o755)  # the co-tenant may reach the tier, as on a shared scratch disk
        old = os.umask(0)
        try:
            files = _kept(base / "node")
        finally:
            os.umask(old)
        record = files.path(RECORD)
        edit = subprocess.run(
            ["runuser", "-u", COTENANT, "--", "sh", "-c", f"echo '{{}}' > {record}"],
            capture_output=True,
            text=True,
        )
        assert edit.returncode != 0 and "Permission denied" in edit.stderr, edit
        assert files.record() == {KEY: [SHA, None, None]}

        # the co-tenant made the directory first (mode 0755, its own) on a shared disk
        shared = base / "shared"
        shared.mkdir()
        shared.chmod(0o1777)
        planted = shared / "node"
        made = subprocess.run(
            ["runuser", "-u", COTENANT, "--", "mkdir", "-m", "755", str(planted)],
            capture_output=True,
            text=True,
        )
        assert made.returncode == 0, made.stderr
        tier, files, warnings = _tier(planted)
        assert files.record() is None and _read(files, []) == BLOB
        assert tier.counts.hits == 0 and len(warnings) == 1, warnings
        assert f"{planted} is owned by uid {other.pw_uid}, not this user" in warnings[0]
        assert "CACHECTL_NODE_CACHE" in warnings[0]

        # a tier of this user's with one directory below handed to the co-tenant
        files = _kept(base / "mine")
        os.chown(files.directory, other.pw_uid, other.pw_gid)
        _tier_, files, warnings = _tier(base / "mine")
        assert files.record() is None and len(warnings) == 1, warnings
        assert f"{files.directory} is owned by uid {other.pw_uid}" in warnings[0]
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(400)
def test_a_service_with_the_server_down_never_reads_a_tier_others_may_write(tmp_path) -> None:
    """A real service in server mode, the server down and the root not on this machine: it would
    read the record kept in the node tier. Group-writable: one line, not read, it compiles. A
    FIFO as the record: one line, and the service runs on (it used to hang)."""
    tiny(tmp_path)
    node = tmp_path / "node"
    env = {
        "CACHECTL_SERVER": f"http://127.0.0.1:{_closed_port()}",
        "CACHECTL_TOKEN": "cachectl_reader_token_of_a_server_that_is_down",
        "CACHECTL_NODE_CACHE": str(node),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(REPO),
    }
    code = TINY_SERVICE.format(dir=str(tmp_path), cache="")

    def service() -> str:
        proc = infra.run_py(code, env, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads(proc.stdout.strip().splitlines()[-1])["hits"] == 0
        return proc.stderr

    service()  # the first start: the tier's directories made, nothing to read
    namespace = max(
        (p for p in node.rglob("*") if p.is_dir() and LOCKS not in p.parts),
        key=lambda p: len(p.parts),
    )
    record = namespace / RECORD
    tier = NodeTier(str(node))
    kept = NodeFiles(tier, str(namespace))
    kept.keep_record({KEY: [SHA, None, None]})
    assert record.is_file()

    node.chmod(0o775)
    stderr = service()
    assert "fetched and verified before" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if f"node cache {node} not used" in line]
    assert len(lines) == 1 and f"chmod go-w {node}" in lines[0], stderr[-3000:]

    node.chmod(0o700)
    record.unlink()
    os.mkfifo(record)
    stderr = service()
    lines = [line for line in stderr.splitlines() if "node cache record" in line]
    assert len(lines) == 1 and "is damaged (not a regular file)" in lines[0], stderr[-3000:]
