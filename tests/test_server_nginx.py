"""nginx in front of `cachectl serve --accel-redirect` (server/accel.py): real nginx on 127.0.0.1 with
the configuration `cachectl serve --print-nginx-config` prints. cachectl checks every download,
nginx sends the bytes; its internal location cannot be asked for directly."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support import infra
from support.server_kit import MAIN, Seed, bearer, entry_key, seed

from cachectl.storage.entries import sha256

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
    cachectl = infra.start_server(
        "cachectl-accel",
        lambda port: [
            sys.executable,
            "-m",
            "cachectl",
            "serve",
            "--db",
            s.db,
            "--port",
            str(port),
            "--accel-redirect",
            PREFIX,
            "--log-level",
            "warning",
        ],
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
        yield s, cachectl, nginx
    finally:
        nginx.stop()
        cachectl.stop()


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
