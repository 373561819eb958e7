"""`cachectl serve --workers N`: N real server processes on one port, each answering on its own,
one that dies replaced, what they remember (tokens, entries) within its documented bound, and bad
values refused in one line."""

from __future__ import annotations

import os
import signal
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

API = "/api/v1"
STALE_S = 1.0  # CACHECTL_SERVER_TOKEN_CACHE for these servers


def _entry_url(server: infra.Server, s: Seed, key: str) -> str:
    return f"{server.url}{API}/caches/{MAIN}/environments/{s.digest}/entries/{key}"


def _ask(method: str, url: str, token: str) -> httpx.Response:
    """On a new connection each time: the kernel hands it to whichever worker accepts."""
    return httpx.request(method, url, headers=bearer(token), timeout=10)


def workers_of(pid: int) -> list[int]:
    """The worker processes uvicorn's supervisor started (multiprocessing's spawned children)."""
    found = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(b"spawn_main" in a for a in argv):
            found.append(int(child))
    return sorted(found)


@contextmanager
def stopped(pid: int) -> Iterator[None]:
    """One worker paused (SIGSTOP): it accepts nothing, so every new connection goes to the others."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@contextmanager
def serving(tmp_path, s: Seed, workers: int) -> Iterator[infra.Server]:
    env = {**os.environ, "CACHECTL_SERVER_TOKEN_CACHE": f"{STALE_S}s"}

    def argv(port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "cachectl",
            "serve",
            "--db",
            s.db,
            "--port",
            str(port),
            "--workers",
            str(workers),
            "--log-level",
            "warning",
        ]

    old = dict(os.environ)
    os.environ.update(env)  # start_server passes this process's environment on
    try:
        server = infra.start_server(
            "serve-workers",
            argv,
            tmp_path / "logs",
            timeout=60,
            check=lambda srv: httpx.get(srv.url + "/healthz", timeout=5).raise_for_status(),
        )
    finally:
        os.environ.clear()
        os.environ.update(old)
    try:
        deadline = time.monotonic() + 60
        while len(workers_of(server.process.pid)) < workers:
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.1)
        yield server
    finally:
        server.stop(timeout=20)


def test_each_worker_serves_and_a_killed_one_is_replaced(tmp_path) -> None:
    s = seed(f"sqlite:///{tmp_path}/index.db", str(tmp_path / "main"), str(tmp_path / "other"))
    key = s.keys[0]
    with serving(tmp_path, s, 2) as server:
        url = _entry_url(server, s, key)
        first, second = workers_of(server.process.pid)
        for worker in (first, second):  # each runs on uvloop (the server extra installs it)
            assert "uvloop" in Path(f"/proc/{worker}/maps").read_text(), worker
        for alone in (second, first):  # each worker alone answers GET and HEAD
            with stopped(first if alone == second else second):
                for _ in range(5):
                    got = _ask("GET", url, s.tokens["reader"])
                    assert got.status_code == 200 and got.content == s.entry_bytes[key]
                    head = _ask("HEAD", url, s.tokens["reader"])
                    assert int(head.headers["content-length"]) == len(s.entry_bytes[key])
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:
            now = workers_of(server.process.pid)
            if len(now) == 2 and first not in now:
                break
            assert time.monotonic() < deadline, (now, server.log_tail())
            time.sleep(0.1)
        replacement = next(p for p in now if p != second)
        deadline = time.monotonic() + 30
        with stopped(second):  # the replacement alone
            while True:
                try:
                    got = _ask("GET", url, s.tokens["reader"])
                    break
                except httpx.TransportError:  # still importing the app
                    assert time.monotonic() < deadline, server.log_tail()
        assert got.status_code == 200 and got.content == s.entry_bytes[key]
        assert replacement in workers_of(server.process.pid)


def test_a_revoked_token_and_a_deleted_entry_stop_being_served_in_every_worker(tmp_path) -> None:
    """Each worker remembers tokens and each entry's recorded sha256 for CACHECTL_SERVER_TOKEN_CACHE
    (here 1 s): a token revoked elsewhere is refused by every worker that much later; a deleted
    entry's file is a 404 at once."""
    s = seed(
        f"sqlite:///{tmp_path}/index.db", str(tmp_path / "main"), str(tmp_path / "other"), entries=2
    )
    with serving(tmp_path, s, 2) as server:
        url = _entry_url(server, s, s.keys[0])
        for worker in workers_of(server.process.pid):  # both remember the token and the entry
            with stopped(worker):
                for method in ("GET", "HEAD", "GET"):
                    assert _ask(method, url, s.tokens["reader"]).status_code == 200
        revoked = subprocess.run(
            [sys.executable, "-m", "cachectl", "--db", s.db, "token", "revoke", "reader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert revoked.returncode == 0, revoked.stderr
        time.sleep(STALE_S + 0.5)
        for worker in workers_of(server.process.pid):
            with stopped(worker):
                for method in ("GET", "HEAD"):
                    got = _ask(method, url, s.tokens["reader"])
                    assert got.status_code == 401, (method, got.status_code)
        # A deleted entry: no worker sends it, at once (each GET and HEAD looks at the file).
        url = _entry_url(server, s, s.keys[1])
        for worker in workers_of(server.process.pid):
            with stopped(worker):
                for method in ("GET", "HEAD", "GET"):
                    assert _ask(method, url, s.tokens["admin"]).status_code == 200
        Path(tmp_path / "main" / s.env.namespace / f"{s.keys[1]}-cache").unlink()
        for worker in workers_of(server.process.pid):
            with stopped(worker):
                for method in ("GET", "HEAD"):
                    assert _ask(method, url, s.tokens["admin"]).status_code == 404


@pytest.mark.parametrize("value", ["0", "-1", "65", "two", "1.5", ""])
def test_bad_worker_counts_are_one_line_errors(tmp_path, value: str) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "cachectl",
            "serve",
            "--db",
            f"sqlite:///{tmp_path}/index.db",
            "--workers",
            value,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--workers" in lines[0] and "1 to 64" in lines[0], done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert not (tmp_path / "index.db").exists()  # refused before anything was opened
