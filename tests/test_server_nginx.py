"""nginx in front of `cachectl serve --accel-redirect` (server/accel.py): real nginx on 127.0.0.1 with
the configuration `cachectl serve --print-nginx-config` prints. cachectl checks every download,
nginx sends the bytes; its internal location cannot be asked for directly."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support import infra
from support.server_kit import MAIN, Seed, bearer, entry_key, seed

from cachectl.index import open_index
from cachectl.storage.entries import make_entry, sha256
from cachectl.trust import tokens

API = "/api/v1"
PREFIX = "/_cachectl_files/"
NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/sbin/nginx") if os.access(p, os.X_OK)), None
)

# scripts/test installs nginx; without it these tests fail, unless CACHECTL_TEST_NO_NGINX=1 says
# to skip them (read at import: isolated_home clears CACHECTL_* before each test).
NO_NGINX = os.environ.get("CACHECTL_TEST_NO_NGINX") == "1"


def _cachectl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cachectl", *args], capture_output=True, text=True, timeout=60
    )


@contextlib.contextmanager
def _recipe(s: Seed, tmp_path: Path) -> Iterator[tuple[infra.Server, infra.Server]]:
    """cachectl serving ``s`` with --accel-redirect, and nginx in front of it, configured with what
    `cachectl serve --print-nginx-config` prints; both stopped on the way out."""
    cachectl = infra.start_server(
        "cachectl-accel",
        lambda port: (
            [sys.executable, "-m", "cachectl", "serve", "--db", s.db, "--port", str(port)]
            + ["--accel-redirect", PREFIX, "--log-level", "warning"]
        ),
        tmp_path / "logs",
        timeout=60,
        check=lambda srv: httpx.get(srv.url + "/healthz", timeout=5).raise_for_status(),
    )
    prefix_dir = tmp_path / "nginx"
    (prefix_dir / "tmp").mkdir(parents=True)

    def nginx_argv(port: int) -> list[str]:
        printed = _cachectl(
            "serve",
            "--db",
            s.db,
            "--port",
            str(cachectl.port),
            "--accel-redirect",
            PREFIX,
            "--print-nginx-config",
            "--nginx-listen",
            f"127.0.0.1:{port}",
            *(["--nginx-user", "root"] if os.geteuid() == 0 else []),  # the roots are 0700 here
        )
        assert printed.returncode == 0, printed.stderr
        conf = prefix_dir / f"nginx-{port}.conf"
        conf.write_text(printed.stdout)
        return [str(NGINX), "-p", str(prefix_dir), "-c", str(conf), "-e", "stderr"]

    try:
        nginx = infra.start_server("nginx", nginx_argv, tmp_path / "logs", timeout=30)
    except BaseException:
        cachectl.stop()
        raise
    try:
        yield cachectl, nginx
    finally:
        nginx.stop()
        cachectl.stop()


@pytest.fixture(scope="module")
def behind_nginx(tmp_path_factory) -> Iterator[tuple[Seed, infra.Server, infra.Server]]:
    """The seeded index served by cachectl with --accel-redirect, and nginx in front of it (one
    pair for the module: each test reads, none changes what the others read)."""
    if NGINX is None:
        if NO_NGINX:
            pytest.skip("nginx not installed and CACHECTL_TEST_NO_NGINX=1")
        pytest.fail(
            "nginx is not installed: scripts/test installs it (or set CACHECTL_TEST_NO_NGINX=1 "
            "to skip these tests)"
        )
    tmp_path = tmp_path_factory.mktemp("nginx")
    s = seed(
        f"sqlite:///{tmp_path}/index.db",
        str(tmp_path / "main"),
        str(tmp_path / "other"),
        entries=2,
        entry_size=300_000,
    )
    with _recipe(s, tmp_path) as (cachectl, nginx):
        yield s, cachectl, nginx


def test_nginx_sends_the_bytes_cachectl_authorized(behind_nginx) -> None:
    s, cachectl, nginx = behind_nginx
    key = s.keys[0]
    path = f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{key}"
    want = s.entry_bytes[key]
    with httpx.Client(base_url=nginx.url, timeout=10) as client:
        got = client.get(path, headers=bearer(s.tokens["reader"]))
        assert got.status_code == 200
        assert got.content == want
        assert got.headers["x-cachectl-sha256"] == sha256(want)
        assert got.headers["etag"] == f'"{sha256(want)}"'
        assert "x-accel-redirect" not in got.headers
        assert got.headers["content-type"] == "application/octet-stream"
        # cachectl itself only redirected: no bytes, the internal location named
        direct = httpx.get(cachectl.url + path, headers=bearer(s.tokens["reader"]), timeout=10)
        assert direct.status_code == 200 and direct.content == b""
        internal = direct.headers["x-accel-redirect"]
        assert internal == f"{PREFIX}{MAIN}/{s.env.namespace}/{key}-cache"
        # ... which nginx serves to nobody who asks for it
        assert client.get(internal).status_code == 404
        assert client.get(internal, headers=bearer(s.tokens["admin"])).status_code == 404
        # ranges and HEAD
        ranged = client.get(path, headers={**bearer(s.tokens["reader"]), "range": "bytes=10-99"})
        assert ranged.status_code == 206 and ranged.content == want[10:100]
        head = client.head(path, headers=bearer(s.tokens["reader"]))
        assert head.status_code == 200 and head.content == b""
        assert int(head.headers["content-length"]) == len(want)
        assert head.headers["x-cachectl-sha256"] == sha256(want)
        # the stored executable's route too, and many requests on one connection
        for _ in range(20):
            again = client.get(path, headers=bearer(s.tokens["reader"]))
            assert again.content == want


def test_nginx_sends_nothing_cachectl_refused(behind_nginx) -> None:
    s, _cachectl, nginx = behind_nginx
    path = f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{s.keys[0]}"
    for token in (None, "not-a-token", "revoked", "wrong_scope_reader"):
        secret = s.tokens.get(token, token) if token else None
        for method in ("GET", "HEAD"):
            got = httpx.request(method, nginx.url + path, headers=bearer(secret), timeout=10)
            assert got.status_code in (401, 403), (token, method, got.status_code)
            assert s.entry_bytes[s.keys[0]][:64] not in got.content


def test_missing_entries_and_planted_links_are_cachectls_answers(behind_nginx) -> None:
    s, _cachectl, nginx = behind_nginx
    planted = entry_key("jit_planted", 7)
    root = Path(s.root.removeprefix("file://"))
    os.symlink("/etc/hostname", root / s.env.namespace / f"{planted}-cache")
    for key in (entry_key("jit_absent", 9), planted):
        path = f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{key}"
        got = httpx.get(nginx.url + path, headers=bearer(s.tokens["reader"]), timeout=10)
        assert got.status_code == 404, (key, got.status_code, got.text[:200])
        assert Path("/etc/hostname").read_bytes() not in got.content or not got.content
        assert got.headers["content-type"].startswith("application/json")


TTL_S = 4.0  # cachectl's token_cache_s in the fixture below: the staleness bound under test


@pytest.fixture()
def cached_recipe(tmp_path, monkeypatch) -> Iterator[tuple[Seed, infra.Server, infra.Server]]:
    """The recipe with token_cache_s = TTL_S, on an index of its own (its tests revoke and delete)."""
    if NGINX is None:
        pytest.skip("nginx not installed") if NO_NGINX else pytest.fail("nginx is not installed")
    s = seed(
        f"sqlite:///{tmp_path}/index.db",
        str(tmp_path / "main"),
        str(tmp_path / "other"),
        entries=3,
        entry_size=200_000,
    )
    monkeypatch.setenv("CACHECTL_SERVER_TOKEN_CACHE", f"{TTL_S:g}s")  # both children read it

    with _recipe(s, tmp_path) as (cachectl, nginx):
        yield s, cachectl, nginx


def _entry(s: Seed, key: str) -> str:
    return f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{key}"


def test_repeat_downloads_are_sent_by_nginx_without_asking_cachectl(cached_recipe) -> None:
    s, cachectl, nginx = cached_recipe
    key, path = s.keys[0], _entry(s, s.keys[0])
    want = s.entry_bytes[key]
    reader = bearer(s.tokens["reader"])
    with httpx.Client(base_url=nginx.url, timeout=10) as client:
        for _ in range(3):  # cachectl remembers the token and the entry, then nginx its answer
            got = client.get(path, headers=reader)
            assert got.status_code == 200 and got.content == want
        os.kill(cachectl.process.pid, signal.SIGSTOP)  # cachectl answers nothing now
        try:
            got = client.get(path, headers=reader, timeout=2)
            head = client.head(path, headers=reader, timeout=2)
            ranged = client.get(path, headers={**reader, "range": "bytes=5-9"}, timeout=2)
        finally:
            os.kill(cachectl.process.pid, signal.SIGCONT)
        # nginx's answer is kept per token: another token, or none, is still cachectl's to judge
        for token in (None, "not-a-token", s.tokens["wrong_scope_reader"], s.tokens["revoked"]):
            for method in ("GET", "HEAD"):
                refused = client.request(method, path, headers=bearer(token))
                assert refused.status_code in (401, 403), (token, method, refused.status_code)
                assert want[:64] not in refused.content
                assert refused.headers["content-type"].startswith("application/json")
    assert got.status_code == 200 and got.content == want
    assert got.headers["x-cachectl-sha256"] == sha256(want)
    assert got.headers["etag"] == f'"{sha256(want)}"'
    assert head.status_code == 200 and int(head.headers["content-length"]) == len(want)
    assert ranged.status_code == 206 and ranged.content == want[5:10]


def _served_until(
    client: httpx.Client, path: str, headers: dict[str, str], limit_s: float
) -> float:
    """Seconds (time.monotonic) when ``path`` was last served: polled until refused or gone."""
    last = time.monotonic()
    while time.monotonic() - last < limit_s:
        got = client.get(path, headers=headers)
        if got.status_code != 200:
            return last
        last = time.monotonic()
        time.sleep(0.05)
    raise AssertionError(f"{path} still served {limit_s} s on")


def test_a_revoked_token_is_refused_within_token_cache_s(cached_recipe) -> None:
    s, _cachectl, nginx = cached_recipe
    index = open_index(s.db)
    try:
        token = tokens.create_token(index, "short-lived", "reader").token
        path = _entry(s, s.keys[1])
        with httpx.Client(base_url=nginx.url, timeout=10) as client:
            first = time.monotonic()  # cachectl asks the index for the token now, and remembers it
            assert client.get(path, headers=bearer(token)).status_code == 200
            # Late in what cachectl remembers, nginx keeps an answer: for no longer than cachectl
            # would have (an answer kept token_cache_s from now would outlive the bound).
            time.sleep(TTL_S - 1.5)
            for _ in range(3):
                assert client.get(path, headers=bearer(token)).status_code == 200
            tokens.revoke_token(index, "short-lived")  # elsewhere: as the CLI or another replica
            revoked = time.monotonic()
            last = _served_until(client, path, bearer(token), 3 * TTL_S)
            refused = client.get(path, headers=bearer(token))
    finally:
        index.close()
    assert refused.status_code == 401 and s.entry_bytes[s.keys[1]][:64] not in refused.content
    assert last - revoked <= TTL_S
    # no later than cachectl alone: its own memory of the token ends TTL_S after it asked
    assert last - first <= TTL_S + 0.5, last - first


def _entry_gets(cachectl: infra.Server, token: str) -> float:
    """How many entry GETs cachectl has answered (its /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(cachectl.url + "/metrics", headers=bearer(token), timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "cachectl_http_requests_total"
        and sample.labels["method"] == "GET"
        and sample.labels["route"].endswith("/entries/{key}")
    )


def test_nginx_asks_cachectl_about_once_per_token_cache_s(cached_recipe) -> None:
    """Late in what cachectl remembers, nginx could keep no answer for a whole second: cachectl
    then asks the index again rather than answering every request of that last second itself."""
    s, cachectl, nginx = cached_recipe
    path, reader = _entry(s, s.keys[0]), bearer(s.tokens["reader"])
    before = _entry_gets(cachectl, s.tokens["reader"])
    sent = 0
    with httpx.Client(base_url=nginx.url, timeout=10) as client:
        until = time.monotonic() + 1.5 * TTL_S  # at least one whole memory of cachectl's ends
        while time.monotonic() < until:
            assert client.get(path, headers=reader).status_code == 200
            sent += 1
    asked = _entry_gets(cachectl, s.tokens["reader"]) - before
    # about two asks per token_cache_s (the index's answer, then one nginx keeps); without the
    # refresh, every request of each memory's last second reached cachectl
    assert sent > 200 and asked <= 8, (sent, asked)


def test_a_deleted_entry_is_not_sent(cached_recipe) -> None:
    s, _cachectl, nginx = cached_recipe
    key, path = s.keys[2], _entry(s, s.keys[2])
    reader = bearer(s.tokens["reader"])
    with httpx.Client(base_url=nginx.url, timeout=10) as client:
        for _ in range(3):
            assert client.get(path, headers=reader).content == s.entry_bytes[key]
        index = open_index(s.db)
        try:  # deleted elsewhere (as `cachectl prune` would): its file, then its row
            (Path(s.root.removeprefix("file://")) / s.env.namespace / f"{key}-cache").unlink()
            env_id = index.ensure_environment(MAIN, s.env).id
            index.delete_entries(env_id, [key])
        finally:
            index.close()
        deleted = time.monotonic()
        last = _served_until(client, path, reader, 3 * TTL_S)
        gone = client.get(path, headers=reader)
    assert last - deleted <= TTL_S
    assert gone.status_code == 404 and gone.headers["content-type"].startswith("application/json")
    assert s.entry_bytes[key][:64] not in gone.content


def test_uploads_through_nginx_are_cachectls(behind_nginx) -> None:
    """An upload to an entry's path is not a read: nginx hands it, body and all, to cachectl."""
    s, _cachectl, nginx = behind_nginx
    key = entry_key("jit_uploaded", 11)
    data = make_entry(os.urandom(5000), compile_seconds=1)
    path = _entry(s, key)
    with httpx.Client(base_url=nginx.url, timeout=10) as client:
        refused = client.put(path, content=data, headers=bearer(s.tokens["reader"]))
        assert refused.status_code == 403, (refused.status_code, refused.text[:200])
        assert refused.headers["content-type"].startswith("application/json")
        put = client.put(
            path,
            content=data,
            headers={**bearer(s.tokens["writer"]), "x-cachectl-sha256": sha256(data)},
        )
        assert put.status_code == 201, (put.status_code, put.text[:200])
        assert put.json()["sha256"] == sha256(data)
        for _ in range(3):  # then read through nginx like any other entry
            got = client.get(path, headers=bearer(s.tokens["reader"]))
            assert got.status_code == 200 and got.content == data


def test_links_planted_below_the_root_are_not_followed(cached_recipe, tmp_path) -> None:
    """While nginx keeps an answer, a writer of the cache root replaces what it names with a link
    (the file, or a directory on its way): nginx does not follow it (disable_symlinks below the
    root). cachectl is stopped, so nothing but nginx could send a byte."""
    s, cachectl, nginx = cached_recipe
    key, path = s.keys[0], _entry(s, s.keys[0])
    reader = bearer(s.tokens["reader"])
    decoy = b"decoy bytes, never to be sent " * 100
    (tmp_path / "decoy").mkdir()
    (tmp_path / "decoy" / f"{key}-cache").write_bytes(decoy)
    leaf = Path(s.root.removeprefix("file://")) / s.env.namespace
    with httpx.Client(base_url=nginx.url, timeout=10) as client:
        asked = time.monotonic()  # cachectl asks the index now: answers are kept TTL_S - 1 s on
        for _ in range(2):  # the first answer is not kept (not yet remembered), the second is
            assert client.get(path, headers=reader).content == s.entry_bytes[key]
        os.kill(cachectl.process.pid, signal.SIGSTOP)
        try:
            kept = client.get(path, headers=reader, timeout=2)
            assert kept.status_code == 200 and kept.content == s.entry_bytes[key]  # nginx's own
            sent = []
            (leaf / f"{key}-cache").unlink()
            (leaf / f"{key}-cache").symlink_to(tmp_path / "decoy" / f"{key}-cache")
            sent.append(_sent_or_none(client, path, reader))
            (leaf / f"{key}-cache").unlink()
            leaf.rename(leaf.with_name(leaf.name + ".moved"))
            leaf.symlink_to(tmp_path / "decoy", target_is_directory=True)
            sent.append(_sent_or_none(client, path, reader))
            still_kept = time.monotonic() - asked
        finally:
            os.kill(cachectl.process.pid, signal.SIGCONT)
    assert still_kept < TTL_S - 1, f"the answer may have expired ({still_kept:.1f} s): inconclusive"
    for got in sent:  # nginx refused the link and asked cachectl, which could not answer
        assert got is None or (got.status_code != 200 and decoy[:64] not in got.content), got


def _sent_or_none(
    client: httpx.Client, path: str, headers: dict[str, str]
) -> httpx.Response | None:
    """nginx's answer, or None when it waited on cachectl (stopped) past a short timeout."""
    try:
        return client.get(path, headers=headers, timeout=0.6)
    except httpx.TimeoutException:
        return None
