"""`cachectl serve --uds PATH`: a real server on a unix socket (one process and --workers 2) answering
HEAD/GET, the socket 0660 less the umask and removed on exit, bad paths and --host/--port refused in
one line, real nginx in front over the socket, and bench/workers.py's refusal of a scaling figure
where cores are too few."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from support import infra
from support.server_kit import MAIN, Seed, bearer, seed

from cachectl.storage.entries import sha256

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


from bench import workers as bench_workers  # noqa: E402

API = "/api/v1"
PREFIX = "/_cachectl_files/"
NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/sbin/nginx") if os.access(p, os.X_OK)), None
)
# As in tests/test_server_nginx.py: scripts/test installs nginx; CACHECTL_TEST_NO_NGINX=1 skips.
NO_NGINX = os.environ.get("CACHECTL_TEST_NO_NGINX") == "1"


def _cachectl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cachectl", *args], capture_output=True, text=True, timeout=timeout
    )


def _client(uds: Path) -> httpx.Client:
    return httpx.Client(
        transport=httpx.HTTPTransport(uds=str(uds)), base_url="http://cachectl", timeout=10
    )


@contextmanager
def serving(s: Seed, uds: Path, log: Path, *extra: str) -> Iterator[subprocess.Popen[bytes]]:
    """`cachectl serve --uds` until it answers /healthz on the socket; stopped with SIGTERM."""
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cachectl", "serve", "--db", s.db, "--uds", str(uds), *extra],
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            if bench_workers._healthy(str(uds)):  # a raw probe: httpx leaks a refused socket
                break
            time.sleep(0.05)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def seeded(tmp_path: Path) -> Seed:
    return seed(
        f"sqlite:///{tmp_path}/index.db",
        str(tmp_path / "main"),
        str(tmp_path / "other"),
        entries=2,
        entry_size=4096,
    )


def _entry(s: Seed) -> tuple[str, bytes]:
    key = s.keys[0]
    return f"{API}/caches/{MAIN}/environments/{s.digest}/entries/{key}", s.entry_bytes[key]


def test_one_process_serves_on_a_unix_socket_0660_and_removes_it(
    seeded: Seed, tmp_path: Path
) -> None:
    uds = tmp_path / "c.sock"
    # a stopped server's leftover socket (nobody listens) is replaced
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
        stale.bind(str(uds))
    path, want = _entry(seeded)
    with serving(seeded, uds, tmp_path / "serve.log") as proc:
        mode = os.stat(uds).st_mode
        assert stat.S_ISSOCK(mode)
        assert mode & 0o007 == 0, oct(mode)  # no access for other users, whatever the umask
        with _client(uds) as c:
            got = c.get(path, headers=bearer(seeded.tokens["reader"]))
            assert got.status_code == 200 and got.content == want
            assert got.headers["x-cachectl-sha256"] == sha256(want)
            head = c.head(path, headers=bearer(seeded.tokens["reader"]))
            assert head.status_code == 200 and int(head.headers["content-length"]) == len(want)
            assert c.get(path).status_code == 401
        # a second server on the same path: refused, the first one untouched
        second = _cachectl("serve", "--db", seeded.db, "--uds", str(uds))
        assert second.returncode == 2, second.stderr
        assert "already listens" in second.stderr and "Traceback" not in second.stderr
        with _client(uds) as c:
            assert c.get("/healthz").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) in (0, -signal.SIGTERM)  # as on a TCP port
    assert not uds.exists()


def _workers_of(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_two_workers_share_the_unix_socket(seeded: Seed, tmp_path: Path) -> None:
    uds = tmp_path / "w.sock"
    path, want = _entry(seeded)
    with serving(seeded, uds, tmp_path / "serve.log", "--workers", "2") as proc:
        assert len(_workers_of(proc.pid)) >= 2
        for _ in range(10):  # new connections: the kernel hands each to one of the workers
            with _client(uds) as c:
                got = c.get(path, headers=bearer(seeded.tokens["reader"]))
                assert got.status_code == 200 and got.content == want
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) in (0, -signal.SIGTERM)  # as on a TCP port
    assert not uds.exists()


@pytest.mark.parametrize(
    ("extra", "where", "says"),
    [
        (("--port", "8123"), "c.sock", "drop --port"),
        (("--host", "127.0.0.1"), "c.sock", "drop --host"),
        ((), "missing/c.sock", "does not exist"),
        ((), "plain-file", "is not a socket"),
    ],
)
def test_bad_uds_is_refused_in_one_line(
    tmp_path: Path, extra: tuple[str, ...], where: str, says: str
) -> None:
    (tmp_path / "plain-file").write_text("keep me")
    got = _cachectl(
        "serve", "--db", f"sqlite:///{tmp_path}/i.db", "--uds", str(tmp_path / where), *extra
    )
    assert got.returncode == 2, got.stderr
    assert says in got.stderr and "Traceback" not in got.stderr
    assert len(got.stderr.strip().splitlines()) == 1, got.stderr
    assert (tmp_path / "plain-file").read_text() == "keep me"
    assert not (tmp_path / "c.sock").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into any directory")
def test_unwritable_directory_is_refused(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    got = _cachectl("serve", "--db", f"sqlite:///{tmp_path}/i.db", "--uds", str(locked / "s"))
    assert got.returncode == 2 and "not writable" in got.stderr, got.stderr


def test_nginx_in_front_over_the_unix_socket(seeded: Seed, tmp_path: Path) -> None:
    if NGINX is None:
        if NO_NGINX:
            pytest.skip("nginx not installed and CACHECTL_TEST_NO_NGINX=1")
        pytest.fail("nginx is not installed: scripts/test installs it")
    uds = tmp_path / "n.sock"
    path, want = _entry(seeded)
    prefix_dir = tmp_path / "nginx"
    (prefix_dir / "tmp").mkdir(parents=True)
    with serving(seeded, uds, tmp_path / "serve.log", "--accel-redirect", PREFIX):

        def nginx_argv(port: int) -> list[str]:
            printed = _cachectl(
                "serve",
                "--db",
                seeded.db,
                "--uds",
                str(uds),
                "--print-nginx-config",
                "--nginx-listen",
                f"127.0.0.1:{port}",
                *(["--nginx-user", "root"] if os.geteuid() == 0 else []),
            )
            assert printed.returncode == 0, printed.stderr
            assert f"server unix:{uds};" in printed.stdout
            conf = prefix_dir / f"nginx-{port}.conf"
            conf.write_text(printed.stdout)
            return [str(NGINX), "-p", str(prefix_dir), "-c", str(conf), "-e", "stderr"]

        nginx = infra.start_server("nginx", nginx_argv, tmp_path / "logs", timeout=30)
        try:
            got = httpx.get(nginx.url + path, headers=bearer(seeded.tokens["reader"]), timeout=10)
            assert got.status_code == 200 and got.content == want
            assert "x-accel-redirect" not in got.headers
            refused = httpx.get(nginx.url + path, timeout=10)
            assert refused.status_code == 401 and want not in refused.content
        finally:
            nginx.stop()


def test_bench_plan_reports_scaling_only_with_cores_to_spare() -> None:
    assert bench_workers.plan([0, 1])["refused"] is not None
    assert bench_workers.plan([0, 1, 2])["refused"] is not None
    four = bench_workers.plan([0, 1, 2, 3])
    assert four["refused"] is None and four["counts"] == [1, 2]
    assert four["server_cpus"][2] == [0, 1] and four["client_cpus"] == [2, 3]
    thirteen = bench_workers.plan(list(range(13)))
    assert thirteen["counts"] == [1, 2, 4] and thirteen["client_cpus"] == list(range(4, 13))
    fewer = bench_workers.plan(list(range(13)), generators=4, top=2)
    assert fewer["counts"] == [1, 2] and fewer["client_cpus"] == [2, 3, 4, 5]


def test_bench_on_two_cores_refuses_the_scaling_figure(tmp_path: Path) -> None:
    """The whole benchmark at small scale, held to two cores: figures, but no ratio, and why."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    out = tmp_path / "workers.json"
    got = subprocess.run(
        [sys.executable, "bench/workers.py", "--quick", "--seconds", "0.3", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: os.sched_setaffinity(0, cores),
    )
    assert got.returncode == 0, got.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["scaling"] is None and result["pinned"] is False
    assert "at least 4 cores" in result["refused"] and "no scaling figure" in got.stdout
    for n in ("1", "2"):
        for route in ("head", "get_4k", "api_cache"):
            cell = result["workers"][n][route]
            assert cell["req_per_s"]["median"] > 0
            assert cell["server_cpu_ms_per_request"]["median"] > 0
            assert cell["server_cores_busy"]["median"] > 0
