"""server/lane_memory.py ``Bodies`` (kept by server/fast_lane.py): a small GET answered again from memory, after one ``fstatat``
(no open, no read), and never with bytes other than the file's own: a file replaced, written in
place (even with its mtime set back), too fresh to trust its timestamps, or deleted is read again
or refused, as the app's own route answers it."""

from __future__ import annotations

import os
import time

import httpx
import pytest
from support.server_kit import MAIN, LiveServer, bearer, seed

from cachectl.storage.entries import sha256
from cachectl.storage.store_local import LocalReader
from cachectl_server.app import create_app
from cachectl_server.lane_memory import SETTLED_NS, Bodies

API = "/api/v1"


def settle(*paths: str) -> None:
    """Wait until each file was last changed ``SETTLED_NS`` ago (only then is a body kept)."""
    newest = max(max(os.stat(p).st_ctime_ns, os.stat(p).st_mtime_ns) for p in paths)
    wait = (newest + SETTLED_NS) / 1e9 + 0.05 - time.time()
    if wait > 0:
        time.sleep(wait)


def replace(path: str, data: bytes) -> None:
    """A new file (a new inode) under the old name, as an upload writes one."""
    with open(path + ".new", "wb") as fh:
        fh.write(data)
    os.replace(path + ".new", path)


@pytest.fixture
def live(tmp_path, monkeypatch):
    """A server with the lane and one without over the same seeded cache, clients of both, and a
    count of the files the lane's readers opened."""
    s = seed(f"sqlite:///{tmp_path}/index.db", str(tmp_path / "main"), str(tmp_path / "other"))
    opened: list[str] = []
    real = LocalReader.open_fd

    def counted(self, rel):
        opened.append(rel)
        return real(self, rel)

    monkeypatch.setattr(LocalReader, "open_fd", counted)
    lane_app, plain_app = create_app(s.db), create_app(s.db, byte_fast_lane=False)
    try:
        with (
            LiveServer(lane_app) as lane,
            LiveServer(plain_app) as plain,
            httpx.Client(base_url=lane.url, headers=bearer(s.tokens["reader"])) as lane_client,
            httpx.Client(base_url=plain.url, headers=bearer(s.tokens["reader"])) as plain_client,
        ):
            yield s, tmp_path, lane_client, plain_client, opened
    finally:
        for app in (lane_app, plain_app):
            app.state.cachectl.jobs.shutdown()
            app.state.cachectl.index.close()


def answer(response: httpx.Response) -> tuple[int, list[tuple[str, str]], bytes]:
    headers = sorted(kv for kv in response.headers.multi_items() if kv[0] != "date")
    return response.status_code, headers, response.content


def test_a_settled_small_entry_is_sent_again_without_opening_its_file(live) -> None:
    s, tmp_path, lane, plain, opened = live
    key = s.keys[0]
    path = f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{key}"
    settle(f"{tmp_path}/main/{s.env.namespace}/{key}-cache")
    want = answer(plain.get(path))
    assert want[0] == 200 and want[2] == s.entry_bytes[key]
    for _ in range(2):  # the app's route (which fills what the lane remembers), then the lane
        assert answer(lane.get(path)) == want
    opened.clear()
    for _ in range(5):
        assert answer(lane.get(path)) == want
        head = lane.head(path)
        assert head.status_code == 200 and head.content == b""
    assert opened == []  # one fstatat each, as a HEAD
    metrics = lane.get("/metrics").text
    assert f'cachectl_entry_download_bytes_total{{cache="{MAIN}"}} {7.0 * len(want[2])}' in metrics


def test_an_entry_changed_on_disk_is_never_sent_from_memory(live) -> None:
    s, tmp_path, lane, plain, opened = live
    key = s.keys[0]
    path = f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{key}"
    file = f"{tmp_path}/main/{s.env.namespace}/{key}-cache"
    original = s.entry_bytes[key]
    settle(file)
    for _ in range(3):
        assert lane.get(path).content == original
    opened.clear()
    assert lane.get(path).content == original and opened == []  # kept

    def same_answers(expected: bytes) -> None:
        got, want = answer(lane.get(path)), answer(plain.get(path))
        assert got == want and got[2] == expected

    # written in place, same size, its mtime set back: the ctime still moves
    before = os.stat(file)
    other = bytes(b ^ 0xFF for b in original)
    with open(file, "r+b") as fh:
        fh.write(other)
    os.utime(file, ns=(before.st_atime_ns, before.st_mtime_ns))
    same_answers(other)
    # replaced by a new file of the same size
    third = bytes(b ^ 0x0F for b in original)
    replace(file, third)
    same_answers(third)
    # the entry's own bytes again, freshly written: read each time (not kept while its
    # timestamps are too fresh to tell a later change apart)
    replace(file, original)
    opened.clear()
    for _ in range(3):
        same_answers(original)
    assert len(opened) == 3
    # deleted: the app's 404
    os.unlink(file)
    got = lane.get(path)
    assert got.status_code == plain.get(path).status_code == 404


def test_bytes_that_are_not_the_recorded_entry_are_never_kept(live) -> None:
    """A file whose bytes do not hash to the entry's recorded sha256 (corrupted on disk, same size)
    is sent as the route sends it, read every time."""
    s, tmp_path, lane, plain, opened = live
    key = s.keys[1]
    path = f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{key}"
    file = f"{tmp_path}/main/{s.env.namespace}/{key}-cache"
    corrupt = b"\0" * len(s.entry_bytes[key])
    replace(file, corrupt)
    settle(file)
    assert lane.get(path).content == corrupt  # the app's route: fills what the lane remembers
    opened.clear()
    for _ in range(3):
        got = lane.get(path)
        assert answer(got) == answer(plain.get(path)) and got.content == corrupt
    assert len(opened) == 3


def test_bodies_are_bounded_and_only_the_recorded_bytes_are_kept(tmp_path) -> None:
    files = []
    for n in range(4):
        p = tmp_path / f"f{n}"
        p.write_bytes(bytes([n]) * 1000)
        files.append(str(p))
    later = time.time_ns() + 2 * SETTLED_NS  # as if read that much after the files were written
    bodies = Bodies(max_bytes=2500)
    for n, p in enumerate(files):
        data = bytes([n]) * 1000
        bodies.put(("r", p), os.stat(p), (1000, sha256(data)), data, b"h" + data, later)
        assert bodies.size <= 2500
    kept = [p for p in files if ("r", p) in bodies]
    assert kept == files[2:]  # the oldest went first
    assert bodies.get(("r", files[3]), os.stat(files[3]), (1000, sha256(bytes([3]) * 1000)))
    # another recorded sha256 (the entry was uploaded again): not sent, and forgotten
    assert bodies.get(("r", files[2]), os.stat(files[2]), (1000, "0" * 64)) is None
    assert ("r", files[2]) not in bodies
    data = bytes([0]) * 1000
    st = os.stat(files[0])
    bodies.put(("r", "x"), st, (1000, sha256(b"other")), data, data, later)  # not the entry's
    bodies.put(("r", "y"), st, (1000, sha256(data)), data, data, time.time_ns())  # too fresh
    bodies.put(("r", "z"), st, None, data, data, later)  # nothing recorded
    assert all(("r", k) not in bodies for k in "xyz")


def test_a_kept_answer_carries_the_current_date(live) -> None:
    """The Date line is the server's current one (joined once per second), never kept with the
    body or the headers after it."""
    s, tmp_path, lane, plain, opened = live
    path = f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{s.keys[0]}"
    settle(f"{tmp_path}/main/{s.env.namespace}/{s.keys[0]}-cache")
    for _ in range(3):
        lane.get(path)
    opened.clear()
    dates = set()
    for n in range(2):
        if n:
            time.sleep(1.1)
        for method in ("GET", "HEAD"):
            got = lane.request(method, path)
            assert got.status_code == 200
            dates.add((method, got.headers["date"]))
    assert opened == [] and len(dates) == 4  # each second's own Date, GET and HEAD alike
