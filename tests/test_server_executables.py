"""The server's stored-executable routes: PUT/GET/HEAD .../entries/{key}/aot, over a live uvicorn server.

The artifacts are real ``executables.pack`` bytes (header and payload checksum as warm
writes them) for the seeded entries; the client is cachectl's own ServerClient
and RemoteIndex, so what the CLI sees in server mode is what is checked.
"""

from __future__ import annotations

import httpx
import pytest
from support.server_kit import MAIN, LiveServer, bearer, entry_key, seed

from cachectl.client import RemoteIndex, ServerClient
from cachectl.core.errors import BadInput, NotFound, PermissionDenied
from cachectl.core.records import HeldEntry
from cachectl.index import open_index
from cachectl.storage import executables
from cachectl.storage.entries import sha256
from cachectl.storage.store import Store
from cachectl_server.app import create_app

API = "/api/v1"


def artifact(key: str, entry: bytes, payload: bytes = b"payload " * 200) -> bytes:
    return executables.pack(
        payload, key=key, entry_sha256=sha256(entry), function="train", bucket={"batch": 1}
    )


@pytest.fixture
def live(tmp_path):
    s = seed(f"sqlite:///{tmp_path}/index.db", str(tmp_path / "main"), str(tmp_path / "other"))
    app = create_app(s.db)
    with LiveServer(app) as server:
        yield s, server
    app.state.cachectl.jobs.shutdown()
    app.state.cachectl.index.close()


def test_upload_download_and_listing_of_an_entrys_executable(live) -> None:
    s, server = live
    key = s.keys[0]
    data = artifact(key, s.entry_bytes[key])
    writer = ServerClient(server.url, s.tokens["writer"])
    reader = ServerClient(server.url, s.tokens["reader"])

    with pytest.raises(PermissionDenied):
        reader.upload_executable(MAIN, s.digest, key, data)
    with pytest.raises(NotFound):
        reader.download_executable(MAIN, s.digest, key)

    info = writer.upload_executable(MAIN, s.digest, key, data)
    assert (info.key, info.aot_size, info.aot_sha256) == (key, len(data), sha256(data))
    assert info.sha256 == sha256(s.entry_bytes[key])  # the entry itself is untouched
    assert Store(s.root).read_bytes(f"{s.env.namespace}/{key}-aot") == data
    assert reader.download_executable(MAIN, s.digest, key) == data

    url = f"{server.url}{API}/caches/{MAIN}/environments/{s.digest}/entries/{key}/aot"
    head = httpx.head(url, headers=bearer(s.tokens["reader"]))
    assert head.status_code == 200 and int(head.headers["content-length"]) == len(data)
    assert head.headers["x-cachectl-sha256"] == sha256(data)
    again = httpx.put(url, content=data, headers=bearer(s.tokens["writer"]))
    assert again.status_code == 200  # replaced

    remote = RemoteIndex(reader)
    env = remote.find_environment(MAIN, s.digest)
    listed = {e.key: e for e in remote.list_entries(env.id)}
    assert (listed[key].aot_size, listed[key].aot_sha256) == (len(data), sha256(data))
    assert remote.aot_keys(env.id) == {key: (len(data), sha256(data))}
    entry_sha = sha256(s.entry_bytes[key])
    assert remote.held_entries(env.id, [key, "jit_absent-" + "0" * 64]) == {
        key: HeldEntry(len(s.entry_bytes[key]), entry_sha, len(data), sha256(data))
    }
    assert remote.find_environment(MAIN, s.digest).executables == 1
    stats = httpx.get(
        f"{server.url}{API}/caches/{MAIN}/stats", headers=bearer(s.tokens["reader"])
    ).json()
    assert stats["executables"] == 1 and stats["aot_bytes"] == len(data)
    assert stats["bytes"] == sum(len(b) for b in s.entry_bytes.values()) + len(data)
    for c in (writer, reader):
        c.close()


def test_uploads_that_are_not_this_entrys_executable_are_refused(live) -> None:
    s, server = live
    key, other = s.keys[0], s.keys[1]
    writer = ServerClient(server.url, s.tokens["writer"])
    good = artifact(key, s.entry_bytes[key])
    flipped = bytearray(good)
    flipped[-1] ^= 0xFF
    unknown = entry_key("jit_nothing", 99)
    refused = {
        "garbage": (key, b"not an executable at all"),
        "flipped payload byte": (key, bytes(flipped)),
        "made for another entry's bytes": (key, artifact(key, s.entry_bytes[other])),
        "header names another key": (key, artifact(other, s.entry_bytes[key])),
        "no such entry": (unknown, artifact(unknown, b"x")),
    }
    for what, (k, data) in refused.items():
        with pytest.raises(BadInput):
            writer.upload_executable(MAIN, s.digest, k, data)
        assert not Store(s.root).exists(f"{s.env.namespace}/{k}-aot"), what
    url = f"{server.url}{API}/caches/{MAIN}/environments/{s.digest}/entries/{key}/aot"
    bad_sha = httpx.put(
        url, content=good, headers={**bearer(s.tokens["writer"]), "x-cachectl-sha256": "0" * 64}
    )
    assert bad_sha.status_code == 422

    # The quota counts entries and executables together: with one executable stored, a second
    # that would fit beside the entries alone does not fit beside both.
    first = artifact(other, s.entry_bytes[other])
    writer.upload_executable(MAIN, s.digest, other, first)
    index = open_index(s.db)
    used = sum(len(b) for b in s.entry_bytes.values())
    index.update_cache(MAIN, max_size=used + len(first) + len(good) - 1)
    index.close()
    too_big = httpx.put(url, content=good, headers=bearer(s.tokens["writer"]))
    assert too_big.status_code == 413, too_big.text
    index = open_index(s.db)
    assert index.get_entry(index.find_environment(MAIN, s.digest).id, key).aot_sha256 is None
    index.close()
    writer.close()


def test_registration_records_an_executable_the_writer_stored_itself(live) -> None:
    s, server = live
    key = s.keys[1]
    data = artifact(key, s.entry_bytes[key])
    Store(s.root).write_bytes(f"{s.env.namespace}/{key}-aot", data)
    remote = RemoteIndex(ServerClient(server.url, s.tokens["writer"]))
    env = remote.find_environment(MAIN, s.digest)
    entry = remote.get_entry(env.id, key)
    from cachectl.index import NewEntry

    base = dict(key=key, module=entry.module, size=entry.size, sha256=entry.sha256, origin="warm")
    with pytest.raises(BadInput):  # the size must be what storage holds
        remote.upsert_entries(
            env.id, [NewEntry(**base, aot_size=len(data) + 1, aot_sha256=sha256(data))]
        )
    remote.upsert_entries(env.id, [NewEntry(**base, aot_size=len(data), aot_sha256=sha256(data))])
    assert remote.aot_keys(env.id) == {key: (len(data), sha256(data))}
    remote.close()
